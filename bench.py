"""
Speed and memory benchmarks for GPT-2 training steps.

    python bench.py  # the speed ladder: 124M at seq 1024 on the GPU, one row per technique
    python bench.py --quick  # a small config on CPU in well under a minute (the tests' smoke run)
    python bench.py --json out.json --plot out.png
    python bench.py --core  # the core rungs only, the trainer's stack timed first
    python bench.py --memory  # where the memory goes: params, grads, optimizer, activations
    python bench.py --memory --activation_checkpointing blocks --world_size 8 --fsdp  # in modes
    python bench.py --find_batch  # the largest fast micro-batch that fits (CUDA)
    python bench.py --fit  # what fits where: computed micro-batches per model, GPU and mode
    torchrun --standalone --nproc_per_node=8 bench.py --ddp  # DDP(compile(m)) vs compile(DDP(m))

Each tool is a file of its own in gpt2train/, read top to bottom: the speed ladder (ladder.py), the
DDP table (ddp_bench.py), the memory report and the fit table (memory_report.py); the micro-batch
finder is microbatch.py's. This file holds the flags, the header, the GPT the tools build (model.py
is a command: the package gets build and flops_per_token from here) and the dispatch. Never imports
train_gpt2.
"""
import dataclasses
import os
import sys

import torch

from gpt2train import optim
from gpt2train import precision
from gpt2train.ddp_bench import ddp_table, run_ddp
from gpt2train.fileio import ArgumentParser, UserError, check_output_file, fail, write_json
from gpt2train.ladder import (BASELINE, Ladder, ladder_table, plot_ladder, require_matplotlib,
                              run_ladder)
from gpt2train.logger import redirect0
from gpt2train.loss import LOSS_IMPLS
from gpt2train.memory import Step, use_loss_head
from gpt2train.microbatch import auto_micro_batch
from gpt2train.memory_report import Modes, fit_report, memory_report
from model import GPT, GPTConfig, PRETRAINED, flops_per_token

# -----------------------------------------------------------------------------
# configurations: the real model on a GPU, small ones on a CPU

SIZES = dict(PRETRAINED)
# the CPU default: same rungs, minutes not hours
SIZES["small"] = dict(n_layer=4, n_head=4, n_embd=256)
SIZES["tiny"] = dict(n_layer=2, n_head=4, n_embd=64)  # --quick

# (model, micro_batch_size, seq_len, warmup steps, timed steps) by mode
DEFAULTS = {
    "cuda": ("gpt2", 16, 1024, 5, 20),  # build-nanogpt's 16x1024, so the anchors compare
    "cpu": ("small", 4, 256, 2, 8),
    "quick": ("tiny", 4, 32, 1, 2),
}
DEFAULT_TOTAL_BATCH = 524288  # 2**19 tokens, GPT-3 small's batch

# -----------------------------------------------------------------------------
# the GPT the tools build


def build(settings, size, micro_batch, seq_len, plan, optimizer="adamw"):
    """A fresh model (same seed every rung) and its optimizers (optim.build_optimizers: the
    trainer's) for one rung's settings under its plan (ladder.rung_plan), with the loss head the
    trainer would run at micro_batch x seq_len (settings["loss"] "auto": memory.use_loss_head, the
    trainer's choice and chunk rows), compiled as the trainer compiles (precision.compile_model)."""
    torch.manual_seed(1337)
    config = GPTConfig(block_size=seq_len, vocab_size=settings["vocab"], attn_impl=settings["attn"],
                       **SIZES[size])
    raw = GPT(config, activation_checkpointing=settings["ckpt"]).to(plan.device)
    step = Step(config, seq_len, dtype=plan.dtype, device_type=plan.device_type,
                optimizer=optimizer, loss_impl=settings["loss"],
                activation_checkpointing=settings["ckpt"])
    use_loss_head(raw, plan, step, micro_batch)
    ns_dtype = optim.ns_dtype_for(settings.get("dtype"), plan.device_type)
    with redirect0(None):  # the optimizer's line once a rung would bury the table
        optimizers = optim.build_optimizers(raw, optimizer, lr=6e-4, weight_decay=0.1,
                                            device_type=plan.device_type, ns_dtype=ns_dtype,
                                            fused=settings["fused"])
    if plan.compile:
        torch._dynamo.reset()  # a fresh cache per rung: no recompile limit, no stale graphs
    return raw, precision.compile_model(raw, plan), optimizers


