"""
Train GPT-2 from scratch on FineWeb-Edu (or fine-tune OpenAI's weights), on one device or many.

    python train_gpt2.py configs/quickstart.py                  # CPU smoke run: a minute or two on 2 cores
    python train_gpt2.py configs/quickstart.py --data=my_book.txt   # your own text: a file, folder or glob
    python train_gpt2.py configs/gpt2_124m.py                   # build-nanogpt's 124M recipe, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --out_dir=out/try

Config files are plain Python assignments (`n_layer = 12`) applied in order to the typed defaults
of `Config` below; `--key=value` overrides them. The resolved config is printed once and saved as
out_dir/config.json; progress goes to the console and to out_dir/log.jsonl; checkpoints to
out_dir/ckpt_XXXXXX.pt (`--resume=true` continues from the newest one, bit-exactly).
"""
import dataclasses
import difflib
import functools
import glob
import importlib.util
import json
import math
import os
import re
import sys
import time
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from data import TokenLoader, shard_paths
from fileio import UserError, replacing, write_json
from model import GPT2_VOCAB_SIZE, GPT, GPTConfig, estimate_mfu, flops_per_token

# -----------------------------------------------------------------------------
# config: typed defaults (build-nanogpt's 124M recipe), config files, --key=value overrides


@dataclass
class Config:
    # data and output
    data_dir: str = "edu_fineweb10B"  # token shards written by fineweb.py
    data_source: str = "fineweb"  # "python": if data_dir is missing or empty, build the quickstart corpus in it
    data: str = ""  # your own text (a file, folder or glob): tokenized into a cache beside out_dir, used instead of data_dir
    shuffle: bool = True  # train rows in a fresh seeded order each epoch (data.TokenLoader); false: file order
    out_dir: str = "out"
    # model
    init_from: str = "scratch"  # "scratch", a GPT-2 name (gpt2 .. gpt2-xl), a save_pretrained dir or a ckpt_*.pt
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50304  # 50257 padded to a multiple of 64: faster matmuls
    # batch: total_batch_size tokens per optimizer step, in micro-batches of micro_batch_size x seq_len per rank
    micro_batch_size: int = 64  # or "auto" (CUDA): the largest fast one that fits, see resolve_micro_batch_size()
    seq_len: int = 1024
    total_batch_size: int = 524288  # 2**19 tokens, ~0.5M as in GPT-3 Small
    # optimization: AdamW, linear warmup then cosine decay to min_lr
    max_steps: int = 19073  # 10B tokens / 524288 tokens per step
    warmup_steps: int = 715  # GPT-3 warms up over 375M tokens
    max_lr: float = 6e-4
    min_lr: float = 6e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # evaluation, sampling, checkpoints (an interval of 0 disables; evals and a checkpoint also run at the end)
    eval_interval: int = 250
    val_steps: int = 20  # val batches (micro_batch_size x seq_len per rank) from the start of the val split
    hellaswag_interval: int = 250
    hellaswag_file: str = ""  # local HellaSwag jsonl; "" = the val split, downloaded once and cached
    hellaswag_limit: int = 0  # evaluate the first N examples only; 0 = all
    sample_interval: int = 250
    num_samples: int = 4
    sample_tokens: int = 32
    sample_prompt: str = "Hello, I'm a language model,"
    checkpoint_interval: int = 5000
    resume: bool = False  # continue from the newest out_dir/ckpt_*.pt
    # system
    device: str = "auto"
    precision: str = "auto"  # auto = precision_plan() for this device
    compile: str = "auto"
    seed: int = 1337


CHOICES = {
    "data_source": ("fineweb", "python"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "compile": ("auto", "true", "false"),
}
FIELDS = {f.name: f for f in dataclasses.fields(Config)}
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_key(key):
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(FIELDS)}")


def check_value(key, value):
    """value (from a config file, or parsed from the command line) as the key's type, or UserError."""
    if key == "micro_batch_size" and value == "auto":
        return value
    t = FIELDS[key].type
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        kind = 'an integer or "auto"' if key == "micro_batch_size" else TYPE_NAMES[t]
        raise UserError(f"{key} must be {kind}, got {value!r} (default: {FIELDS[key].default!r})")
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(f"{key} must be one of {', '.join(CHOICES[key])}; got {value!r}")
    return value


