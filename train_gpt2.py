"""
Train GPT-2 from scratch on FineWeb-Edu (or fine-tune OpenAI's weights), on one device or many.

    python train_gpt2.py configs/quickstart.py                 # CPU smoke run: a minute or two
    python train_gpt2.py configs/quickstart.py --data=my_book.txt   # your own text, folder, glob
    python train_gpt2.py configs/gpt2_124m.py                  # build-nanogpt's 124M recipe, 1 GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.py
    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --out_dir=out/try
    python train_gpt2.py --help                                # every config key: type, meaning

setup() makes every decision of the run once, in order, each in the module that owns it, and
returns a frozen Run that the loop only reads; the resolved config is saved beside what was asked in
out_dir/config.json, progress goes to the console and out_dir/log.jsonl, checkpoints to
out_dir/ckpt_XXXXXX.pt (`--resume=true` continues bit-exactly). Ctrl-C/SIGTERM and --time_limit
finish the step, save and print the command that continues. Here, in the order they run: main,
setup() and its parts, the loop (train) and its periodic work; the step itself is optim.py's.
"""
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

# before torch loads OpenMP: a thread waiting for the others sleeps instead of spinning, so that on
# a CPU shared with other work a step is not held up by spinning threads (docs/training.md "CPU
# threads"). OMP_WAIT_POLICY=ACTIVE keeps the spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import plot
import sample
from gpt2train import checkpoint, data, distributed, logger, memory, microbatch, optim, precision
from gpt2train.config import asked_and_resolved, changes, check_shape, help_text, oddities
from gpt2train.config import parse_args
from gpt2train.data import TokenLoader
from gpt2train.distributed import DistEnv, agree
from gpt2train.fileio import UserError, fail, launcher_note, write_json
from gpt2train.guard import STOP_SIGNALS, Asks, Diverged, Guard, Stopped, catch_stop_signals
from gpt2train.guard import end_failed_line, end_stopped_line, interrupted_line, stop_asks
from gpt2train.guard import stop_notice, stopped_line
from gpt2train.logger import print0
from model import GPT2_VOCAB_SIZE, GPT, GPTConfig, flops_per_token, llmc_flops_per_token

PLOT_EVERY = 60  # seconds: curves.png is redrawn at an eval at most this often (~1 s), and at end

# -----------------------------------------------------------------------------
# main: parse, set up, train; every failure one line and an exit code


