"""
A run's out_dir: its name (run_out_dir), its checkpoint files (list, read, newest; save, prune),
what a checkpoint changes on resume, and the lock that keeps one live run per out_dir.

    lock = OutDirLock(); lock.acquire(out_dir)   # a second live run on out_dir: one line, exit 2
    ckpt, overrides = resume_overrides(out_dir, cfg, given)  # what to continue from, what it fixes
    state = TrainState(raw_model, optimizers, scaler, loader, device)
    save_checkpoint(path, state, step=step, config=config)
    restore(ckpt, raw_model, optimizers, scaler, loader, device)  # what it continues from, put back

Checkpoints hold plain tensors/dicts/numbers only, so torch.load(weights_only=True) reads them; the
optimizer state is keyed by parameter name (one state for AdamW alone, or AdamW + Muon together).
"""
import contextlib
import dataclasses
import datetime
import errno
import json
import os
import pickle
import re
import shutil
import socket
import threading
import time
import zipfile

import torch

from gpt2train.config import SHAPE_KEYS as MODEL_KEYS
from gpt2train.distributed import agree, rank
from gpt2train.fileio import DiskFull, UserError, missing_dirs, remove_empty_dirs, replacing
from gpt2train import optim
from gpt2train.guard import Diverged, remedy
from gpt2train.logger import print0, warn0
from gpt2train.sharding import full_state, load_optimizer_state

# the keys that give a run its meaning: on resume they come from the checkpoint (MODEL_KEYS: from
# its model)
RUN_KEYS = ("init_from", "seq_len", "total_batch_size", "warmup_steps", "max_lr", "min_lr",
            "weight_decay", "grad_clip", "seed", "muon_lr", "muon_momentum", "lr_schedule",
            "cooldown_frac", "embed_lr_mult", "scalar_lr_mult", "muon_momentum_warmup",
            "muon_split_qkv", "zero_init_proj")
# a RUN_KEY whose default changed: what a checkpoint written before the key existed ran with
BEFORE_THE_KEY = {"muon_split_qkv": False}


def checkpoint_files(out_dir):
    """The ckpt_XXXXXX.pt files in out_dir as [(step in the name, path)], highest first (no .tmp
    debris)."""
    if not os.path.isdir(out_dir):
        return []
    names = [f for f in os.listdir(out_dir) if re.fullmatch(r"ckpt_\d+\.pt", f)]
    return sorted(((int(f[5:-3]), os.path.join(out_dir, f)) for f in names), reverse=True)


def held_steps(out_dir, skipped=None):
    """[(the step it holds, path)] of the readable checkpoints in out_dir, newest first by that step
    (not by the name). An unreadable (truncated, foreign) file is left out, its warning (naming it)
    appended to the list skipped when given. The steps are read with mmap: the zip's directory and
    one number, not the tensors."""
    held = []
    for _, path in checkpoint_files(out_dir):
        try:
            step = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
            held.append((step, path))
        except Exception as e:  # noqa: BLE001 - zip, unpickling, EOF, no "step": not to resume
            why = (str(e).strip().splitlines() or [""])[0]  # torch's first line, whole words only
            why = why if len(why) <= 150 else why[:150].rsplit(" ", 1)[0] + " ..."
            if skipped is not None:
                skipped.append(f"skipping {path}: not a readable checkpoint "
                               f"({type(e).__name__}: {why})")
    return sorted(held, reverse=True)


def warned_held_steps(out_dir):
    """held_steps, each unreadable file left out said in one warning line (warn0)."""
    skipped = []
    held = held_steps(out_dir, skipped)
    for line in skipped:
        warn0(line)
    return held


