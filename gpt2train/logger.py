"""
The one printer (print0, warn0: rank 0's console lines) and where the trainer's numbers go besides
the console: out_dir/log.jsonl always, TensorBoard event files and a Weights & Biases run when the
config asks for them; also the console's ETA, the progress bar of a long step and the end-of-run
summary.

    set_rank(env.rank)                  # once, in the trainer's main: print0 prints on rank 0 only
    print0(f"step {step} | ...")        # every console line of the package and the commands
    warn0("torch.compile failed ...")   # the same, as "warning: ..."
    with redirect0(sys.stderr): ...     # print0's lines to stderr (sample.py), or None: nowhere

    python train_gpt2.py configs/quickstart.py --tensorboard=true   # then: tensorboard --logdir out
    WANDB_MODE=offline python train_gpt2.py configs/quickstart.py --wandb_project=gpt2
    wandb sync out/quickstart/wandb/offline-run-*    # later, from a machine with network

Neither package is needed unless asked for: each is imported only then, and a missing one stops the
run at start-up with one line that says how to install it. W&B reads its usual environment
(WANDB_MODE=offline writes the run under out_dir/wandb/ and needs no network or account;
WANDB_API_KEY, WANDB_ENTITY, ...).
"""
import atexit
import collections
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
import time

import torch
from tqdm import tqdm

from gpt2train.fileio import UserError, naming, replacing, write_json

# -----------------------------------------------------------------------------
# the one printer: rank 0's console

RANK = 0  # this process's rank (set_rank): print0 prints on rank 0 only
STREAM = []  # redirect0's streams, innermost last (None: nowhere); empty: sys.stdout


def set_rank(rank):
    """Tell print0 this process's rank, once, before the first line (the trainer's main)."""
    global RANK
    RANK = rank


def print0(*args, file=None, **kwargs):
    """print() on rank 0, to file, else redirect0's stream, else stdout (as it is at the call:
    pytest swaps it)."""
    stream = file or (STREAM[-1] if STREAM else sys.stdout)
    if RANK == 0 and stream is not None:
        print(*args, file=stream, **kwargs)


def warn0(text):
    """print0 of one "warning: ..." line."""
    print0(f"warning: {text}")


@contextlib.contextmanager
def redirect0(stream):
    """print0's lines go to stream inside the block (None: nowhere), e.g. sample.py's status lines
    to stderr, the text alone on stdout."""
    STREAM.append(stream)
    try:
        yield
    finally:
        STREAM.pop()

# -----------------------------------------------------------------------------
# the dashboards: optional packages, asked for by config keys

# config key -> the package it needs
PACKAGES = {"tensorboard": "tensorboard", "wandb_project": "wandb"}


def check_packages(**asked):
    """One line, before anything slow, for each dashboard asked for (key=value that is set) whose
    package is not installed."""
    for key, value in asked.items():
        package = PACKAGES[key]
        if value and importlib.util.find_spec(package) is None:
            raise UserError(f"{key} needs the {package} package, which is not installed: "
                            f"`pip install {package}`, or leave {key} unset")


def load(key):
    """The package (module) a dashboard key needs, imported now, or the same one line when it cannot
    be."""
    check_packages(**{key: True})
    try:
        name = "torch.utils.tensorboard" if key == "tensorboard" else PACKAGES[key]
        return importlib.import_module(name)
    except ImportError as e:
        raise UserError(f"{key} needs the {PACKAGES[key]} package, which does not import ({e}): "
                        f"`pip install -U {PACKAGES[key]}`, or leave {key} unset") from None


