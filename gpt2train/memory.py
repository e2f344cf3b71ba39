"""
What a training step holds in memory, and the micro-batch that fits: estimated from the model's shape,
fitted to a GPU's memory, or probed on the GPU (micro_batch_size=auto).

    parts = training_bytes_estimate(model.config, 64, 1024, torch.bfloat16)      # {part: bytes}
    training_bytes_estimate(config, 64, 1024, activation_checkpointing="blocks")  # a run's settings: arguments
    B, T, reason, model = choose_micro_batch(raw_model, optimizers, plan, ...)    # the trainer's one call
    python bench.py --memory | --fit | --find_batch                               # the reports

Imports torch and gpt2train's loss, optim, precision, distributed and fileio only (never model.py).
"""
import dataclasses
import gc
import statistics
import time

import torch
from torch.distributed.tensor import DTensor

from gpt2train.distributed import agree
from gpt2train.fileio import UserError
from gpt2train.loss import CE_CHUNK_ROWS, full_head_bytes, loss_chunk_rows, loss_head_temp_bytes
from gpt2train.optim import train_step
from gpt2train.precision import compile_model, compiles, fsdp_param_dtype, is_oom, synchronize

# -----------------------------------------------------------------------------
# memory: what a training step holds, estimated from the model's shape


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


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