def newest_checkpoint(spec):
    """spec as it is, or for a training run's out_dir (a folder holding ckpt_XXXXXX.pt files) its
    newest readable checkpoint by the step it holds, as the trainer resumes (an unreadable one
    skipped, warned): sample.py, hellaswag.py and export.py take a run folder this way. A run's
    folder with no checkpoint yet, or a folder with neither checkpoints nor save_pretrained weights,
    is one UserError line saying so (not a loader's "no model weights ... hub names")."""
    files = checkpoint_files(spec)
    if not files and is_run_folder(spec):
        raise UserError(f"no checkpoint in {spec} yet: a run writes ckpt_XXXXXX.pt at its "
                        "checkpoint_interval, at a stop (Ctrl-C) and at its end; wait for one, or "
                        "stop the run to write one now")
    if not files and os.path.isdir(spec) and not any(map(WEIGHTS.fullmatch, os.listdir(spec))):
        raise UserError(f"no ckpt_*.pt and no save_pretrained files in {spec}: pass a run's "
                        "out_dir, a ckpt_*.pt file, or a folder written by export.py or "
                        "save_pretrained")
    held = warned_held_steps(spec) if files else []
    if held:
        return held[0][1]
    return files[0][1] if files else spec  # none readable: read_checkpoint says why


def is_run_folder(path):
    """Whether path is a folder train_gpt2.py writes into (its run.lock, log.jsonl, or a config.json
    with "resolved"), not a save_pretrained directory."""
    if not os.path.isdir(path):
        return False
    if any(os.path.exists(os.path.join(path, name)) for name in ("run.lock", "log.jsonl")):
        return True
    return "resolved" in read_json(os.path.join(path, "config.json"))


def read_json(path):
    """The JSON object in path, or {} (no such file, not JSON, not an object)."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


# the weights save_pretrained writes (one file, or shards and their index), and all its files (the
# tokenizer's too, which export.py adds): a folder holding one is a Hugging Face model folder, never
# a run's out_dir (export.py, the mirror, refuses a run's)
WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
SAVE_PRETRAINED = re.compile(WEIGHTS.pattern + r"|generation_config\.json|vocab\.json|merges\.txt|"
                             r"tokenizer(_config)?\.json|special_tokens_map\.json")
# what the trainer writes in out_dir under fixed names, besides run.lock and its ckpt_XXXXXX.pt
RUN_FILES = ("config.json", "log.jsonl", "curves.png", "wandb_run.json")


def check_out_dir(out_dir):
    """UserError (nothing written) for an out_dir the trainer would write over what it did not
    write: a Hugging Face model folder (save_pretrained's files: export.py's output), or a folder
    holding a RUN_FILES name no run wrote. A run writes config.json (with "resolved") before its
    other files, so without it or a checkpoint they are someone else's."""
    if not os.path.isdir(out_dir):
        return
    names = sorted(os.listdir(out_dir))
    config = read_json(os.path.join(out_dir, "config.json"))
    hf = [n for n in names if SAVE_PRETRAINED.fullmatch(n)]
    hf += ["config.json"] if "model_type" in config else []  # (a GPT2Config: a model's)
    if hf:
        raise UserError(f"out_dir {out_dir!r} is a Hugging Face model folder (it holds {hf[0]}, "
                        "written by export.py or save_pretrained), not a run's: choose another "
                        f"--out_dir (to train on from its weights: --init_from={out_dir})")
    ours = "resolved" in config or bool(checkpoint_files(out_dir))
    for name in RUN_FILES:
        if name in names and not ("resolved" in config if name == "config.json" else ours):
            raise UserError(f"out_dir {out_dir!r} holds {name}, which train_gpt2.py did not write "
                            f"and would overwrite: choose another --out_dir, or move {name} out "
                            "of it")


def read_checkpoint(path):
    """A checkpoint written by train_gpt2.py, as a dict of plain CPU tensors and numbers
    (weights_only), or one UserError line for a missing, truncated or foreign file."""
    if os.path.isdir(path):
        raise UserError(f"checkpoint {path!r} is a folder: pass one of the ckpt_*.pt files in it")
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path!r} not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling, zip, EOF: "not a readable checkpoint"
        # torch.save writes a zip
        complete = zipfile.is_zipfile(path) and not isinstance(e, pickle.UnpicklingError)
        why = ((str(e).strip().splitlines() or [type(e).__name__])[0][:200] if complete
               else "not a complete torch.save file")
        raise UserError(f"{path} is not a readable train_gpt2.py checkpoint ({why}; truncated or "
                        "another file?)") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args"} <= set(ckpt):
        raise UserError(f"{path} is not a train_gpt2.py checkpoint (no 'model' and "
                        "'model_args' in it)")
    return ckpt


