"""
Train GPT-2 from scratch on FineWeb-Edu (or fine-tune OpenAI's weights), on one device or many.

    python train_gpt2.py configs/quickstart.py                  # CPU smoke run: a minute or two on 2 cores
    python train_gpt2.py configs/quickstart.py --data=my_book.txt   # your own text: a file, folder or glob
    python train_gpt2.py configs/gpt2_124m.py                   # build-nanogpt's 124M recipe, one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --out_dir=out/try
    python train_gpt2.py --help                                 # every config key: type, default, meaning

The config (config.py) is frozen once parsed; setup() makes every decision of the run once, in order,
each in the module that owns it (device and precision: precision.py; resume: checkpoint.py; micro-batch:
memory.py), and returns a frozen Run that the loop only reads. The resolved config is printed and saved
beside what was asked in out_dir/config.json; progress goes to the console and out_dir/log.jsonl;
checkpoints to out_dir/ckpt_XXXXXX.pt (`--resume=true` continues from the newest one, bit-exactly).
Ctrl-C/SIGTERM and `--time_limit=MINUTES` finish the step, save and print the command that continues.
In this file, in the order they run: main, setup() and its parts, the loop (train) and the periodic work
it calls; the schedule, the forward/backward and the update are gpt2train/optim.py's.
"""
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

# before torch loads OpenMP: a thread waiting for the others sleeps instead of spinning, so that on a CPU
# shared with other work a step is not held up by spinning threads (2-core CPU under load: a quickstart-shaped
# step 2.3 s -> 0.5 s, the same as 1 thread; docs/training.md "CPU threads"). OMP_WAIT_POLICY=ACTIVE keeps the spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2train import checkpoint
from gpt2train import data
from gpt2train import distributed
from gpt2train import logger
from gpt2train import memory
from gpt2train import optim
import plot
from gpt2train import precision
from gpt2train.config import asked_and_resolved, check_shape, help_text, oddities, parse_args
from gpt2train.data import TokenLoader, shard_paths
from gpt2train.distributed import DistEnv, agree
from gpt2train.fileio import UserError, fail, launcher_note, write_json
from gpt2train.guard import STOP_SIGNALS, Diverged, Guard, Stopped, catch_stop_signals, remedy
from model import GPT2_VOCAB_SIZE, GPT, GPTConfig, flops_per_token

PLOT_EVERY = 60  # seconds: curves.png is redrawn at an eval at most this often (~1 s of matplotlib), and at the end

# -----------------------------------------------------------------------------
# main: parse, set up, train; every failure one line and an exit code