def parse_value(key, text):
    """A --key=value string as the key's type."""
    t = FIELDS[key].type
    if key == "micro_batch_size" and text == "auto":
        return text
    try:
        if t is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        return t(text)
    except (KeyError, ValueError):
        kind = 'an integer or "auto"' if key == "micro_batch_size" else TYPE_NAMES[t]
        raise UserError(f"--{key}={text} is not {kind} (default: {FIELDS[key].default!r})") from None


def read_config_file(path):
    """The assignments of a config file: {name: value}, names starting with _ and imports left out."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found (options are written --key=value)")
    ns = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)
    except Exception as e:
        raise UserError(f"config file {path!r} does not run: {type(e).__name__}: {e}") from None
    return {k: v for k, v in ns.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def parse_args(argv):
    """Config files and --key=value overrides, applied in order. Returns (config, keys the user set)."""
    cfg, given = Config(), set()
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise UserError(f"{arg}: options are written --key=value")
            key, text = arg[2:].split("=", 1)
            check_key(key)
            items = {key: parse_value(key, text)}
        else:
            items = read_config_file(arg)
        for key, value in items.items():
            check_key(key)
            setattr(cfg, key, check_value(key, value))
            given.add(key)
    validate(cfg)
    return cfg, given


def validate(cfg):
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "micro_batch_size", "seq_len",
                "total_batch_size", "max_steps", "val_steps", "num_samples"):
        if getattr(cfg, key) != "auto" and getattr(cfg, key) < 1:
            raise UserError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("warmup_steps", "eval_interval", "hellaswag_interval", "hellaswag_limit", "sample_interval",
                "sample_tokens", "checkpoint_interval", "max_lr", "min_lr", "weight_decay", "grad_clip"):
        if getattr(cfg, key) < 0:
            raise UserError(f"{key} must not be negative, got {getattr(cfg, key)}")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")

# -----------------------------------------------------------------------------
# precision path: chosen from the GPU's compute capability, in exactly one place


@dataclass(frozen=True)
class PrecisionPlan:
    dtype: torch.dtype  # autocast dtype; torch.float32 means no autocast
    grad_scaler: bool  # fp16 needs loss scaling
    tf32: bool  # TF32 tensor cores for fp32 matmuls
    compile: bool  # torch.compile by default
    sdpa_backends: tuple  # SDPA kernels allowed, best first ("flash", "efficient", "math"); () = torch decides
    small_gpu_preset: bool  # sm7x: smaller micro-batch / seq_len, same total batch

    def describe(self):
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        return (f"{name} autocast" if self.dtype != torch.float32 else "fp32") + \
            f", grad scaler {'on' if self.grad_scaler else 'off'}, TF32 {'on' if self.tf32 else 'off'}, " \
            f"compile {'on' if self.compile else 'off'}, attention {'/'.join(self.sdpa_backends) or 'auto'}"


def precision_plan(device_type, capability=None):
    """The default precision path for a device type ('cuda', 'cpu', 'mps') and, on CUDA, its compute
    capability (major, minor). Decided from the capability, not torch.cuda.is_bf16_supported(),
    which says True on a T4 (sm75) where bf16 is only emulated and slow."""
    if device_type == "cuda":
        major, _ = capability
        if major >= 8:  # Ampere, Ada, Hopper, Blackwell: bf16 tensor cores, flash attention
            return PrecisionPlan(torch.bfloat16, False, True, True, ("flash", "efficient"), False)
        if major == 7:  # Volta, Turing: fp16 tensor cores only; no flash kernel; Triton runs on sm70+
            return PrecisionPlan(torch.float16, True, False, True, ("efficient",), True)
        return PrecisionPlan(torch.float32, False, False, False, (), False)  # Pascal and older
    return PrecisionPlan(torch.float32, False, False, False, (), False)  # CPU, MPS


def resolve_plan(cfg, device_type, capability):
    """precision_plan() for this device with the user's `precision` and `compile` overrides applied."""
    plan = precision_plan(device_type, capability)
    if cfg.precision == "bf16":
        if device_type == "cuda" and capability[0] < 8:
            raise UserError(f"precision=bf16 needs an sm80+ GPU (Ampere or newer); this one is sm{capability[0]}{capability[1]}, "
                            "where bf16 is only emulated: use --precision=fp16 (with loss scaling) or --precision=fp32")
        plan = dataclasses.replace(plan, dtype=torch.bfloat16, grad_scaler=False)
    elif cfg.precision == "fp16":  # fp16's narrow exponent range needs loss scaling, wherever it runs
        plan = dataclasses.replace(plan, dtype=torch.float16, grad_scaler=True)
    elif cfg.precision == "fp32":
        plan = dataclasses.replace(plan, dtype=torch.float32, grad_scaler=False)
    if cfg.compile != "auto":
        plan = dataclasses.replace(plan, compile=cfg.compile == "true")
    return plan


