"""
What a training step holds in memory, and the micro-batch that fits: estimated from one frozen Step
(the step's shape), fitted to a GPU's memory or the free RAM, or probed (micro_batch_size=auto).
How the estimate counts: docs/benchmarks.md#how-the-estimate-counts; reports: bench.py --memory.

    step = Step(model.config, seq_len=1024, dtype=torch.bfloat16)  # the shape, built once
    parts = training_bytes_estimate(step, 64)  # {part: bytes} at micro-batch 64
    B, T, why, model = choose_micro_batch(raw_model, optimizers, plan, step, asked)  # the trainer's
"""
import dataclasses
import functools
import os
import statistics
import time
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from gpt2train.config import Config
from gpt2train.distributed import agree
from gpt2train.fileio import UserError
from gpt2train.logger import print0, warn0
from gpt2train.loss import (CE_CHUNK_ROWS, full_head_bytes, fused_head_bytes, fused_probe,
                            loss_chunk_rows, loss_head_temp_bytes)
from gpt2train.optim import train_step
from gpt2train.precision import (ALLOC_CONF, available_ram, compile_model, compiles, free_memory,
                                 fsdp_param_dtype, is_oom, synchronize)


@dataclasses.dataclass(frozen=True)
class Step:
    """The shape of one rank's training step but the micro-batch: built once in setup, passed
    whole (variants: dataclasses.replace)."""
    config: object  # GPTConfig: the model's shape
    seq_len: int = 1024
    total_batch_size: int = 524288  # tokens per optimizer step, over all ranks
    world_size: int = 1
    dtype: torch.dtype = torch.float32  # the autocast dtype (fp32: none)
    device_type: str = "cuda"
    optimizer: str = "adamw"  # muon: one state buffer for the blocks' matrices, not two
    activation_checkpointing: str = "none"  # none | blocks | every_other
    fsdp: bool = False  # the parameters, gradients and optimizer state sharded over world_size
    # full | chunked | fused (one logits-sized buffer, in place); "auto" is weighed chunked
    # (choose_loss_impl decides)
    loss_impl: str = "chunked"
    compiled: bool = False  # the model runs torch.compile'd (a compiled full head keeps less)
    ce_chunk_rows: int = CE_CHUNK_ROWS  # the chunked head's rows a chunk
    # what setup leaves to choose_micro_batch (the user's settings are kept)
    fit: bool = True  # micro-batch not set: fitted to the GPU's memory or the free RAM
    divide: bool = True  # one not dividing total_batch_size over the ranks: the largest that does
    shrink_seq: bool = True  # seq_len not set: halved where not even one row fits

    @property
    def rows(self):
        """Rows per rank per optimizer step (micro-batch x grad_accum), 0 where not dividing."""
        per_row = self.seq_len * self.world_size
        return 0 if self.total_batch_size % per_row else self.total_batch_size // per_row


DEFAULT_MICRO_BATCH = Config.micro_batch_size  # micro_batch_size=auto off CUDA

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
    """Bytes of distinct storages (a tied weight counts once); of a DTensor, this rank's shard."""
    seen = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizers):
    states = [state for opt in optimizers for state in opt.state.values()]
    return [v for state in states for v in state.values() if torch.is_tensor(v)]


