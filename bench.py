"""
Speed and memory benchmarks for GPT-2 training steps.

    python bench.py                         # the speed ladder: 124M at seq 1024 on the GPU, one row per technique
    python bench.py --quick                 # a small config on CPU in well under a minute (the test suite's smoke run)
    python bench.py --json out.json --plot out.png
    python bench.py --memory                # where the memory goes: params, grads, optimizer, activations, allocator
    python bench.py --memory --activation_checkpointing blocks --world_size 8 --fsdp   # ... in those modes
    python bench.py --find_batch            # the largest fast micro-batch that fits (CUDA)
    python bench.py --fit                   # what fits where: computed micro-batches per model, GPU and mode

The ladder adds one technique per row, in this order: fp32 -> +TF32 -> +autocast (bf16, or fp16 with
a GradScaler on sm7x) -> +torch.compile -> +SDPA attention (vs the plain masked softmax) -> +vocab 50304
-> +fused AdamW -> +chunked loss. Rungs that cannot apply on the device are printed as skipped, with the reason.

The trainer uses memory_summary() (one line at the first step) and auto_micro_batch()
(micro_batch_size="auto"); search_micro_batch() is the pure search they share with --find_batch.
"""
import argparse
import dataclasses
import gc
import os
import statistics
import sys
import textwrap
import time

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fileio import replacing, write_json
from model import GPT, GPTConfig, PRETRAINED, estimate_mfu, flops_per_token

# -----------------------------------------------------------------------------
# configurations: the real model on a GPU, small ones on a CPU

SIZES = dict(PRETRAINED)
SIZES["small"] = dict(n_layer=4, n_head=4, n_embd=256)  # the CPU default: same rungs, minutes not hours
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
    dev = torch.device(device)
    if dev.type == "cuda":
        return "cuda", torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev)
    return dev.type, None, None


def synchronize(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "mps":
        torch.mps.synchronize()


def free_memory(device_type):
    """Give cached blocks back so that the next measurement starts clean."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e):
    """CUDA out of memory, including cuBLAS failing to allocate its workspace."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e) or "ALLOC_FAILED" in str(e)


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def float32_matmul(tf32):
    """TF32 tensor cores for fp32 matmuls (CUDA sm80+); 'highest' is plain fp32."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def sdpa_context(backends):
    from train_gpt2 import sdpa_context  # lazily: the trainer imports this module
    return sdpa_context(backends)


def where_label(device_type, capability):
    return f"cuda sm{capability[0]}{capability[1]}" if device_type == "cuda" else device_type


# -----------------------------------------------------------------------------
# one training step, the way the trainer takes it (minus data loading and accumulation)


def train_step(model, optimizer, scaler, x, y, device_type, dtype):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, y)
    if scaler is not None:  # fp16: scale the loss so small gradients survive, unscale before clipping
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return loss


def random_batch(micro_batch, seq_len, device, seed=1337):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)  # real token ids, never padding rows
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)  # (B, T), (B, T)


# -----------------------------------------------------------------------------
# the speed ladder

BASELINE = dict(tf32=False, dtype=torch.float32, scaler=False, compile=False, attn="naive",
                sdpa_backends=(), vocab=50257, fused=False, loss="full", ckpt="none")


def ladder_rungs(plan, device_type, capability=None, force_compile=False, fused_ok=None):
    """The rungs in the issue's order: (name, settings it changes, skip reason or None, note).
    Which rungs apply comes from the precision plan; nothing here re-derives capability rules."""
    where = where_label(device_type, capability)
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16+GradScaler"}.get(plan.dtype)
    rungs = [("fp32", {}, None, "naive attention, vocab 50257, foreach AdamW")]
    rungs.append(("+TF32", {"tf32": True},
                  None if plan.tf32 else f"precision plan for {where} has TF32 off"
                  + (" (TF32 is CUDA-only)" if device_type != "cuda" else " (TF32 tensor cores need sm80+)"), ""))
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
    rungs.append(("+chunked loss", {"loss": "chunked"}, None, "vs logits + F.cross_entropy"))
    return rungs


def fused_available(device_type):
    """Whether torch.optim.AdamW(fused=True) takes tensors on this device type (CUDA, and CPU since torch 2.4)."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device_type, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def build(settings, size, seq_len, device, device_type):
    """A fresh model (same seed every rung) and its optimizer for one rung's settings."""
    torch.manual_seed(1337)
    config = GPTConfig(block_size=seq_len, vocab_size=settings["vocab"], attn_impl=settings["attn"],
                       loss_impl=settings["loss"], activation_checkpointing=settings["ckpt"], **SIZES[size])
    raw = GPT(config).to(device)
    optimizer = raw.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type,
                                         fused=settings["fused"], verbose=False)
    model = raw
    if settings["compile"]:
        torch._dynamo.reset()  # a fresh cache per rung: no recompile limit, no stale graphs
        model = torch.compile(raw)
    return raw, model, optimizer