def check_config(config, state_dict):
    """ValueError unless config's sizes are positive integers that agree with the weights' shapes
    and its modes are known ones (a checkpoint's model_args against its model)."""
    sizes = {k: getattr(config, k)
             for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")}
    if not all(type(v) is int and v >= 1 for v in sizes.values()):
        raise ValueError(f"model_args {sizes} must be positive integers")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
    modes = {"attn_impl": ("sdpa", "naive")}
    for k, allowed in modes.items():
        if getattr(config, k) not in allowed:
            raise ValueError(f"{k}={getattr(config, k)!r} is not one of {', '.join(allowed)}")
    blocks = {k.split(".")[2] for k in state_dict if k.startswith("transformer.h.")}
    shapes = (tuple(state_dict["transformer.wte.weight"].shape),
              tuple(state_dict["transformer.wpe.weight"].shape), len(blocks))
    if shapes != ((config.vocab_size, config.n_embd), (config.block_size, config.n_embd),
                  config.n_layer):
        raise ValueError(f"model_args {sizes} do not match its weights")


def checkpoint_path(out_dir, step):
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def latest_checkpoint(out_dir):
    """(path, checkpoint) of the newest readable checkpoint in out_dir by the step it holds (not by
    its name), or (None, None). An unreadable (truncated, foreign) file is skipped with a warning
    naming it; only the chosen file is read in full."""
    for _, path in warned_held_steps(out_dir):
        try:
            return path, read_checkpoint(path)
        except UserError as e:
            warn0(f"skipping {path}: {e}")
    return None, None


def optimizer_kind(ckpt):
    """"adamw" or "muon": which optimizers a checkpoint's state belongs to (older ones: AdamW)."""
    return ckpt.get("config", {}).get("optimizer", "adamw")


def run_out_dir(cfg, given):
    """--data without --out_dir on the command line trains in <the config's out_dir>-<the data's
    name> (out/quickstart-my_book; out/my_book without a config's out_dir), so that your own text
    never lands in another run's out_dir: the config's own run, or another config's run on the same
    text.
    """
    if cfg.data and given.get("out_dir") != "cli":
        name = os.path.basename(os.path.normpath(cfg.data.split("*")[0])) or "data"
        name = os.path.splitext(name)[0] or "data"
        if "out_dir" in given:
            return f"{os.path.normpath(cfg.out_dir)}-{name}"
        return os.path.join("out", name)
    return cfg.out_dir


def resume_overrides(out_dir, cfg, given):
    """THE resume decision: (the checkpoint to continue from, or None for a fresh run; {key: value}
    it fixes). resume=false refuses an out_dir that holds checkpoints (another run's), true needs
    one, auto takes one if there is one. A model shape, init_from or optimizer the user set that
    differs from the checkpoint's is refused; the RUN_KEYS come from the checkpoint, any that
    changed reported in one line. Only safe keys (intervals, max_steps, device, precision,
    micro-batch, ...) come from cfg."""
    files = checkpoint_files(out_dir)
    if cfg.resume == "false":
        if files:
            newest = os.path.basename(files[0][1])
            raise UserError(f"out_dir {out_dir!r} holds another run's checkpoints ({newest}): "
                            "--resume=auto continues it; for a new run choose another --out_dir "
                            "(or delete its ckpt_*.pt)")
        return None, {}
    if not files:
        if cfg.resume == "true":
            raise UserError(f"resume=true but {out_dir!r} has no ckpt_*.pt: drop --resume or point "
                            "--out_dir at the run")
        return None, {}
    path, ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        raise UserError(f"out_dir {out_dir!r} holds ckpt_*.pt files but none is readable: choose "
                        "another --out_dir")
    saved, model_args = ckpt.get("config", {}), ckpt["model_args"]
    for key in MODEL_KEYS + ("init_from",):
        have = model_args.get(key) if key in MODEL_KEYS else saved.get(key, cfg.init_from)
        if key in given and getattr(cfg, key) != have:
            drop = f"{given[key]} sets it"
            if given[key] == "cli":
                drop = f"drop --{key} to continue this one"
            raise UserError(f"{path} holds a run with {key}={have!r}, not {getattr(cfg, key)!r} as "
                            f"asked: choose another --out_dir for a new run ({drop})")
    if optimizer_kind(ckpt) != cfg.optimizer:
        raise UserError(f"{path} was trained with optimizer={optimizer_kind(ckpt)}, not "
                        f"{cfg.optimizer} as asked: its optimizer state cannot continue as the "
                        "other; drop --optimizer to resume, or start a new run from its weights "
                        f"with --init_from={path} --out_dir=<a new folder>")
    overrides = {k: saved.get(k, BEFORE_THE_KEY.get(k))
                 for k in RUN_KEYS if k in saved or k in BEFORE_THE_KEY}
    changed = [f"{k}={v!r} (not {getattr(cfg, k)!r})"
               for k, v in overrides.items() if v != getattr(cfg, k)]
    if changed:
        print0(f"note: resuming keeps the checkpoint's {', '.join(changed)}: they would change the "
               "run; to change them start a new run in another out_dir")
    ckpt["path"] = path
    return ckpt, overrides


def resume_point(cfg, given, env, device, lock):
    """(out_dir, the checkpoint to continue from or None, {key: value} it fixes): out_dir taken for
    this run (rank 0 holds its lock), the resume decision made (resume_overrides), every rank
    continuing from the same step."""
    out_dir = run_out_dir(cfg, given)
    check_out_dir(out_dir)  # on every rank: each refuses alike, before the lock writes run.lock
    if env.master:
        lock.acquire(out_dir)
    ckpt, overrides = resume_overrides(out_dir, cfg, given)
    if env.ddp:  # out_dir must be one folder all nodes see
        held = float(ckpt["step"]) if ckpt is not None else -1.0
        if agree(held, "min", device) != agree(held, "max", device):
            mine = f"step {ckpt['step']}" if ckpt is not None else "none"
            raise UserError(f"the ranks find different checkpoints in out_dir {out_dir!r} (rank "
                            f"{env.rank}: {mine}): put out_dir on a filesystem every node sees, or "
                            "copy the newest ckpt_*.pt to every node's out_dir")
    return out_dir, ckpt, overrides


def say_extension(cfg, ckpt, out_dir):
    """Print a resume's one note on how the lr schedule goes on when max_steps grew past the
    checkpoint's (extension_note), naming wsd's kept cooldown-start checkpoint when the run is past
    it."""
    planned = ckpt.get("config", {}).get("max_steps")
    if not isinstance(planned, int):
        return
    branch = optim.cooldown_start(cfg, planned)
    path = checkpoint_path(out_dir, branch) if branch is not None else None
    path = path if path and branch < ckpt["step"] and os.path.exists(path) else None
    note = optim.extension_note(cfg, planned, ckpt["step"], ckpt["path"], path)
    if note:
        print0(note)


def kept_branches(cfg, ckpt):
    """The cooldown-start steps (wsd) of the plans before this one, whose checkpoints stay: the
    checkpoint's own list and, when max_steps grew, the cooldown start of the max_steps it was
    planned for (say_extension offers it)."""
    if ckpt is None:
        return ()
    planned = ckpt.get("config", {}).get("max_steps")
    old = None
    if isinstance(planned, int):
        old = optim.cooldown_start(cfg, planned)
    kept = {*ckpt.get("kept", ()), *([old] if old is not None else [])}
    return tuple(sorted(kept - {optim.cooldown_start(cfg)}))


def evals_done_at(ckpt):
    """The step whose evals the checkpoint's run already ran (-1: none, or no checkpoint): a save
    for a stop (signal, time limit) comes before the next step's evals."""
    return ckpt["step"] if ckpt is not None and ckpt.get("evals_done", True) else -1


def finished(ckpt, max_steps):
    """Whether a checkpoint holds a run that is done: past max_steps, or at it with its evals
    run."""
    return ckpt is not None and (ckpt["step"] > max_steps or evals_done_at(ckpt) == max_steps)


def finished_line(ckpt, max_steps):
    """The line for an out_dir whose checkpoint holds a finished run (finished): nothing to do."""
    return (f"{ckpt['path']} holds a finished run (step {ckpt['step']}, max_steps={max_steps}): "
            "nothing to do; raise --max_steps to train on (how the lr schedule goes on: "
            "docs/training.md, 'Extending a run'), or choose another --out_dir")


def prune_checkpoints(out_dir, step, keep_last, keep=()):
    """Once ckpt_{step} is in place: delete the readable checkpoints that hold an older step but the
    keep_last - 1 newest of them (keep_last 0: keep all), and the .tmp left by a save that was
    killed. An unreadable file is never counted among those kept and never deleted (resume skipped
    it, with a warning naming it); a checkpoint holding a later step (from before a resume), or one
    of the steps in keep (wsd's cooldown start), is left alone."""
    for name in os.listdir(out_dir):
        if re.fullmatch(r"ckpt_\d+\.pt\.tmp", name):
            os.remove(os.path.join(out_dir, name))
    older = [path for s, path in held_steps(out_dir) if s < step and s not in keep]
    for path in older[keep_last - 1:] if keep_last > 0 else []:
        os.remove(path)


BRANCH_NOTE = (" (the cooldown starts here; kept: to train longer, copy it to a new out_dir and "
               "resume there with a larger --max_steps)")


def due(run, step, last, progress):
    """Whether the trainer writes a checkpoint before this step: at the end, every
    checkpoint_interval steps, by the clock (checkpoint_minutes), or at wsd's cooldown start when
    checkpoint_interval is on (kept: the run continues from it with a larger max_steps exactly as if
    planned); never at step 0 or at the step the resumed checkpoint holds."""
    every = run.cfg.checkpoint_interval
    branch = every > 0 and step == optim.cooldown_start(run.cfg)
    interval = every > 0 and step % every == 0
    wanted = last or progress.clock_due or branch or interval
    return step != run.evals_done_at and step > 0 and wanted


def save_run(run, step, progress, evals_done=True):
    """Check on every rank that the state is finite (so that all stop alike), write the trainer's
    checkpoint of step on rank 0 and delete those keep_last no longer keeps (never wsd's cooldown
    start or run.kept); note it in progress (the loop's state) and return its path."""
    cfg, branch = run.cfg, optim.cooldown_start(run.cfg)
    if not finite_state(run.raw_model, run.optimizers, run.plan.device):
        raise Diverged("the weights or optimizer state hold inf/nan before the checkpoint at step "
                       f"{step}, so it is not written: the run diverged (newest checkpoint: "
                       f"{progress.newest or 'none'}); {remedy(cfg)}")
    t = time.time()
    path = checkpoint_path(cfg.out_dir, step)
    state = TrainState(run.raw_model, run.optimizers, run.scaler, run.train_loader, run.plan.device)
    save_checkpoint(path, state, step=step, config=dataclasses.asdict(cfg), evals_done=evals_done,
                    guard=progress.guard.state_dict(), kept=list(run.kept))
    if run.env.master:
        prune_checkpoints(cfg.out_dir, step, cfg.keep_last, keep=(branch, *run.kept))
        note = BRANCH_NOTE if step == branch and step < cfg.max_steps else ""
        print0(f"step {step:6d} | saved {path}{note}")
    progress.newest, progress.saved_at, progress.save_s = path, time.time(), 1.5 * (time.time() - t)
    progress.saved_step = step
    note = run.env.shutdown_grace_note(progress.step_s + time.time() - t)  # a stop: a step, a save
    if note and not progress.warned_grace:  # once a run
        progress.warned_grace = True
        print0(note)
    return path


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


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The live state a checkpoint saves: the model, its optimizers, the loss scaler, the data
    position, and the device whose RNG goes with them."""
    raw_model: object  # the GPT itself (FSDP-sharded in place when fsdp)
    optimizers: list  # AdamW, or AdamW + Muon
    scaler: object  # torch.amp.GradScaler (a no-op but for fp16)
    loader: object  # the train TokenLoader
    device: str


def save_checkpoint(path, state, *, step, config, **extra):
    """Write the checkpoint of step to path from state (a TrainState): every rank calls it (under
    FSDP the full state is gathered from all of them), rank 0 writes. config: the run's resolved
    config (a dict). extra: the loop's own state (whether the evals at this step ran, the skip
    guard's history)."""
    # full CPU tensors on rank 0
    model_state, optimizer_state = full_state(state.raw_model, state.optimizers)
    if rank() != 0:
        return
    ckpt = {
        "model": model_state,  # keyed as the bare module's state_dict(): no _orig_mod. prefixes
        "model_args": dataclasses.asdict(state.raw_model.config),
        "optimizer": optimizer_state,  # keyed by parameter name, FSDP or not; AdamW's and Muon's
        "scaler": state.scaler.state_dict(),
        "step": step,  # optimizer steps done
        "config": config,
        "loader": state.loader.state_dict(),
        "rng": rng_state(state.device),
        **extra,
    }
    with replacing(path) as tmp, open(tmp, "wb") as f:  # never half a checkpoint under its name
        try:
            torch.save(ckpt, f)  # (to a file object: a full disk is then an OSError, ENOSPC)
        except RuntimeError as e:  # torch's own report of a short write: a full disk, or I/O
            free = shutil.disk_usage(os.path.dirname(path) or ".").free + f.tell()
            need = state_bytes(ckpt)
            if free < need:  # (f.tell(): the bytes written so far, freed with the temp file)
                raise DiskFull(f"No space left on device: the checkpoint needs {size(need)}, "
                               f"{size(free)} are free there; free {size(need - free)} or choose "
                               "another out_dir, then run the same command again", path) from None
            raise OSError(errno.EIO, f"a short write ({str(e).strip()[:200]})") from None


def size(n):
    """n bytes for a person: GB from 0.1 GB on, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def state_bytes(obj):
    """The bytes of the tensors in a (nested) checkpoint dict: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def restore(ckpt, raw_model, optimizers, scaler, loader, device):
    """Put back the state a checkpoint continues from: optimizers, loss scale, data position,
    RNG."""
    load_optimizer_state(raw_model, optimizers, ckpt["optimizer"])
    if ckpt["scaler"] and scaler.is_enabled():  # (the GradScaler is enabled for fp16 plans only)
        scaler.load_state_dict(ckpt["scaler"])
    loader.load_state_dict(ckpt["loader"], ckpt["path"])  # other data: one line with the ways on
    set_rng_state(ckpt["rng"], device)


def finite_state(raw_model, optimizers, device):
    """Whether the weights and the optimizer state are all finite (checked before every save),
    agreed over the ranks (under FSDP each holds its own shards)."""
    moments = [v for opt in optimizers for state in opt.state.values() for v in state.values()
               if torch.is_tensor(v) and v.is_floating_point()]
    tensors = list(raw_model.parameters()) + moments
    # FSDP: this rank's shard
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    # sync: before a save only
    ok = bool(torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all())
    return agree(float(ok), "min", device) == 1.0

# -----------------------------------------------------------------------------
# one live run per out_dir


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid):
    """A live process's start time (clock ticks since boot; "" where /proc has none), None when
    there is no such process: a pid reused by another program does not look like the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)  # no /proc (macOS): alive or not, no start time
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


# (no permission, read-only: fileio.fail says it, exit 2)
BAD_OUT_DIR = {errno.ENOTDIR, errno.EEXIST, errno.ENOENT}


def make_out_dir(out_dir):
    """os.makedirs(out_dir), or UserError (bad input, exit 2) when the path cannot be a folder: a
    file on the way (--out_dir=my_book.txt/run), a virtual filesystem (/proc/x). No permission or a
    read-only filesystem stays the OSError fileio.fail answers with exit 2; a full disk or an I/O
    error, exit 1."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        if e.errno not in BAD_OUT_DIR:
            raise
        up = os.path.normpath(out_dir)
        while up and not os.path.exists(up) and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        if os.path.isfile(up):
            why = f"{up} is a file, not a folder"
        elif e.errno == errno.ENOENT:
            why = f"{up} allows no new folders ({e.strerror})"
        else:
            why = f"{e.strerror} ({e.filename})"
        raise UserError(f"out_dir {out_dir!r} cannot be made: {why}: choose another "
                        "--out_dir") from None