def ladder_job(args, plan):
    """The command line's Ladder job (run_ladder, run_ddp, memory_report), with this file's GPT."""
    return Ladder(plan, args.model, args.micro_batch_size, args.seq_len, args.warmup, args.steps,
                  build, flops_per_token)


def fit_configs(sizes=("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")):
    """{size: GPTConfig} for the fit table: the real sizes at vocab 50304."""
    return {size: GPTConfig(vocab_size=50304, **SIZES[size]) for size in sizes}



# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = ArgumentParser(prog="bench.py", description="GPT-2 training speed ladder, memory report "
                                                    "and micro-batch finder")
    shape_flags(p)
    ladder_flags(p)
    mode_flags(p)
    args = p.parse_args(argv)
    args.device = precision.resolve_device(args.device or ("cpu" if args.quick else "auto"),
                                           # torchrun: one GPU per process
                                           int(os.environ.get("LOCAL_RANK", 0)))
    fill_defaults(args)
    for name in ("micro_batch_size", "seq_len", "steps", "world_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be at least 0, got {args.warmup}")
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom must be in [0, 1), got {args.headroom}")
    return args


def shape_flags(p):
    """Every tool's: the device, precision, model, optimizer and batch shape."""
    p.add_argument("--device", default=None,
                   help="auto, cpu, cuda, cuda:N, mps (default: auto: cuda if available; cpu with "
                        "--quick)")
    p.add_argument("--precision", default="auto", choices=precision.PRECISIONS,
                   help="the plan's autocast dtype (auto: bf16 on sm80+, fp16 on sm7x, else fp32)")
    p.add_argument("--model", default=None, choices=sorted(SIZES),
                   help="model size (default: gpt2 on CUDA, small on CPU)")
    p.add_argument("--optimizer", default="adamw", choices=optim.OPTIMIZERS,
                   help="the trainer's optimizer=: its state is part of --memory, --fit and "
                        "--find_batch")
    p.add_argument("--micro_batch_size", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)


def ladder_flags(p):
    """The speed ladder's (gpt2train/ladder.py)."""
    p.add_argument("--steps", type=int, default=None, help="timed steps per rung (after warm-up)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per rung (compile happens here)")
    p.add_argument("--compile", action="store_true",
                   help="run the torch.compile rung even where the plan says off (CPU)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, CPU unless --device says otherwise")
    p.add_argument("--core", action="store_true",
                   help="the core rungs only (fp32 ... +loss head), no options")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="write the ladder rows as JSON (after every rung)")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="bar chart of tokens/s per rung (needs matplotlib)")


def mode_flags(p):
    """The other tools, each a mode instead of the ladder, and their flags: --memory (and the fit
    table's, memory_report.py), --find_batch (microbatch.py's finder), --ddp (ddp_bench.py)."""
    p.add_argument("--memory", action="store_true", help="memory report instead of the ladder")
    p.add_argument("--loss_impl", default="auto", choices=("auto", *LOSS_IMPLS),
                   help="the loss head (--memory, --find_batch): auto = the trainer's choice")
    p.add_argument("--activation_checkpointing", default="none",
                   choices=("none", "blocks", "every_other"),
                   help="recompute blocks in backward (--memory, --find_batch)")
    p.add_argument("--world_size", type=int, default=1,
                   help="ranks to compute the per-rank memory for (--memory)")
    p.add_argument("--fsdp", action="store_true",
                   help="the ranks shard the model with FSDP (--memory, computed)")
    p.add_argument("--fit", action="store_true",
                   help="what fits where: computed micro-batches per model, GPU and mode")
    p.add_argument("--find_batch", action="store_true",
                   help="micro-batch finder instead of the ladder")
    p.add_argument("--ddp", action="store_true",
                   help="under torchrun: DDP(compile(model)) vs compile(DDP(model)) instead of the "
                        "ladder")
    p.add_argument("--total_batch_size", type=int, default=DEFAULT_TOTAL_BATCH,
                   help="tokens per optimizer step (--find_batch)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory to keep free (--find_batch)")