def checkpointed_layers(n_layer, activation_checkpointing):
    """How many blocks run under activation checkpointing (GPT.checkpointed says which)."""
    counts = {"none": 0, "blocks": n_layer, "every_other": (n_layer + 1) // 2}
    return counts[activation_checkpointing]


def activation_bytes_estimate(step, micro_batch):
    """(bytes one forward leaves alive for backward, bytes of the logits it returns), by arithmetic
    from the shapes (autograd's saved tensors exactly; the batch is the caller's). The fused head
    returns none: its one logits-sized buffer (dL/dlogits) is saved, an activation."""
    config, a = step.config, 4 if step.dtype == torch.float32 else 2
    B, T, C, L = micro_batch, step.seq_len, config.n_embd, config.n_layer
    nh, V = config.n_head, config.vocab_size
    per_layer = 14 * B * T * C * a + 2 * B * T * C * 4 + 2 * 2 * B * T * 4
    if config.attn_impl == "sdpa":
        per_layer += B * nh * T * 4
    else:
        score = 4  # bytes a (B, nh, T, T) element keeps
        if a != 4:
            score = 6 if step.device_type == "cuda" else 2
        per_layer += B * nh * T * T * score + T * T
    n_ckpt = checkpointed_layers(L, step.activation_checkpointing)
    layers = (L - n_ckpt) * per_layer + n_ckpt * B * T * C * 4
    head = B * T * C * 4 + 2 * B * T * 4 + T * 8  # ln_f input, mean/rstd; position ids
    full = step.loss_impl in ("full", "fused")  # lm_head's input and weight in the compute dtype
    if step.loss_impl == "full":  # lm_head's input, what cross-entropy keeps, its total_weight
        head += B * T * C * a + full_head_bytes(B * T, V, step.dtype, step.compiled)[0] + 4
    elif step.loss_impl == "fused":  # lm_head's input, the one (N, V) buffer, n_valid (int64)
        head += B * T * C * a + fused_head_bytes(B * T, V, C, step.dtype)[0] + 8
    else:  # dL/dh, dL/dW, n_valid
        head += B * T * C * 4 + V * C * 4 + 4
    # c_attn 3CC, c_proj CC, c_fc 4CC, mlp c_proj 4CC
    block_copies = 0 if step.fsdp and step.device_type == "cuda" else (L - n_ckpt) * 12 * C * C
    weights = 0 if a == 4 else 2 * (block_copies + (V * C if full else 0))
    return layers + head + weights, B * T * V * a if step.loss_impl == "full" else 0


def param_counts(config):
    """(all parameters, those of one block) of a GPT of this shape, the tied embedding once."""
    C = config.n_embd
    # c_attn 3CC+3C, c_proj CC+C, c_fc 4CC+4C, mlp c_proj 4CC+C, two layer norms 4C
    block = 12 * C * C + 13 * C
    return config.vocab_size * C + config.block_size * C + config.n_layer * block + 2 * C, block


def training_bytes_estimate(step, micro_batch):
    """Bytes one rank needs for a training step at this micro-batch, by part (a dict), for the
    eager model (a full head as compiled where step.compiled): on the safe side for "does it fit"
    (docs/benchmarks.md)."""
    config, B, T = step.config, micro_batch, step.seq_len
    n, block = param_counts(config)
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    shard = step.world_size if step.fsdp else 1
    muon = L * 12 * C * C if step.optimizer == "muon" else 0  # the blocks' matrices: one buffer
    parts = {"parameters": 4 * n // shard, "gradients": 4 * n // shard,
             "optimizer state": (8 * n - 4 * muon) // shard,
             "DDP buckets": 4 * n if step.world_size > 1 and not step.fsdp else 0}
    if step.fsdp:
        p = torch.finfo(fsdp_param_dtype(step.dtype, step.device_type)).bits // 8
        parts["FSDP gathered"] = 2 * 4 * (n - L * block) + 3 * p * block
    parts["activations"], parts["logits"] = activation_bytes_estimate(step, B)
    if step.loss_impl == "full":
        head = full_head_bytes(B * T, V, step.dtype, step.compiled)[1]
    elif step.loss_impl == "fused":  # no second logits-sized tensor
        head = fused_head_bytes(B * T, V, C, step.dtype)[1]
    else:
        head = loss_head_temp_bytes(B * T, V, C, step.ce_chunk_rows, step.dtype, step.device_type)
    bare = replace(step, fsdp=False, activation_checkpointing="none", loss_impl="chunked",
                   compiled=False)
    one, zero = (replace(bare, config=replace(config, n_layer=k)) for k in (1, 0))
    per_layer = activation_bytes_estimate(one, B)[0] - activation_bytes_estimate(zero, B)[0]
    layer = per_layer if checkpointed_layers(L, step.activation_checkpointing) else 0
    parts["largest temporary"] = max(head, layer + 8 * B * T * C * 4)
    return parts


def training_bytes(step, micro_batch):
    """training_bytes_estimate's total on CUDA without FSDP."""
    cuda = replace(step, device_type="cuda", fsdp=False)
    return sum(training_bytes_estimate(cuda, micro_batch).values())


def estimated_micro_batch(step, budget, limit=4096):
    """The largest micro-batch whose training_bytes_estimate fits in budget bytes (0: none)."""
    lo, hi = 0, limit
    while lo < hi:  # the estimate grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        fits = sum(training_bytes_estimate(step, mid).values()) <= budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def memory_summary(model, optimizers, plan, micro_batch=None, seq_len=None):
    """One line after the first step: parameter, gradient and optimizer-state bytes (this rank's
    under FSDP), activations (estimated, given micro_batch and seq_len), CUDA's allocator stats."""
    device, device_type = plan.device, plan.device_type
    params = list(model.parameters())
    sharded = any(isinstance(p, DTensor) for p in params)
    grads = tensor_bytes(p.grad for p in params)
    if grads == 0:  # freed after the step (set_to_none): what backward allocates again
        trained = {id(p): p for p in params if p.requires_grad}.values()  # a tied weight once
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trained]
        grads = sum(p.numel() * p.element_size() for p in local)
    state = tensor_bytes(optimizer_state_tensors(optimizers))
    parts = [f"params {fmt_bytes(tensor_bytes(params))}", f"grads {fmt_bytes(grads)}",
             f"optimizer state {fmt_bytes(state)}"]
    if sharded:
        import torch.distributed as dist
        parts[0] = f"per rank (FSDP over {dist.get_world_size()}): " + parts[0]
    if micro_batch and seq_len:
        ckpt, loss_impl = model.activation_checkpointing, model.loss_impl
        step = Step(model.config, seq_len, dtype=plan.dtype, device_type=device_type, fsdp=sharded,
                    activation_checkpointing=ckpt, loss_impl=loss_impl, compiled=plan.compile)
        act, logits = activation_bytes_estimate(step, micro_batch)
        parts.append(f"activations ~{fmt_bytes(act + logits)} of which logits ~{fmt_bytes(logits)} "
                     f"(estimate, {micro_batch}x{seq_len}, {loss_impl} loss, checkpointing {ckpt})")
    if device_type == "cuda":
        parts.append(allocator_line(device, tensor_bytes(params) + grads + state))
    else:
        parts.append(f"allocator stats n/a on {device_type}")
    return "memory: " + ", ".join(parts)


