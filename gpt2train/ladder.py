"""
The speed ladder behind `python bench.py` (bench.py is the command: its flags, defaults and the
GPT it builds; this file times the rungs and writes the table).

    python bench.py --quick  # this ladder, tiny, on CPU; python bench.py --core: the core rungs

    job = Ladder(plan, "small", 4, 256, 2, 8, bench.build, flops_per_token)  # every rung's shape
    rows = run_ladder(job)  # one dict per rung, in ladder order
    print(ladder_table(rows))

The ladder adds one technique per row, in this order: fp32 -> +TF32 -> +autocast (bf16, or fp16 with
a GradScaler on sm7x) -> +torch.compile -> +SDPA attention (vs the plain masked softmax) -> +vocab
50304 -> +fused AdamW -> the loss head the trainer runs (memory.choose_loss_impl: full logits inside
the compiled graph where they fit, else the chunked head). Then options, each kept only if faster
than the best row so far: the plan's other SDPA kernel orders, the chunked head (GPU), micro-batches
16/32/64. No compile-mode rung: a mode is the trainer's compile_mode, each timed in its own process
(dev/gpu_session.sh), since max-autotune's autotuning crashed a whole process on an H200
(docs/benchmarks.md). The core rungs are timed last to first (the trainer's stack first: a run cut
off keeps it), the table is in ladder order. Rungs that cannot apply on the device are printed as
skipped, with the reason. Every row counts the host syncs of a step. optim.train_step runs the
trainer's own accumulate_gradients + optimizer_step, so the ladder times the step training runs.
"""
import dataclasses
import functools
import statistics
import sys
import textwrap
import time
import warnings
from typing import Callable

import torch

from gpt2train import precision
from gpt2train.fileio import UserError, replacing
from gpt2train.memory import fmt_bytes
from gpt2train.microbatch import random_batch
from gpt2train.optim import Stepping, train_step
from gpt2train.precision import free_memory, is_oom

# -----------------------------------------------------------------------------
# the rungs: what each one changes, from the precision plan

BASELINE = dict(tf32=False, dtype=torch.float32, scaler=False, compile=False, attn="naive",
                sdpa_backends=(), vocab=50257, fused=False, loss="full", ckpt="none")
MICRO_BATCHES = (16, 32, 64)  # the option rungs try the others than --micro_batch_size


@dataclasses.dataclass(frozen=True)
class Ladder:
    """What every rung of one ladder is timed at: the plan, model size, batch shape and steps, and
    the command's GPT (model.py is a command: bench.py hands its builder and FLOPs count down)."""
    plan: object
    size: str
    micro_batch: int
    seq_len: int
    warmup: int
    steps: int
    build: Callable  # bench.build: (settings, size, micro_batch, seq_len, plan) -> the rung's model
    flops_per_token: Callable  # model.flops_per_token (the package never imports a root script)
    verbose: bool = True


def where_label(device_type, capability):
    return f"cuda sm{capability[0]}{capability[1]}" if device_type == "cuda" else device_type


def rung_plan(device, settings):
    """The precision plan one rung runs under: the device's plan with the rung's dtype, TF32,
    compile and kernels."""
    return dataclasses.replace(precision.make_plan(device), dtype=settings["dtype"],
                               grad_scaler=settings["scaler"],
                               tf32=settings["tf32"], sdpa_backends=settings["sdpa_backends"],
                               compile=settings["compile"])


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



# -----------------------------------------------------------------------------
# timing one rung

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


def time_rung(settings, job):
    """One rung's settings at the Ladder job's size and shape (settings' micro_batch where it has
    one): median ms/step of job.steps synchronised steps after job.warmup, FLOPs per token, peak
    memory and the host syncs of one more step (both CUDA only, else None), and the loss head that
    ran ("full", "chunked, N rows")."""
    device, seq_len = job.plan.device, job.seq_len
    device_type = torch.device(device).type
    plan = rung_plan(device, settings)
    precision.set_tf32(plan.tf32)
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    b = settings.get("micro_batch", job.micro_batch)
    raw, model, optimizers = job.build(settings, job.size, b, seq_len, plan)
    scaler = torch.amp.GradScaler(device_type, enabled=settings["scaler"])
    stepping = Stepping(plan, scaler, optimizers)  # the trainer's step, clipped at 1.0
    x, y = random_batch(b, seq_len, device)
    step = functools.partial(train_step, model, stepping, x, y)
    ms = 1000 * time_steps(step, plan.device, job.warmup, job.steps)
    cuda = device_type == "cuda"
    peak = (None, None)
    if cuda:
        peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    syncs = count_syncs(lambda: train_step(model, stepping, x, y)) if cuda else None
    fpt = job.flops_per_token(raw, seq_len)
    head = raw.loss_impl
    if raw.loss_impl == "chunked":
        head += f", {raw.ce_chunk_rows} rows a chunk"
    return ms, fpt, peak, syncs, head


# -----------------------------------------------------------------------------
# the ladder: every rung, the table, the chart


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


def time_row(row, trial, rung, job):
    """Time one rung of the ladder job under trial's settings into row (or say in row why it was
    skipped); True when it ran."""
    name, change, skip, note, optional = rung
    row["skipped"] = skip
    if skip is None:
        try:
            ms, fpt, (alloc, reserved), syncs, head = time_rung(trial, job)
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