def time_rung(settings, size, micro_batch, seq_len, warmup, steps, device):
    """Median ms/step of `steps` synchronised steps after `warmup`, and peak memory (CUDA only)."""
    device_type, _, _ = device_info(device)
    float32_matmul(settings["tf32"])
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    raw, model, optimizer = build(settings, size, seq_len, device, device_type)
    scaler = torch.amp.GradScaler(device_type) if settings["scaler"] else None
    x, y = random_batch(micro_batch, seq_len, device)
    times = []
    with sdpa_context(settings["sdpa_backends"]):
        for i in range(warmup + steps):
            synchronize(device_type)
            t0 = time.perf_counter()
            train_step(model, optimizer, scaler, x, y, device_type, settings["dtype"])
            synchronize(device_type)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    ms = 1000 * statistics.median(times)
    peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if device_type == "cuda" else (None, None)
    fpt = flops_per_token(raw, seq_len)
    return ms, fpt, peak


def run_ladder(device, size, micro_batch, seq_len, warmup, steps, force_compile=False, verbose=True):
    """Time every rung cumulatively; returns the rows (dicts) of the table."""
    from train_gpt2 import precision_plan  # lazily: the trainer imports this module
    device_type, capability, device_name = device_info(device)
    plan = precision_plan(device_type, capability)
    settings = dict(BASELINE)
    rows, first, prev = [], None, None
    try:
        for name, change, skip, note in ladder_rungs(plan, device_type, capability, force_compile):
            row = dict(name=name, ms_per_step=None, tokens_per_s=None, speedup_prev=None, speedup_first=None,
                       mfu=None, peak_allocated=None, peak_reserved=None, skipped=skip, note=note)
            if skip is None:
                trial = {**settings, **change}
                try:
                    ms, fpt, (alloc, reserved) = time_rung(trial, size, micro_batch, seq_len, warmup, steps, device)
                except RuntimeError as e:  # torch.compile's errors are RuntimeErrors too
                    if is_oom(e):
                        row["skipped"] = f"out of memory at {micro_batch}x{seq_len} (try a smaller --micro_batch_size)"
                    elif change.get("compile"):
                        row["skipped"] = f"torch.compile failed here: {str(e).strip().splitlines()[0][:160]}"
                    else:
                        raise
                else:
                    settings = trial
                    tok_s = micro_batch * seq_len / (ms / 1000)
                    row.update(ms_per_step=ms, tokens_per_s=tok_s, peak_allocated=alloc, peak_reserved=reserved,
                               mfu=estimate_mfu(fpt, tok_s, device_name, settings["dtype"], settings["tf32"]))
                    first = first or row
                    row["speedup_first"] = tok_s / first["tokens_per_s"]
                    row["speedup_prev"] = tok_s / prev["tokens_per_s"] if prev else 1.0
                    prev = row
            rows.append(row)
            if verbose:
                done = f"{row['ms_per_step']:.1f} ms/step" if row["skipped"] is None else f"skipped ({row['skipped']})"
                print(f"  {name}: {done}", file=sys.stderr)
    finally:
        float32_matmul(False)
        if force_compile or plan.compile:
            torch._dynamo.reset()
    return rows