def main(argv):
    env = DistEnv.from_environ()  # the launcher's environment, read once
    logger.set_rank(env.rank)  # print0 prints on rank 0 only
    if "-h" in argv or "--help" in argv:
        print0(help_text())
        return 0
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    lock, run = checkpoint.OutDirLock(), None
    try:
        precision.check_torch()
        cfg, given = parse_args(argv)
        for warning in oddities(cfg):
            print0(warning)
        run = setup(cfg, given, env, lock)
        if run is None:
            return 0
        config_json, saved = (os.path.join(run.cfg.out_dir, "config.json"),
                              asked_and_resolved(cfg, given, run.cfg))
        if env.master:
            write_json(config_json, saved)
        print0(changes(saved, config_json))  # a few lines: every key is in config.json
        return train(run, argv)
    except (UserError, OSError) as e:  # bad input: 2; a full disk or I/O error while writing: 1
        return fail(e, quiet=not env.master)
    except Diverged as e:
        print0(f"error: {e}", file=sys.stderr)
        launcher_note(f"error: {e}")
        return 3
    except RuntimeError as e:  # out of memory; a peer that stopped answering (dist_timeout) or died
        if precision.is_oom(e):
            where = f"error: rank {env.rank}: " if env.ddp else "error: "
            shape = (run.plan.device_type, run.B, run.T, run.grad_accum) if run else (None,) * 4
            print(where + precision.out_of_memory_message(e, *shape), file=sys.stderr)
            return 1
        if isinstance(e, distributed.RestartFailed):  # a torchrun restart that could not start
            print(e, file=sys.stderr)
            launcher_note(str(e))
            return 1
        if not (env.ddp and distributed.peer_failure(e)):
            raise
        held = checkpoint.held_steps(run.cfg.out_dir) if run else None  # what is saved: on disk
        newest = (held[0][1] if held else "") if run else None
        print(distributed.peer_failure_line(e, env.rank, newest), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C before training began, or a second one while stopping
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print0(interrupted_line(signum), file=sys.stderr)
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
    cfg: object  # the resolved Config: what the run does (config.json's "resolved"), B and T too
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
    val_loader: TokenLoader  # None when evals are off: then the val split need not fit
    data_dir: str
    start_step: int
    evals_done_at: int  # the step whose evals the resumed checkpoint already ran (-1: none)
    newest: str  # the newest checkpoint's path, or None
    guard_state: dict  # the skip guard's history, from the checkpoint
    hellaswag: tuple  # (the hellaswag module, its examples) or None
    started: float  # time.time() at start-up: time_limit counts from here
    watch: object  # precision.CompileWatch when the plan compiles: a graph run eagerly is said
    kept: tuple = ()  # wsd's cooldown starts of the shorter plans this run grew from: never pruned

    @property
    def B(self):  # micro-batch rows per rank (microbatch.choose_micro_batch): its one home is cfg
        return self.cfg.micro_batch_size

    @property
    def T(self):  # tokens per row
        return self.cfg.seq_len

    @property
    def tokens_per_step(self):
        return self.B * self.T * self.env.world_size * self.grad_accum


def setup(cfg, given, env, lock):
    """Make every decision of the run, once, in execution order, and return the frozen Run (None
    when out_dir holds a finished run: nothing to do)."""
    started = time.time()
    logger.check_packages(tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project)  # first
    precision.set_allocator(cfg.expandable_segments)  # before anything touches CUDA
    device = precision.resolve_device(cfg.device, env.local_rank)
    startup = distributed.init(env, device, cfg.dist_timeout)  # None without torchrun
    plan = precision.make_plan(device, cfg.precision, cfg.compile, cfg.plan, cfg.compile_mode)
    precision.set_tf32(plan.tf32)
    for line in precision.start_lines(plan, env.world_size):  # the path this device got, said
        print0(line)

    # out_dir and the resume decision, before anything slow (a finished run: nothing to do)
    out_dir, ckpt, overrides = checkpoint.resume_point(cfg, given, env, device, lock)
    if checkpoint.finished(ckpt, cfg.max_steps):
        print0(checkpoint.finished_line(ckpt, cfg.max_steps))
        return None
    cfg = dataclasses.replace(cfg, **overrides)  # the checkpoint's keys, once: now cfg is what runs
    if ckpt is not None:  # max_steps raised: how the lr schedule goes on, said
        checkpoint.say_extension(cfg, ckpt, out_dir)
    cache = precision.compile_cache_dir(cfg.compile_cache_dir, out_dir) if plan.compile else None
    if cache:  # before the first compile (the finder's or compile_and_wrap's): a new session reuses
        precision.use_compile_cache(cache)  # (said in compile_note's line, at that compile)

    # model, optimizers, loss scaler: fresh or from the checkpoint
    torch.manual_seed(cfg.seed)
    raw_model, off = place_model(cfg, given, ckpt, plan, env)
    optimizers = optim.optimizers_for(raw_model, cfg, plan)
    scaler = torch.amp.GradScaler(plan.device_type, enabled=plan.grad_scaler)  # off: a no-op

    # the micro-batch (and on small GPUs seq_len): from here on B x T is the one that runs
    step = memory.Step(raw_model.config, cfg.seq_len, cfg.total_batch_size, env.world_size,
                       plan.dtype, plan.device_type, cfg.optimizer, cfg.activation_checkpointing,
                       cfg.fsdp, cfg.loss_impl, plan.compile, fit="micro_batch_size" not in given,
                       divide=given.get("micro_batch_size") != "cli",  # a config file's adapts
                       shrink_seq="seq_len" not in given and ckpt is None)
    asked = None if cfg.micro_batch_size == "auto" else cfg.micro_batch_size
    said = precision.compile_note(cache) if plan.compile else ""  # at the first compile: said once
    B, T, why, timed = microbatch.choose_micro_batch(raw_model, optimizers, plan, step, asked, said)
    if why:
        print0(why)
    step = dataclasses.replace(step, seq_len=T)
    loss_impl = choose_loss_head(raw_model, plan, step, B)  # before compile: it is in the graph

    # data (rank 0 first: it tokenizes --data or builds the quickstart corpus); compile, DDP
    data_dir = distributed.rank0_first(
        lambda: data.prepare_run_data(cfg, out_dir, B, T, env, ckpt), env, startup)
    if said and timed is None:  # the finder did not compile: compile_and_wrap's is the first
        print0(said)
    model, train_model, plan = compile_and_wrap(raw_model, timed, step, B, plan, env)
    if not plan.compile and loss_impl == "full" and cfg.loss_impl == "auto":  # eager from here
        loss_impl = choose_loss_head(raw_model, plan, step, B)
    vocab_size = raw_model.config.vocab_size
    train_loader, val_loader, val_steps = data.make_loaders(cfg, data_dir, B, T, env, vocab_size)
    if ckpt is not None:
        checkpoint.restore(ckpt, raw_model, optimizers, scaler, train_loader, plan.device)
        print0(f"resuming from {ckpt['path']} at step {ckpt['step']}")

    # what the run resolved, beside what was asked (the model decides its shape; --data: fineweb)
    shape = {k: getattr(raw_model.config, k) for k in checkpoint.MODEL_KEYS}
    decided = dict(overrides, **shape, **off, out_dir=out_dir, data_dir=data_dir,
                   device=plan.device_type, **({"data_source": "fineweb"} if cfg.data else {}),
                   precision=precision.dtype_name(plan.dtype), compile=str(plan.compile).lower(),
                   micro_batch_size=B, seq_len=T, loss_impl=loss_impl, val_steps=val_steps)
    resolved = dataclasses.replace(cfg, **decided)  # the one place a config is rewritten
    return Run(cfg=resolved, env=env, plan=plan,
               grad_accum=resolved.total_batch_size // (B * T * env.world_size),
               raw_model=raw_model, model=model, train_model=train_model, optimizers=optimizers,
               params=[p for p in raw_model.parameters() if p.requires_grad], scaler=scaler,
               train_loader=train_loader, val_loader=val_loader, data_dir=data_dir,
               start_step=ckpt["step"] if ckpt else 0, evals_done_at=checkpoint.evals_done_at(ckpt),
               newest=ckpt["path"] if ckpt else None,
               guard_state=ckpt.get("guard") if ckpt else None,
               hellaswag=load_hellaswag(resolved, env, startup), started=started,
               watch=precision.CompileWatch() if plan.compile else None,
               kept=checkpoint.kept_branches(cfg, ckpt))


def place_model(cfg, given, ckpt, plan, env):
    """(the model on its device, FSDP-sharded when asked; {key: off} for the periodic work it cannot
    do)."""
    raw_model = load_model(cfg, given, ckpt)
    raw_model.set_runtime(activation_checkpointing=cfg.activation_checkpointing,  # the run's own
                          qkv_impl=cfg.qkv_impl, gelu_impl=cfg.gelu_impl)
    if cfg.fsdp and not env.ddp:
        raise UserError("fsdp=true shards the model over the ranks of a torchrun launch: run under "
                        "torchrun, or drop --fsdp")
    if cfg.seq_len > raw_model.config.block_size:
        raise UserError(f"seq_len={cfg.seq_len} is longer than block_size="
                        f"{raw_model.config.block_size}, the model's context: lower seq_len")
    off = extras(cfg, raw_model)
    raw_model.to(plan.device)
    if cfg.fsdp:  # before the optimizer: it must hold the sharded parameters
        from gpt2train.sharding import shard_model
        shard_model(raw_model, plan.dtype, plan.device_type)
    return raw_model, off


def load_model(cfg, given, ckpt):
    """The model to train: the checkpoint's, or fresh (the config's shape), OpenAI's or a
    save_pretrained dir (whose shape a shape key the user set must match)."""
    if ckpt is not None:
        return GPT.from_checkpoint(ckpt)
    config = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd)
    model = GPT.load(cfg.init_from, config=config)
    check_shape(cfg, given, dataclasses.asdict(model.config))
    if cfg.zero_init_proj and cfg.init_from == "scratch":  # never a loaded model's weights
        model.zero_init_projections()
    return model


