"""
Train GPT-2 from scratch on FineWeb-Edu (or fine-tune OpenAI's weights), on one device or many.

    python train_gpt2.py configs/quickstart.py                  # CPU smoke run: a minute or two on 2 cores
    python train_gpt2.py configs/quickstart.py --data=my_book.txt   # your own text: a file, folder or glob
    python train_gpt2.py configs/gpt2_124m.py                   # build-nanogpt's 124M recipe, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --out_dir=out/try
    python train_gpt2.py --help                                 # every config key: type, default, meaning

Config files are plain Python assignments (`n_layer = 12`) applied in order to the typed defaults
of `Config` below; `--key=value` overrides them. The resolved config is printed once and saved as
out_dir/config.json; progress goes to the console and to out_dir/log.jsonl; checkpoints to
out_dir/ckpt_XXXXXX.pt (`--resume=true` continues from the newest one, bit-exactly). Ctrl-C/SIGTERM
and `--time_limit=MINUTES` finish the step, save and print the command that continues the run.
"""
import dataclasses
import datetime
import difflib
import errno
import importlib.util
import inspect
import io
import json
import math
import os
import re
import shutil
import shlex
import signal
import sys
import textwrap
import time
import tokenize
import types
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import logger
import plot
import precision
from data import TokenLoader, shard_paths  # TokenLoader: also re-exported for the tests
from fileio import UserError, fail, replacing, write_json
from model import GPT2_VOCAB_SIZE, GPT, GPTConfig, flops_per_token, read_checkpoint
from sharding import full_state, load_optimizer_state, shard_model

# -----------------------------------------------------------------------------
# config: typed defaults (build-nanogpt's 124M recipe), config files, --key=value overrides


@dataclass
class Config:
    # data and output
    data_dir: str = "edu_fineweb10B"  # token shards written by fineweb.py
    data_source: str = "fineweb"  # "python": if data_dir is missing or empty, build the quickstart corpus in it
    data: str = ""  # your own text (a file, folder or glob): tokenized into a cache beside out_dir, used instead of data_dir
    shuffle: bool = True  # train rows in a fresh seeded order each epoch (data.TokenLoader); false: file order
    out_dir: str = "out"  # checkpoints, log.jsonl, config.json (and curves.png, TensorBoard/W&B files)
    # model
    init_from: str = "scratch"  # "scratch", a GPT-2 name (gpt2 .. gpt2-xl), a save_pretrained dir or a ckpt_*.pt
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width of the residual stream
    block_size: int = 1024  # the longest context the model takes (its position embeddings)
    vocab_size: int = 50304  # 50257 padded to a multiple of 64: faster matmuls
    # batch: total_batch_size tokens per optimizer step, in micro-batches of micro_batch_size x seq_len per rank
    micro_batch_size: int = 64  # or "auto" (CUDA): the largest fast one that fits, see resolve_micro_batch_size()
    seq_len: int = 1024  # tokens per row of a micro-batch, at most block_size
    total_batch_size: int = 524288  # 2**19 tokens, ~0.5M as in GPT-3 Small
    # optimization: AdamW, linear warmup then cosine decay to min_lr
    max_steps: int = 19073  # 10B tokens / 524288 tokens per step
    warmup_steps: int = 715  # GPT-3 warms up over 375M tokens
    max_lr: float = 6e-4  # the learning rate after warmup
    min_lr: float = 6e-5  # the learning rate at max_steps
    weight_decay: float = 0.1  # AdamW's, on matrices and embeddings only
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # evaluation, sampling, checkpoints (an interval of 0 disables; evals and a checkpoint also run at the end)
    eval_interval: int = 250  # steps between val loss evaluations
    val_steps: int = 20  # val batches (micro_batch_size x seq_len per rank) from the start of the val split
    hellaswag_interval: int = 250  # steps between HellaSwag evaluations
    hellaswag_file: str = ""  # local HellaSwag jsonl; "" = the val split, downloaded once and cached
    hellaswag_limit: int = 0  # evaluate the first N examples only; 0 = all
    sample_interval: int = 250  # steps between printed samples
    num_samples: int = 4  # samples printed each time
    sample_tokens: int = 32  # new tokens per sample
    sample_prompt: str = "Hello, I'm a language model,"  # the text samples continue
    checkpoint_interval: int = 5000  # steps between out_dir/ckpt_XXXXXX.pt files
    checkpoint_minutes: float = 60.0  # also save when this long has passed since the last save (0 = off)
    keep_last: int = 2  # checkpoints kept in out_dir (older ones are deleted once a new one is in place); 0 = all
    resume: str = "false"  # "true": continue from the newest out_dir/ckpt_*.pt; "auto": if there is one; "false": start fresh
    # surviving the session: stop cleanly on SIGINT/SIGTERM or near the time limit; stop on divergence
    time_limit: float = 0.0  # minutes from start-up; save and stop before they run out (0 = no limit)
    max_skipped: int = 10  # stop after this many optimizer steps skipped in a row (inf/nan, outliers); 0 = never
    skip_outliers_z: float = 0.0  # skip the update when loss or grad norm is > z std above the last 128 steps' mean (0 = off)
    # logging: out_dir/log.jsonl always; TensorBoard and Weights & Biases when asked (logger.py)
    tensorboard: bool = False  # also write TensorBoard event files to out_dir (needs `pip install tensorboard`)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs wandb; WANDB_MODE=offline: no network)
    wandb_run_name: str = ""  # the W&B run's name; "" = wandb picks one
    # system
    device: str = "auto"  # auto, cpu, cuda, cuda:N, mps
    precision: str = "auto"  # auto = the plan for this GPU (precision.py): bf16 on sm80+, fp16 on sm7x/P100, else fp32
    compile: str = "auto"  # torch.compile: auto = the plan's choice (on for sm70+ GPUs), true, false
    seed: int = 1337  # the run's random seed (initial weights, samples)
    dist_timeout: int = 600  # seconds a rank waits for its peers in a collective before giving up (torchrun)
    # memory: for models that do not fit (see bench/README.md for what fits where)
    fsdp: bool = False  # under torchrun: shard parameters, gradients and AdamW state over the ranks (FSDP2)
    activation_checkpointing: str = "none"  # "blocks" or "every_other": recompute blocks in backward