def precision_name(dtype):
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


# Turing/Volta (sm7x, 16 GB T4 / V100): 16 x 512 = 8K tokens per micro-step keeps the 124M model's
# fp16 activations (memory-efficient attention, no flash kernel) near 5 GB, next to ~2 GB of fp32
# weights, gradients and AdamW state; the total batch stays 524288 tokens through 64 accumulation steps.
SMALL_GPU_PRESET = {"micro_batch_size": 16, "seq_len": 512}


def apply_small_gpu_preset(cfg, given):
    """Set the preset's keys the user did not set (config file or command line); returns those applied."""
    applied = {k: v for k, v in SMALL_GPU_PRESET.items() if k not in given}
    for k, v in applied.items():
        setattr(cfg, k, v)
    return applied


def sdpa_context(backends):
    """Restrict SDPA to the named kernels ('flash', 'efficient', 'math'); () lets torch decide."""
    if not backends:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([names[b] for b in backends])


@contextmanager
def amp_context(device_type, plan):
    """Autocast to the plan's dtype (none for fp32) and, on CUDA, the plan's SDPA kernels."""
    sdpa = sdpa_context(plan.sdpa_backends if device_type == "cuda" else ())
    with torch.autocast(device_type, dtype=plan.dtype, enabled=plan.dtype != torch.float32), sdpa:
        yield

# -----------------------------------------------------------------------------
# model


def build_model(cfg, verbose=True):
    """The model to train: fresh, OpenAI/Hugging Face weights, or one of our checkpoints."""
    if cfg.init_from == "scratch":
        return GPT(GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                             n_head=cfg.n_head, n_embd=cfg.n_embd))
    if cfg.init_from.endswith(".pt"):
        if not os.path.isfile(cfg.init_from):
            raise UserError(f"init_from={cfg.init_from!r}: no such checkpoint file")
        return GPT.from_checkpoint(cfg.init_from)
    try:
        return GPT.from_pretrained(cfg.init_from, verbose=verbose)
    except ValueError as e:
        raise UserError(str(e)) from None


MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")

# -----------------------------------------------------------------------------
# learning rate schedule: linear warmup, then cosine decay to min_lr at max_steps


def get_lr(step, cfg):
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.max_lr - cfg.min_lr)

# -----------------------------------------------------------------------------
# checkpoints: plain tensors/dicts/numbers only, so torch.load(weights_only=True) reads them


def checkpoint_path(out_dir, step):
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def latest_checkpoint(out_dir):
    paths = glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
    paths = [p for p in paths if re.fullmatch(r"ckpt_\d+\.pt", os.path.basename(p))]
    return max(paths, key=lambda p: int(os.path.basename(p)[5:-3])) if paths else None


def rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, raw_model, optimizer, scaler, step, cfg, loader):
    ckpt = {
        "model": raw_model.state_dict(),  # the bare module: no _orig_mod. / module. prefixes
        "model_args": dataclasses.asdict(raw_model.config),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,  # optimizer steps done
        "config": dataclasses.asdict(cfg),
        "loader": loader.state_dict(),
        "rng": rng_state(),
    }
    with replacing(path) as tmp:  # never a half-written checkpoint under the real name
        torch.save(ckpt, tmp)


def append_log(path, event):
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")

