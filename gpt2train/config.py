"""
The trainer's configuration: typed defaults (build-nanogpt's 124M recipe), config files,
--key=value.

    cfg, given = parse_args(["configs/quickstart.py", "--max_steps=10"])  # a Config, the keys set
    print(help_text())  # python train_gpt2.py --help

Config files are plain Python assignments (`n_layer = 12`) applied in order to the defaults below;
`--key=value` overrides them. The Config is frozen once parsed: what a run decides from it (device,
precision, micro-batch, ...) is the trainer's Run, never written back here.
"""
import dataclasses
import difflib
import io
import json
import os
import re
import shutil
import textwrap
import tokenize
import types
import inspect
from dataclasses import dataclass

from gpt2train import precision
from gpt2train.fileio import UserError
from gpt2train.kernels import GELU_IMPLS, QKV_IMPLS
from gpt2train.loss import LOSS_IMPLS


@dataclass(frozen=True)
class Config:
    # data and output
    data_dir: str = "edu_fineweb10B"  # token shards written by fineweb.py
    data_source: str = "fineweb"  # "python": if data_dir is missing or empty, build the quickstart
                                  # corpus in it
    data: str = ""  # your text (a file, folder or glob), tokenized into a cache beside out_dir:
                    # replaces data_dir
    text_column: str = "text"  # --data's .jsonl, .json and .parquet files: the field that holds the
                               # documents
    shuffle: bool = True  # train rows in a fresh seeded order each epoch (data.TokenLoader); false:
                          # file order
    out_dir: str = "out"  # checkpoints, log.jsonl, config.json (and curves.png, TensorBoard/W&B
                          # files)
    # model (init_from not scratch: its weights set the shape; a shape key set in a file or flag
    # must match them)
    init_from: str = "scratch"  # "scratch", a GPT-2 name (gpt2 .. gpt2-xl), a save_pretrained dir
                                # or a ckpt_*.pt
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width of the residual stream
    block_size: int = 1024  # the longest context the model takes (its position embeddings)
    vocab_size: int = 50304  # 50257 padded to a multiple of 64: faster matmuls
    # batch: total_batch_size tokens per optimizer step, in micro-batches of micro_batch_size x
    # seq_len per rank
    micro_batch_size: int = 64  # rows per micro-batch; auto: probe the GPU for the largest fast one
                                # that fits
    seq_len: int = 1024  # tokens per row of a micro-batch, at most block_size
    total_batch_size: int = 524288  # 2**19 tokens, ~0.5M as in GPT-3 Small
    # optimization: linear warmup then lr_schedule down to min_lr, one multiplier of every
    # optimizer's lrs
    optimizer: str = "adamw"  # "adamw" everywhere, or "muon": Muon on the blocks' matrices, AdamW
                              # on the rest
    max_steps: int = 19073  # 10B tokens / 524288 tokens per step
    warmup_steps: int = 715  # GPT-3 warms up over 375M tokens
    max_lr: float = 6e-4  # AdamW's learning rate after warmup
    min_lr: float = 6e-5  # AdamW's learning rate at max_steps
    lr_schedule: str = "cosine"  # cosine (build-nanogpt's), linear, or wsd (flat, then linear: the
                                 # Muon configs')
    cooldown_frac: float = 0.2  # lr_schedule=wsd: the last fraction of max_steps that cools down
                                # (its start: saved)
    embed_lr_mult: float = 1.0  # AdamW's lr x this on wte (tied lm_head) and wpe; 1 = GPT-2's (Muon
                                # configs: 3)
    scalar_lr_mult: float = 1.0  # AdamW's lr x this on biases and layer-norm gains; 1 = GPT-2's
                                 # (Muon configs: 3)
    weight_decay: float = 0.1  # AdamW's, on matrices and embeddings only (and Muon's, on its
                               # matrices)
    muon_lr: float = 6e-3  # optimizer=muon: Muon's lr after warmup, on AdamW's scale (torch's
                           # original: no better)
    muon_momentum: float = 0.95  # optimizer=muon: Muon's momentum (Nesterov)
    muon_momentum_warmup: int = 0  # optimizer=muon: steps of momentum 0.85 -> muon_momentum; 0 =
                                   # off (measured no gain)
    muon_split_qkv: bool = True  # optimizer=muon: c_attn as q, k, v: three (C, C) (dev/recipe.md:
                                 # -0.054 val)
    zero_init_proj: bool = False  # scratch runs: attn.c_proj, mlp.c_proj weights start at 0 (the
                                  # Muon configs)
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # evaluation, sampling, checkpoints (an interval of 0 disables; evals and a checkpoint also run
    # at the end)
    eval_interval: int = 250  # steps between val loss evaluations
    val_steps: int = 20  # val batches (micro_batch_size x seq_len per rank) from the start of the
                         # val split
    hellaswag_interval: int = 250  # steps between HellaSwag evaluations
    hellaswag_file: str = ""  # local HellaSwag jsonl; "" = the val split, downloaded once and
                              # cached
    hellaswag_limit: int = 0  # evaluate the first N examples only; 0 = all
    sample_interval: int = 250  # steps between printed samples
    num_samples: int = 4  # samples printed each time
    sample_tokens: int = 32  # new tokens per sample
    sample_prompt: str = "Hello, I'm a language model,"  # the text samples continue
    checkpoint_interval: int = 5000  # steps between out_dir/ckpt_XXXXXX.pt files
    checkpoint_minutes: float = 60.0  # also save when this long has passed since the last save (0 =
                                      # off)
    keep_last: int = 2  # checkpoints kept in out_dir (older ones are deleted once a new one is in
                        # place); 0 = all
    resume: str = "false"  # true: continue from the newest out_dir/ckpt_*.pt; auto: if there is
                           # one; false: start fresh
    # surviving the session: stop cleanly on SIGINT/SIGTERM or near the time limit; stop on
    # divergence
    time_limit: float = 0.0  # minutes from start-up; save and stop before they run out (0 = no
                             # limit)
    max_skipped: int = 10  # stop after this many optimizer steps skipped in a row (inf/nan,
                           # outliers); 0 = never
    skip_outliers_z: float = 0.0  # skip a step with loss or grad norm > z std above the last 128
                                  # steps' mean (0 = off)
    # logging: out_dir/log.jsonl always; TensorBoard and Weights & Biases when asked (logger.py)
    tensorboard: bool = False  # also write TensorBoard event files to out_dir (needs `pip install
                               # tensorboard`)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs wandb;
                             # WANDB_MODE=offline: no network)
    wandb_run_name: str = ""  # the W&B run's name; "" = wandb picks one
    # system
    device: str = "auto"  # auto, cpu, cuda, cuda:N, mps
    plan: str = "auto"  # CUDA: run another GPU generation's plan on this GPU, for testing (sm60,
                        # sm75, sm80, sm90)
    precision: str = "auto"  # auto = the plan for this GPU (precision.py): bf16 on sm80+, fp16 on
                             # sm7x/P100, else fp32
    compile: str = "auto"  # torch.compile: auto = the plan's choice (on for sm70+ GPUs), true,
                           # false
    compile_mode: str = "default"  # torch.compile's mode where the run compiles: default,
                                   # reduce-overhead (CUDA graphs; CUDA only) or
                                   # max-autotune-no-cudagraphs (kernels autotuned: minutes more)
    compile_cache_dir: str = "auto"  # torch.compile's caches: auto = <out_dir>/../.compile_cache,
                                     # "" = /tmp, a folder
    seed: int = 1337  # the run's random seed (initial weights, samples)
    dist_timeout: int = 600  # seconds a rank waits for its peers in a collective before giving up
                             # (torchrun)
    # memory: for models that do not fit (see dev/README.md for what fits where)
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state over the
                        # ranks (FSDP2)
    activation_checkpointing: str = "none"  # "blocks" or "every_other": recompute blocks in
                                            # backward
    loss_impl: str = "auto"  # loss head: auto = fused on CUDA where Triton runs it, else full
                             # logits where compiled and they fit, else chunked; full, chunked,
                             # fused (one Triton pass over the logits, in place; CPU: only under
                             # TRITON_INTERPRET=1)
    expandable_segments: bool = False  # CUDA: the caching allocator grows its segments in place
                                       # (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): less
                                       # reserved beyond what is allocated
    # kernel layouts: levers the GPU session times (dev/gpu_session.sh), the defaults until a lease
    # shows one faster (gpt2train/kernels.py)
    qkv_impl: str = "fused"  # c_attn: one matmul for q, k, v; "split": a matmul each on its rows
                             # (no cat of their gradients in backward)
    gelu_impl: str = "pointwise"  # the MLP's GELU: its own kernel; "epilogue": in the c_fc GEMM on
                                  # CUDA, its input recomputed in backward (one GEMM more, the
                                  # (B, T, 4C) pre-activation never kept)