CHOICES = {
    "data_source": ("fineweb", "python"),
    "precision": precision.PRECISIONS,
    "compile": ("auto", "true", "false"),
    "activation_checkpointing": ("none", "blocks", "every_other"),
    "resume": ("false", "true", "auto"),
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
    if key == "resume" and isinstance(value, bool):  # resume = True in a config file
        value = str(value).lower()
    t = FIELDS[key].type
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        kind = 'an integer or "auto"' if key == "micro_batch_size" else "true, false or auto" if key == "resume" else TYPE_NAMES[t]
        raise UserError(f"{key} must be {kind}, got {value!r} (default: {FIELDS[key].default!r})")
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(f"{key} must be one of {', '.join(CHOICES[key])}; got {value!r}")
    return value


def parse_value(key, text):
    """A --key=value string as the key's type."""
    t = FIELDS[key].type
    if key == "micro_batch_size" and text == "auto":
        return text
    if key == "resume":
        return {"1": "true", "yes": "true", "0": "false", "no": "false"}.get(text.lower(), text.lower())
    try:
        if t is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        return t(text)
    except (KeyError, ValueError):
        kind = 'an integer or "auto"' if key == "micro_batch_size" else TYPE_NAMES[t]
        raise UserError(f"--{key}={text} is not {kind} (default: {FIELDS[key].default!r})") from None


def read_config_file(path):
    """The assignments of a config file: {name: value}, names starting with _ and imports left out."""
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder: pass a file such as configs/quickstart.py")
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
                "total_batch_size", "max_steps", "val_steps", "num_samples", "dist_timeout"):
        if getattr(cfg, key) != "auto" and getattr(cfg, key) < 1:
            raise UserError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("warmup_steps", "eval_interval", "hellaswag_interval", "hellaswag_limit", "sample_interval",
                "sample_tokens", "checkpoint_interval", "checkpoint_minutes", "keep_last", "time_limit",
                "max_skipped", "skip_outliers_z", "max_lr", "min_lr", "weight_decay", "grad_clip"):
        if not getattr(cfg, key) >= 0:  # (NaN fails this too)
            raise UserError(f"{key} must not be negative, got {getattr(cfg, key)}")
    for key in ("max_lr", "min_lr"):  # (NaN fails this too)
        if not getattr(cfg, key) < 1e37:
            raise UserError(f"{key}={getattr(cfg, key):g} is too large: AdamW's first step overflows float32 above ~3e37")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
    if os.path.isfile(cfg.out_dir):
        raise UserError(f"out_dir {cfg.out_dir!r} is a file; out_dir is a folder: move the file or choose another out_dir")
    logger.check_packages(tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project)  # before anything slow


def config_sections():
    """Config's keys as [(section, [names])] and {name: meaning}, read from its source: a comment line
    opens a section, the comment that ends a field's line says what it means. --help prints these, and
    tests/test_readme.py holds the README's key list to them."""
    sections, meaning = [], {}
    for line in inspect.getsource(Config).splitlines():
        code = line.strip()
        if code.startswith("#"):
            sections.append((code.lstrip("# "), []))
        elif re.match(r"\w+\s*:", code) and code.split(":")[0].strip() in FIELDS:
            name = code.split(":")[0].strip()
            comments = [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.COMMENT]
            sections[-1][1].append(name)
            meaning[name] = comments[0].lstrip("# ") if comments else ""
    return sections, meaning