# -----------------------------------------------------------------------------
# one optimizer step, evaluation, sampling


def accumulate_gradients(model, loader, grad_accum, device, amp, scaler, ddp):
    """Forward/backward over grad_accum micro-batches; the gradients end up those of their mean loss.
    DDP all-reduces the gradients only on the last micro-step. Returns the mean loss (tensor)."""
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum):
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = nullcontext() if not ddp or micro_step == grad_accum - 1 else model.no_sync()
        with sync:
            with amp():
                _, loss = model(x, y)
            loss = loss / grad_accum  # cross-entropy is a mean: scale so the sum over micro-steps is the mean
            loss_accum += loss.detach().float()
            scaler.scale(loss).backward()
    return loss_accum


def optimizer_step(model, optimizer, scaler, grad_clip, lr):
    """Unscale (fp16), clip, step, update the loss scale. A step whose gradients hold inf/nan is
    skipped by the scaler. Returns the gradient norm before clipping (a float; inf when skipped)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


@torch.no_grad()
def evaluate(model, loader, val_steps, device, amp, world_size):
    """Mean loss over val_steps batches from the start of the val split, averaged over ranks."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(val_steps):
        x, y = loader.next_batch()
        with amp():
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    if world_size > 1:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / (val_steps * world_size)


def sample(raw_model, cfg, device, amp):
    """num_samples top-k continuations of the prompt. Uses its own generator, seeded afresh each time,
    so sampling never moves the training RNG (and resumed runs stay bit-exact)."""
    from tokenizer import get_encoding
    enc = get_encoding()
    idx = torch.tensor(enc.encode_ordinary(cfg.sample_prompt), dtype=torch.long, device=device)
    idx = idx.unsqueeze(0).repeat(cfg.num_samples, 1)  # (num_samples, T0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 42)
    raw_model.eval()
    with amp():
        out = raw_model.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    raw_model.train()
    return [enc.decode(row.tolist()) for row in out]


def load_hellaswag(cfg, master, ddp, say):
    """(the hellaswag module, its examples) when HellaSwag evals are on and hellaswag.py is there, else
    (None, None). Loaded once, at start-up, so that a download shows here and not mid-run; rank 0 first
    (it downloads), then the others (they read its cache)."""
    if cfg.hellaswag_interval == 0:
        return None, None
    if importlib.util.find_spec("hellaswag") is None:
        say("note: hellaswag.py not found; HellaSwag evaluation is skipped")
        return None, None
    import hellaswag
    examples = None
    for turn in ("first", "rest"):
        if master == (turn == "first"):
            try:
                examples = hellaswag.load_examples("val", data_file=cfg.hellaswag_file or None, download=True)
            except Exception as e:  # offline, a missing or malformed file: the user's to fix
                raise UserError(f"cannot load HellaSwag: {e} (set --hellaswag_file=PATH or --hellaswag_interval=0)") from None
        if ddp:
            dist.barrier()
    return hellaswag, examples[:cfg.hellaswag_limit or None]

# -----------------------------------------------------------------------------
# setup: device, distributed, batch


def resolve_device(name, local_rank):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device=cuda but this torch ({torch.__version__}) sees no CUDA GPU: use --device=cpu or install a CUDA build")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available here: use --device=cpu")
    return f"cuda:{local_rank}" if name == "cuda" else name


def resolve_micro_batch_size(cfg, world_size, raw_model, optimizer, device, plan, say):
    """THE place the micro-batch is decided, once the model and optimizer exist and before compile/DDP
    wrap them. micro_batch_size="auto" probes the GPU for the largest fast micro-batch (bench.py); on
    CPU/MPS it keeps the default. Sets cfg.micro_batch_size and returns the accumulation steps."""
    if cfg.micro_batch_size == "auto":
        from bench import auto_micro_batch
        try:
            cfg.micro_batch_size, reason = auto_micro_batch(raw_model, optimizer, cfg.seq_len, cfg.total_batch_size,
                                                            world_size, device, plan, default=FIELDS["micro_batch_size"].default)
        except ValueError as e:
            raise UserError(f"micro_batch_size=auto: {e}") from None
        say(reason)
    tokens = cfg.micro_batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens:
        raise UserError(f"total_batch_size={cfg.total_batch_size} is not a multiple of micro_batch_size x seq_len x "
                        f"world_size = {cfg.micro_batch_size} x {cfg.seq_len} x {world_size} = {tokens}: "
                        f"e.g. --total_batch_size={max(1, round(cfg.total_batch_size / tokens)) * tokens}")
    return cfg.total_batch_size // tokens