def main(argv):
    env = DistEnv.from_environ()  # the launcher's environment, read once
    if "-h" in argv or "--help" in argv:
        if env.master:
            print(help_text())
        return 0
    say = print if env.master else (lambda *a, **k: None)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    lock, run = checkpoint.OutDirLock(), None
    try:
        precision.check_torch()
        cfg, given = parse_args(argv)
        for warning in oddities(cfg):
            say(warning)
        run = setup(cfg, given, env, say, lock)
        if run is None:
            return 0
        if env.master:
            write_json(os.path.join(run.cfg.out_dir, "config.json"), asked_and_resolved(cfg, given, run.cfg))
        return train(run, argv, say)
    except (UserError, OSError) as e:  # bad input: 2; a full disk or I/O error while writing: 1
        return fail(e, quiet=not env.master)
    except Diverged as e:
        if env.master:
            print(f"error: {e}", file=sys.stderr)
        launcher_note(f"error: {e}")
        return 3
    except RuntimeError as e:  # out of memory; a peer that stopped answering (dist_timeout) or died
        if precision.is_oom(e):
            print(f"error: rank {env.rank}: " if env.ddp else "error: ", precision.out_of_memory_message(
                e, run and run.plan.device_type, run and run.B, run and run.T, run and run.grad_accum),
                sep="", file=sys.stderr)
            return 1
        if not (env.ddp and distributed.peer_failure(e)):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        print(f"error: rank {env.rank}: a peer did not answer within dist_timeout or went away ({why}): check that "
              "every node is up and reachable (NCCL_DEBUG=INFO shows where it waits); the checkpoints written so "
              "far are intact, continue with --resume=auto", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C before training began, or a second one while stopping
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        if env.master:
            print(f"{signal.Signals(signum).name}: stopped at once, nothing saved (the checkpoints in out_dir are "
                  "as they were)", file=sys.stderr)
        return 128 + signum
    finally:
        if run is not None and run.watch is not None:
            run.watch.close()
        lock.release()
        distributed.teardown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

# -----------------------------------------------------------------------------
# setup: every decision of the run, once, in execution order


@dataclass(frozen=True)
class Run:
    cfg: object  # the resolved Config: what the run does (config.json's "resolved"), B and T included
    env: DistEnv
    plan: precision.Plan
    grad_accum: int  # micro-batches per optimizer step
    raw_model: object  # the GPT itself (FSDP-sharded in place when fsdp)
    model: object  # what evals run: compiled, or raw_model
    train_model: object  # what trains: DDP(model) under torchrun, else model
    optimizers: list  # AdamW, or AdamW + Muon: stepped together by optim.optimizer_step
    params: list  # every trained parameter once: the one clip runs over them
    scaler: object  # torch.amp.GradScaler, enabled for fp16 only (a no-op otherwise)
    train_loader: TokenLoader
    val_loader: TokenLoader  # None when evals are off: a run without them never needs the val split to fit
    data_dir: str
    start_step: int
    evals_done_at: int  # the step whose evals the resumed checkpoint already ran (-1: none)
    newest: str  # the newest checkpoint's path, or None
    guard_state: dict  # the skip guard's history, from the checkpoint
    hellaswag: tuple  # (the hellaswag module, its examples) or None
    started: float  # time.time() at start-up: time_limit counts from here
    watch: object  # precision.CompileWatch when the plan compiles: a graph that runs eagerly is said, never silent
    kept: tuple = ()  # wsd's cooldown-start steps of the shorter plans this run was extended from: never pruned

    @property
    def B(self):  # micro-batch rows per rank, as chosen (memory.choose_micro_batch): its one home is cfg
        return self.cfg.micro_batch_size

    @property
    def T(self):  # tokens per row
        return self.cfg.seq_len

    @property
    def tokens_per_step(self):
        return self.B * self.T * self.env.world_size * self.grad_accum

    @property
    def wraps_ddp(self):
        return self.train_model is not self.model


def setup(cfg, given, env, say, lock):
    """Every decision of the run, once, in execution order. Returns the frozen Run, or None when the
    out_dir holds a finished run (nothing to do)."""
    started = time.time()
    logger.check_packages(tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project)  # before anything slow
    device = precision.resolve_device(cfg.device, env.local_rank)
    startup = distributed.init(env, device, cfg.dist_timeout)  # None without torchrun
    plan = precision.make_plan(device, cfg.precision, cfg.compile, cfg.plan)
    precision.set_tf32(plan.tf32)
    where = f"{device} ({plan.device_name}, sm{plan.capability[0]}{plan.capability[1]})" if plan.capability else device
    say(f"torch {torch.__version__} | device {where} x {env.world_size} | {plan.describe()}")
    if precision.cpu_note(plan):
        say(precision.cpu_note(plan))

    # out_dir and the resume decision, before anything slow (a finished run: nothing to do)
    out_dir, ckpt, overrides = resume_point(cfg, given, env, device, lock, say)
    if checkpoint.finished(ckpt, cfg.max_steps):
        say(f"{ckpt['path']} holds a finished run (step {ckpt['step']}, max_steps={cfg.max_steps}): nothing to do; "
            f"raise --max_steps to train on (how the lr schedule goes on: docs/training.md, 'Extending a run'), or "
            "choose another --out_dir")
        return None
    cfg = dataclasses.replace(cfg, **overrides)  # the checkpoint's keys, once: from here on cfg is what runs
    if ckpt is not None:  # max_steps raised: how the lr schedule goes on, said
        say_extension(cfg, ckpt, out_dir, say)
    cache = precision.compile_cache_dir(cfg.compile_cache_dir, out_dir) if plan.compile else None
    if cache:  # before the first compile (the finder's or compile_and_wrap's): a new session reuses the graphs
        precision.use_compile_cache(cache)
        say(f"compile cache: {cache}")

    # model, optimizers, loss scaler: fresh or from the checkpoint
    torch.manual_seed(cfg.seed)
    raw_model, off = place_model(cfg, given, ckpt, cfg.seq_len, plan, env, say)
    optimizers = optim.build_optimizers(raw_model, cfg.optimizer, lr=cfg.max_lr,
                                        weight_decay=cfg.weight_decay,
                                        muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum,
                                        muon_split_qkv=cfg.muon_split_qkv, embed_lr_mult=cfg.embed_lr_mult,
                                        scalar_lr_mult=cfg.scalar_lr_mult,
                                        device_type=plan.device_type, verbose=env.master,
                                        ns_dtype=optim.ns_dtype_for(plan.dtype, plan.device_type))
    scaler = torch.amp.GradScaler(plan.device_type, enabled=plan.grad_scaler)  # off: a no-op (bf16, fp32)

    # the micro-batch (and on small GPUs seq_len): from here on B x T is the one that runs
    step = memory.Step(raw_model.config, cfg.seq_len, cfg.total_batch_size, env.world_size, plan.dtype,
                       plan.device_type, cfg.optimizer, cfg.activation_checkpointing, cfg.fsdp, cfg.loss_impl,
                       plan.compile, fit="micro_batch_size" not in given,
                       divide=given.get("micro_batch_size") != "cli",  # a config file's adapts to the ranks
                       shrink_seq="seq_len" not in given and ckpt is None)
    asked = None if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
    B, T, why, timed = memory.choose_micro_batch(raw_model, optimizers, plan, step, asked, warn=say)
    if why:
        say(why)
    step = dataclasses.replace(step, seq_len=T)
    loss_impl = choose_loss_head(raw_model, plan, step, B, say)  # before compile: it is in the graph

    # data (rank 0 first: it tokenizes --data or builds the quickstart corpus), checked for B x T; compile, DDP
    data_dir = distributed.rank0_first(lambda: prepare_data(cfg, out_dir, B, T, env, ckpt), env, startup)
    model, train_model, plan = compile_and_wrap(raw_model, timed, B, T, plan, env, cfg.fsdp, say)
    if not plan.compile and loss_impl == "full" and cfg.loss_impl == "auto":  # the compiler failed: eager from here
        loss_impl = choose_loss_head(raw_model, plan, step, B, say)
    train_loader, val_loader, val_steps = make_loaders(cfg, data_dir, B, T, env, raw_model.config.vocab_size, say)
    if ckpt is not None:
        checkpoint.restore(ckpt, raw_model, optimizers, scaler, train_loader, plan.device)
        say(f"resuming from {ckpt['path']} at step {ckpt['step']}")

    # what the run resolved, beside what was asked (the model decides its shape)
    decided = dict(overrides, **{k: getattr(raw_model.config, k) for k in checkpoint.MODEL_KEYS}, **off,
                   out_dir=out_dir, data_dir=data_dir, device=plan.device_type,
                   **({"data_source": "fineweb"} if cfg.data else {}),  # --data's cache: fineweb.py's shards
                   precision=precision.dtype_name(plan.dtype), compile=str(plan.compile).lower(),
                   micro_batch_size=B, seq_len=T, loss_impl=loss_impl, val_steps=val_steps)
    resolved = dataclasses.replace(cfg, **decided)  # the one place a config is rewritten: the resolved copy
    return Run(cfg=resolved, env=env, plan=plan, grad_accum=resolved.total_batch_size // (B * T * env.world_size),
               raw_model=raw_model, model=model, train_model=train_model, optimizers=optimizers,
               params=[p for p in raw_model.parameters() if p.requires_grad], scaler=scaler,
               train_loader=train_loader, val_loader=val_loader, data_dir=data_dir,
               start_step=ckpt["step"] if ckpt else 0, evals_done_at=checkpoint.evals_done_at(ckpt),
               newest=ckpt["path"] if ckpt else None, guard_state=ckpt.get("guard") if ckpt else None,
               hellaswag=load_hellaswag(resolved, env, startup), started=started,
               watch=precision.CompileWatch() if plan.compile else None, kept=kept_branches(cfg, ckpt))


def resume_point(cfg, given, env, device, lock, say):
    """(out_dir, the checkpoint to continue from or None, {key: value} it fixes): out_dir taken for this
    run (rank 0 holds its lock), the resume decision made (checkpoint.resume_overrides), every rank
    continuing from the same step."""
    out_dir = checkpoint.run_out_dir(cfg, given)
    if env.master:
        lock.acquire(out_dir)
    ckpt, overrides = checkpoint.resume_overrides(out_dir, cfg, given, say)
    if env.ddp:  # out_dir must be one folder all nodes see
        held = float(ckpt["step"]) if ckpt is not None else -1.0
        if agree(held, "min", device) != agree(held, "max", device):
            mine = f"step {ckpt['step']}" if ckpt is not None else "none"
            raise UserError(f"the ranks find different checkpoints in out_dir {out_dir!r} (rank {env.rank}: {mine}): "
                            "put out_dir on a filesystem every node sees, or copy the newest ckpt_*.pt to every "
                            "node's out_dir")
    return out_dir, ckpt, overrides


def kept_branches(cfg, ckpt):
    """The cooldown-start steps (wsd) of the plans before this one, whose checkpoints stay: the checkpoint's own list
    and, when max_steps grew, the cooldown start of the max_steps it was planned for (say_extension offers it)."""
    if ckpt is None:
        return ()
    planned = ckpt.get("config", {}).get("max_steps")
    old = optim.cooldown_start(dataclasses.replace(cfg, max_steps=planned)) if isinstance(planned, int) else None
    return tuple(sorted({*ckpt.get("kept", ()), *([old] if old is not None else [])} - {optim.cooldown_start(cfg)}))


def say_extension(cfg, ckpt, out_dir, say):
    """A resume with max_steps above the checkpoint's: one note on how the lr schedule goes on (optim.extension_note),
    naming wsd's kept cooldown-start checkpoint when the run is past it."""
    planned = ckpt.get("config", {}).get("max_steps")
    if not isinstance(planned, int):
        return
    branch = optim.cooldown_start(dataclasses.replace(cfg, max_steps=planned))
    path = checkpoint.checkpoint_path(out_dir, branch) if branch is not None else None
    path = path if path and branch < ckpt["step"] and os.path.exists(path) else None
    note = optim.extension_note(cfg, planned, ckpt["step"], ckpt["path"], path)
    if note:
        say(note)


def place_model(cfg, given, ckpt, seq_len, plan, env, say):
    """(the model on its device, FSDP-sharded when asked; {key: off} for the periodic work it cannot do)."""
    raw_model = load_model(cfg, given, ckpt, verbose=env.master)
    raw_model.set_runtime(activation_checkpointing=cfg.activation_checkpointing)  # the run's, never a checkpoint's
    if cfg.fsdp and not env.ddp:
        raise UserError("fsdp=true shards the model over the ranks of a torchrun launch: run under torchrun, "
                        "or drop --fsdp")
    if seq_len > raw_model.config.block_size:
        raise UserError(f"seq_len={seq_len} is longer than block_size={raw_model.config.block_size}, the model's "
                        "context: lower seq_len")
    off = extras(cfg, raw_model, say)
    raw_model.to(plan.device)
    if cfg.fsdp:  # before the optimizer: it must hold the sharded parameters
        from gpt2train.sharding import shard_model
        shard_model(raw_model, plan.dtype, plan.device_type)
    return raw_model, off


def load_model(cfg, given, ckpt, verbose):
    """The model to train: the checkpoint's, or fresh (the config's shape), OpenAI's or a save_pretrained dir
    (whose shape a shape key the user set must match)."""
    if ckpt is not None:
        return GPT.from_checkpoint(ckpt)
    config = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd)
    model = GPT.load(cfg.init_from, config=config, verbose=verbose)
    check_shape(cfg, given, dataclasses.asdict(model.config))
    if cfg.zero_init_proj and cfg.init_from == "scratch":  # never a loaded model's weights
        model.zero_init_projections()
    return model


