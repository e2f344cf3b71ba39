"""
Speed and memory benchmarks for GPT-2 training steps.

    python bench.py                         # the speed ladder: 124M at seq 1024 on the GPU, one row per technique
    python bench.py --quick                 # a small config on CPU in well under a minute (the test suite's smoke run)
    python bench.py --json out.json --plot out.png
    python bench.py --memory                # where the memory goes: params, grads, optimizer, activations, allocator
    python bench.py --find_batch            # the largest fast micro-batch that fits (CUDA)

The ladder adds one technique per row, in this order: fp32 -> +TF32 -> +autocast (bf16, or fp16 with
a GradScaler on sm7x) -> +torch.compile -> +SDPA attention (vs the plain masked softmax) -> +vocab 50304
-> +fused AdamW. Rungs that cannot apply on the device are printed as skipped, with the reason.

The trainer uses memory_summary() (one line at the first step) and auto_micro_batch()
(micro_batch_size="auto"); search_micro_batch() is the pure search they share with --find_batch.
"""
import argparse
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
                sdpa_backends=(), vocab=50257, fused=False)


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
    config = GPTConfig(block_size=seq_len, vocab_size=settings["vocab"], attn_impl=settings["attn"], **SIZES[size])
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


def activation_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda"):
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
    lm_head for the full loss). The batch (idx, targets) is the caller's, not counted.
    Checked against saved_activation_bytes."""
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
    weights = 0 if a == 4 else 2 * ((L - n_ckpt) * 12 * C * C + (V * C if full else 0))  # c_attn 3CC + c_proj CC + c_fc 4CC + mlp c_proj 4CC
    return layers + head + weights, B * T * V * a if full else 0


def memory_summary(model, optimizer, device, micro_batch=None, seq_len=None, dtype=torch.float32):
    """One line for the trainer after its first step: parameter, gradient and optimizer-state bytes
    (from the tensors, so on every device), activations (an estimate when micro_batch and seq_len are
    given), and on CUDA what the allocator holds: allocated, reserved (cached on top) and the peaks."""
    device_type = torch.device(device).type
    params = list(model.parameters())
    grads = tensor_bytes(p.grad for p in params)
    if grads == 0:  # freed after the step (zero_grad(set_to_none=True)): what backward allocates again
        grads = sum(p.numel() * p.element_size() for p in {id(p): p for p in params if p.requires_grad}.values())
    parts = [f"params {fmt_bytes(tensor_bytes(params))}",
             f"grads {fmt_bytes(grads)}",
             f"optimizer state {fmt_bytes(tensor_bytes(optimizer_state_tensors(optimizer)))}"]
    if micro_batch and seq_len:
        act, logits = activation_bytes_estimate(unwrap(model).config, micro_batch, seq_len, dtype, device_type)
        parts.append(f"activations ~{fmt_bytes(act + logits)} (estimate, {micro_batch}x{seq_len})")
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


def memory_report(device, size, micro_batch, seq_len):
    """The --memory report, as lines of text."""
    from train_gpt2 import precision_plan
    device_type, capability, device_name = device_info(device)
    plan = precision_plan(device_type, capability)
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler, attn="sdpa",
                    sdpa_backends=plan.sdpa_backends, vocab=50304, fused=device_type == "cuda")
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[plan.dtype]
    lines = [f"memory of a training step: {size} at {micro_batch}x{seq_len}, {plan.describe()}, vocab 50304, "
             f"on {device_name or device_type}"]
    float32_matmul(settings["tf32"])
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    raw, model, optimizer = build(settings, size, seq_len, device, device_type)
    x, y = random_batch(micro_batch, seq_len, device)
    scaler = torch.amp.GradScaler(device_type) if settings["scaler"] else None
    with sdpa_context(settings["sdpa_backends"]):
        saved, logits = saved_activation_bytes(raw, x, y, device_type, plan.dtype)
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
              f"estimate {fmt_bytes(est_logits)}"]
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
    p.add_argument("--find_batch", action="store_true", help="micro-batch finder instead of the ladder")
    p.add_argument("--total_batch_size", type=int, default=DEFAULT_TOTAL_BATCH, help="tokens per optimizer step (--find_batch)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory to keep free (--find_batch)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    device_type = torch.device(args.device).type
    if device_type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    mode = "quick" if args.quick else ("cuda" if device_type == "cuda" else "cpu")
    size, b, t, warmup, steps = DEFAULTS[mode]
    for name, default in (("model", size), ("micro_batch_size", b), ("seq_len", t), ("warmup", warmup), ("steps", steps)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("micro_batch_size", "seq_len", "steps"):
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
        print("\n".join(memory_report(args.device, args.model, args.micro_batch_size, args.seq_len)))
        return
    if args.find_batch:
        from train_gpt2 import precision_plan
        plan = precision_plan(device_type, capability)
        settings = dict(BASELINE, attn="sdpa", vocab=50304, fused=device_type == "cuda")
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