# -----------------------------------------------------------------------------
# the training loop


def main(argv):
    ddp = "RANK" in os.environ  # launched by torchrun
    rank = int(os.environ.get("RANK", 0))
    master = rank == 0
    try:
        return train(argv, ddp, rank, master)
    except UserError as e:
        if master:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()


def train(argv, ddp, rank, master):
    say = print if master else (lambda *a, **k: None)
    cfg, given = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(cfg.device, local_rank)
    device_type = device.split(":")[0]
    if ddp:
        if device_type == "mps":
            raise UserError("torchrun on MPS is not supported: run one process, or use --device=cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")

    # precision and the sm7x preset, announced in one line
    capability = torch.cuda.get_device_capability(device) if device_type == "cuda" else None
    plan = resolve_plan(cfg, device_type, capability)
    preset = apply_small_gpu_preset(cfg, given) if plan.small_gpu_preset else {}
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high" if plan.tf32 else "highest")
        name = torch.cuda.get_device_name(device)
        where = f"{device} ({name}, sm{capability[0]}{capability[1]})"
    else:
        name, where = None, device
    say(f"device {where} x {world_size} | {plan.describe()}")
    if preset:
        say(f"sm7x preset (set these keys to override): {', '.join(f'{k}={v}' for k, v in preset.items())}")

    # data: there before anything slow (rank 0 tokenizes --data or builds the quickstart corpus; the others wait)
    rows = world_size * (cfg.micro_batch_size if cfg.micro_batch_size != "auto" else 1)  # one batch's rows, at least
    cfg.data_dir = data.prepare(cfg, rows, build=master)
    if ddp:
        dist.barrier()
    for split in ("train", "val"):
        shard_paths(cfg.data_dir, split)

    # model, optimizer, loss scaler: fresh or from the newest checkpoint
    torch.manual_seed(cfg.seed)
    ckpt = None
    if cfg.resume:
        path = latest_checkpoint(cfg.out_dir)
        if path is None:
            raise UserError(f"resume=true but {cfg.out_dir!r} has no ckpt_*.pt: drop --resume or point --out_dir at the run")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        raw_model = GPT(GPTConfig(**ckpt["model_args"]))
        raw_model.load_state_dict(ckpt["model"])
    else:
        raw_model = build_model(cfg, verbose=master)
    for k in MODEL_KEYS:  # the model decides its shape (pretrained weights, checkpoints)
        setattr(cfg, k, getattr(raw_model.config, k))
    if cfg.vocab_size < GPT2_VOCAB_SIZE and (cfg.sample_interval > 0 or cfg.hellaswag_interval > 0):
        say(f"note: vocab_size={cfg.vocab_size} cannot hold GPT-2's tokens: sampling and HellaSwag are off")
        cfg.sample_interval = cfg.hellaswag_interval = 0
    if cfg.seq_len > cfg.block_size:
        raise UserError(f"seq_len={cfg.seq_len} is longer than block_size={cfg.block_size}, the model's context: lower seq_len")
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.max_lr, device_type, verbose=master)
    scaler = torch.amp.GradScaler(device_type, enabled=plan.grad_scaler)

    # micro-batch: decided here, once the model and optimizer exist and before compile/DDP wrap them
    grad_accum = resolve_micro_batch_size(cfg, world_size, raw_model, optimizer, device, plan, say)
    B, T = cfg.micro_batch_size, cfg.seq_len
    train_loader = TokenLoader(cfg.data_dir, "train", B, T, rank, world_size, cfg.vocab_size, cfg.shuffle, cfg.seed)
    val_loader = TokenLoader(cfg.data_dir, "val", B, T, rank, world_size, cfg.vocab_size, shuffle=False)

    start_step = 0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"] and plan.grad_scaler:
            scaler.load_state_dict(ckpt["scaler"])
        train_loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        start_step = ckpt["step"]
        say(f"resuming from {path} at step {start_step}")
        del ckpt
    model = torch.compile(raw_model) if plan.compile else raw_model  # eval uses this one
    train_model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None) if ddp else model
    amp = functools.partial(amp_context, device_type, plan)  # amp() gives a fresh context each time

    hellaswag, hs_examples = load_hellaswag(cfg, master, ddp, say)

    # the resolved config, the log
    cfg.device, cfg.precision = device_type, precision_name(plan.dtype)
    cfg.compile = "true" if plan.compile else "false"
    say(json.dumps(dataclasses.asdict(cfg), indent=2))
    tokens_per_step = B * T * world_size * grad_accum
    say(f"{raw_model.num_params(non_embedding=False):,} parameters | {tokens_per_step:,} tokens per step = "
        f"{B} x {T} x {world_size} rank(s) x {grad_accum} accumulation step(s) | {cfg.max_steps} steps")
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        write_json(os.path.join(cfg.out_dir, "config.json"), dataclasses.asdict(cfg))
    flops_tok = flops_per_token(raw_model, T)

    for step in range(start_step, cfg.max_steps + 1):
        last = step == cfg.max_steps
        fresh = step > start_step or start_step == 0  # a resumed run already did this step's evals
        if fresh and cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or last):
            val_loss = evaluate(model, val_loader, cfg.val_steps, device, amp, world_size)
            say(f"step {step:6d} | val loss {val_loss:.4f}")
            if master:
                append_log(log_path, {"step": step, "val_loss": val_loss})
        if fresh and hs_examples is not None and (step % cfg.hellaswag_interval == 0 or last):
            res = hellaswag.evaluate(model, hs_examples, device=device, dtype=plan.dtype, rank=rank,
                                     world_size=world_size, progress=master)
            say(f"step {step:6d} | HellaSwag acc {res['acc']:.4f} acc_norm {res['acc_norm']:.4f} ({res['n']} examples)")
            if master:
                append_log(log_path, {"step": step, "hellaswag_acc": res["acc"], "hellaswag_acc_norm": res["acc_norm"]})
        if fresh and master and cfg.sample_interval > 0 and step > 0 and (step % cfg.sample_interval == 0 or last):
            for text in sample(raw_model, cfg, device, amp):
                say(f"sample: {text!r}")
        if step > start_step and master and (last or cfg.checkpoint_interval > 0 and step % cfg.checkpoint_interval == 0):
            path = checkpoint_path(cfg.out_dir, step)
            save_checkpoint(path, raw_model, optimizer, scaler, step, cfg, train_loader)
            say(f"step {step:6d} | saved {path}")
        if last:
            break

        # one optimizer step
        t0 = time.time()
        lr = get_lr(step, cfg)
        loss = accumulate_gradients(train_model, train_loader, grad_accum, device, amp, scaler, ddp)
        if ddp:
            dist.all_reduce(loss)  # SUM, then the mean over ranks, for the log only
            loss /= world_size
        norm = optimizer_step(train_model, optimizer, scaler, cfg.grad_clip, lr)
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        loss = loss.item()
        tok_per_s = tokens_per_step / dt
        mfu = estimate_mfu(flops_tok, tok_per_s / world_size, name, plan.dtype, plan.tf32)
        skipped = " (skipped: inf/nan gradients)" if not math.isfinite(norm) else ""
        say(f"step {step:6d}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.3f}{skipped} | "
            f"{dt * 1000:.1f} ms | {tok_per_s:,.0f} tok/s | MFU {'n/a' if mfu is None else f'{mfu * 100:.1f}%'}")
        if step == start_step and master:
            from bench import memory_summary
            say(memory_summary(raw_model, optimizer, device, micro_batch=B, seq_len=T, dtype=plan.dtype))
        if master:
            append_log(log_path, {"step": step, "loss": loss, "lr": lr, "norm": norm if math.isfinite(norm) else None,
                                  "dt_ms": dt * 1000, "tok_per_s": tok_per_s})
    if ddp:
        dist.barrier()  # rank 0 may still be writing the last checkpoint: leave together
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