class OutDirLock:
    """out_dir/run.lock, created with O_EXCL (atomic on local disks, NFS and FUSE mounts such as
    Google Drive, where fcntl/flock locks may not hold), naming its holder; a thread touches it
    every HEARTBEAT seconds. Stale, and taken over: a holder on this host that is gone (its pid gone
    or now another process, or the machine rebooted), or one on another host silent for STALE
    seconds. A killed run never blocks resume=auto."""
    HEARTBEAT, STALE = 30.0, 300.0

    def __init__(self):
        self.path, self.made_dirs, self.stopped = None, [], threading.Event()
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                   "process_start": _process_start(os.getpid()) or "",
                   "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}

    def holder(self):
        """The lock's live holder (what it holds), or None: no lock, or a stale one."""
        age = 0.0
        try:
            age = time.time() - os.path.getmtime(self.path)
            with open(self.path) as f:
                held = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # half-written by a run killed while taking it
            return None if age > 5 else {"pid": "?", "host": "?", "since": "?"}
        if held.get("host") != self.me["host"]:
            return held if age < self.STALE else None
        start = None  # the machine rebooted: no process of it is alive
        if held.get("boot_id") == self.me["boot_id"]:
            start = _process_start(int(held.get("pid", -1)))
        return held if start is not None and start == held.get("process_start", start) else None

    def acquire(self, out_dir):
        """Take out_dir's lock (making out_dir), or raise UserError naming its live holder. Again: a
        no-op."""
        self.path = os.path.join(out_dir, "run.lock")
        self.made_dirs += missing_dirs(out_dir)  # the folders made for the run: out/my_book, out
        make_out_dir(out_dir)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                held = self.holder()
                ours = (self.me["pid"], self.me["host"])
                if held is not None and (held.get("pid"), held.get("host")) == ours:
                    return self
                if held is not None:
                    raise UserError(f"out_dir {out_dir!r} is in use by a live run: pid "
                                    f"{held.get('pid')} on {held.get('host')}, since "
                                    f"{held.get('since')} ({self.path}); wait for it to finish or "
                                    "stop it, or choose another --out_dir") from None
                # one of several racers wins the O_EXCL that follows
                stale = f"{self.path}.stale.{os.getpid()}"
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.path, stale)
                    os.remove(stale)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            threading.Thread(target=self.beat, daemon=True).start()
            return self
        raise UserError(f"could not take {self.path}: other runs keep taking it; choose another "
                        "--out_dir")

    def beat(self):
        while not self.stopped.wait(self.HEARTBEAT):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self):
        """Remove the lock if it is still ours, and the folders acquire made for out_dir, left
        empty."""
        self.stopped.set()
        if self.path is None:  # never acquired
            return
        with contextlib.suppress(OSError, ValueError):
            with open(self.path) as f:
                ours = json.load(f).get("pid") == self.me["pid"]
            if ours:
                os.remove(self.path)
        remove_empty_dirs(self.made_dirs)