CHOICES = {
    "data_source": ("fineweb", "python"),
    "optimizer": ("adamw", "muon"),
    "lr_schedule": ("cosine", "linear", "wsd"),
    "plan": ("auto", *precision.EMULATED_PLANS),
    "precision": precision.PRECISIONS,
    "compile": ("auto", "true", "false"),
    "compile_mode": precision.COMPILE_MODES,
    "activation_checkpointing": ("none", "blocks", "every_other"),
    "loss_impl": ("auto", *LOSS_IMPLS),
    "qkv_impl": QKV_IMPLS,
    "gelu_impl": GELU_IMPLS,
    "resume": ("false", "true", "auto"),
}
FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# int keys that also take "auto": the run decides (microbatch.choose_micro_batch)
AUTO_INTS = ("micro_batch_size",)
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
# nanoGPT's and build-nanogpt's names for our keys: a did-you-mean that explains the difference
NANOGPT_NAMES = {
    "learning_rate": "max_lr (the peak learning rate; min_lr is where the cosine ends)",
    "batch_size": "micro_batch_size (rows per micro-batch; total_batch_size is tokens per "
                  "optimizer step)",
    "max_iters": "max_steps",
    "lr_decay_iters": "max_steps (the cosine ends at max_steps)",
    "warmup_iters": "warmup_steps",
    "gradient_accumulation_steps": "total_batch_size (tokens per optimizer step; accumulation "
                                   "follows from it)",
    "block_size_train": "seq_len",
    "eval_iters": "val_steps",
    "dtype": "precision",
    "decay_lr": "min_lr (set min_lr = max_lr for a constant learning rate)",
    "always_save_checkpoint": "checkpoint_interval",
    "wandb_log": "wandb_project",
}