def ladder_table(rows):
    """The rows as a Markdown table."""
    def num(v, f):
        return "n/a" if v is None else f.format(v)
    lines = ["| rung | ms/step | tok/s | vs prev | vs first | MFU | peak alloc | peak reserved | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["skipped"] is not None:
            lines.append(f"| {r['name']} | skipped | | | | | | | {r['skipped']} |")
            continue
        lines.append(f"| {r['name']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['speedup_prev']:.2f}x "
                     f"| {r['speedup_first']:.2f}x | {num(r['mfu'], '{:.1%}')} | {fmt_bytes(r['peak_allocated'])} "
                     f"| {fmt_bytes(r['peak_reserved'])} | {r['note']} |")
    return "\n".join(lines)


def require_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib, which is not installed: pip install matplotlib") from None
    return plt


def plot_ladder(rows, out, title):
    """Bar chart of tokens/s per rung; skipped rungs keep their slot, labelled 'skipped'."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["name"] for r in rows]
    vals = [r["tokens_per_s"] or 0 for r in rows]
    bars = ax.bar(range(len(rows)), vals, color=["tab:gray" if r["skipped"] else "tab:blue" for r in rows])
    for bar, r in zip(bars, rows):
        label = "skipped" if r["skipped"] else f"{r['tokens_per_s']:,.0f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    fig.tight_layout()
    with replacing(out, suffix=".tmp.png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------
# memory: what the tensors hold, what autograd keeps for backward, what the allocator reserves


def unwrap(model):
    """The GPT inside DDP and/or torch.compile wrappers."""
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def tensor_bytes(tensors):
    """Bytes of distinct storages (a tied weight counts once); of an FSDP-sharded tensor (a DTensor),
    this rank's shard."""
    seen = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class LiveTensors(TorchDispatchMode):
    """Counts the storages that the ops run under it create (those in `exclude`, the parameters, are
    not counted), by weak reference: live() is the bytes of those still alive, peak the most that
    were alive at once, checked after every op. Works on every device, CPU included: it sees tensors,
    not the allocator (whose peak adds fragmentation and workspaces to this)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude, self.refs, self.peak = set(exclude), {}, 0

    def live(self):
        self.refs = {k: (ref, n) for k, (ref, n) in self.refs.items() if not ref.expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = storage_ptrs(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        self.live()  # forget the dead first: a new storage may reuse a freed address
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()  # views and in-place results share an input's storage: not new
                if s.data_ptr() not in self.exclude | inputs and s.data_ptr() not in self.refs:
                    self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, self.live())
        return out


def storage_ptrs(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def saved_activation_bytes(model, x, y, device_type, dtype):
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
            torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype != torch.float32):
        logits, loss = model(x, y)
    logits_bytes = 0 if logits is None else logits.untyped_storage().nbytes()
    del logits, loss
    return sum(saved.values()), logits_bytes


def step_peak_bytes(model, x, y, device_type, dtype):
    """The most bytes alive at once during one forward + backward, parameters left out: activations,
    the temporaries of both passes and the gradients. The gradients are freed afterwards."""
    counter = LiveTensors(exclude=storage_ptrs(model.parameters()))
    with counter:
        with torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x, y)
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    return counter.peak


def checkpointed_layers(config):
    """How many blocks run under activation checkpointing (GPT.checkpointed says which)."""
    return {"none": 0, "blocks": config.n_layer, "every_other": (config.n_layer + 1) // 2}[config.activation_checkpointing]


def activation_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", fsdp=False):
    """Arithmetic estimate of what one forward of our GPT leaves alive for backward, in bytes, and the
    logits it returns. Per layer it saves, in the autocast dtype (a bytes/element):
    ln_1 and ln_2 outputs, qkv (3), attention output, c_fc output (4) and GELU output (4) = 14 BTC,
    plus the two residual-stream inputs of the layer norms in fp32 (2 BTC) and their mean/rstd;
    SDPA adds its logsumexp (B, nh, T); the masked softmax instead keeps the (B, nh, T, T) attention
    and the (T, T) mask; under CUDA autocast softmax runs in fp32 and att @ v keeps a second, bf16
    copy (6 bytes per element, more than fp32's 4), CPU autocast keeps one bf16 copy. A checkpointed
    layer keeps only its fp32 input (BTC). The head keeps ln_f's input and statistics and the position
    ids, and then either (loss_impl="full") lm_head's input, cross-entropy's fp32 log-softmax (B, T, V)
    and the logits it returns, or (chunked) dL/dh (BTC, fp32) and dL/dlm_head (V x C, fp32).
    Autocast also keeps a copy of every matmul weight of the layers that are not checkpointed (and of
    lm_head for the full loss), except under FSDP on CUDA, where the blocks' weights are gathered in
    the autocast dtype already and freed after the forward. The batch (idx, targets) is the caller's,
    not counted. Checked against saved_activation_bytes."""
    B, T, C, L, nh, V = micro_batch, seq_len, config.n_embd, config.n_layer, config.n_head, config.vocab_size
    a = 4 if dtype == torch.float32 else 2
    per_layer = 14 * B * T * C * a + 2 * B * T * C * 4 + 2 * 2 * B * T * 4
    if config.attn_impl == "sdpa":
        per_layer += B * nh * T * 4
    else:
        per_layer += B * nh * T * T * (4 if a == 4 else 6 if device_type == "cuda" else 2) + T * T
    n_ckpt = checkpointed_layers(config)
    layers = (L - n_ckpt) * per_layer + n_ckpt * B * T * C * 4
    head = B * T * C * 4 + 2 * B * T * 4 + T * 8  # ln_f input, mean/rstd; position ids
    full = config.loss_impl == "full"
    head += B * T * C * a + B * T * V * 4 + 4 if full else B * T * C * 4 + V * C * 4  # + total_weight | dL/dh, dL/dW
    block_copies = 0 if fsdp and device_type == "cuda" else (L - n_ckpt) * 12 * C * C  # c_attn 3CC, c_proj CC, c_fc 4CC, mlp c_proj 4CC
    weights = 0 if a == 4 else 2 * (block_copies + (V * C if full else 0))
    return layers + head + weights, B * T * V * a if full else 0


def param_counts(config):
    """(all parameters, those of one block) of a GPT of this shape, the tied embedding once."""
    C = config.n_embd
    block = 12 * C * C + 13 * C  # c_attn 3CC+3C, c_proj CC+C, c_fc 4CC+4C, mlp c_proj 4CC+C, two layer norms 4C
    return config.vocab_size * C + config.block_size * C + config.n_layer * block + 2 * C, block


def training_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", world_size=1,
                            fsdp=False):
    """Bytes one rank needs for a training step, by part (a dict), computed from the shapes for the
    eager model (torch.compile fuses some activations away). Meant to be safe for "does it fit": it
    counts all the gradients as alive together with all the activations and adds the largest
    temporary on top, which no single moment of a step holds. Parts: fp32 parameters, gradients
    and AdamW state (divided by world_size under FSDP); DDP's gradient buckets (a second copy of the
    gradients, world_size > 1 without FSDP); under FSDP the gathered root (fp32, with its unsharded
    gradient) and two blocks in the compute dtype (the one running and the one prefetched) plus one
    block's unsharded gradient; activations and logits (activation_bytes_estimate); the largest
    temporary: the loss's (full: two (B*T, V) fp32 gradients; chunked: one chunk of fp32 logits and
    a (V, C) product) or a block's in backward (its recomputed activations when checkpointed, and
    about 8 x B*T*C fp32 of gradients flowing through it). Gradients and activations do meet from
    the second micro-step of an accumulating step on. On CPU it lies 7-110% above the measured peak
    of forward + backward (step_peak_bytes, tests/test_bench.py)."""
    n, block = param_counts(config)
    B, T, C, V, L = micro_batch, seq_len, config.n_embd, config.vocab_size, config.n_layer
    a = 4 if dtype == torch.float32 else 2
    shard = world_size if fsdp else 1
    parts = {"parameters": 4 * n // shard, "gradients": 4 * n // shard, "optimizer state": 8 * n // shard,
             "DDP buckets": 4 * n if world_size > 1 and not fsdp else 0}
    if fsdp:
        from sharding import fsdp_param_dtype
        p = torch.finfo(fsdp_param_dtype(dtype, device_type)).bits // 8
        parts["FSDP gathered"] = 2 * 4 * (n - L * block) + 3 * p * block
    parts["activations"], parts["logits"] = activation_bytes_estimate(config, B, T, dtype, device_type, fsdp)
    if config.loss_impl == "full":
        head = B * T * V * (8 + (a if a == 2 else 0))
    else:
        from model import CE_CHUNK_ROWS
        cast = a if a == 2 else 0  # the compute-dtype copies next to the fp32 ones
        head = min(CE_CHUNK_ROWS, B * T) * V * (4 + cast) + V * C * (a + cast) + B * T * C * 4
    per_layer = activation_bytes_estimate(dataclasses.replace(config, n_layer=1, activation_checkpointing="none"),
                                          B, T, dtype, device_type)[0] - activation_bytes_estimate(
        dataclasses.replace(config, n_layer=0, activation_checkpointing="none"), B, T, dtype, device_type)[0]
    layer = (per_layer if checkpointed_layers(config) else 0) + 8 * B * T * C * 4
    parts["largest temporary"] = max(head, layer)
    return parts


def estimated_micro_batch(config, seq_len, dtype, budget, device_type="cuda", world_size=1, fsdp=False, limit=4096):
    """The largest micro-batch whose training_bytes_estimate fits in budget bytes (0 if none does)."""
    fits = lambda b: sum(training_bytes_estimate(config, b, seq_len, dtype, device_type, world_size, fsdp).values()) <= budget  # noqa: E731
    lo, hi = 0, limit
    while lo < hi:  # the estimate grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def is_sharded(model):
    return any(isinstance(p, DTensor) for p in model.parameters())


def memory_summary(model, optimizer, device, micro_batch=None, seq_len=None, dtype=torch.float32):
    """One line for the trainer after its first step: parameter, gradient and optimizer-state bytes
    (from the tensors, so on every device; this rank's shards under FSDP), activations (an estimate
    for the model's loss and checkpointing modes when micro_batch and seq_len are given), and on
    CUDA what the allocator holds: allocated, reserved (cached on top) and the peaks."""
    device_type = torch.device(device).type
    params = list(model.parameters())
    sharded = is_sharded(model)
    grads = tensor_bytes(p.grad for p in params)
    if grads == 0:  # freed after the step (zero_grad(set_to_none=True)): what backward allocates again
        local = [p.to_local() if isinstance(p, DTensor) else p for p in {id(p): p for p in params if p.requires_grad}.values()]
        grads = sum(p.numel() * p.element_size() for p in local)
    parts = [f"params {fmt_bytes(tensor_bytes(params))}",
             f"grads {fmt_bytes(grads)}",
             f"optimizer state {fmt_bytes(tensor_bytes(optimizer_state_tensors(optimizer)))}"]
    if sharded:
        import torch.distributed as dist
        parts[0] = f"per rank (FSDP over {dist.get_world_size()}): " + parts[0]
    if micro_batch and seq_len:
        config = unwrap(model).config
        act, logits = activation_bytes_estimate(config, micro_batch, seq_len, dtype, device_type, fsdp=sharded)
        parts.append(f"activations ~{fmt_bytes(act + logits)} (estimate, {micro_batch}x{seq_len}, "
                     f"{config.loss_impl} loss, checkpointing {config.activation_checkpointing})")
    if device_type == "cuda":
        alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        parts.append(f"allocated {fmt_bytes(alloc)}, reserved {fmt_bytes(reserved)} (+{fmt_bytes(reserved - alloc)} cached), "
                     f"peak allocated {fmt_bytes(torch.cuda.max_memory_allocated(device))}, "
                     f"peak reserved {fmt_bytes(torch.cuda.max_memory_reserved(device))}")
    else:
        parts.append(f"allocator stats n/a on {device_type}")
    return "memory: " + ", ".join(parts)


def tf32_workspace(size, micro_batch, seq_len, device, steps=3):
    """fp32 steps with TF32 off and on: (peak allocated, peak reserved) for each (CUDA only)."""
    out = {}
    settings = dict(BASELINE, attn="sdpa", vocab=50304)
    for tf32 in (False, True):
        _, _, peak = time_rung({**settings, "tf32": tf32}, size, micro_batch, seq_len, 1, steps, device)
        out[tf32] = peak
    float32_matmul(False)
    return out


def memory_report(device, size, micro_batch, seq_len, loss="chunked", ckpt="none", world_size=1, fsdp=False):
    """The --memory report, as lines of text: measured in this process, with the given loss and
    activation checkpointing modes; then what one rank of world_size (FSDP or DDP) needs, computed."""
    from train_gpt2 import precision_plan
    device_type, capability, device_name = device_info(device)
    plan = precision_plan(device_type, capability)
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler, attn="sdpa",
                    sdpa_backends=plan.sdpa_backends, vocab=50304, fused=device_type == "cuda", loss=loss, ckpt=ckpt)
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[plan.dtype]
    lines = [f"memory of a training step: {size} at {micro_batch}x{seq_len}, {plan.describe()}, vocab 50304, "
             f"{loss} loss, activation checkpointing {ckpt}, on {device_name or device_type}"]
    float32_matmul(settings["tf32"])
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    raw, model, optimizer = build(settings, size, seq_len, device, device_type)
    x, y = random_batch(micro_batch, seq_len, device)
    scaler = torch.amp.GradScaler(device_type) if settings["scaler"] else None
    with sdpa_context(settings["sdpa_backends"]):
        saved, logits = saved_activation_bytes(raw, x, y, device_type, plan.dtype)
        peak = step_peak_bytes(raw, x, y, device_type, plan.dtype)
        for _ in range(2 if device_type == "cuda" else 1):  # CUDA: the 2nd step's peak has the optimizer state
            train_step(model, optimizer, scaler, x, y, device_type, plan.dtype)
    synchronize(device_type)
    params = list(raw.parameters())
    p, g, o = tensor_bytes(params), tensor_bytes(p_.grad for p_ in params), tensor_bytes(optimizer_state_tensors(optimizer))
    est, est_logits = activation_bytes_estimate(raw.config, micro_batch, seq_len, plan.dtype, device_type)
    lines += [f"  parameters        {fmt_bytes(p):>10}  ({sum(t.numel() for t in params):,} fp32)",
              f"  gradients         {fmt_bytes(g):>10}",
              f"  optimizer state   {fmt_bytes(o):>10}  (AdamW exp_avg + exp_avg_sq)",
              f"  activations       {fmt_bytes(saved):>10}  measured: saved for backward ({dname}); estimate {fmt_bytes(est)}",
              f"  logits            {fmt_bytes(logits):>10}  returned by forward, alive until backward; "
              f"estimate {fmt_bytes(est_logits)}",
              f"  step peak         {fmt_bytes(peak):>10}  measured: most bytes alive at once in forward + backward, "
              "parameters left out (tensors counted, not the allocator)"]
    if device_type == "cuda":
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        peak_a, peak_r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        lines += [f"  allocated now     {fmt_bytes(alloc):>10}  (params + grads + optimizer state + batch)",
                  f"  peak allocated    {fmt_bytes(peak_a):>10}  (peak - steady = activations + backward temporaries: "
                  f"{fmt_bytes(peak_a - alloc)})",
                  f"  reserved now      {fmt_bytes(reserved):>10}  (allocator cache on top of allocated: "
                  f"{fmt_bytes(reserved - alloc)})",
                  f"  peak reserved     {fmt_bytes(peak_r):>10}  (fragmentation at the peak: {fmt_bytes(peak_r - peak_a)})"]
    else:
        lines.append(f"  allocator         n/a on {device_type} (no caching-allocator statistics)")
    config = raw.config
    del raw, model, optimizer, x, y
    float32_matmul(False)
    free_memory(device_type)
    if device_type == "cuda":
        ws = tf32_workspace(size, micro_batch, seq_len, device)
        (a0, r0), (a1, r1) = ws[False], ws[True]
        lines.append(f"  TF32 off vs on (fp32 steps): peak allocated {fmt_bytes(a0)} vs {fmt_bytes(a1)} "
                     f"({fmt_bytes(a1 - a0)}), peak reserved {fmt_bytes(r0)} vs {fmt_bytes(r1)} ({fmt_bytes(r1 - r0)}): "
                     "TF32 changes the matmul math, not the fp32 storage")
    else:
        lines.append(f"  TF32 off vs on    n/a on {device_type} (TF32 is CUDA-only)")
    for d in (torch.float32, torch.bfloat16):
        a, lg = activation_bytes_estimate(config, micro_batch, seq_len, d)
        what = "fp32" if d == torch.float32 else "bf16 autocast"
        lines.append(f"  estimate {what}: activations {fmt_bytes(a)} + logits {fmt_bytes(lg)}")
    how = f"FSDP over {world_size}" if fsdp else f"DDP x {world_size}" if world_size > 1 else "1 process"
    parts = training_bytes_estimate(config, micro_batch, seq_len, plan.dtype, device_type, world_size, fsdp)
    lines.append(f"  per rank, {how}, computed (training_bytes_estimate): " +
                 ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v) + f"; total {fmt_bytes(sum(parts.values()))}")
    return lines


# -----------------------------------------------------------------------------
# what fits where, computed

GPUS = [("T4 16 GB", 15.0, torch.float16), ("24 GB", 22.5, torch.bfloat16), ("A100 40 GB", 39.5, torch.bfloat16),
        ("80 GB", 79.1, torch.bfloat16)]  # (name, GiB CUDA reports as total (A10, L4, 4090: 22.1-23.6), autocast dtype)
FIT_MODES = [  # (column, world_size, fsdp, loss_impl, activation_checkpointing)
    ("1 GPU, full loss", 1, False, "full", "none"),
    ("1 GPU", 1, False, "chunked", "none"),
    ("1 GPU, ckpt every_other", 1, False, "chunked", "every_other"),
    ("1 GPU, ckpt blocks", 1, False, "chunked", "blocks"),
    ("8 GPUs DDP", 8, False, "chunked", "none"),
    ("8 GPUs DDP, ckpt blocks", 8, False, "chunked", "blocks"),
    ("8 GPUs FSDP", 8, True, "chunked", "none"),
    ("8 GPUs FSDP, ckpt blocks", 8, True, "chunked", "blocks"),
]


def fit_table(seq_len=1024, headroom=0.1, sizes=("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")):
    """Markdown: the largest micro-batch at seq_len whose training_bytes_estimate stays within
    1 - headroom of each GPU's memory, for each model size and mode ("-": not even 1)."""
    lines = ["| model | GPU | " + " | ".join(m[0] for m in FIT_MODES) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in FIT_MODES) + " |"]
    for size in sizes:
        for gpu, gib, dtype in GPUS:
            cells = []
            for _, world, fsdp, loss, ckpt in FIT_MODES:
                config = GPTConfig(vocab_size=50304, loss_impl=loss, activation_checkpointing=ckpt, **SIZES[size])
                b = estimated_micro_batch(config, seq_len, dtype, (1 - headroom) * gib * 2**30, "cuda", world, fsdp)
                cells.append(str(b) if b else "-")
            n = param_counts(GPTConfig(vocab_size=50304, **SIZES[size]))[0]
            lines.append(f"| {size} ({n / 1e6:.0f}M) | {gpu} | " + " | ".join(cells) + " |")
    return lines


