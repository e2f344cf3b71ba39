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

The ladder adds one technique per row, in this order: fp32 -> +TF32 -> +autocast (bf16, or fp16 with
a GradScaler on sm7x) -> +torch.compile -> +SDPA attention (vs the plain masked softmax) -> +vocab
50304 -> +fused AdamW -> the loss head the trainer runs (memory.choose_loss_impl: full logits inside
the compiled graph where they fit, else the chunked head). Then options, each kept only if faster
than the best row so far: the plan's other SDPA kernel orders, the chunked head (GPU), micro-batches
16/32/64. No compile-mode rung: a mode is the trainer's compile_mode, each timed in its own process
(dev/gpu_session.sh), since max-autotune's autotuning crashed a whole process on an H200
(docs/benchmarks.md). The core rungs
are timed last to first (the trainer's stack first: a run cut off keeps it), the table is in ladder
order. Rungs that cannot apply on the device are printed as skipped, with the reason. Every row
counts the host syncs of a step.

The memory estimate and the micro-batch finder live in memory.py, the training step in optim.py
(optim.train_step runs the trainer's own accumulate_gradients + optimizer_step, so the ladder times
the step training runs); this file times and reports. Never imports train_gpt2.
"""
import dataclasses
import functools
import os
import statistics
import sys
import textwrap
import time
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpt2train import optim
from gpt2train import precision
from gpt2train.fileio import (ArgumentParser, UserError, check_output_file, fail, replacing,
                              write_json)
from gpt2train.logger import redirect0
from gpt2train.loss import LOSS_IMPLS
from model import GPT, GPTConfig, PRETRAINED, flops_per_token
from gpt2train.distributed import agree
from gpt2train.memory import (Step, activation_bytes_estimate, auto_micro_batch,
                              estimated_micro_batch, fmt_bytes, free_memory,
                              optimizer_state_tensors, param_counts, random_batch, tensor_bytes,
                              training_bytes_estimate, use_loss_head)
from gpt2train.optim import train_step
from gpt2train.precision import is_oom

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
# device helpers


def device_info(device):
    """(device_type, compute capability or None, device name or None) for a torch device string."""
    cap = precision.capability(device)
    return torch.device(device).type, cap, torch.cuda.get_device_name(device) if cap else None


def where_label(device_type, capability):
    return f"cuda sm{capability[0]}{capability[1]}" if device_type == "cuda" else device_type


def rung_plan(device, settings):
    """The precision plan one rung runs under: the device's plan with the rung's dtype, TF32,
    compile and kernels."""
    return dataclasses.replace(precision.make_plan(device), dtype=settings["dtype"],
                               grad_scaler=settings["scaler"],
                               tf32=settings["tf32"], sdpa_backends=settings["sdpa_backends"],
                               compile=settings["compile"])


# -----------------------------------------------------------------------------
# the speed ladder

BASELINE = dict(tf32=False, dtype=torch.float32, scaler=False, compile=False, attn="naive",
                sdpa_backends=(), vocab=50257, fused=False, loss="full", ckpt="none")
MICRO_BATCHES = (16, 32, 64)  # the option rungs try the others than --micro_batch_size


def ladder_rungs(plan, device_type, capability=None, force_compile=False, fused_ok=None,
                 micro_batch=16):
    """The rungs in order: (name, settings it changes, skip reason or None, note, optional). The
    core rungs always stay on the ladder; the optional ones after them are kept only when faster
    than the best so far (other attention kernel orders, the chunked head, other micro-batches).
    Which rungs apply comes from the precision plan; nothing here re-derives capability rules."""
    core = core_rungs(plan, device_type, capability, force_compile, fused_ok)
    rungs = [rung + (False,) for rung in core]
    gpu_only = None if device_type == "cuda" else f"a GPU option: not run on {device_type}"
    backends = plan.sdpa_backends
    others = [backends[i:] for i in range(1, len(backends)) if backends[i] != "math"]
    for order in others:
        rungs.append((f"attention {'/'.join(order)}", {"sdpa_backends": order}, gpu_only,
                      f"vs {'/'.join(backends)}: {order[0]} first", True))
    if not others:
        where = where_label(device_type, capability)
        reason = gpu_only or f"the precision plan for {where} has one kernel ({'/'.join(backends)})"
        rungs.append(("attention kernels", {}, reason, "", True))
    rungs.append(("chunked loss", {"loss": "chunked"}, gpu_only,
                  "the memory fallback, vs the trainer's head", True))
    for b in MICRO_BATCHES:
        if b != micro_batch:
            rungs.append((f"micro-batch {b}", {"micro_batch": b}, gpu_only,
                          f"vs {micro_batch}, same seq_len", True))
    return rungs


def core_rungs(plan, device_type, capability=None, force_compile=False, fused_ok=None):
    """The cumulative ladder: (name, settings it changes, skip reason or None, note)."""
    where = where_label(device_type, capability)
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16+GradScaler"}.get(plan.dtype)
    rungs = [("fp32", {}, None, "naive attention, vocab 50257, foreach AdamW")]
    rungs.append(("+TF32", {"tf32": True},
                  None if plan.tf32 else f"precision plan for {where} has TF32 off"
                  + (" (TF32 is CUDA-only)" if device_type != "cuda" else " (TF32 tensor cores "
                                                                          "need sm80+)"), ""))
    rungs.append((f"+autocast {dname}" if dname else "+autocast",
                  {"dtype": plan.dtype, "scaler": plan.grad_scaler},
                  None if dname else f"precision plan for {where} is fp32", ""))
    compile_reason = None
    if not (plan.compile or force_compile):
        compile_reason = f"precision plan for {where} has compile off" + \
            (" (Triton needs sm70+)" if device_type == "cuda" else " (--compile forces it)")
    forced = "forced by --compile" if force_compile and not plan.compile else ""
    rungs.append(("+torch.compile", {"compile": True}, compile_reason, forced))
    backends = plan.sdpa_backends
    note = "vs the masked softmax"
    if device_type == "cuda" and "flash" not in backends:
        note += "; no flash kernel below sm80"
    rungs.append(("+SDPA " + ("/".join(backends) if backends else "(torch's choice)"),
                  {"attn": "sdpa", "sdpa_backends": backends}, None, note))
    rungs.append(("+vocab 50304", {"vocab": 50304}, None, "vs 50257"))
    if fused_ok is None:
        fused_ok = device_type == "cuda" or fused_available(device_type)
    rungs.append(("+fused AdamW", {"fused": True}, None if fused_ok else
                  f"this torch has no fused AdamW kernel for {device_type}", "vs foreach"))
    rungs.append(("+loss head", {"loss": "auto"}, None, "the trainer's choice"))
    return rungs


def fused_available(device_type):
    """Whether torch.optim.AdamW(fused=True) takes tensors on this device type (CUDA, and CPU since
    torch 2.4)."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device_type, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def build(settings, size, micro_batch, seq_len, plan, optimizer="adamw"):
    """A fresh model (same seed every rung) and its optimizers (optim.build_optimizers: the
    trainer's) for one rung's settings under its plan (rung_plan), with the loss head the trainer
    would run at micro_batch x seq_len (settings["loss"] "auto": memory.use_loss_head, the
    trainer's choice and chunk rows), compiled as the trainer compiles
    (precision.compile_model)."""
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


# torch.cuda.set_sync_debug_mode("warn")'s text
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs(fn, set_mode=None):
    """Run fn() with torch.cuda.set_sync_debug_mode("warn") and count the host syncs it reported:
    .item(), .tolist(), .cpu(), blocking copies, nonzero() and the like (what torch itself waits on;
    a cudaMemcpyAsync from pageable memory stalls without a warning). The mode is restored however
    fn ends. set_mode: for tests; CUDA only, the caller says n/a elsewhere."""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every sync, not the first per line
        set_mode("warn")
        try:
            fn()
        finally:
            set_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def time_steps(step, device, warmup, steps):
    """Median seconds of `steps` synchronised calls of step() after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        precision.synchronize(device)
        t0 = time.perf_counter()
        step()
        precision.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_rung(settings, size, micro_batch, seq_len, warmup, steps, device):
    """Median ms/step of `steps` synchronised steps after `warmup`, FLOPs per token, peak memory and
    the host syncs of one more step (both CUDA only, else None), and the loss head that ran ("full",
    "chunked, N rows")."""
    device_type = torch.device(device).type
    plan = rung_plan(device, settings)
    precision.set_tf32(plan.tf32)
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    b = settings.get("micro_batch", micro_batch)
    raw, model, optimizers = build(settings, size, b, seq_len, plan)
    scaler = torch.amp.GradScaler(device_type, enabled=settings["scaler"])
    x, y = random_batch(b, seq_len, device)
    step = functools.partial(train_step, model, optimizers, scaler, x, y, plan)
    ms = 1000 * time_steps(step, plan.device, warmup, steps)
    cuda = device_type == "cuda"
    peak = (None, None)
    if cuda:
        peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    syncs = count_syncs(lambda: train_step(model, optimizers, scaler, x, y, plan)) if cuda else None
    fpt = flops_per_token(raw, seq_len)
    head = raw.loss_impl
    if raw.loss_impl == "chunked":
        head += f", {raw.ce_chunk_rows} rows a chunk"
    return ms, fpt, peak, syncs, head


def run_ladder(job, force_compile=False, core=False, on_row=None):
    """Time every rung of the Ladder job, the rungs chosen by its plan (core: the core rungs
    only); returns the rows (dicts) of the table, in ladder order. The core rungs are cumulative
    (each the baseline plus every applicable core change up to it) and are timed most important
    first, the trainer's stack (the last) first down to fp32, so that a run cut off keeps what
    matters; the options follow in order. on_row(rows) after every rung (rows not yet timed say
    so): e.g. write the JSON as the ladder goes."""
    plan, micro_batch = job.plan, job.micro_batch
    rungs = [r for r in ladder_rungs(plan, plan.device_type, plan.capability, force_compile,
                                     micro_batch=micro_batch)
             if not (core and r[-1])]
    rows = [dict(name=name, ms_per_step=None, tokens_per_s=None, speedup_prev=None,
                 speedup_first=None, mfu=None, peak_allocated=None, peak_reserved=None,
                 syncs_per_step=None, skipped="not run (yet)", note=note, kept=None)
            for name, _, _, note, _ in rungs]
    settings, trials = dict(BASELINE, micro_batch=micro_batch), []
    # each core rung's settings: the applicable changes up to it
    for _, change, skip, _, optional in rungs:
        if not optional and skip is None:
            settings = {**settings, **change}
        trials.append(settings)
    # the index of the row the options build on: the last core row that ran, then faster options
    best = None
    if job.verbose:
        print("timing the core rungs from the trainer's stack down to fp32 (a run cut off keeps "
              "what matters most; the table is in ladder order):", file=sys.stderr)
    try:
        for i in [i for i, r in enumerate(rungs) if not r[-1]][::-1]:
            if time_row(rows[i], trials[i], rungs[i], job):
                best = i if best is None else best
            fill_speedups(rows, rungs)
            on_row and on_row(rows)
        settings = trials[best] if best is not None else dict(BASELINE, micro_batch=micro_batch)
        if job.verbose and any(r[-1] for r in rungs):
            print("then the options, each kept only if faster than the best so far:",
                  file=sys.stderr)
        # options: kept only when faster than the best so far
        for i in (i for i, r in enumerate(rungs) if r[-1]):
            trial = {**settings, **rungs[i][1]}
            if time_row(rows[i], trial, rungs[i], job):
                tok_s = rows[i]["tokens_per_s"]
                ref = rows[best]["tokens_per_s"] if best is not None else None
                kept = (tok_s / ref, tok_s > ref) if ref else (1.0, True)
                rows[i]["speedup_prev"], rows[i]["kept"] = kept
                verdict = "kept" if rows[i]["kept"] else "not kept (slower)"
                rows[i]["note"] = f"{rungs[i][3]}; {verdict}"
                if rows[i]["kept"]:
                    settings, best = trial, i
            fill_speedups(rows, rungs)
            on_row and on_row(rows)
    finally:
        precision.set_tf32(False)
        if force_compile or plan.compile:
            torch._dynamo.reset()
    return rows


@dataclasses.dataclass(frozen=True)
class Ladder:
    """What every rung of one ladder is timed at: the plan, model size, batch shape and steps."""
    plan: object
    size: str
    micro_batch: int
    seq_len: int
    warmup: int
    steps: int
    verbose: bool = True


def ladder_job(args, plan):
    """The command line's Ladder job (run_ladder, run_ddp)."""
    return Ladder(plan, args.model, args.micro_batch_size, args.seq_len, args.warmup, args.steps)


def time_row(row, trial, rung, job):
    """Time one rung of the ladder job under trial's settings into row (or say in row why it was
    skipped); True when it ran."""
    name, change, skip, note, optional = rung
    row["skipped"] = skip
    if skip is None:
        try:
            ms, fpt, (alloc, reserved), syncs, head = time_rung(
                trial, job.size, job.micro_batch, job.seq_len, job.warmup, job.steps,
                job.plan.device)
        except RuntimeError as e:  # torch.compile's errors are RuntimeErrors too
            if is_oom(e):
                row["skipped"] = (f"out of memory at {trial['micro_batch']}x{job.seq_len}"
                                  + ("" if optional else " (try a smaller --micro_batch_size)"))
            elif trial["compile"]:
                first = str(e).strip().splitlines()[0][:160]
                row["skipped"] = f"torch.compile failed here: {first}"
            else:
                raise
        else:
            tok_s = trial["micro_batch"] * job.seq_len / (ms / 1000)
            row.update(ms_per_step=ms, tokens_per_s=tok_s, peak_allocated=alloc,
                       peak_reserved=reserved, syncs_per_step=syncs,
                       mfu=precision.estimate_mfu(fpt, tok_s, job.plan.device_name,
                                                  trial["dtype"], trial["tf32"]))
            # the head that ran: the trainer's choice and chunk for this device and size
            if "loss" in change:
                row["note"] = f"{note}: {head}"
    if job.verbose:
        done = f"skipped ({row['skipped']})"
        if row["skipped"] is None:
            done = f"{row['ms_per_step']:.1f} ms/step"
        print(f"  {name}: {done}", file=sys.stderr)
    return row["skipped"] is None


def fill_speedups(rows, rungs):
    """From the rows timed so far: speedup_first of every timed row (against the first timed core
    row) and speedup_prev of the core rows (against the timed core row before it, in ladder
    order)."""
    timed = [i for i, r in enumerate(rungs) if not r[-1] and rows[i]["skipped"] is None]
    for k, i in enumerate(timed):
        prev = rows[timed[k - 1]]["tokens_per_s"] if k else None
        rows[i]["speedup_prev"] = rows[i]["tokens_per_s"] / prev if k else 1.0
    for row in rows:
        if row["skipped"] is None and timed:
            row["speedup_first"] = row["tokens_per_s"] / rows[timed[0]]["tokens_per_s"]


def ladder_table(rows):
    """The rows as a Markdown table."""
    def num(v, f):
        return "n/a" if v is None else f.format(v)
    lines = ["| rung | ms/step | tok/s | vs prev | vs first | MFU | peak alloc | peak reserved | "
             "syncs/step | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["skipped"] is not None:
            lines.append(f"| {r['name']} | skipped | | | | | | | | {r['skipped']} |")
            continue
        lines.append(f"| {r['name']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speedup_prev']:.2f}x "
                     f"| {r['speedup_first']:.2f}x | {num(r['mfu'], '{:.1%}')} | "
                     f"{fmt_bytes(r['peak_allocated'])} "
                     f"| {fmt_bytes(r['peak_reserved'])} | {num(r.get('syncs_per_step'), '{:d}')} "
                     f"| {r['note']} |")
    return "\n".join(lines)


def require_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed: "
                        "pip install matplotlib") from None
    return plt


def plot_ladder(rows, out, title):
    """Bar chart of tokens/s per rung; skipped rungs keep their slot, labelled 'skipped'."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["name"] for r in rows]
    vals = [r["tokens_per_s"] or 0 for r in rows]
    bars = ax.bar(range(len(rows)), vals,
                  color=["tab:gray" if r["skipped"] else "tab:blue" for r in rows])
    for bar, r in zip(bars, rows):
        label = "skipped" if r["skipped"] else f"{r['tokens_per_s']:,.0f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    fig.tight_layout()
    with replacing(out, suffix=".tmp.png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------
# DDP: where torch.compile goes (torchrun --standalone --nproc_per_node=N bench.py --ddp)

DDP_ORDERS = ("DDP(compile(model))", "compile(DDP(model))")


def wrap_ddp(raw, order, device_ids, backend="inductor"):
    """raw wrapped in one of DDP_ORDERS. DDP(compile(model)) is the trainer's: DDP's gradient hooks
    fire as the compiled backward hands the gradients over, which it does at its end. In
    compile(DDP(model)) dynamo splits the graph at DDP's bucket boundaries (optimize_ddp), so a
    bucket's all-reduce can start while the backward of the layers below it still runs."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = dict(device_ids=device_ids, gradient_as_bucket_view=True)
    if order == DDP_ORDERS[0]:
        return DDP(torch.compile(raw, dynamic=False, backend=backend), **kw)
    return torch.compile(DDP(raw, **kw), dynamic=False, backend=backend)


def run_ddp(job, force_compile=False, backend="inductor"):
    """Each DDP order of the Ladder job at the trainer's settings (the plan's precision and
    kernels, vocab 50304, fused AdamW on CUDA), one micro-step per optimizer step so every step
    all-reduces. Every rank times its own steps; the slowest rank's median counts. Returns rows
    like the ladder's (tokens/s over all ranks)."""
    plan, size, micro_batch, seq_len = job.plan, job.size, job.micro_batch, job.seq_len
    import torch.distributed as dist
    device, device_type, device_name = plan.device, plan.device_type, plan.device_name
    world = dist.get_world_size()
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler,
                    attn="sdpa", sdpa_backends=plan.sdpa_backends, vocab=50304,
                    fused=device_type == "cuda")
    skip = None
    if not (plan.compile or force_compile):
        where = where_label(device_type, plan.capability)
        skip = f"precision plan for {where} has compile off (--compile forces it)"
    rows, first = [], None
    for order in DDP_ORDERS:
        row = dict(name=order, ms_per_step=None, tokens_per_s=None, speedup_first=None, mfu=None,
                   skipped=skip, note=f"{world} rank(s), gradient_as_bucket_view")
        if skip is None:
            precision.set_tf32(plan.tf32)
            raw, _, optimizers = build(settings, size, micro_batch, seq_len,
                                       rung_plan(device, settings))
            torch._dynamo.reset()
            model = wrap_ddp(raw, order, [device] if device_type == "cuda" else None, backend)
            scaler = torch.amp.GradScaler(device_type, enabled=plan.grad_scaler)
            x, y = random_batch(micro_batch, seq_len, device, seed=1337 + dist.get_rank())
            step = functools.partial(train_step, model, optimizers, scaler, x, y, plan)
            seconds = time_steps(step, device, job.warmup, job.steps)
            ms = 1000 * agree(seconds, "max", device)
            tok_s = world * micro_batch * seq_len / (ms / 1000)
            first = first or tok_s
            row.update(ms_per_step=ms, tokens_per_s=tok_s, speedup_first=tok_s / first,
                       mfu=precision.estimate_mfu(flops_per_token(raw, seq_len), tok_s / world,
                                                  device_name, plan.dtype, plan.tf32))
            del raw, model, optimizers
            free_memory(device_type)
        rows.append(row)
    precision.set_tf32(False)
    torch._dynamo.reset()
    return rows