def check_key(key, source="cli"):
    """UserError for a key Config does not have, naming the config file it is in (source) and the
    3 nearest keys."""
    if key in FIELDS:
        return
    where = "" if source == "cli" else f"config file {source!r}: "
    if key in NANOGPT_NAMES:
        raise UserError(f"{where}unknown config key {key!r}: here it is {NANOGPT_NAMES[key]}")
    close = [repr(k) for k in difflib.get_close_matches(key, FIELDS, n=3)]
    hint = ""
    if close:
        near = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else close[0]
        hint = f" (did you mean {near}?)"
    raise UserError(f"{where}unknown config key {key!r}{hint}; `python train_gpt2.py --help` "
                    "lists every key")


def kind(key):
    """What a key takes, in words."""
    return ("true, false or auto" if key == "resume" else
            TYPE_NAMES[FIELDS[key].type] + (' or "auto"' if key in AUTO_INTS else ""))


def check_value(key, value):
    """value (from a config file, or parsed from the command line) as the key's type, or
    UserError."""
    if key == "resume" and isinstance(value, bool):  # resume = True in a config file
        value = str(value).lower()
    t = FIELDS[key].type
    # kept as the word: the run decides, config.json shows it as asked
    if key in AUTO_INTS and value == "auto":
        return value
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise UserError(f"{key} must be {kind(key)}, got {value!r} (default: "
                        f"{FIELDS[key].default!r})")
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(f"{key} must be one of {', '.join(CHOICES[key])}; got {value!r}")
    return value


def typed(text):
    """What the user typed, in a message: as it is, or quoted where it holds a line break or another
    unprintable character (a message is one line)."""
    return text if text.isprintable() else repr(text)


def parse_value(key, text, now=None):
    """A --key=value string as the key's type. now: (the value in force, where it was set: a config
    file's path or "cli"), named in the error; the default when None."""
    t = FIELDS[key].type
    if key in AUTO_INTS and text == "auto":
        return text
    if key == "resume":
        words = {"1": "true", "yes": "true", "0": "false", "no": "false"}
        return words.get(text.lower(), text.lower())
    try:
        if t is bool:
            words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            return words[text.lower()]
        return t(text)
    except (KeyError, ValueError):
        value, source = now or (FIELDS[key].default, None)
        in_force = {None: "default: ", "cli": f"before it: --{key}="}.get(source, f"{source} sets ")
        raise UserError(f"--{key}={typed(text)} is not {kind(key)} ({in_force}"
                        f"{shown(value)})") from None