def extras(cfg, model, say):
    """{key: off} for the periodic work this run cannot do (sampling, HellaSwag), each said once."""
    if cfg.sample_interval == 0 and cfg.hellaswag_interval == 0:
        return {}
    why = ("fsdp=true: in-training sampling and HellaSwag are off (they run outside the sharded forward); score a "
           "checkpoint with hellaswag.py" if cfg.fsdp else
           f"vocab_size={model.config.vocab_size} cannot hold GPT-2's tokens: sampling and HellaSwag are off"
           if model.config.vocab_size < GPT2_VOCAB_SIZE else "")
    if why:
        say(f"note: {why}")
        return {"sample_interval": 0, "hellaswag_interval": 0}
    from gpt2train.tokenizer import get_encoding
    get_encoding()  # now, not at the first sample: a missing vocabulary is one line before any training
    return {}


def prepare_data(cfg, out_dir, B, T, env, ckpt=None):
    """The shard folder the run reads (data.prepare: rank 0 builds, the others check they see it), each split
    holding a batch of the chosen B x T on every rank; a --data cache the checkpoint trained on is kept when the
    text changed."""
    resume = {"path": ckpt["path"], "step": ckpt["step"], "loader": ckpt["loader"]} \
        if ckpt is not None and isinstance(ckpt.get("loader"), dict) else None
    data_dir = data.prepare(cfg.data, cfg.data_dir, cfg.data_source, out_dir, T, env.world_size * B,
                            build=env.master, text_column=cfg.text_column, resume=resume)
    for split in ("train", "val"):
        shard_paths(data_dir, split)  # (one line if not)
    return data_dir