def extras(cfg, model):
    """{key: off} for the periodic work this run cannot do (sampling, HellaSwag), each said once."""
    if cfg.sample_interval == 0 and cfg.hellaswag_interval == 0:
        return {}
    why = ""
    if model.config.vocab_size < GPT2_VOCAB_SIZE:
        why = (f"vocab_size={model.config.vocab_size} cannot hold GPT-2's tokens: sampling and "
               "HellaSwag are off")
    if cfg.fsdp:
        why = ("fsdp=true: in-training sampling and HellaSwag are off (they run outside the "
               "sharded forward); score a checkpoint with hellaswag.py")
    if why:
        print0(f"note: {why}")
        return {"sample_interval": 0, "hellaswag_interval": 0}
    from gpt2train.tokenizer import get_encoding
    get_encoding()  # now, not at the first sample: a missing vocabulary is one line before training
    return {}


def choose_loss_head(raw_model, plan, step, B):
    """Set THE loss head (memory.use_loss_head: full logits in the compiled graph where they fit,
    else chunked) and its chunk rows on the model for this device and B x T, never a checkpoint's;
    return the loss_impl."""
    loss_impl, why = memory.use_loss_head(raw_model, plan, step, B)
    if why:
        print0(why)
    return loss_impl


def compile_and_wrap(raw_model, timed, step, B, plan, env):
    """(the model evals run, the model that trains, the plan as it ran): compiled when the plan says
    so (timed: already compiled by the micro-batch finder), wrapped in DDP under torchrun (not FSDP:
    it reduce-scatters by itself), compiled now through the wrapper so dynamo splits at DDP's
    buckets; any rank whose compiler fails makes every rank go on eagerly. The finder times the
    default mode: under another compile_mode the model is compiled again, in that mode."""
    def wrap(m):
        if not env.ddp or step.fsdp:
            return m
        ids = [env.local_rank] if plan.device_type == "cuda" else None
        return DDP(m, device_ids=ids, gradient_as_bucket_view=True)  # grads live in the buckets
    if timed is not None and plan.compile_mode != "default":
        timed = None
        torch._dynamo.reset()  # the finder's graphs were the default mode's
    eager = dataclasses.replace(plan, compile=False, cudagraphs=False)  # the plan, uncompiled
    model = timed or precision.compile_model(raw_model, plan)
    if model is raw_model:
        return raw_model, wrap(raw_model), eager
    if timed is not None and env.ddp:
        torch._dynamo.reset()  # the finder's graphs were compiled outside DDP: compile through it
    train_model = wrap(model)
    ok = precision.compiles(train_model, B, step.seq_len, plan)
    if agree(float(ok), "min", plan.device) < 1:
        return raw_model, wrap(raw_model), eager
    return model, train_model, plan


