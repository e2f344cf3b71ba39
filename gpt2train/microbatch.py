"""
The micro-batch (and on small GPUs seq_len) a run trains with, decided once before step 0: the
user's, lowered to one that divides total_batch_size; fitted to a small GPU's memory (sm7x) or the
free RAM by memory.py's byte counts; or probed on CUDA (micro_batch_size=auto: the fastest of the
largest that fit). On its own: python bench.py --find_batch.

    B, T, why, model = choose_micro_batch(raw_model, optimizers, plan, step, asked)  # the trainer's
    b, reason, timed = auto_micro_batch(model, optimizers, plan, step)  # bench.py --find_batch
"""
import statistics
import time
from dataclasses import replace

import torch

from gpt2train.config import Config
from gpt2train.distributed import agree
from gpt2train.fileio import UserError
from gpt2train.logger import print0, warn0
from gpt2train.loss import CE_CHUNK_ROWS
from gpt2train.memory import (FIT_HEADROOM, Step, fmt_bytes, loss_chunk, param_counts,
                              training_bytes, training_bytes_estimate, use_loss_head)
from gpt2train.optim import Stepping, train_step
from gpt2train.precision import (available_ram, compile_model, compiles, free_memory, is_oom,
                                 synchronize)

DEFAULT_MICRO_BATCH = Config.micro_batch_size  # micro_batch_size=auto off CUDA

# -----------------------------------------------------------------------------
# the micro-batch by the estimate: fitted to a small GPU's memory (sm7x)


def estimated_micro_batch(step, budget, limit=4096):
    """The largest micro-batch whose training_bytes_estimate fits in budget bytes (0: none)."""
    lo, hi = 0, limit
    while lo < hi:  # the estimate grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        fits = sum(training_bytes_estimate(step, mid).values()) <= budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


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


# -----------------------------------------------------------------------------
# the micro-batch probed on CUDA (micro_batch_size=auto), and THE micro-batch of a run


def random_batch(micro_batch, seq_len, device, seed=1337):
    g = torch.Generator().manual_seed(seed)
    # real token ids, never padding rows
    x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)  # (B, T), (B, T)


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
    stepping = Stepping(plan, scaler, optimizers)  # the trainer's step, clipped at 1.0
    lrs = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    times = []
    try:
        x, y = random_batch(micro_batch, seq_len, device)
        for _ in range(steps):  # the second step is the steady state: optimizer state alive
            synchronize(device)
            t0 = time.perf_counter()
            # lr 0: no update, no weight decay
            train_step(model, stepping, x, y, lr_scale=0.0)
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