def optimizer_state_tensors(optimizers):
    return [v for opt in optimizers for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def checkpointed_layers(n_layer, activation_checkpointing):
    """How many blocks run under activation checkpointing (GPT.checkpointed says which)."""
    return {"none": 0, "blocks": n_layer, "every_other": (n_layer + 1) // 2}[activation_checkpointing]


def activation_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", fsdp=False,
                              activation_checkpointing="none", loss_impl="chunked", compiled=False):
    """Arithmetic estimate of what one forward of our GPT leaves alive for backward, in bytes, and the
    logits it returns. Per layer it saves, in the autocast dtype (a bytes/element):
    ln_1 and ln_2 outputs, qkv (3), attention output, c_fc output (4) and GELU output (4) = 14 BTC,
    plus the two residual-stream inputs of the layer norms in fp32 (2 BTC) and their mean/rstd;
    SDPA adds its logsumexp (B, nh, T); the masked softmax instead keeps the (B, nh, T, T) attention
    and the (T, T) mask; under CUDA autocast softmax runs in fp32 and att @ v keeps a second, bf16
    copy (6 bytes per element, more than fp32's 4), CPU autocast keeps one bf16 copy. A checkpointed
    layer keeps only its fp32 input (BTC). The head keeps ln_f's input and statistics and the position
    ids, and then either (loss_impl="full") lm_head's input, what cross-entropy keeps (loss.full_head_bytes:
    eager an fp32 (B, T, V) log-softmax, compiled a log-sum-exp per row) and the logits it returns, or
    (chunked) dL/dh (BTC, fp32), dL/dlm_head (V x C, fp32) and n_valid (fp32).
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
    n_ckpt = checkpointed_layers(L, activation_checkpointing)
    layers = (L - n_ckpt) * per_layer + n_ckpt * B * T * C * 4
    head = B * T * C * 4 + 2 * B * T * 4 + T * 8  # ln_f input, mean/rstd; position ids
    full = loss_impl == "full"
    # lm_head's input, what cross-entropy keeps, its total_weight | dL/dh, dL/dW, n_valid
    head += B * T * C * a + full_head_bytes(B * T, V, dtype, compiled)[0] + 4 if full else \
        B * T * C * 4 + V * C * 4 + 4
    # c_attn 3CC, c_proj CC, c_fc 4CC, mlp c_proj 4CC
    block_copies = 0 if fsdp and device_type == "cuda" else (L - n_ckpt) * 12 * C * C
    weights = 0 if a == 4 else 2 * (block_copies + (V * C if full else 0))
    return layers + head + weights, B * T * V * a if full else 0


def param_counts(config):
    """(all parameters, those of one block) of a GPT of this shape, the tied embedding once."""
    C = config.n_embd
    block = 12 * C * C + 13 * C  # c_attn 3CC+3C, c_proj CC+C, c_fc 4CC+4C, mlp c_proj 4CC+C, two layer norms 4C
    return config.vocab_size * C + config.block_size * C + config.n_layer * block + 2 * C, block


def training_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", world_size=1,
                            fsdp=False, optimizer="adamw", activation_checkpointing="none",
                            ce_chunk_rows=CE_CHUNK_ROWS, loss_impl="chunked", compiled=False):
    """Bytes one rank needs for a training step, by part (a dict), computed from the shapes for the
    eager model (torch.compile fuses some activations away). Meant to be safe for "does it fit": it
    counts all the gradients as alive together with all the activations and adds the largest
    temporary on top, which no single moment of a step holds. Parts: fp32 parameters, gradients
    and optimizer state (AdamW: two fp32 buffers per parameter; optimizer="muon": one for the
    blocks' matrices; divided by world_size under FSDP); DDP's gradient buckets (a second copy of the
    gradients, world_size > 1 without FSDP); under FSDP the gathered root (fp32, with its unsharded
    gradient) and two blocks in the compute dtype (the one running and the one prefetched) plus one
    block's unsharded gradient; activations and logits (activation_bytes_estimate); the largest
    temporary: the loss's (full: loss.full_head_bytes, compiled or not; chunked: one chunk of fp32 logits and
    a (V, C) product) or a block's in backward (its recomputed activations when checkpointed, and
    about 8 x B*T*C fp32 of gradients flowing through it). Gradients and activations do meet from
    the second micro-step of an accumulating step on. On CPU it lies 7-110% above the measured peak
    of forward + backward (step_peak_bytes, tests/test_bench.py). activation_checkpointing, ce_chunk_rows and
    loss_impl: the run's settings of the model (GPT.set_runtime); compiled: the model runs torch.compile'd."""
    n, block = param_counts(config)
    B, T, C, V, L = micro_batch, seq_len, config.n_embd, config.vocab_size, config.n_layer
    shard = world_size if fsdp else 1
    muon = L * 12 * C * C if optimizer == "muon" else 0  # the blocks' matrices (12CC a block): one buffer, not two
    parts = {"parameters": 4 * n // shard, "gradients": 4 * n // shard, "optimizer state": (8 * n - 4 * muon) // shard,
             "DDP buckets": 4 * n if world_size > 1 and not fsdp else 0}
    if fsdp:
        p = torch.finfo(fsdp_param_dtype(dtype, device_type)).bits // 8
        parts["FSDP gathered"] = 2 * 4 * (n - L * block) + 3 * p * block
    parts["activations"], parts["logits"] = activation_bytes_estimate(config, B, T, dtype, device_type, fsdp,
                                                                      activation_checkpointing, loss_impl, compiled)
    if loss_impl == "full":
        head = full_head_bytes(B * T, V, dtype, compiled)[1]
    else:
        head = loss_head_temp_bytes(B * T, V, C, ce_chunk_rows, dtype, device_type)
    per_layer = activation_bytes_estimate(dataclasses.replace(config, n_layer=1), B, T, dtype, device_type)[0] - \
        activation_bytes_estimate(dataclasses.replace(config, n_layer=0), B, T, dtype, device_type)[0]
    layer = (per_layer if checkpointed_layers(L, activation_checkpointing) else 0) + 8 * B * T * C * 4
    parts["largest temporary"] = max(head, layer)
    return parts


def estimated_micro_batch(config, seq_len, dtype, budget, device_type="cuda", world_size=1, fsdp=False, limit=4096,
                          optimizer="adamw", activation_checkpointing="none", ce_chunk_rows=CE_CHUNK_ROWS,
                          loss_impl="chunked"):
    """The largest micro-batch whose training_bytes_estimate fits in budget bytes (0 if none does); a full loss
    head counted compiled (the plans that fit a GPU's memory compile)."""
    def fits(b):
        parts = training_bytes_estimate(config, b, seq_len, dtype, device_type, world_size, fsdp, optimizer,
                                        activation_checkpointing, ce_chunk_rows, loss_impl, loss_impl == "full")
        return sum(parts.values()) <= budget
    lo, hi = 0, limit
    while lo < hi:  # the estimate grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def is_sharded(model):
    return any(isinstance(p, DTensor) for p in model.parameters())


def memory_summary(model, optimizers, device, micro_batch=None, seq_len=None, dtype=torch.float32, compiled=False):
    """One line for the trainer after its first step: parameter, gradient and optimizer-state bytes
    (from the tensors, so on every device; this rank's shards under FSDP), activations (an estimate
    for the model's loss and checkpointing modes when micro_batch and seq_len are given), and on
    CUDA what the allocator holds: allocated, reserved (cached on top) and the peaks."""
    device_type = torch.device(device).type
    params = list(model.parameters())
    sharded = is_sharded(model)
    grads = tensor_bytes(p.grad for p in params)
    if grads == 0:  # freed after the step (zero_grad(set_to_none=True)): what backward allocates again
        trained = {id(p): p for p in params if p.requires_grad}.values()  # a tied weight once
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trained]
        grads = sum(p.numel() * p.element_size() for p in local)
    parts = [f"params {fmt_bytes(tensor_bytes(params))}",
             f"grads {fmt_bytes(grads)}",
             f"optimizer state {fmt_bytes(tensor_bytes(optimizer_state_tensors(optimizers)))}"]
    if sharded:
        import torch.distributed as dist
        parts[0] = f"per rank (FSDP over {dist.get_world_size()}): " + parts[0]
    if micro_batch and seq_len:
        act, logits = activation_bytes_estimate(model.config, micro_batch, seq_len, dtype, device_type, sharded,
                                                model.activation_checkpointing, model.loss_impl, compiled)
        parts.append(f"activations ~{fmt_bytes(act + logits)} (estimate, {micro_batch}x{seq_len}, "
                     f"{model.loss_impl} loss, checkpointing {model.activation_checkpointing})")
    if device_type == "cuda":
        alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        parts.append(f"allocated {fmt_bytes(alloc)}, reserved {fmt_bytes(reserved)} "
                     f"(+{fmt_bytes(reserved - alloc)} cached), "
                     f"peak allocated {fmt_bytes(torch.cuda.max_memory_allocated(device))}, "
                     f"peak reserved {fmt_bytes(torch.cuda.max_memory_reserved(device))}")
    else:
        parts.append(f"allocator stats n/a on {device_type}")
    return "memory: " + ", ".join(parts)