def read_kept(path):
    """The {"project", "id"} of out_dir's W&B run, or {} when there is none (or it is not
    readable)."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) and isinstance(kept.get("id"), str) else {}


class RunLog:
    """Every event goes to out_dir/log.jsonl (one JSON object a line, appended across resumes) and,
    when asked, to TensorBoard (event files in out_dir, one scalar tag per key) and to a W&B run
    (its history, under out_dir/wandb/). write(event, **extra): event is {"step": s, key: value,
    ...} as log.jsonl holds it; the extra scalars (MFU, memory) go to the dashboards only, so that
    log.jsonl keeps its fields."""

    def __init__(self, out_dir, config, tensorboard=False, wandb_project="", wandb_run_name="",
                 resumed=False):
        """resumed: the run continues from a checkpoint in out_dir, so its W&B run (its id kept in
        out_dir/wandb_run.json) goes on, instead of a new one starting with the steps since the
        resume."""
        self.path = os.path.join(out_dir, "log.jsonl")
        # kept open for the run; line-buffered: each row lands whole
        self.file = open(self.path, "a", buffering=1)
        tb = load("tensorboard") if tensorboard else None
        wandb = load("wandb_project") if wandb_project else None
        self.tb = tb.SummaryWriter(log_dir=out_dir, flush_secs=30) if tb else None
        self.wandb = None
        if wandb:
            keep = os.path.join(out_dir, "wandb_run.json")
            previous = read_kept(keep) if resumed else {}
            again = {}
            if previous.get("project") == wandb_project:
                again = dict(id=previous["id"], resume="allow")
            try:
                self.wandb = wandb.init(project=wandb_project, name=wandb_run_name or None,
                                        dir=out_dir, config=config, **again)
            except Exception as e:  # no account, no network, a bad project name: the user's to fix
                raise UserError(f"wandb_project={wandb_project!r}: wandb.init failed "
                                f"({type(e).__name__}: {e}); set WANDB_MODE=offline to log without "
                                "network (then `wandb sync`)") from None
            write_json(keep, {"project": wandb_project, "id": self.wandb.id})
        atexit.register(self.close)  # flushed on every way out, an exception included

    def write(self, event, **extra):
        # (a full disk: one error line naming log.jsonl; the rows before stay whole)
        with naming(self.path):
            self.file.write(json.dumps(event) + "\n")
        scalars = {k: v for k, v in {**event, **extra}.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, event["step"])
        if self.wandb:
            self.wandb.log(scalars, step=event["step"])

    def close(self):
        if not self.file.closed:
            try:
                self.file.close()
            except OSError:  # the rest of a row a full disk refused: that write already said so
                pass
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


def compile_notes(watch, step, runlog):
    """Print each compiled graph that ran eagerly since the last step (watch:
    precision.CompileWatch, or None) as one warning line, and write it as a "compile" row in
    log.jsonl (runlog, or None)."""
    for line in watch.check() if watch else ():
        print0(line)
        if runlog:
            runlog.write({"step": step, "compile": line})


def step_row(step, stepped, lrs, dt, tok_per_s):
    """The log.jsonl row of an optimizer step (stepped: optim.Stepped; lrs: the base lrs, AdamW's
    and Muon's); a norm JSON cannot hold (inf/nan) is null."""
    row = {"step": step, "loss": stepped.loss, "lr": lrs[0]}
    if len(lrs) > 1:
        row["muon_lr"] = lrs[1]
    row.update(norm=stepped.norm if math.isfinite(stepped.norm) else None, dt_ms=dt * 1000,
               tok_per_s=tok_per_s)
    if stepped.why:
        row["skipped"] = stepped.why
    return row


def fmt_mfu(mfu, mfu_llmc):
    """The step line's MFU: ours (PaLM's count, model.flops_per_token) and, beside it, llm.c's
    (model.llmc_flops_per_token) against the same peak, so that its step line compares; n/a where
    the GPU's peak is unknown."""
    if mfu is None:
        return "n/a"
    return f"{mfu * 100:.1f}% (llm.c's count {mfu_llmc * 100:.1f}%)"


def fmt_lrs(lrs):
    """The base lrs on the console: AdamW's, or "adamw X muon Y" when there are two."""
    return f"adamw {lrs[0]:.2e} muon {lrs[1]:.2e}" if len(lrs) > 1 else f"{lrs[0]:.2e}"


def memory_stats(device):
    """Memory scalars for the dashboards, in MiB: the CUDA allocator's (allocated, reserved, peak
    allocated), or elsewhere the process's peak resident set."""
    if torch.device(device).type == "cuda":
        return {"mem_allocated_mib": torch.cuda.memory_allocated(device) / 2**20,
                "mem_reserved_mib": torch.cuda.memory_reserved(device) / 2**20,
                "mem_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    try:
        import resource
    except ImportError:  # Windows
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"mem_rss_peak_mib": peak / 2**20 if sys.platform == "darwin" else peak / 2**10}

# -----------------------------------------------------------------------------
# the console: the run's ETA, and a progress bar inside long steps

PROGRESS_DELAY = 5.0  # seconds: a step shorter than this never shows its micro-step bar


class StepTimer:
    """The run's ETA from the mean time of the last `window` optimizer steps. The first step of each
    process is left out (compilation, warm-up); evals, HellaSwag and checkpoints are not counted."""

    def __init__(self, window=20):
        self.times = collections.deque(maxlen=window)
        self.seen_first = False

    def eta(self, dt, steps_left):
        """Records a step that took dt seconds; returns the seconds that steps_left more such steps
        take, or None while there is no step to go by."""
        if self.seen_first:
            self.times.append(dt)
        self.seen_first = True
        return sum(self.times) / len(self.times) * steps_left if self.times else None


def fmt_duration(seconds):
    """42s, 12m05s, 3h07m, 2d03h; n/a for None."""
    if seconds is None:
        return "n/a"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def micro_step_bar(grad_accum, master, stream=None):
    """A bar over one optimizer step's micro-steps (call .update() after each) on rank 0's terminal:
    it shows only once the step has run PROGRESS_DELAY seconds (tqdm's delay) and clears itself at
    the end, so fast steps print nothing. Off on other ranks, for a single micro-step, and when
    stream (stderr) is not a terminal, so log files and pipes never see it. (On a GPU it counts
    micro-steps queued: the work itself may finish later.)"""
    stream = stream or sys.stderr
    show = master and grad_accum > 1 and stream.isatty()
    return tqdm(total=grad_accum, desc="micro-steps", unit="", file=stream, leave=False,
                dynamic_ncols=True, delay=PROGRESS_DELAY, disable=not show)


def trim_log(path, step, keep_evals):
    """Before a run (re)starts at step: drop the log rows it will write again, so that log.jsonl has
    no duplicates: every row from step on, except the evals at step itself when the checkpoint was
    written after them (keep_evals). Rows that do not parse (a line cut by a kill) are dropped too.
    """
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
# the end of a run


def summary(run, progress):
    """Print the end of a finished run: its checkpoint, last and best val loss (log.jsonl: the whole
    run, resumed sessions included), tokens, wall time and tok/s of this session, and the commands
    to run next. run: the trainer's Run; progress: its loop state."""
    cfg = run.cfg
    try:
        with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
            vals = [(r["val_loss"], r["step"]) for r in map(json.loads, f) if "val_loss" in r]
    except (OSError, ValueError):
        vals = []
    val = "no val loss (eval_interval=0)"
    if vals:
        val = f"val loss {vals[-1][0]:.4f} (best {min(vals)[0]:.4f} at step {min(vals)[1]})"
    steps = cfg.max_steps - run.start_step
    tokens = steps * run.tokens_per_step
    speed = f"{tokens / progress.train_s:,.0f} tok/s" if progress.train_s > 0 else "n/a tok/s"
    print0(f"done: step {cfg.max_steps} | {val} | {steps} steps, {tokens:,} tokens in "
           f"{fmt_duration(time.time() - run.started)}, {speed} | "
           f"checkpoint {progress.newest or 'none'}")
    if progress.newest:
        print0(f"next: python sample.py --model {cfg.out_dir}          # text from the newest "
               "checkpoint\n"
               f"      python export.py {progress.newest} {os.path.join(cfg.out_dir, 'hf')}"
               "  # a Hugging Face folder\n"
               f"      python plot.py {cfg.out_dir}                    # the curves: "
               f"{os.path.join(cfg.out_dir, 'curves.png')} (needs matplotlib, optional: "
               "pip install matplotlib)")