def load_hellaswag(cfg, env, startup):
    """(the hellaswag module, its examples, loaded once at start-up: a download shows here, not
    mid-run), or None when HellaSwag is off."""
    if cfg.hellaswag_interval == 0:
        return None
    import hellaswag
    return hellaswag, hellaswag.training_examples(cfg, env, startup)

# -----------------------------------------------------------------------------
# the training loop


@dataclass
class Progress:
    """What the loop keeps between steps (the Run never changes)."""
    newest: str  # the newest checkpoint's path
    saved_at: float  # time.time() of the last save
    save_s: float  # what a save is expected to take
    runlog: object = None  # logger.RunLog on rank 0 (log.jsonl, the dashboards), else None
    guard: Guard = None  # the skip guard: steps skipped in a row, the outlier test
    step_s: float = 0.0  # the last optimizer step's seconds
    longest: float = 0.0  # the longest loop iteration so far (evals included)
    deadline: float = math.inf  # time.time() by which the run must have stopped and saved
    timer: object = None  # logger.StepTimer: the ETA
    flops_per_token: float = 0.0  # for the MFU
    llmc_flops_per_token: float = 0.0  # for the MFU as llm.c counts it (model.llmc_flops_per_token)
    clock_due: bool = False  # a save by the clock (checkpoint_minutes) is due before the next step
    plotted_at: float = -math.inf
    warned_grace: bool = False
    train_s: float = 0.0  # the optimizer steps' seconds this session (the end-of-run tok/s)
    at: int = 0  # the step the loop is at
    saved_step: int = 0  # the step the newest checkpoint holds (0: none)
    phase: str = "step"  # "step", "eval" or "end" (after the final checkpoint): what a signal stops
    signals: list = None  # the stop signals caught (catch_stop_signals)