# -----------------------------------------------------------------------------
# the micro-batch: fitted to a small GPU's memory (sm7x), or probed (micro_batch_size=auto)


def free_memory(device_type):
    """Give cached blocks back so that the next measurement starts clean."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def random_batch(micro_batch, seq_len, device, seed=1337):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)  # real token ids, never padding rows
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)  # (B, T), (B, T)


FIT_HEADROOM = 0.15  # of the GPU's memory, left out of the fit: the allocator's cache, CUDA's context
LOSS_CHUNK_SHARE = 0.05  # of the GPU's memory for one chunk of the loss head's logits (within FIT_HEADROOM)


def loss_chunk(plan, rows, vocab_size):
    """Rows of logits the chunked loss head computes at a time for rows = B*T, decided from the device at every
    start-up (never a checkpoint's: another GPU's): few large chunks where the GPU has the memory
    (LOSS_CHUNK_SHARE of it; fp16 capped at 1024 rows unless the GPU has the fp32-out matmul: loss.fp16_capped);
    elsewhere CE_CHUNK_ROWS (1024) (CPU: the numbers tests and the quickstart pin)."""
    if plan.device_type != "cuda" or not plan.memory:
        return CE_CHUNK_ROWS
    return loss_chunk_rows(rows, vocab_size, int(LOSS_CHUNK_SHARE * plan.memory), plan.dtype, plan.device)


def choose_loss_impl(model, plan, asked, micro_batch, seq_len, world_size=1, optimizer="adamw"):
    """(THE loss head of a run at this micro-batch, why: a line for the log): asked "full" or "chunked" is kept;
    "auto" is "full" (the logits inside the compiled graph: inductor's fused cross-entropy, the fastest head)
    where the plan compiles and the compiled full head's training_bytes_estimate fits the device (1 -
    FIT_HEADROOM of the GPU; the free RAM on CPU), else "chunked" (eager, in place: the memory fallback)."""
    if asked != "auto":
        return asked, ""
    if not plan.compile:
        return "chunked", "loss_impl=chunked: the plan does not compile (eager full logits keep ~4 more bytes a logit)"
    need = sum(training_bytes_estimate(model.config, micro_batch, seq_len, plan.dtype, plan.device_type, world_size,
                                       is_sharded(model), optimizer, model.activation_checkpointing,
                                       loss_impl="full", compiled=True).values())
    room = (1 - FIT_HEADROOM) * plan.memory if plan.device_type == "cuda" and plan.memory else available_ram()
    if room is None or need <= room:
        where = f" of {fmt_bytes(room)}" if room else ""
        return "full", f"loss_impl=full: the logits inside the compiled graph (~{fmt_bytes(need)} estimated{where})"
    return "chunked", (f"loss_impl=chunked: full logits at {micro_batch} x {seq_len} need ~{fmt_bytes(need)}, over "
                       f"{fmt_bytes(room)} (a smaller --micro_batch_size lets them fit)")


def set_loss_head(model, plan, micro_batch, seq_len, loss_impl):
    """The model's loss head and its chunk rows for this device and micro-batch, set before compile (both are in the
    compiled graph's guards: the finder times each size with what training will run, so no graph is built twice)."""
    model.set_runtime(ce_chunk_rows=loss_chunk(plan, micro_batch * seq_len, model.config.vocab_size),
                      loss_impl=loss_impl)