# -----------------------------------------------------------------------------
# micro-batch finder


def search_micro_batch(usage, measure, seq_len, total_batch_size, world_size=1, max_micro_batch=None,
                       headroom=0.1, n_timed=3):
    """Pick the micro-batch for a fixed total_batch_size (tokens per optimizer step).

    usage(b) -> peak memory of a step at micro-batch b as a fraction of the device's memory, or None
    when it ran out; it must grow with b. measure(b) -> tokens/s. Candidates divide the batch
    (total_batch_size = b * seq_len * world_size * grad_accum); multiples of 8 are preferred, powers
    of two are not required. The largest candidate using at most 1 - headroom of memory is found by
    bisection, it and the next n_timed-1 smaller ones are timed, the fastest wins.
    Returns (micro_batch, reason). Raises ValueError when no micro-batch can keep the total, or
    none fits."""
    per_row = seq_len * world_size
    if total_batch_size % per_row:
        raise ValueError(f"total_batch_size {total_batch_size} is not divisible by seq_len x world_size = {per_row}: "
                         f"no micro-batch keeps it; use a multiple of {per_row}")
    rows = total_batch_size // per_row  # micro_batch * grad_accum
    limit = rows if max_micro_batch is None else min(rows, max_micro_batch)
    divisors = [b for b in range(1, limit + 1) if rows % b == 0]
    used = {}

    def fits(b):
        if b not in used:
            used[b] = usage(b)
        return used[b] is not None and used[b] <= 1 - headroom

    pool = [b for b in divisors if b % 8 == 0]
    k = largest_fitting(pool, fits)
    note = ""
    if k is None:
        pool = [b for b in divisors if b % 8]
        k = largest_fitting(pool, fits)
        note = "; no multiple of 8 fits"
    if k is None:
        raise ValueError(f"no micro-batch fits in {1 - headroom:.0%} of memory at seq_len {seq_len} "
                         f"(tried {sorted(used)}); shorten seq_len or use a smaller model")
    timed = pool[max(0, k - n_timed + 1):k + 1]
    speed = {b: measure(b) for b in reversed(timed)}
    best = max(speed, key=speed.get)
    tried = ", ".join(f"{b}: {speed[b]:,.0f} tok/s" for b in sorted(speed, reverse=True))
    if k + 1 < len(pool):
        nxt = pool[k + 1]
        why = f"{nxt} " + ("runs out of memory" if used[nxt] is None else
                           f"uses {used[nxt]:.0%} of memory, over the {1 - headroom:.0%} limit")
    else:
        why = f"{pool[k]} is the largest that divides the batch" + (f" within max {max_micro_batch}" if max_micro_batch else "")
    reason = (f"micro_batch {best}: fastest of the largest that fit ({tried}); {why}{note}; "
              f"grad_accum {rows // best} keeps total_batch_size {total_batch_size}")
    return best, reason