def train(run, argv):
    """Run the loop: the periodic work due at a step, then one optimizer step, until max_steps or a
    stop (a signal, the time limit); then the end of the run (wrap_up). Returns the exit code."""
    cfg, env = run.cfg, run.env
    progress, wrapped = start(run), run.train_model is not run.model  # wrapped: in DDP
    stepping = optim.Stepping(run.plan, run.scaler, run.optimizers, run.params, cfg.grad_clip)
    notice = (lambda sig: stop_notice(progress, sig, env.ddp)) if env.master else (lambda sig: None)
    code, progress.signals = 0, catch_stop_signals(notice)
    for step in range(run.start_step, cfg.max_steps):
        t_iter, progress.at = time.time(), step
        if step != run.evals_done_at:  # (the resumed checkpoint ran this step's already)
            sig = run_evals(run, step, False, progress)
            if sig:  # a signal, on any rank, cut the evaluation short
                code = stop(run, step, progress, argv, sig, in_eval=True)
                break
            print_samples(run, step, False)
        if checkpoint.due(run, step, False, progress):
            checkpoint.save_run(run, step, progress)

        # one optimizer step: forward/backward over grad_accum micro-batches, then the update
        t0 = time.time()
        with logger.micro_step_bar(run.grad_accum, env.master) as bar:  # once a step takes > 5 s
            loss = optim.accumulate_gradients(run.train_model, run.train_loader, run.grad_accum,
                                              stepping, wrapped, bar)
        asks = stop_asks(progress.signals, progress, cfg.checkpoint_minutes)  # stop? save by clock?
        pooled = distributed.over_ranks(loss, asks.flags(), env)  # DDP: mean loss, asks counted
        outlier = progress.guard.is_outlier if cfg.skip_outliers_z > 0 else None
        stepped = optim.optimizer_step(  # the update: every optimizer at base_lr x the schedule
            stepping, optim.lr_multiplier(step, cfg), pooled.loss, outlier, pooled.counts,
            optim.muon_momentum(step, cfg))
        dt = time.time() - t0  # optimizer_step read loss and norm from the device: the step is done
        asks = Asks.read(stepped.flags) if env.ddp else asks  # any rank's: all decide alike
        progress.clock_due = asks.clock_due
        log_step(run, step, stepped, dt, progress)
        logger.compile_notes(run.watch, step, progress.runlog)  # no silent eager
        progress.step_s, progress.longest = dt, max(progress.longest, time.time() - t_iter)
        progress.train_s += dt
        if progress.guard.update(stepped.loss, stepped.norm, stepped.applied):
            raise progress.guard.diverged(stepped.why, step, progress.newest, cfg)
        if asks.signal or asks.out_of_time:
            code = stop(run, step + 1, progress, argv, asks.signal)
            break
    else:
        code = wrap_up(run, progress)
    finish(run, progress.runlog)
    if progress.at == cfg.max_steps and env.master:
        logger.summary(run, progress)
    return code