def ddp_table(rows):
    lines = ["| order | ms/step | tok/s (all ranks) | vs first | MFU | notes |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["skipped"] is not None:
            lines.append(f"| {r['name']} | skipped | | | | {r['skipped']} |")
        else:
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            lines.append(f"| {r['name']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['speedup_first']:.2f}x | {mfu} | {r['note']} |")
    return "\n".join(lines)


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


# -----------------------------------------------------------------------------
# memory: what the tensors hold, what autograd keeps for backward, what the allocator reserves


class LiveTensors(TorchDispatchMode):
    """Counts the storages that the ops run under it create (those in `exclude`, the parameters, are
    not counted), by weak reference: live() is the bytes of those still alive, peak the most that
    were alive at once, checked after every op. Works on every device, CPU included: it sees
    tensors, not the allocator (whose peak adds fragmentation and workspaces to this)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude, self.refs, self.peak = set(exclude), {}, 0

    def live(self):
        self.refs = {k: (ref, n) for k, (ref, n) in self.refs.items() if not ref.expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten((args, kwargs))[0]
        inputs = storage_ptrs(t for t in flat if isinstance(t, torch.Tensor))
        self.live()  # forget the dead first: a new storage may reuse a freed address
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                # views and in-place results share an input's storage: not new
                s = t.untyped_storage()
                if s.data_ptr() not in self.exclude | inputs and s.data_ptr() not in self.refs:
                    self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, self.live())
        return out


def storage_ptrs(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def saved_activation_bytes(model, x, y, plan):
    """Measure the activations of one forward: bytes of the distinct storages autograd saves for
    backward, parameters and the batch (x, y) left out; autocast's weight copies count (they are
    saved too), and so does each checkpointed block's input (what activation checkpointing keeps).
    Returns (saved, logits): logits 0 when the forward returns none (the chunked loss)."""
    skip = storage_ptrs([*model.parameters(), x, y])
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            precision.autocast(plan):
        logits, loss = model(x, y)
    logits_bytes = 0 if logits is None else logits.untyped_storage().nbytes()
    del logits, loss
    return sum(saved.values()), logits_bytes


def step_peak_bytes(model, x, y, plan):
    """The most bytes alive at once during one forward + backward, parameters left out: activations,
    the temporaries of both passes and the gradients. The gradients are freed afterwards."""
    counter = LiveTensors(exclude=storage_ptrs(model.parameters()))
    with counter:
        with precision.autocast(plan):
            _, loss = model(x, y)
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    return counter.peak


def tf32_workspace(size, micro_batch, seq_len, device, steps=3):
    """fp32 steps with TF32 off and on: (peak allocated, peak reserved) for each (CUDA only)."""
    out = {}
    settings = dict(BASELINE, attn="sdpa", vocab=50304)
    for tf32 in (False, True):
        _, _, peak, *_ = time_rung({**settings, "tf32": tf32}, size, micro_batch, seq_len, 1, steps,
                                   device)
        out[tf32] = peak
    precision.set_tf32(False)
    return out


def memory_report(plan, size, micro_batch, seq_len, loss="chunked", ckpt="none", world_size=1,
                  fsdp=False, optimizer="adamw"):
    """The --memory report under a precision plan, as lines of text: measured in this process, with
    the given loss and activation checkpointing modes; then what one rank of world_size (FSDP or
    DDP) needs, computed."""
    device, device_type, device_name = plan.device, plan.device_type, plan.device_name
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler,
                    attn="sdpa", sdpa_backends=plan.sdpa_backends, vocab=50304,
                    fused=device_type == "cuda", loss=loss, ckpt=ckpt)
    dname = precision.dtype_name(plan.dtype)
    precision.set_tf32(settings["tf32"])
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    raw, model, optimizers = build(settings, size, micro_batch, seq_len,
                                   rung_plan(device, settings), optimizer)
    loss = raw.loss_impl  # auto: the head the trainer would run here, eager
    lines = [f"memory of a training step: {size} at {micro_batch}x{seq_len}, {plan.describe()}, "
             f"vocab 50304, {loss} loss, activation checkpointing {ckpt}, eager, on "
             f"{device_name or device_type}"]
    x, y = random_batch(micro_batch, seq_len, device)
    scaler = torch.amp.GradScaler(device_type, enabled=settings["scaler"])
    saved, logits = saved_activation_bytes(raw, x, y, plan)
    peak = step_peak_bytes(raw, x, y, plan)
    # CUDA: the 2nd step's peak has the optimizer state
    for _ in range(2 if device_type == "cuda" else 1):
        train_step(model, optimizers, scaler, x, y, plan)
    precision.synchronize(device)
    params = list(raw.parameters())
    p, g = tensor_bytes(params), tensor_bytes(p_.grad for p_ in params)
    o = tensor_bytes(optimizer_state_tensors(optimizers))
    step = Step(raw.config, seq_len, dtype=plan.dtype, device_type=device_type,
                activation_checkpointing=ckpt, loss_impl=loss)
    est, est_logits = activation_bytes_estimate(step, micro_batch)
    lines += [f"  parameters        {fmt_bytes(p):>10}  ({sum(t.numel() for t in params):,} fp32)",
              f"  gradients         {fmt_bytes(g):>10}",
              f"  optimizer state   {fmt_bytes(o):>10}  ({OPTIMIZER_STATE[optimizer]})",
              f"  activations       {fmt_bytes(saved):>10}  measured: saved for backward "
              f"({dname}); estimate {fmt_bytes(est)}",
              f"  logits            {fmt_bytes(logits):>10}  returned by forward, alive until "
              f"backward; estimate {fmt_bytes(est_logits)}",
              f"  step peak         {fmt_bytes(peak):>10}  measured: most bytes alive at once in "
              "forward + backward, parameters left out (tensors counted, not the allocator)"]
    if device_type == "cuda":
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        peak_a, peak_r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        lines += [f"  allocated now     {fmt_bytes(alloc):>10}  (params + grads + optimizer state "
                  "+ batch)",
                  f"  peak allocated    {fmt_bytes(peak_a):>10}  (peak - steady = activations + "
                  f"backward temporaries: {fmt_bytes(peak_a - alloc)})",
                  f"  reserved now      {fmt_bytes(reserved):>10}  (allocator cache on top of "
                  f"allocated: {fmt_bytes(reserved - alloc)})",
                  f"  peak reserved     {fmt_bytes(peak_r):>10}  "
                  f"(fragmentation at the peak: {fmt_bytes(peak_r - peak_a)})"]
    else:
        lines.append(f"  allocator         n/a on {device_type} (no caching-allocator statistics)")
    del raw, model, optimizers, x, y
    precision.set_tf32(False)
    free_memory(device_type)
    if device_type == "cuda":
        ws = tf32_workspace(size, micro_batch, seq_len, device)
        (a0, r0), (a1, r1) = ws[False], ws[True]
        lines.append(f"  TF32 off vs on (fp32 steps): peak allocated {fmt_bytes(a0)} vs "
                     f"{fmt_bytes(a1)} ({fmt_bytes(a1 - a0)}), peak reserved {fmt_bytes(r0)} vs "
                     f"{fmt_bytes(r1)} ({fmt_bytes(r1 - r0)}): "
                     "TF32 changes the matmul math, not the fp32 storage")
    else:
        lines.append(f"  TF32 off vs on    n/a on {device_type} (TF32 is CUDA-only)")
    for d in (torch.float32, torch.bfloat16):
        a, lg = activation_bytes_estimate(dataclasses.replace(step, dtype=d, device_type="cuda"),
                                          micro_batch)
        what = "fp32" if d == torch.float32 else "bf16 autocast"
        lines.append(f"  estimate {what}: activations {fmt_bytes(a)} + logits {fmt_bytes(lg)}")
    how = "1 process"
    if fsdp:
        how = f"FSDP over {world_size}"
    elif world_size > 1:
        how = f"DDP x {world_size}"
    parts = training_bytes_estimate(dataclasses.replace(step, world_size=world_size, fsdp=fsdp,
                                                        optimizer=optimizer),
                                    micro_batch)
    lines.append(f"  per rank, {how}, computed (training_bytes_estimate): " +
                 ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v) +
                 f"; total {fmt_bytes(sum(parts.values()))}")
    return lines


# -----------------------------------------------------------------------------
# what fits where, computed

GPUS = [("T4 16 GB", 15.0, torch.float16), ("24 GB", 22.5, torch.bfloat16),
        ("A100 40 GB", 39.5, torch.bfloat16),
        # (name, GiB CUDA reports as total (A10, L4, 4090: 22.1-23.6), autocast dtype)
        ("80 GB", 79.1, torch.bfloat16)]
OPTIMIZER_STATE = {"adamw": "AdamW exp_avg + exp_avg_sq",
                   "muon": "Muon: one momentum buffer per block matrix; AdamW's two on the rest"}
FIT_MODES = [  # (column, world_size, fsdp, loss_impl, activation_checkpointing)
    ("1 GPU, full loss compiled", 1, False, "full", "none"),
    ("1 GPU", 1, False, "chunked", "none"),
    ("1 GPU, ckpt every_other", 1, False, "chunked", "every_other"),
    ("1 GPU, ckpt blocks", 1, False, "chunked", "blocks"),
    ("8 GPUs DDP", 8, False, "chunked", "none"),
    ("8 GPUs DDP, ckpt blocks", 8, False, "chunked", "blocks"),
    ("8 GPUs FSDP", 8, True, "chunked", "none"),
    ("8 GPUs FSDP, ckpt blocks", 8, True, "chunked", "blocks"),
]


def fit_table(seq_len=1024, headroom=0.1, sizes=("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"),
              optimizer="adamw"):
    """Markdown: the largest micro-batch at seq_len whose training_bytes_estimate stays within
    1 - headroom of each GPU's memory, for each model size and mode ("-": not even 1)."""
    lines = ["| model | GPU | " + " | ".join(m[0] for m in FIT_MODES) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in FIT_MODES) + " |"]
    for size in sizes:
        for gpu, gib, dtype in GPUS:
            cells = []
            for _, world, fsdp, loss, ckpt in FIT_MODES:
                config = GPTConfig(vocab_size=50304, **SIZES[size])
                step = Step(config, seq_len, world_size=world, dtype=dtype, optimizer=optimizer,
                            activation_checkpointing=ckpt, fsdp=fsdp, loss_impl=loss,
                            compiled=loss == "full")  # the full column: the trainer's compiled head
                b = estimated_micro_batch(step, (1 - headroom) * gib * 2**30)
                cells.append(str(b) if b else "-")
            n = param_counts(GPTConfig(vocab_size=50304, **SIZES[size]))[0]
            lines.append(f"| {size} ({n / 1e6:.0f}M) | {gpu} | " + " | ".join(cells) + " |")
    return lines


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = ArgumentParser(prog="bench.py", description="GPT-2 training speed ladder, memory report "
                                                    "and micro-batch finder")
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
    args = p.parse_args(argv)
    args.device = precision.resolve_device(args.device or ("cpu" if args.quick else "auto"),
                                           # torchrun: one GPU per process
                                           int(os.environ.get("LOCAL_RANK", 0)))
    device_type = torch.device(args.device).type
    mode = "cpu"
    if args.quick:
        mode = "quick"
    elif device_type == "cuda" or args.fit:  # --fit: GPU shapes
        mode = "cuda"
    size, b, t, warmup, steps = DEFAULTS[mode]
    defaults = {"model": size, "micro_batch_size": b, "seq_len": t, "warmup": warmup,
                "steps": steps}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("micro_batch_size", "seq_len", "steps", "world_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be at least 0, got {args.warmup}")
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom must be in [0, 1), got {args.headroom}")
    return args


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
    device_type = torch.device(args.device).type
    plan = precision.make_plan(args.device, args.precision)
    if args.memory:
        print(header(args, steps=False))
        print("\n".join(memory_report(plan, args.model, args.micro_batch_size, args.seq_len,
                                      args.loss_impl,
                                       args.activation_checkpointing, args.world_size, args.fsdp,
                                       args.optimizer)))
        return 0
    if args.fit:
        print(f"largest micro-batch at seq_len {args.seq_len} within {1 - args.headroom:.0%} of "
              "the GPU's memory, "
              "computed by training_bytes_estimate (the full loss compiled, the rest eager; vocab "
              f"50304; fp16 on the T4, bf16 elsewhere; optimizer {args.optimizer})\n")
        print("\n".join(fit_table(args.seq_len, args.headroom, optimizer=args.optimizer)))
        return 0
    if args.ddp:
        return ddp_cli(args, plan)
    if args.find_batch:
        settings = dict(BASELINE, attn="sdpa", vocab=50304, fused=device_type == "cuda",
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
    print(header(args) + "\n")
    # after every rung: a cut-off keeps it
    on_row = (lambda rows: write_json(args.json, rows)) if args.json else None
    rows = run_ladder(ladder_job(args, plan), args.compile, core=args.core, on_row=on_row)
    print(ladder_table(rows))
    if args.plot:
        plot_ladder(rows, args.plot, header(args).split(" | command")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