def training_bytes(config, micro_batch, seq_len, dtype, world_size=1, optimizer="adamw",
                   activation_checkpointing="none", ce_chunk_rows=CE_CHUNK_ROWS, loss_impl="chunked"):
    """training_bytes_estimate's total on CUDA (a full loss head counted compiled: the plans that fit compile)."""
    return sum(training_bytes_estimate(config, micro_batch, seq_len, dtype, "cuda", world_size, False, optimizer,
                                       activation_checkpointing, ce_chunk_rows, loss_impl,
                                       compiled=loss_impl == "full").values())


def fit_micro_batch(config, memory_bytes, seq_len, total_batch_size, world_size=1, dtype=torch.float16,
                    shrink_seq=True, headroom=FIT_HEADROOM, optimizer="adamw", plan=None,
                    activation_checkpointing="none", ce_chunk_rows=CE_CHUNK_ROWS, loss_impl="chunked"):
    """For GPUs that start small (sm7x: 8-32 GB): the largest micro-batch whose training step fits in
    memory_bytes by training_bytes_estimate (which counts the loss and checkpointing modes),
    within 1 - headroom, among those that keep total_batch_size by accumulation. The micro-batch
    shrinks first; seq_len is halved only when not even one sequence of it fits (and shrink_seq
    allows). plan: the device whose loss-chunk rows each candidate counts (loss_chunk); None: ce_chunk_rows.
    loss_impl: the head each candidate is weighed with (full: compiled). Returns (micro_batch, seq_len, reason)."""
    chunk = (lambda b, t: loss_chunk(plan, b * t, config.vocab_size)) if plan else lambda b, t: ce_chunk_rows  # noqa: E731
    need = lambda b, t: training_bytes(config, b, t, dtype, world_size, optimizer,  # noqa: E731
                                       activation_checkpointing, chunk(b, t), loss_impl)
    budget = (1 - headroom) * memory_bytes
    T = seq_len
    while True:
        rows = total_batch_size // (T * world_size) if total_batch_size % (T * world_size) == 0 else 0
        fitting = [b for b in range(1, rows + 1) if rows % b == 0 and need(b, T) <= budget]
        if fitting:
            b = max(fitting)
            how = f"seq_len {seq_len} -> {T}: not even 1 x {seq_len} fits, " if T != seq_len else ""
            return b, T, (f"micro-batch fitted to {fmt_bytes(memory_bytes)}: {how}{b} x {T} "
                          f"(~{fmt_bytes(need(b, T))} estimated, grad_accum {rows // b} keeps total_batch_size "
                          f"{total_batch_size})")
        if not shrink_seq or rows == 0 or T <= 64:
            break
        T //= 2
    fixed = training_bytes_estimate(config, 1, T, dtype, "cuda", world_size, optimizer=optimizer)  # no activations
    state = fixed["parameters"] + fixed["gradients"] + fixed["optimizer state"]
    raise UserError(f"a {param_counts(config)[0] / 1e6:.0f}M-parameter model does not fit in {fmt_bytes(memory_bytes)} "
                    f"at seq_len {T} with total_batch_size {total_batch_size} (estimate: "
                    f"{fmt_bytes(state)} of weights, gradients and AdamW state alone): use a smaller model, "
                    "activation_checkpointing=blocks, fsdp=true over several GPUs, or set micro_batch_size/seq_len "
                    "yourself")