def read_config_file(path):
    """The assignments of a config file as {name: value}, without names starting with _ and
    imports."""
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder: pass a file such as "
                        "configs/quickstart.py")
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found (options are written --key=value)")
    ns = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)
    except Exception as e:
        why = " ".join(str(e).splitlines())  # (the user's code may raise a message of lines)
        raise UserError(f"config file {path!r} does not run: {type(e).__name__}: {why}") from None
    return {k: v for k, v in ns.items()
            if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def parse_args(argv):
    """Config files and --key=value overrides, applied in order. Returns (the frozen Config, {key
    the user set: "cli" or the config file's path, where it was set last})."""
    values, given = {}, {}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise UserError(f"{typed(arg)}: options are written --key=value")
            key, text = arg[2:].split("=", 1)
            check_key(key)
            now = (values[key], given[key]) if key in values else None  # the value in force
            items, source = {key: parse_value(key, text, now)}, "cli"
        else:
            items, source = read_config_file(arg), arg
        for key, value in items.items():
            check_key(key, source)
            values[key] = check_value(key, value)
            given[key] = source
    cfg = Config(**values)
    validate(cfg)
    return cfg, given


def validate(cfg):
    """Refuse what cannot run or contradicts itself: one UserError line."""
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "micro_batch_size",
                "seq_len", "total_batch_size", "max_steps", "val_steps", "num_samples",
                "dist_timeout"):
        if getattr(cfg, key) != "auto" and getattr(cfg, key) < 1:  # (auto: AUTO_INTS)
            raise UserError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("warmup_steps", "eval_interval", "hellaswag_interval", "hellaswag_limit",
                "sample_interval", "sample_tokens", "checkpoint_interval", "checkpoint_minutes",
                "keep_last", "time_limit", "max_skipped", "skip_outliers_z", "max_lr", "min_lr",
                "weight_decay", "grad_clip", "muon_lr", "muon_momentum", "muon_momentum_warmup",
                "cooldown_frac", "embed_lr_mult", "scalar_lr_mult"):
        if not getattr(cfg, key) >= 0:  # (NaN fails this too)
            raise UserError(f"{key} must not be negative, got {getattr(cfg, key)}")
    for key in ("max_lr", "min_lr", "muon_lr"):  # (NaN fails this too)
        if not getattr(cfg, key) < 1e37:
            raise UserError(f"{key}={getattr(cfg, key):g} is too large: AdamW's first step "
                            "overflows float32 above ~3e37")
    if cfg.min_lr > cfg.max_lr:
        raise UserError(f"min_lr={cfg.min_lr:g} is above max_lr={cfg.max_lr:g}: the cosine decays "
                        "from max_lr down to min_lr; swap them (min_lr = max_lr gives a constant "
                        "learning rate)")
    if cfg.cooldown_frac > 1:
        raise UserError("cooldown_frac is a fraction of max_steps, at most 1; got "
                        f"{cfg.cooldown_frac:g} (0.2 is usual)")
    if cfg.muon_momentum >= 1:
        raise UserError(f"muon_momentum must be below 1, got {cfg.muon_momentum:g} (0.95 is usual)")
    if cfg.fsdp and cfg.compile_mode == "reduce-overhead":
        raise UserError("compile_mode=reduce-overhead replays CUDA graphs over fixed memory, but "
                        "fsdp=true gathers the weights into fresh memory every step: use "
                        "compile_mode=default with fsdp")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
    if os.path.isfile(cfg.out_dir):
        raise UserError(f"out_dir {cfg.out_dir!r} is a file; out_dir is a folder: move the file or "
                        "choose another out_dir")


SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # the model's shape


def check_shape(cfg, given, shape):
    """Under init_from (not scratch) the model's shape comes from its weights (shape: {key: value}):
    a shape key the user set, in a config file or on the command line, that differs is one UserError
    line."""
    differ = [k for k in SHAPE_KEYS if k in given and getattr(cfg, k) != shape[k]]
    if not differ:
        return
    said = ", ".join(f"{k}={getattr(cfg, k)} (the weights: {shape[k]})" for k in differ)
    if any(given[k] == "cli" for k in differ):
        flags = " ".join(f"--{k}" for k in differ if given[k] == "cli")
        raise UserError(f"{said} but init_from={cfg.init_from!r} sets the model's shape: drop "
                        f"{flags} (or drop --init_from to train a fresh model of that shape)")
    raise UserError(f"{given[differ[0]]} sets {said}, but init_from={cfg.init_from!r} sets the "
                    f"model's shape: a config for init_from leaves {', '.join(differ)} out (as "
                    "configs/finetune_gpt2.py does)")


def oddities(cfg):
    """Warnings for what runs but is probably not what was meant."""
    warnings = []
    if cfg.warmup_steps >= cfg.max_steps:
        warnings.append(f"warning: warmup_steps={cfg.warmup_steps} is not below "
                        f"max_steps={cfg.max_steps}: the "
                        "learning rate never reaches max_lr and never decays (warmup_steps is "
                        f"usually ~1-5% of max_steps)")
    return warnings