def allocator_line(device, held):
    """What CUDA's allocator holds: now and at its peak, the peak's share beyond `held` (the
    parameters, gradients and optimizer state: the step's activations, logits and temporaries) and
    its slack (reserved beyond allocated at the peak), with the allocator's settings."""
    alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    peak, peak_reserved = (torch.cuda.max_memory_allocated(device),
                           torch.cuda.max_memory_reserved(device))
    conf = os.environ.get(ALLOC_CONF, "")
    return (f"allocated {fmt_bytes(alloc)}, reserved {fmt_bytes(reserved)} "
            f"(+{fmt_bytes(reserved - alloc)} cached), peak allocated {fmt_bytes(peak)} "
            f"(the step's own {fmt_bytes(peak - held)}), peak reserved {fmt_bytes(peak_reserved)} "
            f"(slack {fmt_bytes(peak_reserved - peak)}), allocator {conf or 'default'}")


# -----------------------------------------------------------------------------
# the micro-batch: fitted to a small GPU's memory (sm7x), or probed (micro_batch_size=auto)


def random_batch(micro_batch, seq_len, device, seed=1337):
    g = torch.Generator().manual_seed(seed)
    # real token ids, never padding rows
    x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)  # (B, T), (B, T)


FIT_HEADROOM = 0.15  # of the GPU's memory left out of the fit: allocator cache, CUDA context
LOSS_CHUNK_SHARE = 0.05  # of the GPU's memory for one chunk of the loss head's logits


def loss_chunk(plan, rows, vocab_size):
    """Rows a chunk of the chunked head for rows = B*T: LOSS_CHUNK_SHARE of a CUDA GPU's memory
    (loss.loss_chunk_rows), else CE_CHUNK_ROWS; the device's, never a checkpoint's."""
    if plan.device_type != "cuda" or not plan.memory:
        return CE_CHUNK_ROWS
    return loss_chunk_rows(rows, vocab_size, int(LOSS_CHUNK_SHARE * plan.memory), plan.dtype,
                           plan.device)


FUSED_MIN_CAPABILITY = (7, 0)  # Triton's oldest GPU generation


@functools.cache
def fused_runs(device, dtype):
    """Whether the fused head passes its start-up probe (loss.fused_probe) on this CUDA device and
    dtype; where it fails, one warning line, once a process."""
    why = fused_probe(device, dtype)
    if why:
        warn0(f"loss_impl=auto: the fused loss head is off here, {why}; the full or chunked head "
              "runs instead")
    return not why