def make_loaders(cfg, data_dir, B, T, env, vocab_size, say):
    """(the train loader, the val loader or None when evals are off, the val_steps an eval runs): val_steps is
    capped to the val split, said in one line, so that no row counts twice (a mistyped --val_steps=100000 read the
    split over and over)."""
    train_loader = TokenLoader(data_dir, "train", B, T, env.rank, env.world_size, vocab_size, cfg.shuffle, cfg.seed)
    if cfg.eval_interval == 0:
        return train_loader, None, cfg.val_steps
    val_loader = TokenLoader(data_dir, "val", B, T, env.rank, env.world_size, vocab_size, shuffle=False)
    rows, most = cfg.val_steps * B * env.world_size, max(1, val_loader.n_rows // (B * env.world_size))
    if cfg.val_steps > most:
        say(f"note: val_steps={cfg.val_steps} asks for {rows:,} rows of {T} + 1 tokens, the val split holds "
            f"{val_loader.n_rows:,}: evaluating val_steps={most} instead ({most * B * env.world_size:,} rows, each "
            "at most once)")
    return train_loader, val_loader, min(cfg.val_steps, most)


def choose_loss_head(raw_model, plan, step, B, say):
    """THE loss head (memory.choose_loss_impl: full logits in the compiled graph where they fit, else chunked) and
    its chunk rows, set on the model for this device and B x T, never a checkpoint's. Returns the loss_impl."""
    loss_impl, why = memory.choose_loss_impl(plan, step, B)
    if why:
        say(why)
    memory.set_loss_head(raw_model, plan, B, step.seq_len, loss_impl)
    return loss_impl


def compile_and_wrap(raw_model, timed, B, T, plan, env, fsdp, say):
    """(the model evals run, the model that trains, the plan as it ran): compiled when the plan says so
    (timed: already compiled by the micro-batch finder), wrapped in DDP under torchrun (not FSDP: it
    reduce-scatters by itself), compiled now through the wrapper so dynamo splits at DDP's buckets;
    any rank whose compiler fails makes every rank go on eagerly."""
    def wrap(m):
        if not env.ddp or fsdp:
            return m
        ids = [env.local_rank] if plan.device_type == "cuda" else None
        return DDP(m, device_ids=ids, gradient_as_bucket_view=True)  # grads live in the all-reduce buckets: no copy
    model = timed or precision.compile_model(raw_model, plan)
    if model is raw_model:
        return raw_model, wrap(raw_model), dataclasses.replace(plan, compile=False)
    if timed is not None and env.ddp:
        torch._dynamo.reset()  # the finder's graphs were compiled outside DDP: compile again through it
    train_model = wrap(model)
    ok = precision.compiles(train_model, B, T, plan, warn=say)
    if agree(float(ok), "min", plan.device) < 1:
        return raw_model, wrap(raw_model), dataclasses.replace(plan, compile=False)
    return model, train_model, plan


def load_hellaswag(cfg, env, startup):
    """The HellaSwag examples, loaded once at start-up (a download shows here, not mid-run); rank 0
    first (it downloads), then the others (they read its cache). None when HellaSwag is off."""
    if cfg.hellaswag_interval == 0:
        return None
    import hellaswag

    def load():
        try:
            return hellaswag.load_examples("val", data_file=cfg.hellaswag_file or None, download=True,
                                           file_option="--hellaswag_file")
        except Exception as e:  # offline, a missing or malformed file: the user's to fix
            raise UserError(f"cannot load HellaSwag: {e} (set --hellaswag_file=PATH or --hellaswag_interval=0)") \
                from None
    return hellaswag, distributed.rank0_first(load, env, startup)[:cfg.hellaswag_limit or None]

# -----------------------------------------------------------------------------
# the training loop


@dataclass
class Progress:
    """What the loop keeps between steps (the Run never changes)."""
    newest: str  # the newest checkpoint's path
    saved_at: float  # time.time() of the last save
    save_s: float  # what a save is expected to take
    step_s: float = 0.0  # the last optimizer step's seconds
    longest: float = 0.0  # the longest loop iteration so far (evals included)
    deadline: float = math.inf  # time.time() by which the run must have stopped and saved (time_limit)
    timer: object = None  # logger.StepTimer: the ETA
    flops_per_token: float = 0.0  # for the MFU
    clock_due: bool = False  # a save by the clock (checkpoint_minutes) is due before the next step
    plotted_at: float = -math.inf
    warned_grace: bool = False
    train_s: float = 0.0  # the optimizer steps' seconds this session (the end-of-run tok/s)
    at: int = 0  # the step the loop is at
    saved_step: int = 0  # the step the newest checkpoint holds (0: none)
    phase: str = "step"  # "step", "eval" or "end" (after the final checkpoint): what a stop signal interrupts
    signals: list = None  # the stop signals caught (catch_stop_signals)


def train(run, argv, say):
    """The loop: the periodic work due at a step, then one optimizer step, until max_steps or a stop
    (a signal, the time limit); then the end of the run (wrap_up). Returns the exit code."""
    cfg, env = run.cfg, run.env
    runlog, guard, progress = start(run, say)
    code, signals = 0, catch_stop_signals(lambda sig: stop_notice(progress, sig) if env.master else None)
    progress.signals = signals
    for step in range(run.start_step, cfg.max_steps):
        t_iter, progress.at = time.time(), step
        if step != run.evals_done_at:  # (the resumed checkpoint ran this step's already)
            if run_evals(run, step, False, say, runlog, progress):  # a signal cut the evaluation short
                code = stop(run, step, progress, guard, say, argv, signals[0], in_eval=True)
                break
            print_samples(run, step, False, say)
        if checkpoint_due(run, step, False, progress):
            save(run, step, progress, guard, say)

        # one optimizer step: forward/backward over grad_accum micro-batches, then the update
        t0 = time.time()
        with logger.micro_step_bar(run.grad_accum, env.master) as bar:  # on a terminal, once a step takes > 5 s
            loss = optim.accumulate_gradients(run.train_model, run.train_loader, run.grad_accum, run.plan,
                                              run.scaler, run.wraps_ddp, bar)
        asks = stop_asks(run, signals, progress)  # after this step: stop? save by the clock?
        loss, flags = over_ranks(loss, asks, env)  # DDP: the mean loss, and how many ranks ask for each
        loss, norm, applied, counts = optim.optimizer_step(  # the update: every optimizer at base_lr x the schedule
            run.optimizers, run.scaler, run.params, cfg.grad_clip, optim.lr_multiplier(step, cfg), loss,
            guard.is_outlier if cfg.skip_outliers_z > 0 else None, flags, optim.muon_momentum(step, cfg))
        dt = time.time() - t0  # optimizer_step read loss and norm from the device: the step is done
        *signalled, out_of_time, progress.clock_due = [n > 0 for n in counts] if env.ddp else asks
        stop_signal = next((sig for sig, ask in zip(STOP_SIGNALS, signalled) if ask), None)
        finite = math.isfinite(loss) and math.isfinite(norm)
        why = "" if applied else "inf/nan loss or gradients" if not finite else "outlier"
        log_step(run, step, loss, optim.lrs(run.optimizers), norm, why, dt, progress, say, runlog)
        compile_notes(run, step, say, runlog)
        progress.step_s, progress.longest = dt, max(progress.longest, time.time() - t_iter)
        progress.train_s += dt
        if guard.update(loss, norm, applied):
            raise Diverged(f"the run diverged: {guard.in_a_row} optimizer steps in a row were skipped ({why}), "
                           f"the last at step {step} (newest checkpoint: {progress.newest or 'none'}); {remedy(cfg)}")
        if stop_signal or out_of_time:
            code = stop(run, step + 1, progress, guard, say, argv, stop_signal)
            break
    else:
        code = wrap_up(run, progress, guard, say, runlog)
    finish(run, runlog)
    if progress.at == cfg.max_steps and env.master:
        summary(run, progress, say)
    return code


def stop(run, step, progress, guard, say, argv, sig, in_eval=False):
    """A stop before max_steps (sig, or None: the time limit) after step - 1, or in the evaluation at step: step
    saved (unless the newest checkpoint holds it), the line that says so and how to continue. Returns the exit
    code."""
    path = progress.newest if step == progress.saved_step else save(run, step, progress, guard, say, evals_done=False)
    reason = signal.Signals(sig).name if sig else f"time_limit={run.cfg.time_limit:g} min"
    where = f" (in the evaluation at step {step})" if in_eval else ""
    if path:
        say(f"{reason}: stopped after step {step - 1}{where}, saved {path}; resume with: "
            f"{run.env.command(__file__, argv)}")
    else:
        say(f"{reason}: stopped in the evaluation at step {step}: nothing trained yet, nothing saved")
    return 128 + sig if sig else 124


def stop_notice(progress, sig):
    """The line the first SIGINT/SIGTERM is answered with at once (the signal handler writes it): what the run
    does now, and what a second signal costs."""
    name, step, lost = signal.Signals(sig).name, progress.at, progress.at - progress.saved_step
    if progress.phase == "end":
        now, lost = f"the final evaluation stops at its next batch (step {step} is saved)", 0
    elif progress.phase == "eval":
        now = f"the evaluation stops at its next batch, then step {step} is saved"
    else:
        now, lost = f"finishing step {step}, then step {step + 1} is saved", lost + 1
    again = "Ctrl-C" if sig == signal.SIGINT else name
    return (f"{name}: stopping: {now}; {again} again quits at once" +
            (f" without saving the last {lost} step(s)" if lost > 0 else ""))


def wrap_up(run, progress, guard, say, runlog):
    """The end of a run that reached max_steps: the final checkpoint first, then what is optional (the last
    evals, samples and plot), each of which costs a warning when it fails, never the checkpoint or the exit
    code. A signal stops the final evaluation at its next batch. Returns the exit code."""
    step = progress.at = run.cfg.max_steps
    if checkpoint_due(run, step, True, progress):
        save(run, step, progress, guard, say)
    if step == run.evals_done_at:  # (the resumed checkpoint ran this step's already)
        return 0
    progress.phase = "end"
    for what, work in (("the final evaluation", lambda: run_evals(run, step, True, say, runlog, progress)),
                       ("the end-of-run samples", lambda: print_samples(run, step, True, say))):
        try:
            if work():  # cut short by a signal
                sig = progress.signals[0]
                say(f"{signal.Signals(sig).name}: the final evaluation stopped (not logged); the run is saved"
                    f"{f' in {progress.newest}' if progress.newest else ''}")
                return 128 + sig
        except Exception as e:  # noqa: BLE001 - optional: the run is saved, whatever went wrong here
            say(f"warning: {what} failed ({type(e).__name__}: {str(e).strip()[:200]}); the run itself is saved"
                f"{f' in {progress.newest}' if progress.newest else ''}")
    return 0


def summary(run, progress, say):
    """The end of a finished run (rank 0): its checkpoint, last and best val loss (log.jsonl: the whole run,
    resumed sessions included), tokens, wall time and tok/s of this session, and the commands to run next."""
    cfg = run.cfg
    try:
        with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
            vals = [(r["val_loss"], r["step"]) for r in map(json.loads, f) if "val_loss" in r]
    except (OSError, ValueError):
        vals = []
    val = (f"val loss {vals[-1][0]:.4f} (best {min(vals)[0]:.4f} at step {min(vals)[1]})" if vals
           else "no val loss (eval_interval=0)")
    steps = cfg.max_steps - run.start_step
    tokens = steps * run.tokens_per_step
    speed = f"{tokens / progress.train_s:,.0f} tok/s" if progress.train_s > 0 else "n/a tok/s"
    say(f"done: step {cfg.max_steps} | {val} | {steps} steps, {tokens:,} tokens in "
        f"{logger.fmt_duration(time.time() - run.started)}, {speed} | checkpoint {progress.newest or 'none'}")
    if progress.newest:
        say(f"next: python sample.py --model {cfg.out_dir}          # text from the newest checkpoint\n"
            f"      python export.py {progress.newest} {os.path.join(cfg.out_dir, 'hf')}"
            "  # a Hugging Face folder\n"
            f"      python plot.py {cfg.out_dir}                    # the curves: "
            f"{os.path.join(cfg.out_dir, 'curves.png')}")


def start(run, say):
    """Before the first step: the resolved config and the run's size said, rank 0's log opened (log.jsonl,
    TensorBoard / W&B when asked: logger.py), the skip guard and the loop's progress. Returns all three."""
    cfg, env = run.cfg, run.env
    say(json.dumps(dataclasses.asdict(cfg), indent=2))
    n_params = run.raw_model.num_params(non_embedding=False)
    say(f"{n_params:,} parameters | {run.tokens_per_step:,} tokens per step = "
        f"{run.B} x {run.T} x {env.world_size} rank(s) x {run.grad_accum} accumulation step(s) | {cfg.max_steps} steps")
    runlog = None
    if env.master:
        logger.trim_log(os.path.join(cfg.out_dir, "log.jsonl"), run.start_step, keep_evals=run.evals_done_at >= 0)
        runlog = logger.RunLog(cfg.out_dir, dataclasses.asdict(cfg), cfg.tensorboard, cfg.wandb_project,
                               cfg.wandb_run_name, resumed=run.start_step > 0)
    guard = Guard(cfg.skip_outliers_z, cfg.max_skipped, run.guard_state)
    progress = Progress(run.newest, time.time(), n_params * 12 / 100e6,  # a first guess at a save's seconds
                        at=run.start_step, saved_step=run.start_step,
                        deadline=run.started + cfg.time_limit * 60 if cfg.time_limit > 0 else math.inf,
                        timer=logger.StepTimer(), flops_per_token=flops_per_token(run.raw_model, run.T))
    return runlog, guard, progress


def stop_asks(run, signals, progress):
    """What this rank asks for after a step: [one per STOP_SIGNALS: caught?, out of time (too little left for
    a step and a save)?, a save by the clock due?]."""
    now, minutes = time.time(), run.cfg.checkpoint_minutes
    out_of_time = now + progress.longest + progress.step_s + progress.save_s > progress.deadline
    clock_due = minutes > 0 and now - progress.saved_at > minutes * 60
    return [sig in signals for sig in STOP_SIGNALS] + [out_of_time, clock_due]


def over_ranks(loss, asks, env):
    """(the loss averaged over the ranks, how many ranks ask for each of asks): one all_reduce (SUM) under
    torchrun, so that every rank decides alike; the counts stay on the device for optimizer_step to read with
    the loss and the norm, in one transfer. Alone: (loss, None)."""
    if not env.ddp:
        return loss, None
    stats = torch.stack([loss] + [torch.full_like(loss, ask) for ask in asks])  # no host-to-device copy
    dist.all_reduce(stats)
    return stats[0] / env.world_size, stats[1:]


def finish(run, runlog):
    """After the last step or a stop: the log closed, late signals ignored, the ranks leave together."""
    if runlog is not None:
        runlog.close()
    for sig in STOP_SIGNALS:  # saved: a late signal (torchrun stopping the ranks that are still here) changes nothing
        signal.signal(sig, signal.SIG_IGN)
    if run.env.ddp:
        dist.barrier()  # rank 0 may still be writing the last checkpoint


def log_step(run, step, loss, lrs, norm, why, dt, progress, say, runlog):
    """The step's console line (rank 0: each optimizer's base lr, optim.lrs, named when there are two), its
    log.jsonl row, and after the first step the memory line."""
    cfg = run.cfg
    tok_per_s = run.tokens_per_step / dt
    mfu = precision.estimate_mfu(progress.flops_per_token, tok_per_s / run.env.world_size, run.plan.device_name,
                                 run.plan.dtype, run.plan.tf32)
    eta = progress.timer.eta(dt, cfg.max_steps - step - 1)
    skipped = why and f" (skipped: {why})"
    shown = f"adamw {lrs[0]:.2e} muon {lrs[1]:.2e}" if len(lrs) > 1 else f"{lrs[0]:.2e}"  # the base lrs
    say(f"step {step:6d}/{cfg.max_steps} | loss {loss:.4f} | lr {shown} | norm {norm:.3f}{skipped} | "
        f"{dt * 1000:.1f} ms | {tok_per_s:,.0f} tok/s | MFU {'n/a' if mfu is None else f'{mfu * 100:.1f}%'} | "
        f"ETA {logger.fmt_duration(eta)}")
    if runlog is None:
        return
    if step == run.start_step:
        say(memory.memory_summary(run.raw_model, run.optimizers, run.plan, run.B, run.T))
    runlog.write({"step": step, "loss": loss, "lr": lrs[0], **({"muon_lr": lrs[1]} if len(lrs) > 1 else {}),
                  "norm": norm if math.isfinite(norm) else None,
                  "dt_ms": dt * 1000, "tok_per_s": tok_per_s, **({"skipped": why} if why else {})},
                 mfu=mfu, **logger.memory_stats(run.plan.device))

def compile_notes(run, step, say, runlog):
    """No silent eager: a compiled graph that ran eagerly since the last step (precision.CompileWatch) is one
    warning line, and a "compile" row in log.jsonl."""
    for line in run.watch.check() if run.watch else ():
        say(line)
        runlog and runlog.write({"step": step, "compile": line})

# -----------------------------------------------------------------------------
# periodic work: evaluation, HellaSwag, samples, checkpoints


def due(every, step, last):
    """Whether work done every `every` steps (0: never) is due at this step (and always at the last)."""
    return every > 0 and (step % every == 0 or last)


def run_evals(run, step, last, say, runlog, progress):
    """The val loss and HellaSwag due at this step (rank 0 logs them), and curves.png redrawn after them.
    Returns True when a stop signal cut an evaluation short (nothing of it logged)."""
    cfg, phase = run.cfg, progress.phase
    stop_now = lambda: agree(float(bool(progress.signals)), "max", run.plan.device) > 0  # noqa: E731 - all ranks
    progress.phase = "eval" if phase == "step" else phase
    try:
        if due(cfg.eval_interval, step, last):
            val_loss = evaluate(run, run.val_loader, stop_now)
            if val_loss is None:
                return True
            say(f"step {step:6d} | val loss {val_loss:.4f}")
            runlog and runlog.write({"step": step, "val_loss": val_loss})
        if run.hellaswag and due(cfg.hellaswag_interval, step, last):
            hellaswag, examples = run.hellaswag
            res = hellaswag.evaluate(run.model, examples, plan=run.plan, rank=run.env.rank,
                                     world_size=run.env.world_size, progress=run.env.master,
                                     stop=None if run.env.ddp else stop_now)  # (ranks hold different batches)
            if res.get("stopped"):
                return True
            say(f"step {step:6d} | HellaSwag acc {res['acc']:.4f} acc_norm {res['acc_norm']:.4f} "
                f"({res['n']} examples)")
            runlog and runlog.write({"step": step, "hellaswag_acc": res["acc"], "hellaswag_acc_norm": res["acc_norm"]})
    finally:
        progress.phase = phase
    evals = due(cfg.eval_interval, step, last) or run.hellaswag and due(cfg.hellaswag_interval, step, last)
    if runlog and evals and (last or time.time() - progress.plotted_at > PLOT_EVERY):
        plot.refresh(cfg.out_dir, say)  # out_dir/curves.png when matplotlib is installed; never a crash
        progress.plotted_at = time.time()
    return False


def print_samples(run, step, last, say):
    if run.env.master and step > 0 and due(run.cfg.sample_interval, step, last):
        for text in sample(run):
            say(f"sample: {text!r}")


def checkpoint_due(run, step, last, progress):
    """Whether a checkpoint is written before this step: at the end, every checkpoint_interval steps, by the
    clock (checkpoint_minutes), or at wsd's cooldown start when checkpoint_interval is on (kept: the run continues
    from it with a larger max_steps exactly as if planned); never at step 0 or at the step the resumed checkpoint
    holds."""
    every = run.cfg.checkpoint_interval
    branch = every > 0 and step == optim.cooldown_start(run.cfg)
    return step != run.evals_done_at and step > 0 and (last or progress.clock_due or branch
                                                       or every > 0 and step % every == 0)


@torch.no_grad()
def evaluate(run, loader, stop_now=lambda: False):
    """Mean loss over val_steps batches from the start of the val split, averaged over ranks; None when
    stop_now() (asked before each batch, alike on every rank) ends it early."""
    run.model.eval()
    loader.reset()
    total = torch.zeros((), device=run.plan.device)
    for _ in range(run.cfg.val_steps):
        if stop_now():
            run.model.train()
            return None
        x, y = loader.next_batch(run.plan.device)  # (B, T), (B, T)
        with precision.autocast(run.plan):
            _, loss = run.model(x, y)
        total += loss.float()
    if run.env.world_size > 1:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    run.model.train()
    return total.item() / (run.cfg.val_steps * run.env.world_size)  # sync: once per eval


def sample(run):
    """num_samples top-k continuations of the prompt (an empty one: a new document, after <|endoftext|>, as
    sample.py). Uses its own generator, seeded afresh each time, so sampling never moves the training RNG
    (and resumed runs stay bit-exact)."""
    from gpt2train.tokenizer import EOT, get_encoding
    cfg, device, enc = run.cfg, run.plan.device, get_encoding()
    ids = enc.encode_ordinary(cfg.sample_prompt) or [EOT]
    idx = torch.tensor(ids, dtype=torch.long, device=device)
    idx = idx.unsqueeze(0).repeat(cfg.num_samples, 1)  # (num_samples, T0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 42)
    run.raw_model.eval()
    with precision.autocast(run.plan):
        out = run.raw_model.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    run.raw_model.train()
    return [enc.decode(row.tolist()) for row in out]


BRANCH_NOTE = (" (the cooldown starts here; kept: to train longer, copy it to a new out_dir and resume there with a "
               "larger --max_steps)")


def save(run, step, progress, guard, say, evals_done=True):
    """Every rank checks that the state is finite (so that all stop alike); rank 0 writes the checkpoint,
    then deletes those keep_last no longer keeps. Returns its path."""
    if not checkpoint.finite_state(run.raw_model, run.optimizers, run.plan.device):
        raise Diverged(f"the weights or optimizer state hold inf/nan before the checkpoint at step {step}, "
                       f"so it is not written: the run diverged (newest checkpoint: {progress.newest or 'none'}); "
                       f"{remedy(run.cfg)}")
    t = time.time()
    path = checkpoint.checkpoint_path(run.cfg.out_dir, step)
    checkpoint.save_checkpoint(path, run.raw_model, run.optimizers, run.scaler, step, dataclasses.asdict(run.cfg),
                               run.train_loader, run.plan.device, run.env.master, evals_done=evals_done,
                               guard=guard.state_dict(), kept=list(run.kept))
    if run.env.master:
        branch = optim.cooldown_start(run.cfg)
        checkpoint.prune_checkpoints(run.cfg.out_dir, step, run.cfg.keep_last, keep=(branch, *run.kept))
        say(f"step {step:6d} | saved {path}" + (BRANCH_NOTE if step == branch and step < run.cfg.max_steps else ""))
    progress.newest, progress.saved_at, progress.save_s = path, time.time(), 1.5 * (time.time() - t)
    progress.saved_step = step
    note = run.env.shutdown_grace_note(progress.step_s + time.time() - t)  # a stop costs the step, then a save
    if note and not progress.warned_grace:  # once a run
        progress.warned_grace = True
        say(note)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