def start(run):
    """Print the run's size, open rank 0's log (log.jsonl, TensorBoard / W&B when asked: logger.py)
    and return the loop's Progress, the skip guard in it."""
    cfg, env = run.cfg, run.env
    n_params = run.raw_model.num_params(non_embedding=False)
    print0(f"{n_params:,} parameters | {run.tokens_per_step:,} tokens per step = {run.B} x {run.T} "
           f"x {env.world_size} rank(s) x {run.grad_accum} accumulation step(s) | "
           f"{cfg.max_steps} steps")
    runlog = None
    if env.master:
        logger.trim_log(os.path.join(cfg.out_dir, "log.jsonl"), run.start_step,
                        keep_evals=run.evals_done_at >= 0)
        runlog = logger.RunLog(cfg.out_dir, dataclasses.asdict(cfg), cfg.tensorboard,
                               cfg.wandb_project, cfg.wandb_run_name, resumed=run.start_step > 0)
    deadline = run.started + cfg.time_limit * 60 if cfg.time_limit > 0 else math.inf
    guard = Guard(cfg.skip_outliers_z, cfg.max_skipped, run.guard_state)
    return Progress(run.newest, time.time(), n_params * 12 / 100e6,  # a first guess at a save's s
                    runlog=runlog, guard=guard, at=run.start_step, saved_step=run.start_step,
                    deadline=deadline,
                    timer=logger.StepTimer(), flops_per_token=flops_per_token(run.raw_model, run.T),
                    llmc_flops_per_token=llmc_flops_per_token(run.raw_model, run.T))


def stop(run, step, progress, argv, sig, in_eval=False):
    """Save step after a stop before max_steps (sig, or None: the time limit) after step - 1 or in
    the evaluation at step (unless the newest checkpoint holds it), say so and how to continue, and
    return the exit code."""
    path = progress.newest
    if step != progress.saved_step:
        path = checkpoint.save_run(run, step, progress, evals_done=False)
    command = run.env.command(__file__, argv)
    print0(stopped_line(sig, run.cfg.time_limit, step, in_eval, path, command))
    return 128 + sig if sig else 124


def wrap_up(run, progress):
    """End a run that reached max_steps: the final checkpoint first, then what is optional (the last
    evals, samples and plot), each of which costs a warning when it fails, never the checkpoint or
    the exit code. A signal stops the final evaluation at its next batch. Returns the exit code."""
    step = progress.at = run.cfg.max_steps
    if checkpoint.due(run, step, True, progress):
        checkpoint.save_run(run, step, progress)
    if step == run.evals_done_at:  # (the resumed checkpoint ran this step's already)
        return 0
    progress.phase = "end"
    for what, work in (("the final evaluation", lambda: run_evals(run, step, True, progress)),
                       ("the end-of-run samples", lambda: print_samples(run, step, True))):
        try:
            sig = work()
            if sig:  # cut short by a signal, on any rank
                print0(end_stopped_line(sig, progress.newest))
                return 128 + sig
        except Exception as e:  # noqa: BLE001 - optional: the run is saved, whatever went wrong
            print0(end_failed_line(what, e, progress.newest))
    return 0


def finish(run, runlog):
    """Close the log after the last step or a stop, ignore late signals, leave with the ranks."""
    if runlog is not None:
        runlog.close()
    for sig in STOP_SIGNALS:  # saved: a late signal (torchrun stopping the ranks) changes nothing
        signal.signal(sig, signal.SIG_IGN)
    if run.env.ddp:
        dist.barrier()  # rank 0 may still be writing the last checkpoint