def choose_loss_impl(plan, step, micro_batch):
    """(the loss head at this micro-batch, why): step.loss_impl full/chunked is kept, fused too
    where it runs here (else UserError); auto is fused on CUDA where Triton runs its kernel (the
    start-up probe) and the logits fit (1 - FIT_HEADROOM of the GPU), else full where the plan
    compiles and the compiled full head fits (the free RAM on CPU), else chunked (eager, in
    place)."""
    if step.loss_impl == "fused":
        why = fused_probe(plan.device, plan.dtype)
        if why:
            raise UserError(f"loss_impl=fused: {why}; use loss_impl=full, chunked or auto")
        return "fused", "loss_impl=fused: one Triton pass over the logits, in place (as asked)"
    if step.loss_impl != "auto":
        return step.loss_impl, f"loss_impl={step.loss_impl} (as asked)"
    on_gpu = plan.device_type == "cuda" and plan.memory
    if on_gpu and (plan.capability or (0,)) >= FUSED_MIN_CAPABILITY and fused_runs(plan.device,
                                                                                  plan.dtype):
        fused = replace(step, loss_impl="fused", compiled=plan.compile)
        need = sum(training_bytes_estimate(fused, micro_batch).values())
        if need <= (1 - FIT_HEADROOM) * plan.memory:
            return "fused", (f"loss_impl=fused: one Triton pass over the logits, in place "
                             f"(~{fmt_bytes(need)} estimated of {fmt_bytes(plan.memory)})")
    if not plan.compile:
        return "chunked", ("loss_impl=chunked: the plan does not compile (eager full logits keep "
                           "~4 more bytes a logit)")
    full = replace(step, loss_impl="full", compiled=True)
    need = sum(training_bytes_estimate(full, micro_batch).values())
    room = (1 - FIT_HEADROOM) * plan.memory if on_gpu else available_ram()
    if room is None or need <= room:
        where = f" of {fmt_bytes(room)}" if room else ""
        return "full", (f"loss_impl=full: the logits inside the compiled graph "
                        f"(~{fmt_bytes(need)} estimated{where})")
    return "chunked", (f"loss_impl=chunked: full logits at {micro_batch} x {step.seq_len} need "
                       f"~{fmt_bytes(need)}, over {fmt_bytes(room)} (a smaller --micro_batch_size "
                       "lets them fit)")


def set_loss_head(model, plan, micro_batch, seq_len, loss_impl):
    """Set the model's loss head and its chunk rows for this device and micro-batch, before compile
    (both are in the compiled graph's guards: the finder times each size as training runs it)."""
    rows = loss_chunk(plan, micro_batch * seq_len, model.config.vocab_size)
    model.set_runtime(ce_chunk_rows=rows, loss_impl=loss_impl)


def use_loss_head(model, plan, step, micro_batch):
    """THE loss head at this micro-batch, chosen (choose_loss_impl) and set (set_loss_head): what
    the trainer, bench's rungs and the micro-batch finder all run. Returns (loss_impl, why)."""
    loss_impl, why = choose_loss_impl(plan, step, micro_batch)
    set_loss_head(model, plan, micro_batch, step.seq_len, loss_impl)
    return loss_impl, why


def fit_micro_batch(step, memory_bytes, plan=None, headroom=FIT_HEADROOM):
    """(micro_batch, seq_len, reason) for small GPUs (sm7x): the largest micro-batch that keeps
    total_batch_size and fits 1 - headroom of memory_bytes; seq_len halved where step.shrink_seq
    and not even one row fits."""
    def need(b, t):
        rows = loss_chunk(plan, b * t, step.config.vocab_size) if plan else step.ce_chunk_rows
        return training_bytes(replace(step, seq_len=t, ce_chunk_rows=rows), b)
    budget, T, total = (1 - headroom) * memory_bytes, step.seq_len, step.total_batch_size
    while True:
        rows = replace(step, seq_len=T).rows
        fitting = [b for b in range(1, rows + 1) if rows % b == 0 and need(b, T) <= budget]
        if fitting:
            b = max(fitting)
            how = ""
            if T != step.seq_len:
                how = f"seq_len {step.seq_len} -> {T}: not even 1 x {step.seq_len} fits, "
            return b, T, (f"micro-batch fitted to {fmt_bytes(memory_bytes)}: {how}{b} x {T} "
                          f"(~{fmt_bytes(need(b, T))} estimated, grad_accum {rows // b} keeps "
                          f"total_batch_size {total})")
        if not step.shrink_seq or rows == 0 or T <= 64:
            break
        T //= 2
    fixed = training_bytes_estimate(Step(step.config, T, dtype=step.dtype,
                                         world_size=step.world_size, optimizer=step.optimizer), 1)
    state = fixed["parameters"] + fixed["gradients"] + fixed["optimizer state"]
    raise UserError(f"a {param_counts(step.config)[0] / 1e6:.0f}M-parameter model does not fit in "
                    f"{fmt_bytes(memory_bytes)} at seq_len {T} with total_batch_size {total} "
                    f"(estimate: {fmt_bytes(state)} of weights, gradients and AdamW state alone): "
                    "use a smaller model, activation_checkpointing=blocks, fsdp=true over several "
                    "GPUs, or set micro_batch_size/seq_len yourself")