def fill_defaults(args):
    """The model, batch shape and steps not given: by mode (--quick, CUDA or --fit, else CPU)."""
    mode = "cpu"
    if args.quick:
        mode = "quick"
    elif torch.device(args.device).type == "cuda" or args.fit:  # --fit: GPU shapes
        mode = "cuda"
    size, b, t, warmup, steps = DEFAULTS[mode]
    defaults = {"model": size, "micro_batch_size": b, "seq_len": t, "warmup": warmup,
                "steps": steps}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def device_info(device):
    """(device_type, compute capability or None, device name or None) for a torch device string."""
    cap = precision.capability(device)
    return torch.device(device).type, cap, torch.cuda.get_device_name(device) if cap else None


def header(args, steps=True):
    device_type, capability, name = device_info(args.device)
    what = name or device_type
    if capability:
        what += f" sm{capability[0]}{capability[1]}"
    if device_type == "cpu":  # shared machines make CPU timings noisy: say how busy this one was
        what += (f" ({torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on "
                 f"{os.cpu_count()} cores)")
    parts = [f"device: {what}", f"torch {torch.__version__}",
             f"model {args.model}, micro-batch {args.micro_batch_size} x seq {args.seq_len}"]
    if steps:
        parts.append(f"{args.warmup} warm-up + {args.steps} timed steps")
    parts.append(f"command: python bench.py {' '.join(sys.argv[1:])}")
    return " | ".join(parts)


# -----------------------------------------------------------------------------
# the tools, one per mode


def main(argv=None):
    try:
        return run(parse_args(argv))
    except (UserError, OSError) as e:
        return fail(e)


def run(args):
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, option)  # before the long run, not after
    if args.plot:
        require_matplotlib()
    plan = precision.make_plan(args.device, args.precision)
    if args.memory:
        modes = Modes(args.loss_impl, args.activation_checkpointing, args.world_size, args.fsdp,
                      args.optimizer)
        print(header(args, steps=False))
        print("\n".join(memory_report(ladder_job(args, plan), modes)))
        return 0
    if args.fit:
        print("\n".join(fit_report(fit_configs(), args.seq_len, args.headroom, args.optimizer)))
        return 0
    if args.ddp:
        return ddp_cli(args, plan)
    if args.find_batch:
        return find_batch(args, plan)
    print(header(args) + "\n")
    # after every rung: a cut-off keeps it
    on_row = (lambda rows: write_json(args.json, rows)) if args.json else None
    rows = run_ladder(ladder_job(args, plan), args.compile, core=args.core, on_row=on_row)
    print(ladder_table(rows))
    if args.plot:
        plot_ladder(rows, args.plot, header(args).split(" | command")[0])
    return 0


def find_batch(args, plan):
    """--find_batch: the trainer's micro_batch_size=auto (microbatch.auto_micro_batch), on the
    model."""
    settings = dict(BASELINE, attn="sdpa", vocab=50304, fused=plan.device_type == "cuda",
                    loss=args.loss_impl, ckpt=args.activation_checkpointing)
    raw, _, optimizers = build(settings, args.model, args.micro_batch_size, args.seq_len,
                               # the finder compiles
                               dataclasses.replace(plan, compile=False), args.optimizer)
    precision.set_tf32(plan.tf32)
    try:
        step = Step(raw.config, args.seq_len, args.total_batch_size, dtype=plan.dtype,
                    device_type=plan.device_type, optimizer=args.optimizer,
                    activation_checkpointing=args.activation_checkpointing,
                    loss_impl=args.loss_impl)
        b, reason, _ = auto_micro_batch(raw, optimizers, plan, step, headroom=args.headroom)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"{header(args, steps=False)}\n{reason}")
    return 0


def ddp_cli(args, plan):
    """--ddp: one process per GPU under torchrun; rank 0 prints the table (and writes --json)."""
    import torch.distributed as dist
    if "RANK" not in os.environ:
        raise UserError("--ddp compares DDP wrappings across processes: run it under torchrun, "
                        "e.g. torchrun --standalone --nproc_per_node=8 bench.py --ddp")
    if plan.device_type == "cuda":
        torch.cuda.set_device(plan.device)
    dist.init_process_group(backend="nccl" if plan.device_type == "cuda" else "gloo")
    try:
        rows = run_ddp(ladder_job(args, plan), args.compile)
        if dist.get_rank() == 0:
            print(header(args) + "\n\n" + ddp_table(rows))
            if args.json:
                write_json(args.json, rows)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