def asked_and_resolved(cfg, given, resolved):
    """config.json: the keys the user set, as asked (config files and flags), and the whole resolved
    config the run used; "decided": the keys whose resolved value differs from the asked or default
    one (device, precision, micro-batch, ...), so a user sees at a glance what the run chose."""
    asked, got = dataclasses.asdict(cfg), dataclasses.asdict(resolved)
    return {"asked": {k: asked[k] for k in asked if k in given}, "resolved": got,
            "decided": sorted(k for k in asked if asked[k] != got[k])}


def shown(value):
    """A config value as --key=value writes it: true/false, numbers, plain words bare; other strings
    (empty, spaces, commas, quotes) quoted."""
    if isinstance(value, str) and value and not re.search(r"[\s,\"'=]", value):
        return value
    return json.dumps(value)


def changes(saved, path, width=100):
    """The start-up's config block, from config.json's dict (asked_and_resolved): the keys set in a
    config file or flag whose value differs from the default, then what the run decided (device,
    precision, micro-batch, ...), key=value in Config's order, wrapped at width (never inside a
    value); the whole config is in path. A few lines instead of every key."""
    asked, got, default = saved["asked"], saved["resolved"], dataclasses.asdict(Config())
    set_ = [f"{k}={shown(asked[k])}" for k in FIELDS if k in asked and asked[k] != default[k]]
    chose = [f"{k}={shown(got[k])}" for k in FIELDS if k in saved["decided"]]
    lines = [f"config: what differs from the defaults (every key: {path})"]
    for title, items in (("set", set_), ("decided", chose)):
        line = f"  {title}:"
        for item in items:
            if len(line) + 1 + len(item) > width and not line.endswith(":"):
                lines.append(line)
                line = "   "
            line += " " + item
        if items:
            lines.append(line)
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# --help


def config_sections():
    """Config's keys as [(section, [names])] and {name: meaning}, read from its source: a comment
    line opens a section (comment lines right under it continue it), the comment that ends a
    field's line says what it means (continued on comment lines indented under it). --help prints
    these, and tests/test_readme.py holds docs/training.md's key list to them."""
    sections, meaning = [], {}
    name = indent = None  # the field whose comment a deeper-indented comment line continues
    for line in inspect.getsource(Config).splitlines():
        code = line.strip()
        if code.startswith("#") and name and len(line) - len(code) > indent:
            meaning[name] += " " + code.lstrip("# ")
        elif code.startswith("#") and sections and not sections[-1][1]:  # a section's next line
            sections[-1] = (sections[-1][0] + " " + code.lstrip("# "), [])
        elif code.startswith("#"):
            sections.append((code.lstrip("# "), []))
            name = None
        elif re.match(r"\w+\s*:", code) and code.split(":")[0].strip() in FIELDS:
            name, indent = code.split(":")[0].strip(), len(line) - len(line.lstrip())
            tokens = tokenize.generate_tokens(io.StringIO(code).readline)
            comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
            sections[-1][1].append(name)
            meaning[name] = comments[0].lstrip("# ") if comments else ""
    return sections, meaning


def help_text(width=None):
    """`python train_gpt2.py --help`: every key with its type, default and meaning, by section. A
    key's meaning goes on its own indented lines, so it wraps at the terminal's width, not in a
    narrow column."""
    width = width or max(80, shutil.get_terminal_size().columns)
    sections, meaning = config_sections()
    lines = ["usage: python train_gpt2.py [CONFIG_FILE ...] [--key=value ...]", "", textwrap.fill(
        "Config files (plain Python assignments, see configs/) and --key=value overrides apply in "
        "order to the defaults below; what differs from them is printed at start-up, the whole "
        "resolved config saved as out_dir/config.json.", width)]
    for title, names in sections:
        lines += ["", textwrap.fill(title + ":", width, break_on_hyphens=False)]
        for name in names:
            f = FIELDS[name]
            if name in CHOICES:
                shown = "|".join(CHOICES[name])
            elif f.type is bool:
                shown = "true|false"
            else:
                shown = f.type.__name__ + ("|auto" if name in AUTO_INTS else "")
            lines.append(f"  --{name} {shown}")
            lines.append(textwrap.fill(f"{meaning[name]} (default: {json.dumps(f.default)})", width,
                                       initial_indent=" " * 6, subsequent_indent=" " * 6,
                                       break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)