N_TIMED = 3  # the finder times the largest sizes that fit, this many


def search_micro_batch(usage, measure, step, max_micro_batch=None, headroom=0.1):
    """(the micro-batch for step.total_batch_size, reason): the fastest of the N_TIMED largest that
    fit. usage(b): peak memory at b as a fraction of the device's (None: ran out); measure(b):
    tokens/s (None: ran out or over the limit). ValueError where none keeps the total or fits."""
    rows, total, per_row = step.rows, step.total_batch_size, step.seq_len * step.world_size
    if total % per_row:
        raise ValueError(f"total_batch_size {total} is not divisible by seq_len x world_size = "
                         f"{per_row}: no micro-batch keeps it; use a multiple of {per_row}")
    limit = rows if max_micro_batch is None else min(rows, max_micro_batch)
    divisors = [b for b in range(1, limit + 1) if rows % b == 0]
    used = {}

    def fits(b):
        if b not in used:
            used[b] = usage(b)
        return used[b] is not None and used[b] <= 1 - headroom

    pool, note = [b for b in divisors if b % 8 == 0], ""
    k = largest_fitting(pool, fits)
    if k is None:
        pool, note = [b for b in divisors if b % 8], "; no multiple of 8 fits"
        k = largest_fitting(pool, fits)
    if k is None:
        raise ValueError(f"no micro-batch fits in {1 - headroom:.0%} of memory at seq_len "
                         f"{step.seq_len} (tried {sorted(used)}); shorten seq_len or use a smaller "
                         "model")
    speed = {}
    for b in reversed(pool[:k + 1]):  # the N_TIMED largest that fit, and on while none of them ran
        if len(speed) >= N_TIMED and any(v is not None for v in speed.values()):
            break
        speed[b] = measure(b)
    ran = {b: v for b, v in speed.items() if v is not None}
    over = f"out of memory or over the {1 - headroom:.0%} limit"
    tried = ", ".join(f"{b}: {v:,.0f} tok/s" if v is not None else f"{b}: {over}"
                      for b, v in speed.items())
    if not ran:
        raise ValueError(f"no micro-batch that fits could be timed ({tried}); shorten seq_len or "
                         "use a smaller model")
    best = max(ran, key=ran.get)
    if k + 1 < len(pool):
        nxt = pool[k + 1]
        why = f"{nxt} runs out of memory"
        if used[nxt] is not None:
            why = f"{nxt} uses {used[nxt]:.0%} of memory, over the {1 - headroom:.0%} limit"
    else:
        why = f"{pool[k]} is the largest that divides the batch"
        why += f" within max {max_micro_batch}" if max_micro_batch else ""
    reason = (f"micro_batch {best}: fastest of the largest that fit ({tried}); {why}{note}; "
              f"grad_accum {rows // best} keeps total_batch_size {total}")
    return best, reason