def log_step(run, step, stepped, dt, progress):
    """Print the step's console line (each optimizer's base lr, named when there are two), write
    its log.jsonl row on rank 0, and after the first step the memory line."""
    cfg, plan, lrs, why = run.cfg, run.plan, optim.lrs(run.optimizers), stepped.why
    tok_per_s = run.tokens_per_step / dt
    mfu, mfu_llmc = (precision.estimate_mfu(flops, tok_per_s / run.env.world_size,
                                            plan.device_name, plan.dtype, plan.tf32)
                     for flops in (progress.flops_per_token, progress.llmc_flops_per_token))
    eta = progress.timer.eta(dt, cfg.max_steps - step - 1)
    print0(f"step {step:6d}/{cfg.max_steps} | loss {stepped.loss:.4f} | lr {logger.fmt_lrs(lrs)} | "
           f"norm {stepped.norm:.3f}{why and f' (skipped: {why})'} | {dt * 1000:.1f} ms | "
           f"{tok_per_s:,.0f} tok/s | MFU {logger.fmt_mfu(mfu, mfu_llmc)} | "
           f"ETA {logger.fmt_duration(eta)}")
    if progress.runlog is None:
        return
    if step == run.start_step:
        print0(memory.memory_summary(run.raw_model, run.optimizers, plan, run.B, run.T))
    row = logger.step_row(step, stepped, lrs, dt, tok_per_s)
    progress.runlog.write(row, mfu=mfu, mfu_llmc=mfu_llmc, **logger.memory_stats(plan.device))

# -----------------------------------------------------------------------------
# periodic work: evaluation, HellaSwag, samples, checkpoints


def due(every, step, last):
    """Whether work done every `every` steps (0: never) is due at this step (always at the last)."""
    return every > 0 and (step % every == 0 or last)


def run_evals(run, step, last, progress):
    """Run the val loss and HellaSwag due at this step (rank 0 logs them) and redraw curves.png
    after them; return the stop signal that cut an evaluation short (nothing of it logged), else
    0."""
    cfg, phase, runlog, env = run.cfg, progress.phase, progress.runlog, run.env
    stop_now = lambda: distributed.agreed_signal(progress.signals, run.plan.device) > 0  # noqa: E731
    progress.phase = "eval" if phase == "step" else phase
    try:
        if due(cfg.eval_interval, step, last):
            val_loss = optim.evaluate(run.model, run.val_loader, cfg.val_steps, run.plan,
                                      env.world_size, stop_now)
            if val_loss is None:  # every rank stopped at the same batch: each asks alike
                return distributed.agreed_signal(progress.signals, run.plan.device)
            print0(f"step {step:6d} | val loss {val_loss:.4f}")
            runlog and runlog.write({"step": step, "val_loss": val_loss})
        if run.hellaswag and due(cfg.hellaswag_interval, step, last):
            hellaswag, examples = run.hellaswag
            res = hellaswag.evaluate(run.model, examples, plan=run.plan, progress=env.master,
                                     stop=None if env.ddp else stop_now)  # (ranks: other batches)
            if res.get("stopped"):
                return distributed.agreed_signal(progress.signals, run.plan.device)
            print0(f"step {step:6d} | HellaSwag acc {res['acc']:.4f} "
                   f"acc_norm {res['acc_norm']:.4f} ({res['n']} examples)")
            runlog and runlog.write({"step": step, "hellaswag_acc": res["acc"],
                                     "hellaswag_acc_norm": res["acc_norm"]})
    finally:
        progress.phase = phase
    hellaswag_due = run.hellaswag and due(cfg.hellaswag_interval, step, last)
    evals = due(cfg.eval_interval, step, last) or hellaswag_due
    if runlog and evals and (last or time.time() - progress.plotted_at > PLOT_EVERY):
        plot.refresh(cfg.out_dir)  # out_dir/curves.png when matplotlib is installed; never a crash
        progress.plotted_at = time.time()
    return 0


def print_samples(run, step, last):
    if run.env.master and step > 0 and due(run.cfg.sample_interval, step, last):
        cfg = run.cfg  # the training RNG never moves: sample.py's batch has a generator of its own
        for text in sample.sample_batch(run.raw_model, run.plan, cfg.sample_prompt,
                                        cfg.num_samples, cfg.sample_tokens, cfg.seed + 42):
            print0(f"sample: {text!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