def help_text(width=None):
    """`python train_gpt2.py --help`: every key with its type, default and meaning, by section."""
    width = width or max(80, shutil.get_terminal_size().columns)
    sections, meaning = config_sections()
    lines = ["usage: python train_gpt2.py [CONFIG_FILE ...] [--key=value ...]", "",
             "Config files (plain Python assignments, see configs/) and --key=value overrides apply in order",
             "to the defaults below; the resolved config is printed at start-up and saved as out_dir/config.json."]
    heads = {}
    for name, f in FIELDS.items():
        kind = ("|".join(CHOICES[name]) if name in CHOICES else "int|auto" if name == "micro_batch_size"
                else "true|false" if f.type is bool else f.type.__name__)
        heads[name] = f"  --{name} {kind}"
    col = max(map(len, heads.values())) + 2
    for title, names in sections:
        lines += ["", title + ":"]
        for name in names:
            lines.append(textwrap.fill(f"{meaning[name]} (default: {json.dumps(FIELDS[name].default)})", width,
                                       initial_indent=heads[name].ljust(col), subsequent_indent=" " * col,
                                       break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# model


def build_model(cfg, verbose=True):
    """The model to train: fresh (the config's shape), OpenAI/Hugging Face weights, or one of our checkpoints."""
    config = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd)
    return GPT.load(cfg.init_from, config=config, verbose=verbose)


STARTUP_TIMEOUT = datetime.timedelta(hours=24)  # the other ranks wait this long for rank 0's data prep, not dist_timeout
PLOT_EVERY = 60  # seconds: curves.png is redrawn at an eval at most this often (~1 s of matplotlib), and at the end

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


def checkpoint_files(out_dir):
    """The ckpt_XXXXXX.pt files in out_dir as [(step in the name, path)], highest first (no .tmp debris)."""
    if not os.path.isdir(out_dir):
        return []
    names = [f for f in os.listdir(out_dir) if re.fullmatch(r"ckpt_\d+\.pt", f)]
    return sorted(((int(f[5:-3]), os.path.join(out_dir, f)) for f in names), reverse=True)


def latest_checkpoint(out_dir, warn=print):
    """(path, checkpoint) of the newest readable checkpoint in out_dir by the step it holds (not by its
    name), or (None, None). An unreadable (truncated, foreign) file is skipped with a warning naming it.
    The steps are read with mmap, so that only the chosen file is read in full."""
    held = []
    for _, path in checkpoint_files(out_dir):
        try:
            held.append((torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"], path))
        except Exception as e:  # noqa: BLE001 - zip, unpickling, EOF, no "step": not a checkpoint to resume
            warn(f"warning: skipping {path}: not a readable checkpoint ({type(e).__name__}: {str(e)[:100]})")
    for step, path in sorted(held, reverse=True):
        try:
            return path, read_checkpoint(path)
        except UserError as e:
            warn(f"warning: skipping {path}: {e}")
    return None, None


# the keys that give a run its meaning: on resume they come from the checkpoint (MODEL_KEYS: from its model)
RUN_KEYS = ("init_from", "seq_len", "total_batch_size", "warmup_steps", "max_lr", "min_lr", "weight_decay",
            "grad_clip", "seed")


def resume_checkpoint(cfg, given, say):
    """THE resume decision: the checkpoint to continue from, or None for a fresh run. resume=false refuses
    an out_dir that holds checkpoints (another run's), true needs one, auto takes one if there is one.
    A model shape (or init_from) the user set that differs from the checkpoint's is refused; the other
    RUN_KEYS are set from the checkpoint, any that changed reported in one line. Only safe keys
    (intervals, max_steps, device, precision, micro-batch, time_limit, ...) come from the new config."""
    files = checkpoint_files(cfg.out_dir)
    how = "--resume=auto continues it; for a new run choose another --out_dir (or delete its ckpt_*.pt)"
    if cfg.resume == "false":
        if files:
            raise UserError(f"out_dir {cfg.out_dir!r} holds another run's checkpoints ({os.path.basename(files[0][1])}): {how}")
        return None
    if not files:
        if cfg.resume == "true":
            raise UserError(f"resume=true but {cfg.out_dir!r} has no ckpt_*.pt: drop --resume or point --out_dir at the run")
        return None
    path, ckpt = latest_checkpoint(cfg.out_dir, warn=say)
    if ckpt is None:
        raise UserError(f"out_dir {cfg.out_dir!r} holds ckpt_*.pt files but none is readable: choose another --out_dir")
    saved, model_args = ckpt.get("config", {}), ckpt["model_args"]
    for key in MODEL_KEYS + ("init_from",):
        have = model_args.get(key) if key in MODEL_KEYS else saved.get(key, cfg.init_from)
        if key in given and getattr(cfg, key) != have:
            raise UserError(f"{path} holds a run with {key}={have!r}, not {getattr(cfg, key)!r} as asked: "
                            f"choose another --out_dir for a new run (or drop {key} to continue this one)")
    changed = [f"{k}={saved[k]!r} (not {getattr(cfg, k)!r})" for k in RUN_KEYS if k in saved and saved[k] != getattr(cfg, k)]
    for k in RUN_KEYS:
        setattr(cfg, k, saved.get(k, getattr(cfg, k)))
    if changed:
        say(f"note: resuming keeps the checkpoint's {', '.join(changed)}: they would change the run; "
            f"to change them start a new run in another out_dir")
    ckpt["path"] = path
    return ckpt


def prune_checkpoints(out_dir, step, keep_last):
    """Once ckpt_{step} is in place: delete the checkpoints older than it but the keep_last - 1 newest
    (keep_last 0: keep all), and the .tmp left by a save that was killed. Higher-numbered files (an
    unreadable one that resume skipped) are left alone."""
    for name in os.listdir(out_dir):
        if re.fullmatch(r"ckpt_\d+\.pt\.tmp", name):
            os.remove(os.path.join(out_dir, name))
    older = [path for s, path in checkpoint_files(out_dir) if s < step]
    for path in older[keep_last - 1:] if keep_last > 0 else []:
        os.remove(path)


def rng_state(device):
    """The CPU generator and this process's own GPU generator only: a checkpoint then resumes on a
    machine with another number of GPUs (each rank restores its own device's state)."""
    state = {"torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if torch.device(device).type == "cuda" and torch.is_tensor(state.get("cuda")):
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path, raw_model, optimizer, scaler, step, cfg, loader, device, master=True, **extra):
    """Every rank calls it (under FSDP the full state is gathered from all of them); rank 0 writes.
    extra: the loop's own state (whether the evals at this step ran, the skip guard's history)."""
    model_state, optimizer_state = full_state(raw_model, optimizer)  # full CPU tensors on rank 0
    if not master:
        return
    ckpt = {
        "model": model_state,  # keyed as the bare module's state_dict(): no _orig_mod. / module. prefixes
        "model_args": dataclasses.asdict(raw_model.config),
        "optimizer": optimizer_state,  # keyed by parameter name, with or without FSDP
        "scaler": scaler.state_dict(),
        "step": step,  # optimizer steps done
        "config": dataclasses.asdict(cfg),
        "loader": loader.state_dict(),
        "rng": rng_state(device),
        **extra,
    }
    with replacing(path) as tmp, open(tmp, "wb") as f:  # never a half-written checkpoint under the real name
        try:
            torch.save(ckpt, f)  # (to a file object: a full disk is then an OSError, ENOSPC)
        except RuntimeError as e:  # torch's own report of a short write
            raise OSError(errno.EIO, f"a short write ({str(e).strip()[:200]})") from None


def finite_state(raw_model, optimizer, device):
    """Whether the weights and the optimizer state are all finite (checked before every save), agreed
    over the ranks (under FSDP each holds its own shards)."""
    tensors = list(raw_model.parameters()) + [v for state in optimizer.state.values() for v in state.values()
                                              if torch.is_tensor(v) and v.is_floating_point()]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP: this rank's shard
    ok = bool(torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all())
    return precision.agree(float(ok), "min", device) == 1.0


def trim_log(path, step, keep_evals):
    """Before a run (re)starts at step: drop the log rows it will write again, so that log.jsonl has no
    duplicates: every row from step on, except the evals at step itself when the checkpoint was written
    after them (keep_evals). Rows that do not parse (a line cut by a kill) are dropped too."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        at = row.get("step", -1) if isinstance(row, dict) else -1
        if at < step or (at == step and keep_evals and "loss" not in row):
            keep.append(line)
    if len(keep) < len(lines):
        with replacing(path) as tmp:
            with open(tmp, "w") as f:
                f.write("".join(line + "\n" for line in keep))

# -----------------------------------------------------------------------------
# one optimizer step, evaluation, sampling


def accumulate_gradients(model, loader, grad_accum, device, plan, scaler, ddp, bar=None):
    """Forward/backward over grad_accum micro-batches; the gradients end up those of their mean loss.
    DDP all-reduces the gradients only on the last micro-step. Each micro-batch after the first is read
    before the previous one's backward is queued. Returns the mean loss (tensor).
    bar (logger.micro_step_bar) is told of each micro-step done."""
    loss_accum = torch.zeros((), device=device)
    x, y = loader.next_batch(device)
    for micro_step in range(grad_accum):
        sync = nullcontext() if not ddp or micro_step == grad_accum - 1 else model.no_sync()
        with sync:
            with precision.autocast(plan):
                _, loss = model(x, y)
            if micro_step < grad_accum - 1:  # the next batch is gathered while the GPU runs this forward/backward
                x, y = loader.next_batch(device)
            loss = loss / grad_accum  # cross-entropy is a mean: scale so the sum over micro-steps is the mean
            loss_accum += loss.detach().float()
            scaler.scale(loss).backward()
        if bar is not None:
            bar.update()
    return loss_accum


class Stepped(NamedTuple):
    loss: float  # the step's mean loss
    norm: float  # the gradient norm before clipping
    applied: bool  # whether the update was applied
    flags: list  # the values of optimizer_step's flags, read in the same transfer


def optimizer_step(model, optimizer, scaler, grad_clip, lr, loss, is_outlier=None, flags=None):
    """Unscale (fp16), clip, step, update the loss scale. A step whose loss or gradients hold inf/nan
    is skipped in every precision: the fp16 GradScaler skips it (and lowers its scale), otherwise it is
    skipped here, so the weights never go non-finite. is_outlier(loss, norm) -> True skips a finite
    step too (the loss scale is left as it is). flags: a 1-D tensor on the device (the ranks' stop
    requests) read along with loss and norm. Returns Stepped, read from the GPU in one transfer."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor over the ranks (the whole model's norm once gathered)
        norm = norm.full_tensor()
    read = [loss.float().view(1), norm.float().to(loss.device).view(1)] + ([flags.float()] if flags is not None else [])
    loss, norm, *flags = torch.cat(read).tolist()  # the step's one host sync
    finite = math.isfinite(loss) and math.isfinite(norm)
    apply = finite and not (is_outlier is not None and is_outlier(loss, norm))
    if scaler.is_enabled():
        if apply or not finite:
            scaler.step(optimizer)  # skips by itself when the (unscaled) gradients hold inf/nan
        scaler.update()
    elif apply:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return Stepped(loss, norm, apply, flags)


@torch.no_grad()
def evaluate(model, loader, val_steps, device, plan, world_size):
    """Mean loss over val_steps batches from the start of the val split, averaged over ranks."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(val_steps):
        x, y = loader.next_batch(device)
        with precision.autocast(plan):
            _, loss = model(x, y)
        total += loss.float()
    if world_size > 1:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / (val_steps * world_size)


def sample(raw_model, cfg, device, plan):
    """num_samples top-k continuations of the prompt. Uses its own generator, seeded afresh each time,
    so sampling never moves the training RNG (and resumed runs stay bit-exact)."""
    from tokenizer import get_encoding
    enc = get_encoding()
    idx = torch.tensor(enc.encode_ordinary(cfg.sample_prompt), dtype=torch.long, device=device)
    idx = idx.unsqueeze(0).repeat(cfg.num_samples, 1)  # (num_samples, T0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 42)
    raw_model.eval()
    with precision.autocast(plan):
        out = raw_model.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    raw_model.train()
    return [enc.decode(row.tolist()) for row in out]


def load_hellaswag(cfg, rank, startup, say):
    """(the hellaswag module, its examples) when HellaSwag evals are on and hellaswag.py is there, else
    (None, None). Loaded once, at start-up, so that a download shows here and not mid-run; rank 0 first
    (it downloads), then the others (they read its cache)."""
    if cfg.hellaswag_interval == 0:
        return None, None
    if importlib.util.find_spec("hellaswag") is None:
        say("note: hellaswag.py not found; HellaSwag evaluation is skipped")
        return None, None
    import hellaswag

    def load():
        try:
            return hellaswag.load_examples("val", data_file=cfg.hellaswag_file or None, download=True)
        except Exception as e:  # offline, a missing or malformed file: the user's to fix
            raise UserError(f"cannot load HellaSwag: {e} (set --hellaswag_file=PATH or --hellaswag_interval=0)") from None
    examples = rank0_first(load, rank, startup)
    return hellaswag, examples[:cfg.hellaswag_limit or None]


def rank0_first(work, rank, startup):
    """work() on rank 0 first, then on the other ranks, which use what it made (a tokenized corpus, a
    download in the cache). The ranks wait for each other in the start-up group (gloo, STARTUP_TIMEOUT:
    tokenizing a large --data can outlast dist_timeout). Each turn ends with the ranks agreeing on the
    worst outcome, so a failure on any rank stops them all at once, with its exit code (2 bad input, 1
    otherwise), instead of leaving the others waiting for a peer that is gone and then blaming the network.
    startup None (no torchrun): work() alone."""
    if startup is None:
        return work()
    result = None
    for turn in ("rank 0", "another rank"):
        failure = None
        if (rank == 0) == (turn == "rank 0"):
            try:
                result = work()
            except Exception as e:  # noqa: BLE001 - said below, then raised again
                failure = e
        code = 0 if failure is None else 2 if isinstance(failure, UserError) else 1
        worst = int(precision.agree(code, "max", "cpu", group=startup))
        if failure is not None:
            if rank > 0 and isinstance(failure, (UserError, OSError)):  # main() says rank 0's errors only
                print(f"error: rank {rank}: {failure}", file=sys.stderr)
            raise failure
        if worst:
            why = f"stopped: {turn} failed at start-up; its error is in its output"
            if rank > 0 and os.environ.get("LOCAL_RANK") == "0":  # one line on each other node (rank 0 says its own)
                print(f"error: rank {rank}: {why}", file=sys.stderr)
            raise (UserError if worst == 2 else OSError)(why)
    return result

# -----------------------------------------------------------------------------
# setup: device, distributed, batch


def resolve_micro_batch_size(cfg, given, world_size, raw_model, optimizer, plan, say):
    """THE place the micro-batch (and on small GPUs the sequence length) is decided and the model
    compiled, once the model and optimizer exist and before DDP wraps them. micro_batch_size="auto"
    probes the GPU for the largest fast micro-batch, timed with the compiled model; on sm7x GPUs
    (plan.fit_to_memory) the keys the user did not set are fitted to the GPU's memory: the micro-batch
    shrinks first, seq_len only if even 1 x seq_len does not fit. Sets cfg.micro_batch_size (and
    cfg.seq_len); returns (accumulation steps, the model to train: compiled, or raw_model when the
    plan says no or the compiler failed)."""
    def compiled(model, micro_batch):  # static shapes; a compiler that fails costs one warning, the run goes on eager
        return precision.compile_model(model, plan, precision.compile_probe(micro_batch, cfg.seq_len, plan), warn=say)

    model = None
    if cfg.micro_batch_size == "auto":
        try:
            cfg.micro_batch_size, reason, model = precision.auto_micro_batch(
                raw_model, optimizer, cfg.seq_len, cfg.total_batch_size, world_size, plan.device, plan,
                default=FIELDS["micro_batch_size"].default, compile=compiled)
        except ValueError as e:
            raise UserError(f"micro_batch_size=auto: {e}") from None
        say(reason)
    elif plan.fit_to_memory and "micro_batch_size" not in given:
        memory = torch.cuda.get_device_properties(plan.device).total_memory
        cfg.micro_batch_size, cfg.seq_len, reason = precision.fit_micro_batch(
            raw_model.config, memory, cfg.seq_len, cfg.total_batch_size, world_size, plan.dtype,
            shrink_seq="seq_len" not in given)
        say(f"{reason} (set micro_batch_size/seq_len to choose yourself)")
    tokens = cfg.micro_batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens:
        raise UserError(f"total_batch_size={cfg.total_batch_size} is not a multiple of micro_batch_size x seq_len x "
                        f"world_size = {cfg.micro_batch_size} x {cfg.seq_len} x {world_size} = {tokens}: "
                        f"e.g. --total_batch_size={max(1, round(cfg.total_batch_size / tokens)) * tokens}")
    if model is None:  # not timed by the finder (its compiled graphs, one per size timed, serve training too)
        model = compiled(raw_model, cfg.micro_batch_size)
    return cfg.total_batch_size // tokens, model


# -----------------------------------------------------------------------------
# surviving the session: signals, the time limit, divergence


class Diverged(Exception):
    """The run cannot go on (steps skipped in a row, non-finite weights): one line, exit code 3."""


class Stopped(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: quit now, without saving."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def catch_stop_signals():
    """From here on, the first SIGINT/SIGTERM is noted in the returned list (the loop stops after the
    current optimizer step and saves); a second one raises Stopped wherever the loop is (a save in
    progress leaves its .tmp, never a broken file under a checkpoint's name). The loop ignores both
    once its last checkpoint is written; main() puts the previous handlers back. The handler prints nothing: a print inside it can collide with one in progress."""
    got = []

    def handler(signum, frame):
        if got:
            raise Stopped(signum)
        got.append(signum)
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return got


def resume_command(argv, ddp):
    """The command line that continues this run, as typed from the same directory."""
    args = [a for a in argv if not a.startswith("--resume=")] + ["--resume=true"]
    script = os.path.relpath(os.path.abspath(__file__))
    launcher = [os.path.basename(sys.executable)]
    if ddp:
        nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        launcher = ["torchrun", "--standalone" if nodes == 1 else f"--nnodes={nodes}",
                    f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)}"]
    return shlex.join(launcher + [script] + args)


OUTLIER_WINDOW = 128  # steps of history for the outlier test (llm.c's window)


class Guard:
    """Counts optimizer steps skipped in a row (inf/nan loss or gradients, or outliers) and stops the
    run after max_skipped of them. With z > 0 it flags as an outlier a step whose loss or gradient norm
    is more than z standard deviations above its mean over the last OUTLIER_WINDOW steps (the test
    starts once the window is full; every finite step goes into it, llm.c-style, so a lasting shift
    is absorbed). Its state is saved in checkpoints: a resumed run skips the same steps."""

    def __init__(self, z, max_skipped, state=None):
        self.z, self.max_skipped = z, max_skipped
        state = state or {}
        self.history = {k: deque(state.get(k, []), maxlen=OUTLIER_WINDOW) for k in ("loss", "norm")}
        self.in_a_row = state.get("in_a_row", 0)

    def is_outlier(self, loss, norm):
        return self.z > 0 and any(zscore(self.history[k], v) > self.z for k, v in (("loss", loss), ("norm", norm)))

    def update(self, loss, norm, applied):
        """After a step: True when it was the max_skipped-th skipped in a row."""
        if math.isfinite(loss) and math.isfinite(norm):
            self.history["loss"].append(loss)
            self.history["norm"].append(norm)
        self.in_a_row = 0 if applied else self.in_a_row + 1
        return 0 < self.max_skipped <= self.in_a_row

    def state_dict(self):
        return {"loss": list(self.history["loss"]), "norm": list(self.history["norm"]), "in_a_row": self.in_a_row}


def zscore(window, x):
    """How many standard deviations x is above the window's mean; 0 until the window is full."""
    if len(window) < window.maxlen:
        return 0.0
    mean = sum(window) / len(window)
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
    return (x - mean) / std if std > 0 else 0.0

# -----------------------------------------------------------------------------
# the training loop


def peer_failure(e):
    """Whether a RuntimeError is a collective that failed for want of a peer: torch.distributed's own
    errors, and the backends' timeouts and closed connections that DDP's reducer raises as plain
    RuntimeErrors."""
    return isinstance(e, dist.DistError) or any(s in str(e) for s in (
        "Timed out waiting", "Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
        "Watchdog caught collective operation timeout"))


def main(argv):
    ddp = "RANK" in os.environ  # launched by torchrun
    rank = int(os.environ.get("RANK", 0))
    master = rank == 0
    if "-h" in argv or "--help" in argv:
        if master:
            print(help_text())
        return 0
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        return train(argv, ddp, rank, master)
    except (UserError, OSError) as e:  # bad input: 2; a full disk or I/O error while writing: 1
        return fail(e, quiet=not master)
    except Diverged as e:
        if master:
            print(f"error: {e}", file=sys.stderr)
        return 3
    except RuntimeError as e:  # a peer stopped answering (dist_timeout) or died: said by the rank that saw it
        if not (ddp and peer_failure(e)):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        print(f"error: rank {rank}: a peer did not answer within dist_timeout or went away ({why}): check that every "
              "node is up and reachable (NCCL_DEBUG=INFO shows where it waits); the checkpoints written so far are "
              "intact, continue with --resume=auto", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C before training began, or a second one while stopping
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        if master:
            print(f"{signal.Signals(signum).name}: stopped at once, nothing saved (the checkpoints in out_dir are as they were)",
                  file=sys.stderr)
        return 128 + signum
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def train(argv, ddp, rank, master):
    started = time.time()  # time_limit counts from here
    say = print if master else (lambda *a, **k: None)
    cfg, given = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = precision.resolve_device(cfg.device, local_rank)
    device_type = torch.device(device).type
    startup = None  # under torchrun: the group rank0_first waits in
    if ddp:
        if device_type == "mps":
            raise UserError("torchrun on MPS is not supported: run one process, or use --device=cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        # NCCL: the watchdog tears a hung collective down after dist_timeout (3: without cleanup, the
        # torch default; 0 would leave it blocking forever); gloo raises in the waiting rank
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.dist_timeout))
        startup = dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)  # rank0_first's waits, on the CPU

    # precision: every hardware decision comes from the plan (precision.py), announced in one line
    plan = precision.make_plan(device, cfg.precision, cfg.compile)
    precision.set_tf32(plan.tf32)
    where = f"{device} ({plan.device_name}, sm{plan.capability[0]}{plan.capability[1]})" if plan.capability else device
    say(f"device {where} x {world_size} | {plan.describe()}")

    # data: there before anything slow (rank 0 tokenizes --data or builds the quickstart corpus; the others wait)
    rows = world_size * (cfg.micro_batch_size if cfg.micro_batch_size != "auto" else 1)  # one batch's rows, at least

    def prepare_data():
        data_dir = data.prepare(cfg, rows, build=master)
        for split in ("train", "val"):
            shard_paths(data_dir, split)  # every rank sees the shards (one line if not)
        return data_dir
    cfg.data_dir = rank0_first(prepare_data, rank, startup)

    # model, optimizer, loss scaler: fresh or from the newest checkpoint (resume_checkpoint decides)
    ckpt = resume_checkpoint(cfg, given, say)
    if ddp:  # every rank continues from the same step, or none does: out_dir must be one folder all nodes see
        held = float(ckpt["step"]) if ckpt is not None else -1.0
        if precision.agree(held, "min", device) != precision.agree(held, "max", device):
            raise UserError(f"the ranks find different checkpoints in out_dir {cfg.out_dir!r} (rank {rank}: "
                            f"{'step ' + str(ckpt['step']) if ckpt is not None else 'none'}): put out_dir on a filesystem "
                            "every node sees, or copy the newest ckpt_*.pt to every node's out_dir")
    evals_done = ckpt is not None and ckpt.get("evals_done", True)  # False: the evals at its step are still to run
    if ckpt is not None and (ckpt["step"] > cfg.max_steps or ckpt["step"] == cfg.max_steps and evals_done):
        say(f"{ckpt['path']} holds a finished run (step {ckpt['step']}, max_steps={cfg.max_steps}): nothing to do; "
            f"raise --max_steps to train on, or choose another --out_dir")
        return 0
    torch.manual_seed(cfg.seed)
    if ckpt is not None:
        raw_model = GPT.from_checkpoint(ckpt)
        given.add("seq_len")  # the checkpoint's: not to be fitted to the GPU again
    else:
        raw_model = build_model(cfg, verbose=master)
    for k in MODEL_KEYS:  # the model decides its shape (pretrained weights, checkpoints)
        setattr(cfg, k, getattr(raw_model.config, k))
    raw_model.config.activation_checkpointing = cfg.activation_checkpointing  # the run decides this one
    if cfg.fsdp and not ddp:
        raise UserError("fsdp=true shards the model over the ranks of a torchrun launch: run under torchrun, or drop --fsdp")
    if cfg.fsdp and (cfg.sample_interval > 0 or cfg.hellaswag_interval > 0):
        say("note: fsdp=true: in-training sampling and HellaSwag are off (they run outside the sharded forward); "
            "score a checkpoint with hellaswag.py")
        cfg.sample_interval = cfg.hellaswag_interval = 0
    if cfg.vocab_size < GPT2_VOCAB_SIZE and (cfg.sample_interval > 0 or cfg.hellaswag_interval > 0):
        say(f"note: vocab_size={cfg.vocab_size} cannot hold GPT-2's tokens: sampling and HellaSwag are off")
        cfg.sample_interval = cfg.hellaswag_interval = 0
    if cfg.seq_len > cfg.block_size:
        raise UserError(f"seq_len={cfg.seq_len} is longer than block_size={cfg.block_size}, the model's context: lower seq_len")
    raw_model.to(device)
    if cfg.fsdp:  # before the optimizer: it must hold the sharded parameters
        shard_model(raw_model, plan.dtype, device_type)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.max_lr, device_type, verbose=master)
    scaler = torch.amp.GradScaler(device_type, enabled=plan.grad_scaler)

    # micro-batch and compile: decided here, once the model and optimizer exist and before DDP wraps the model
    grad_accum, model = resolve_micro_batch_size(cfg, given, world_size, raw_model, optimizer, plan, say)
    if ddp and precision.agree(float(model is not raw_model), "min", device) < 1:  # one rank failed to compile: all eager
        model = raw_model
    plan = dataclasses.replace(plan, compile=model is not raw_model)
    B, T = cfg.micro_batch_size, cfg.seq_len
    train_loader = TokenLoader(cfg.data_dir, "train", B, T, rank, world_size, cfg.vocab_size, cfg.shuffle, cfg.seed)
    val_loader = TokenLoader(cfg.data_dir, "val", B, T, rank, world_size, cfg.vocab_size, shuffle=False)

    start_step, guard_state, newest = 0, None, None
    if ckpt is not None:
        load_optimizer_state(raw_model, optimizer, ckpt["optimizer"])
        if ckpt["scaler"] and plan.grad_scaler:
            scaler.load_state_dict(ckpt["scaler"])
        train_loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"], device)
        start_step, guard_state, newest = ckpt["step"], ckpt.get("guard"), ckpt["path"]
        say(f"resuming from {ckpt['path']} at step {start_step}")
        del ckpt
    wrap_ddp = ddp and not cfg.fsdp  # FSDP reduce-scatters the gradients itself, after every micro-step
    train_model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None,
                      gradient_as_bucket_view=True) if wrap_ddp else model  # grads live in the all-reduce buckets: no copy

    hellaswag, hs_examples = load_hellaswag(cfg, rank, startup, say)

    # the resolved config, the log
    cfg.device, cfg.precision = device_type, precision.dtype_name(plan.dtype)
    cfg.compile = "true" if plan.compile else "false"
    say(json.dumps(dataclasses.asdict(cfg), indent=2))
    tokens_per_step = B * T * world_size * grad_accum
    say(f"{raw_model.num_params(non_embedding=False):,} parameters | {tokens_per_step:,} tokens per step = "
        f"{B} x {T} x {world_size} rank(s) x {grad_accum} accumulation step(s) | {cfg.max_steps} steps")
    runlog = None  # rank 0's: log.jsonl, and TensorBoard / W&B when asked (logger.py)
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        write_json(os.path.join(cfg.out_dir, "config.json"), dataclasses.asdict(cfg))
        trim_log(os.path.join(cfg.out_dir, "log.jsonl"), start_step, keep_evals=evals_done)  # no rows twice
        runlog = logger.RunLog(cfg.out_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb_project, cfg.wandb_run_name,
                               resumed=start_step > 0)
    timer = logger.StepTimer()
    flops_tok = flops_per_token(raw_model, T)

    # surviving the session: the skip guard, the time limit, the last save
    guard = Guard(cfg.skip_outliers_z, cfg.max_skipped, guard_state)
    deadline = started + cfg.time_limit * 60 if cfg.time_limit > 0 else math.inf
    redo = start_step > 0 and not evals_done  # resumed from a stop checkpoint: its step's evals are still to run
    last_save = {"path": newest, "at": time.time(), "seconds": raw_model.num_params(non_embedding=False) * 12 / 100e6}
    longest = step_s = 0.0  # the longest loop iteration so far (evals included), the last optimizer step

    def checkpoint(step, evals_done):
        """Every rank checks that the state is finite (so that all stop alike); rank 0 writes it, then
        deletes the checkpoints keep_last no longer keeps. Returns its path."""
        if not finite_state(raw_model, optimizer, device):
            raise Diverged(f"the weights or optimizer state hold inf/nan before the checkpoint at step {step}, "
                           f"so it is not written: the run diverged (newest checkpoint: {last_save['path'] or 'none'}); "
                           f"lower max_lr or set grad_clip and start again")
        t = time.time()
        path = checkpoint_path(cfg.out_dir, step)
        save_checkpoint(path, raw_model, optimizer, scaler, step, cfg, train_loader, device, master,
                        evals_done=evals_done, guard=guard.state_dict())
        if master:
            prune_checkpoints(cfg.out_dir, step, cfg.keep_last)
            say(f"step {step:6d} | saved {path}")
        last_save.update(path=path, at=time.time(), seconds=1.5 * (time.time() - t))
        took = step_s + time.time() - t  # what a stop signal costs: the step in progress, then this save
        grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or os.environ.get("PET_SHUTDOWN_TIMEOUT") or 30)
        if ddp and took > grace and not last_save.get("warned"):  # once a run
            last_save["warned"] = True
            say(f"note: a step and a save take {took:.0f} s, more than the {grace:.0f} s torchrun gives the workers "
                f"between passing on a stop signal and SIGKILL: set TORCH_ELASTIC_SHUTDOWN_TIMEOUT="
                f"{max(60, math.ceil(2 * took / 10) * 10)} for torchrun (a torch whose torchrun has --shutdown-timeout), "
                f"or a stop may lose the steps since the last checkpoint")
        return path

    code, clock_due, signals = 0, False, catch_stop_signals()
    plotted_at = -math.inf
    for step in range(start_step, cfg.max_steps + 1):
        t_iter = time.time()
        last = step == cfg.max_steps
        fresh = step > start_step or start_step == 0 or redo  # a resumed run already did this step's evals
        do_eval = fresh and cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or last)
        do_hellaswag = fresh and hs_examples is not None and (step % cfg.hellaswag_interval == 0 or last)
        if do_eval:
            val_loss = evaluate(model, val_loader, cfg.val_steps, device, plan, world_size)
            say(f"step {step:6d} | val loss {val_loss:.4f}")
            if master:
                runlog.write({"step": step, "val_loss": val_loss})
        if do_hellaswag:
            res = hellaswag.evaluate(model, hs_examples, plan=plan, rank=rank,
                                     world_size=world_size, progress=master)
            say(f"step {step:6d} | HellaSwag acc {res['acc']:.4f} acc_norm {res['acc_norm']:.4f} ({res['n']} examples)")
            if master:
                runlog.write({"step": step, "hellaswag_acc": res["acc"], "hellaswag_acc_norm": res["acc_norm"]})
        if master and (do_eval or do_hellaswag) and (last or time.time() - plotted_at > PLOT_EVERY):
            plot.refresh(cfg.out_dir, say)  # out_dir/curves.png; a note once if matplotlib is missing, never a crash
            plotted_at = time.time()
        if fresh and master and cfg.sample_interval > 0 and step > 0 and (step % cfg.sample_interval == 0 or last):
            for text in sample(raw_model, cfg, device, plan):
                say(f"sample: {text!r}")
        if (step > start_step or redo) and (last or clock_due or cfg.checkpoint_interval > 0 and step % cfg.checkpoint_interval == 0):
            checkpoint(step, evals_done=True)
        if last:
            break

        # one optimizer step
        t0 = time.time()
        lr = get_lr(step, cfg)
        with logger.micro_step_bar(grad_accum, master) as bar:  # on a terminal, once a step takes > 5 s
            loss = accumulate_gradients(train_model, train_loader, grad_accum, device, plan, scaler, wrap_ddp, bar)
        # after this step: stop for a signal or the time limit (too little left for a step and a save)? save by the clock?
        now = time.time()
        out_of_time = now + longest + step_s + last_save["seconds"] > deadline
        clock_due = cfg.checkpoint_minutes > 0 and now - last_save["at"] > cfg.checkpoint_minutes * 60
        asks = [sig in signals for sig in STOP_SIGNALS] + [out_of_time, clock_due]
        flags = None
        if ddp:  # one all_reduce (SUM): the mean loss, and how many ranks ask for each: every rank decides alike
            stats = torch.stack([loss] + [torch.full_like(loss, ask) for ask in asks])  # no host-to-device copy
            dist.all_reduce(stats)
            loss, flags = stats[0] / world_size, stats[1:]  # the counts are read with loss and norm, in one transfer
        loss, norm, applied, counts = optimizer_step(train_model, optimizer, scaler, cfg.grad_clip, lr, loss,
                                                     guard.is_outlier, flags)
        if ddp:
            asks = [n > 0 for n in counts]
        *signalled, out_of_time, clock_due = asks
        stop_signal = next((sig for sig, ask in zip(STOP_SIGNALS, signalled) if ask), None)
        dt = time.time() - t0  # optimizer_step read loss and norm from the GPU: the step is done
        tok_per_s = tokens_per_step / dt
        mfu = precision.estimate_mfu(flops_tok, tok_per_s / world_size, plan.device_name, plan.dtype, plan.tf32)
        why = "" if applied else "inf/nan loss or gradients" if not (math.isfinite(loss) and math.isfinite(norm)) else "outlier"
        eta = timer.eta(dt, cfg.max_steps - step - 1)
        say(f"step {step:6d}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.3f}{why and f' (skipped: {why})'} | "
            f"{dt * 1000:.1f} ms | {tok_per_s:,.0f} tok/s | MFU {'n/a' if mfu is None else f'{mfu * 100:.1f}%'} | "
            f"ETA {logger.fmt_duration(eta)}")
        if step == start_step and master:
            say(precision.memory_summary(raw_model, optimizer, device, micro_batch=B, seq_len=T, dtype=plan.dtype))
        if master:
            runlog.write({"step": step, "loss": loss, "lr": lr, "norm": norm if math.isfinite(norm) else None,
                          "dt_ms": dt * 1000, "tok_per_s": tok_per_s, **({"skipped": why} if why else {})},
                         mfu=mfu, **logger.memory_stats(device))
        step_s, longest = dt, max(longest, time.time() - t_iter)
        if guard.update(loss, norm, applied):
            raise Diverged(f"the run diverged: {guard.in_a_row} optimizer steps in a row were skipped ({why}), "
                           f"the last at step {step} (newest checkpoint: {last_save['path'] or 'none'}); lower max_lr or "
                           f"set grad_clip and start again")
        if stop_signal or out_of_time:
            path = checkpoint(step + 1, evals_done=False)
            reason = stop_signal.name if stop_signal else f"time_limit={cfg.time_limit:g} min"
            say(f"{reason}: stopped after step {step}, saved {path}; resume with: {resume_command(argv, ddp)}")
            code = 128 + stop_signal if stop_signal else 124
            break
    if master:
        runlog.close()
    for sig in STOP_SIGNALS:  # saved: a late signal (torchrun stopping the ranks that are still here) changes nothing
        signal.signal(sig, signal.SIG_IGN)
    if ddp:
        dist.barrier()  # rank 0 may still be writing the last checkpoint: leave together
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