def largest_fitting(pool, fits):
    """Index of the largest b in the ascending pool with fits(b), fits being monotone; or None."""
    lo, hi, best = 0, len(pool) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(pool[mid]):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def probe_steps(model, optimizers, micro_batch, seq_len, plan, steps):
    """Median seconds of `steps` training steps (optim.train_step) on random tokens at lr 0: the
    weights stay, the gradients and optimizer state are dropped after."""
    device = plan.device
    # fp16: skips steps on inf grads
    scaler = torch.amp.GradScaler(plan.device_type, enabled=plan.grad_scaler)
    lrs = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    times = []
    try:
        x, y = random_batch(micro_batch, seq_len, device)
        for _ in range(steps):  # the second step is the steady state: optimizer state alive
            synchronize(device)
            t0 = time.perf_counter()
            # lr 0: no update, no weight decay
            train_step(model, optimizers, scaler, x, y, plan, lr_scale=0.0)
            synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        for opt, opt_lrs in zip(optimizers, lrs):
            for group, lr in zip(opt.param_groups, opt_lrs):
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            opt.state.clear()
    return statistics.median(times)


def micro_batch_cap(step, budget, slack=4):
    """(cap, note): slack x the largest micro-batch the estimate fits in budget on CUDA, the
    finder's limit (the estimate is on the safe side: probes above it would only run out)."""
    est = estimated_micro_batch(replace(step, device_type="cuda"), budget)
    cap, fsdp = slack * max(est, 1), ", FSDP" if step.fsdp else ""
    return cap, (f"the estimate for {step.loss_impl} loss, checkpointing "
                 f"{step.activation_checkpointing}{fsdp} fits {est}; probed up to {cap}")


def auto_micro_batch(model, optimizers, plan, step, headroom=0.1, compile_line=""):
    """micro_batch_size=auto: (micro_batch, reason, the model the sizes were timed with or None),
    probed on CUDA (the fastest of the largest that fit, minimum over ranks), else the default.
    compile_line: said before the compile (precision.compile_note), or "" (bench: nothing)."""
    T, world, total = step.seq_len, step.world_size, step.total_batch_size
    if plan.device_type != "cuda":
        b = DEFAULT_MICRO_BATCH
        if total % (b * T * world):
            raise ValueError(f"total_batch_size {total} is not divisible by micro_batch x seq_len "
                             f"x world_size = {b} x {T} x {world}; change one of them")
        return b, (f"micro_batch_size=auto needs CUDA; on {plan.device_type} using the default "
                   f"micro_batch {b} (grad_accum {total // (b * T * world)})"), None
    free_memory("cuda")
    # free + held
    capacity = torch.cuda.mem_get_info(plan.device)[0] + torch.cuda.memory_reserved(plan.device)
    if plan.memory:  # plan=smXY: no more than that card has
        capacity = min(capacity, plan.memory)
    # the largest chunk: a safe cap
    widest = loss_chunk(plan, max(1, step.rows) * T, step.config.vocab_size)
    head = step.loss_impl if step.loss_impl in ("full", "fused") else "chunked"
    cap, note = micro_batch_cap(replace(step, ce_chunk_rows=widest, loss_impl=head),
                                (1 - headroom) * capacity)

    def peak(step_model, b, steps):
        """(peak memory as a fraction of capacity, seconds per step) of `steps` probe steps at b,
        both inf when it ran out of memory; the maximum over the ranks."""
        free_memory("cuda")
        torch.cuda.reset_peak_memory_stats(plan.device)
        use_loss_head(model, plan, step, b)  # as training runs b
        try:
            seconds = probe_steps(step_model, optimizers, b, T, plan, steps)
            used = torch.cuda.max_memory_reserved(plan.device) / capacity
        except RuntimeError as e:
            if not is_oom(e):
                raise
            seconds = used = float("inf")
        free_memory("cuda")  # outside the except: the traceback no longer pins the step's tensors
        return agree(used, "max", plan.device), agree(seconds, "max", plan.device)

    def usage(b):
        used, _ = peak(model, b, steps=2)
        return None if used == float("inf") else used

    timed = []  # the model the sizes are timed with: compiled once, at the first (largest) size

    def measure(b):
        if not timed:  # the default mode: CUDA graphs' pools would stay from size to size
            if compile_line and plan.compile:  # the run's first compile: a minute of silence else
                print0(compile_line)
            compiled = compile_model(model, replace(plan, compile_mode="default", cudagraphs=False))
            ok = compiled is model or compiles(compiled, b, T, plan)
            timed.append(compiled if agree(float(ok), "min", plan.device) == 1.0 else model)
        used, seconds = peak(timed[0], b, steps=4)
        return None if used > 1 - headroom else b * T / seconds

    b, reason = search_micro_batch(usage, measure, step, cap, headroom)
    reason += f"; timed {'eager' if not timed or timed[0] is model else 'compiled'} ({note})"
    agreed = int(agree(b, "min", plan.device))
    if agreed != b:
        reason = f"micro_batch {agreed}: the minimum over DDP ranks (this rank: {reason})"
        b = agreed
    return b, reason, timed[0] if timed else None