def largest_fitting(pool, fits):
    """Index of the largest b in the ascending pool with fits(b), assuming fits is monotone; or None."""
    lo, hi, best = 0, len(pool) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(pool[mid]):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def probe_steps(model, optimizer, micro_batch, seq_len, device, plan, steps):
    """Run `steps` training steps on random tokens with the learning rate at 0, so the weights stay
    as they were; the gradients and the optimizer state it created are dropped afterwards.
    Returns the median seconds per step."""
    device_type = torch.device(device).type
    lrs = [group["lr"] for group in optimizer.param_groups]
    scaler = torch.amp.GradScaler(device_type) if plan.grad_scaler else None  # fp16: skips steps on inf grads
    times = []
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # AdamW with lr 0: no update and no weight decay
        x, y = random_batch(micro_batch, seq_len, device)
        with sdpa_context(plan.sdpa_backends):
            for _ in range(steps):  # the second step is the steady state: optimizer state alive during backward
                synchronize(device_type)
                t0 = time.perf_counter()
                train_step(model, optimizer, scaler, x, y, device_type, plan.dtype)
                synchronize(device_type)
                times.append(time.perf_counter() - t0)
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
    return statistics.median(times)


def agree(value, op, device):
    """The same number on every DDP rank: all_reduce with op ('max' or 'min'); unchanged without DDP."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return t.item()


def micro_batch_cap(config, seq_len, dtype, budget, world_size=1, fsdp=False, slack=4):
    """The finder probes no micro-batch above slack x the largest that training_bytes_estimate fits in
    budget: the estimate is on the safe side (the measured peak is lower; torch.compile lowers it
    more), so the probes skip sizes that would only run out of memory. Returns (cap, note)."""
    est = estimated_micro_batch(config, seq_len, dtype, budget, "cuda", world_size, fsdp)
    return slack * max(est, 1), (f"the estimate for {config.loss_impl} loss, checkpointing "
                                 f"{config.activation_checkpointing}{', FSDP' if fsdp else ''} fits {est}; "
                                 f"probed up to {slack * max(est, 1)}")


def auto_micro_batch(model, optimizer, seq_len, total_batch_size, world_size, device, plan, default,
                     max_micro_batch=None, headroom=0.1):
    """micro_batch_size="auto": on CUDA, probe the raw model (before torch.compile and DDP) and its
    optimizer with OOM-guarded steps at lr 0 (weights untouched, grads and optimizer state freed,
    cache emptied after every probe) and return search_micro_batch's (micro_batch, reason). Every
    DDP rank probes the same sizes (peak use is the maximum over ranks, speed the minimum) and the
    result is the minimum over ranks. On CPU/MPS returns (default, reason) without probing."""
    device_type = torch.device(device).type
    if device_type != "cuda":
        if total_batch_size % (default * seq_len * world_size):
            raise ValueError(f"total_batch_size {total_batch_size} is not divisible by micro_batch x seq_len x world_size "
                             f"= {default} x {seq_len} x {world_size}; change one of them")
        return default, (f"micro_batch_size=auto needs CUDA; on {device_type} using the default micro_batch {default} "
                         f"(grad_accum {total_batch_size // (default * seq_len * world_size)})")
    free_memory(device_type)
    capacity = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)  # free + what we hold
    cap, note = micro_batch_cap(unwrap(model).config, seq_len, plan.dtype, (1 - headroom) * capacity, world_size,
                                is_sharded(model))
    max_micro_batch = cap if max_micro_batch is None else min(max_micro_batch, cap)

    def usage(b):
        free_memory(device_type)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            probe_steps(model, optimizer, b, seq_len, device, plan, steps=2)
            used = torch.cuda.max_memory_reserved(device) / capacity
        except RuntimeError as e:
            if not is_oom(e):
                raise
            used = float("inf")
        free_memory(device_type)  # outside the except: the traceback no longer pins the step's tensors
        used = agree(used, "max", device)
        return None if used == float("inf") else used

    def measure(b):
        s = probe_steps(model, optimizer, b, seq_len, device, plan, steps=4)
        free_memory(device_type)
        return agree(b * seq_len / s, "min", device)

    b, reason = search_micro_batch(usage, measure, seq_len, total_batch_size, world_size, max_micro_batch, headroom)
    reason += f" ({note})"
    agreed = int(agree(b, "min", device))
    if agreed != b:
        b, reason = agreed, f"micro_batch {agreed}: the minimum over DDP ranks (this rank: {reason})"
    return b, reason


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description="GPT-2 training speed ladder, memory report and micro-batch finder")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, mps (default: cuda if available, else cpu)")
    p.add_argument("--model", default=None, choices=sorted(SIZES), help="model size (default: gpt2 on CUDA, small on CPU)")
    p.add_argument("--micro_batch_size", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per rung (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per rung (compile happens here)")
    p.add_argument("--compile", action="store_true", help="run the torch.compile rung even where the plan says off (CPU)")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, CPU unless --device says otherwise")
    p.add_argument("--json", default=None, metavar="OUT", help="write the ladder rows as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="bar chart of tokens/s per rung (needs matplotlib)")
    p.add_argument("--memory", action="store_true", help="memory report instead of the ladder")
    p.add_argument("--loss_impl", default="chunked", choices=("chunked", "full"), help="the loss (--memory, --find_batch)")
    p.add_argument("--activation_checkpointing", default="none", choices=("none", "blocks", "every_other"),
                   help="recompute blocks in backward (--memory, --find_batch)")
    p.add_argument("--world_size", type=int, default=1, help="ranks to compute the per-rank memory for (--memory)")
    p.add_argument("--fsdp", action="store_true", help="the ranks shard the model with FSDP (--memory, computed)")
    p.add_argument("--fit", action="store_true", help="what fits where: computed micro-batches per model, GPU and mode")
    p.add_argument("--find_batch", action="store_true", help="micro-batch finder instead of the ladder")
    p.add_argument("--total_batch_size", type=int, default=DEFAULT_TOTAL_BATCH, help="tokens per optimizer step (--find_batch)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory to keep free (--find_batch)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    device_type = torch.device(args.device).type
    if device_type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    mode = "quick" if args.quick else ("cuda" if device_type == "cuda" or args.fit else "cpu")  # --fit: GPU shapes
    size, b, t, warmup, steps = DEFAULTS[mode]
    for name, default in (("model", size), ("micro_batch_size", b), ("seq_len", t), ("warmup", warmup), ("steps", steps)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("micro_batch_size", "seq_len", "steps", "world_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if not 0 <= args.headroom < 1:
        p.error("--headroom must be in [0, 1)")
    return args


def header(args, steps=True):
    device_type, capability, name = device_info(args.device)
    what = name or device_type
    if capability:
        what += f" sm{capability[0]}{capability[1]}"
    if device_type == "cpu":  # shared machines make CPU timings noisy: say how busy this one was
        what += f" ({torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    parts = [f"device: {what}", f"torch {torch.__version__}",
             f"model {args.model}, micro-batch {args.micro_batch_size} x seq {args.seq_len}"]
    if steps:
        parts.append(f"{args.warmup} warm-up + {args.steps} timed steps")
    parts.append(f"command: python bench.py {' '.join(sys.argv[1:])}")
    return " | ".join(parts)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()  # fail before the long run, not after
    device_type, capability, _ = device_info(args.device)
    if args.memory:
        print(header(args, steps=False))
        print("\n".join(memory_report(args.device, args.model, args.micro_batch_size, args.seq_len, args.loss_impl,
                                       args.activation_checkpointing, args.world_size, args.fsdp)))
        return
    if args.fit:
        print(f"largest micro-batch at seq_len {args.seq_len} within {1 - args.headroom:.0%} of the GPU's memory, "
              "computed by training_bytes_estimate (eager, vocab 50304; fp16 on the T4, bf16 elsewhere)\n")
        print("\n".join(fit_table(args.seq_len, args.headroom)))
        return
    if args.find_batch:
        from train_gpt2 import precision_plan
        plan = precision_plan(device_type, capability)
        settings = dict(BASELINE, attn="sdpa", vocab=50304, fused=device_type == "cuda", loss=args.loss_impl,
                        ckpt=args.activation_checkpointing)
        raw, _, optimizer = build(settings, args.model, args.seq_len, args.device, device_type)
        float32_matmul(plan.tf32)
        try:
            b, reason = auto_micro_batch(raw, optimizer, args.seq_len, args.total_batch_size, 1, args.device, plan,
                                         default=args.micro_batch_size, headroom=args.headroom)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"{header(args, steps=False)}\n{reason}")
        return
    print(header(args) + "\n")
    rows = run_ladder(args.device, args.model, args.micro_batch_size, args.seq_len, args.warmup, args.steps, args.compile)
    print(ladder_table(rows))
    if args.json:
        write_json(args.json, rows)
    if args.plot:
        plot_ladder(rows, args.plot, header(args).split(" | command")[0])


if __name__ == "__main__":
    main()