def search_micro_batch(usage, measure, seq_len, total_batch_size, world_size=1, max_micro_batch=None,
                       headroom=0.1, n_timed=3):
    """Pick the micro-batch for a fixed total_batch_size (tokens per optimizer step).

    usage(b) -> peak memory of a step at micro-batch b as a fraction of the device's memory, or None
    when it ran out; it must grow with b. measure(b) -> tokens/s, or None when b ran out of memory or
    went over the limit while timed (the timed model may differ: compiled). Candidates divide the batch
    (total_batch_size = b * seq_len * world_size * grad_accum); multiples of 8 are preferred, powers
    of two are not required. The largest candidate using at most 1 - headroom of memory is found by
    bisection, it and the next n_timed-1 smaller ones are timed (and smaller ones after them while
    none could be timed), the fastest wins.
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
    speed = {}
    for b in reversed(pool[:k + 1]):  # the n_timed largest that fit, and on while none of them ran
        if len(speed) >= n_timed and any(v is not None for v in speed.values()):
            break
        speed[b] = measure(b)
    ran = {b: v for b, v in speed.items() if v is not None}
    tried = ", ".join(f"{b}: {speed[b]:,.0f} tok/s" if speed[b] is not None else
                      f"{b}: out of memory or over the {1 - headroom:.0%} limit" for b in speed)
    if not ran:
        raise ValueError(f"no micro-batch that fits could be timed ({tried}); shorten seq_len or use a smaller model")
    best = max(ran, key=ran.get)
    if k + 1 < len(pool):
        nxt = pool[k + 1]
        why = f"{nxt} " + ("runs out of memory" if used[nxt] is None else
                           f"uses {used[nxt]:.0%} of memory, over the {1 - headroom:.0%} limit")
    else:
        why = f"{pool[k]} is the largest that divides the batch"
        why += f" within max {max_micro_batch}" if max_micro_batch else ""
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


def probe_steps(model, optimizers, micro_batch, seq_len, device, plan, steps):
    """Run `steps` training steps (optim.train_step, the trainer's own) on random tokens with the
    learning rate at 0, so the weights stay as they were; the gradients and the optimizer state it
    created are dropped afterwards. Returns the median seconds per step."""
    device_type = torch.device(device).type
    scaler = torch.amp.GradScaler(device_type, enabled=plan.grad_scaler)  # fp16: skips steps on inf grads
    lrs = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    times = []
    try:
        x, y = random_batch(micro_batch, seq_len, device)
        for _ in range(steps):  # the second step is the steady state: optimizer state alive during backward
            synchronize(device)
            t0 = time.perf_counter()
            train_step(model, optimizers, scaler, x, y, plan, lr_scale=0.0)  # lr 0: no update, no weight decay
            synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        for opt, opt_lrs in zip(optimizers, lrs):
            for group, lr in zip(opt.param_groups, opt_lrs):
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            opt.state.clear()
    return statistics.median(times)


def micro_batch_cap(config, seq_len, dtype, budget, world_size=1, fsdp=False, slack=4,
                    activation_checkpointing="none", ce_chunk_rows=CE_CHUNK_ROWS, loss_impl="chunked"):
    """The finder probes no micro-batch above slack x the largest that training_bytes_estimate fits in
    budget: the estimate is on the safe side (the measured peak is lower; torch.compile lowers it
    more), so the probes skip sizes that would only run out of memory. Returns (cap, note)."""
    est = estimated_micro_batch(config, seq_len, dtype, budget, "cuda", world_size, fsdp,
                                activation_checkpointing=activation_checkpointing, ce_chunk_rows=ce_chunk_rows,
                                loss_impl=loss_impl)
    return slack * max(est, 1), (f"the estimate for {loss_impl} loss, checkpointing "
                                 f"{activation_checkpointing}{', FSDP' if fsdp else ''} fits {est}; "
                                 f"probed up to {slack * max(est, 1)}")


def auto_micro_batch(model, optimizers, seq_len, total_batch_size, world_size, device, plan, default,
                     max_micro_batch=None, headroom=0.1, warn=print, loss_impl="auto"):
    """micro_batch_size="auto": on CUDA, probe the raw model (before torch.compile and DDP) and its
    optimizers with OOM-guarded steps at lr 0 (weights untouched, grads and optimizer state freed,
    cache emptied after every probe) for the largest micro-batches that fit, then time those with the
    model compiled by the plan (compiled once, at the largest size timed): eager steps misjudge the
    compiled model's speed and memory. Every DDP rank probes the same sizes (peak use is the maximum
    over ranks, speed the minimum) and the result is the minimum over ranks.
    Each size runs the loss head training would run at it (choose_loss_impl from loss_impl, the asked one).
    Returns (micro_batch, reason, the model the sizes were timed with, or None when none was timed).
    On CPU/MPS returns (default, reason, None) without probing."""
    device_type = torch.device(device).type
    if device_type != "cuda":
        if total_batch_size % (default * seq_len * world_size):
            raise ValueError(f"total_batch_size {total_batch_size} is not divisible by micro_batch x seq_len x "
                             f"world_size = {default} x {seq_len} x {world_size}; change one of them")
        return default, (f"micro_batch_size=auto needs CUDA; on {device_type} using the default micro_batch {default} "
                         f"(grad_accum {total_batch_size // (default * seq_len * world_size)})"), None
    free_memory(device_type)
    capacity = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)  # free + what we hold
    if plan.memory:  # plan=smXY: no more than that card has
        capacity = min(capacity, plan.memory)
    rows = max(1, total_batch_size // (seq_len * world_size))
    widest = loss_chunk(plan, rows * seq_len, model.config.vocab_size)  # the device's largest chunk: a safe cap
    cap, note = micro_batch_cap(model.config, seq_len, plan.dtype, (1 - headroom) * capacity, world_size,
                                is_sharded(model), activation_checkpointing=model.activation_checkpointing,
                                ce_chunk_rows=widest, loss_impl="full" if loss_impl == "full" else "chunked")
    max_micro_batch = cap if max_micro_batch is None else min(max_micro_batch, cap)

    def peak(step_model, b, steps):
        """(peak memory as a fraction of capacity, seconds per step) of `steps` probe steps at b, both
        inf when it ran out of memory; the maximum use and the longest step over the ranks."""
        free_memory(device_type)
        torch.cuda.reset_peak_memory_stats(device)
        impl = choose_loss_impl(model, plan, loss_impl, b, seq_len, world_size)[0]
        set_loss_head(model, plan, b, seq_len, impl)  # as training will run b (step_model wraps model)
        try:
            seconds = probe_steps(step_model, optimizers, b, seq_len, device, plan, steps)
            used = torch.cuda.max_memory_reserved(device) / capacity
        except RuntimeError as e:
            if not is_oom(e):
                raise
            seconds = used = float("inf")
        free_memory(device_type)  # outside the except: the traceback no longer pins the step's tensors
        return agree(used, "max", device), agree(seconds, "max", device)

    def usage(b):
        used, _ = peak(model, b, steps=2)
        return None if used == float("inf") else used

    timed = []  # the model the sizes are timed with: compiled once, at the first (largest) size timed

    def measure(b):
        if not timed:
            compiled = compile_model(model, plan)
            ok = compiled is model or compiles(compiled, b, seq_len, plan, warn)
            timed.append(compiled if agree(float(ok), "min", device) == 1.0 else model)
        used, seconds = peak(timed[0], b, steps=4)
        return None if used > 1 - headroom else b * seq_len / seconds

    b, reason = search_micro_batch(usage, measure, seq_len, total_batch_size, world_size, max_micro_batch, headroom)
    reason += f"; timed {'eager' if not timed or timed[0] is model else 'compiled'} ({note})"
    agreed = int(agree(b, "min", device))
    if agreed != b:
        b, reason = agreed, f"micro_batch {agreed}: the minimum over DDP ranks (this rank: {reason})"
    return b, reason, timed[0] if timed else None


def choose_micro_batch(model, optimizers, plan, micro_batch, seq_len, total_batch_size, world_size=1, fit=True,
                       shrink_seq=True, optimizer="adamw", warn=print, default=64, divide=None, loss_impl="auto"):
    """THE micro-batch (and on small GPUs the sequence length) of a run, decided once the model and its
    optimizers exist and before DDP wraps them: micro_batch="auto" probes the GPU (auto_micro_batch; off
    CUDA it takes default, the config's); otherwise,
    where the user did not set the micro-batch (fit), a CUDA plan fits it to memory by the estimate: the
    sm7x plans always (plan.fit_to_memory), the others when the configured one does not fit; seq_len is
    shortened only where not even 1 x seq_len fits and shrink_seq allows. Every size is weighed with the
    device's loss-chunk rows (loss_chunk), never the model's own (a checkpoint's: another GPU's), and the chunked
    head unless loss_impl (the asked one) is "full" (then choose_loss_impl picks the head at B). One that does
    not divide total_batch_size over the ranks becomes the largest that does where divide (default: fit; a
    config file's micro-batch, not the command line's). Returns (B, T, why: a line for the log or "", the model
    the finder timed (compiled) or None)."""
    timed, config, mode = None, model.config, model.activation_checkpointing
    head = "full" if loss_impl == "full" else "chunked"  # auto: sizes as chunked, full where it fits at the size
    if micro_batch == "auto":
        try:
            micro_batch, why, timed = auto_micro_batch(model, optimizers, seq_len, total_batch_size, world_size,
                                                       plan.device, plan, default=default, warn=warn,
                                                       loss_impl=loss_impl)
        except ValueError as e:
            raise UserError(f"micro_batch_size=auto: {e}") from None
    elif fit and plan.device_type == "cuda" and (plan.fit_to_memory or training_bytes(
            config, micro_batch, seq_len, plan.dtype, world_size, optimizer, mode,
            loss_chunk(plan, micro_batch * seq_len, config.vocab_size), head) > (1 - FIT_HEADROOM) * plan.memory):
        micro_batch, seq_len, why = fit_micro_batch(config, plan.memory, seq_len, total_batch_size, world_size,
                                                    plan.dtype, shrink_seq, optimizer=optimizer, plan=plan,
                                                    activation_checkpointing=mode, loss_impl=head)
        why += " (set micro_batch_size/seq_len to choose yourself)"
    else:
        why = ""
    tokens = micro_batch * seq_len * world_size
    keeps = dividing_micro_batch(micro_batch, seq_len, total_batch_size, world_size)  # same tokens per step
    if total_batch_size % tokens and (fit if divide is None else divide) and keeps:
        why = (f"micro_batch_size={keeps}: the largest up to {micro_batch} whose {keeps} x {seq_len} x {world_size} "
               f"rank(s) divides total_batch_size={total_batch_size} (set micro_batch_size to choose yourself)")
        micro_batch = keeps
    elif total_batch_size % tokens:
        other = max(1, round(total_batch_size / tokens)) * tokens
        fix = (f"--micro_batch_size={keeps} keeps {total_batch_size:,} tokens per step (or --total_batch_size="
               f"{other} makes it {other:,})" if keeps else f"e.g. --total_batch_size={other}")
        raise UserError(f"total_batch_size={total_batch_size} is not a multiple of micro_batch_size x seq_len x "
                        f"world_size = {micro_batch} x {seq_len} x {world_size} = {tokens}: {fix}")
    if plan.device_type == "cpu":
        micro_batch, why = fit_cpu_ram(config, micro_batch, seq_len, total_batch_size, world_size, plan.dtype,
                                       fit, optimizer, warn, mode) or (micro_batch, why)
    return micro_batch, seq_len, why, timed


def available_ram():
    """Bytes of RAM free for a new process (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def fit_cpu_ram(config, micro_batch, seq_len, total_batch_size, world_size, dtype, fit, optimizer, warn,
                activation_checkpointing="none"):
    """On CPU, before the first step: a micro-batch whose step needs more than the free RAM by the estimate
    (the kernel's OOM killer would end the run without a word) is lowered to the largest that fits and keeps
    total_batch_size where the user left it to its default (fit), else warned about with the one that fits.
    Returns (micro_batch, why) when it lowered it, else None."""
    ram = available_ram()
    need = lambda b: sum(training_bytes_estimate(config, b, seq_len, dtype, "cpu", world_size,  # noqa: E731
                                                 optimizer=optimizer, activation_checkpointing=activation_checkpointing
                                                 ).values()) * world_size  # ranks share the RAM
    if ram is None or need(micro_batch) <= ram:
        return None
    rows = total_batch_size // (seq_len * world_size)
    fitting = [b for b in range(1, micro_batch) if rows % b == 0 and need(b) <= ram]
    said = f"{micro_batch} x {seq_len} needs ~{fmt_bytes(need(micro_batch))} of RAM by the estimate, " \
           f"{fmt_bytes(ram)} is free"
    if not fitting:
        warn(f"warning: micro-batch {said}, and not even 1 x {seq_len} fits: the run may be killed for memory; use "
             "a smaller model or seq_len, or --activation_checkpointing=blocks")
        return None
    b = max(fitting)
    how = f"{b} x {seq_len} (~{fmt_bytes(need(b))}, grad_accum {rows // b} keeps total_batch_size {total_batch_size})"
    if fit:
        return b, f"micro-batch fitted to the free RAM: {said}; {how} (set micro_batch_size to choose yourself)"
    warn(f"warning: micro-batch {said}: the run may be killed for memory; --micro_batch_size={b} fits: {how}")
    return None


def dividing_micro_batch(micro_batch, seq_len, total_batch_size, world_size):
    """The largest micro-batch up to micro_batch whose rows over world_size ranks divide total_batch_size
    (the tokens per step kept, by accumulation), or None when no micro-batch does."""
    if total_batch_size % (seq_len * world_size):
        return None
    rows = total_batch_size // (seq_len * world_size)  # rows per rank per optimizer step
    return max(b for b in range(1, min(micro_batch, rows) + 1) if rows % b == 0)


def out_of_memory_message(e, device_type=None, B=None, T=None, grad_accum=None):
    """One line for a run that ran out of memory (e): what ran out, at which micro-batch, and what to try.
    device_type None: before the run was set up (the model and its optimizer state)."""
    cpu = device_type in ("cpu", "mps") or device_type is None and not isinstance(e, torch.OutOfMemoryError)
    what = "CPU RAM" if cpu else "GPU memory"
    if B is None:
        return (f"out of {what} while setting up (the model and its optimizer state): use a smaller model, fsdp=true "
                "under torchrun, or a device with more memory")
    auto = "" if cpu else "--micro_batch_size=auto, "  # (on CPU auto keeps the micro-batch it was given)
    smaller = max((b for b in range(1, B) if (B * grad_accum) % b == 0), default=None)  # keeps the step's rows
    eg = f" (e.g. {smaller}" if smaller else " ("
    return (f"out of {what} at micro-batch {B} x {T} (grad_accum {grad_accum}): try {auto}a smaller "
            f"--micro_batch_size{eg}{'; ' if smaller else ''}total_batch_size stays, by more accumulation steps) or "
            "--activation_checkpointing=blocks")