def choose_micro_batch(model, optimizers, plan, step, asked, compile_line=""):
    """(B, T, why for the log or "", the model the finder timed or None): the run's micro-batch
    (and on small GPUs seq_len) for asked, an int or None (auto); where step.fit, fitted to the
    GPU's memory or the free RAM; one not dividing total_batch_size is lowered or refused.
    compile_line: said before the finder compiles (auto_micro_batch)."""
    micro_batch, T, V, why, timed = asked, step.seq_len, step.config.vocab_size, "", None
    if asked is None:
        try:
            micro_batch, why, timed = auto_micro_batch(model, optimizers, plan, step,
                                                       compile_line=compile_line)
        except ValueError as e:
            raise UserError(f"micro_batch_size=auto: {e}") from None
    elif step.fit and plan.device_type == "cuda":
        sized = replace(step, ce_chunk_rows=loss_chunk(plan, asked * T, V))
        if plan.fit_to_memory or training_bytes(sized, asked) > (1 - FIT_HEADROOM) * plan.memory:
            micro_batch, T, why = fit_micro_batch(step, plan.memory, plan=plan)
            why += " (set micro_batch_size/seq_len to choose yourself)"
    step = replace(step, seq_len=T)
    total, world, tokens = step.total_batch_size, step.world_size, micro_batch * T * step.world_size
    rows = step.rows  # the largest micro-batch up to micro_batch whose rows divide: same tokens
    keeps = max((b for b in range(1, min(micro_batch, rows) + 1) if rows % b == 0), default=None)
    if total % tokens and step.divide and keeps:
        why = (f"micro_batch_size={keeps}: the largest up to {micro_batch} whose {keeps} x {T} x "
               f"{world} rank(s) divides total_batch_size={total} (set micro_batch_size to choose "
               "yourself)")
        micro_batch = keeps
    elif total % tokens:
        other = max(1, round(total / tokens)) * tokens
        fix = f"e.g. --total_batch_size={other}"
        if keeps:
            fix = (f"--micro_batch_size={keeps} keeps {total:,} tokens per step (or "
                   f"--total_batch_size={other} makes it {other:,})")
        raise UserError(f"total_batch_size={total} is not a multiple of micro_batch_size x seq_len "
                        f"x world_size = {micro_batch} x {T} x {world} = {tokens}: {fix}")
    if plan.device_type == "cpu":
        micro_batch, why = fit_cpu_ram(step, micro_batch) or (micro_batch, why)
    return micro_batch, T, why, timed


def fit_cpu_ram(step, micro_batch):
    """On CPU: (micro_batch, why) lowered to the largest that fits the free RAM where step.fit, else
    None (warned with one that fits where it does not)."""
    ram, T = available_ram(), step.seq_len
    cpu = replace(step, device_type="cpu", fsdp=False, loss_impl="chunked", compiled=False,
                  ce_chunk_rows=CE_CHUNK_ROWS)

    def need(b):  # the ranks share the RAM
        return sum(training_bytes_estimate(cpu, b).values()) * step.world_size
    if ram is None or need(micro_batch) <= ram:
        return None
    rows = step.total_batch_size // (T * step.world_size)
    fitting = [b for b in range(1, micro_batch) if rows % b == 0 and need(b) <= ram]
    said = (f"{micro_batch} x {T} needs ~{fmt_bytes(need(micro_batch))} of RAM by the estimate, "
            f"{fmt_bytes(ram)} is free")
    if not fitting:
        warn0(f"micro-batch {said}, and not even 1 x {T} fits: the run may be killed for memory; "
              "use a smaller model or seq_len, or --activation_checkpointing=blocks")
        return None
    b = max(fitting)
    how = (f"{b} x {T} (~{fmt_bytes(need(b))}, grad_accum {rows // b} keeps total_batch_size "
           f"{step.total_batch_size})")
    if step.fit:
        return b, (f"micro-batch fitted to the free RAM: {said}; {how} (set micro_batch_size to "
                   "choose yourself)")
    warn0(f"micro-batch {said}: the run may be killed for memory; --micro_batch_size={b} "
          f"fits: {how}")
    return None

