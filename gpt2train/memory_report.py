"""
Where the memory of a training step goes, behind `python bench.py --memory` (measured in this
process, then computed) and `python bench.py --fit` (what fits where, computed).

    python bench.py --memory --device cpu --model gpt2 --micro_batch_size 1 --seq_len 1024
    python bench.py --memory --activation_checkpointing blocks --world_size 8 --fsdp
    python bench.py --fit --optimizer muon

    lines = memory_report(job, Modes(loss="full", ckpt="blocks"))  # job: a ladder.Ladder
    lines = fit_table({"gpt2": GPTConfig(vocab_size=50304)})  # one row per GPU

The byte counts are memory.py's (training_bytes_estimate); this file measures them against one
real step and prints both.
"""
import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpt2train import precision
from gpt2train.ladder import BASELINE, rung_plan, time_rung
from gpt2train.memory import (Step, activation_bytes_estimate, fmt_bytes, optimizer_state_tensors,
                              param_counts, tensor_bytes, training_bytes_estimate)
from gpt2train.microbatch import estimated_micro_batch, random_batch
from gpt2train.optim import Stepping, train_step
from gpt2train.precision import free_memory

# -----------------------------------------------------------------------------
# measuring: what the tensors hold, what autograd keeps for backward

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


# -----------------------------------------------------------------------------
# the --memory report: measured, then computed

OPTIMIZER_STATE = {"adamw": "AdamW exp_avg + exp_avg_sq",
                   "muon": "Muon: one momentum buffer per block matrix; AdamW's two on the rest"}


@dataclasses.dataclass(frozen=True)
class Modes:
    """The memory modes one report is for (bench.py's flags): the loss head, activation
    checkpointing and optimizer of the step measured; the ranks its per-rank estimate is for."""
    loss: str = "chunked"  # auto: the head the trainer would run here, eager
    ckpt: str = "none"
    world_size: int = 1
    fsdp: bool = False
    optimizer: str = "adamw"


def memory_report(job, modes=Modes()):
    """The --memory report of the Ladder job's plan, size and batch shape under modes, as lines of
    text: one step measured in this process, then computed: TF32's workspace (CUDA), the activation
    estimates in fp32 and bf16, and what one rank of modes.world_size (FSDP or DDP) needs."""
    step, lines = measure_step(job, modes)
    lines += tf32_lines(job)
    lines += estimate_lines(step, job.micro_batch, modes)
    return lines


def measure_step(job, modes):
    """Build the job's model (eager) under modes and measure one training step of it: (its Step,
    the lines: title, the tensors by part, the allocator's view)."""
    plan = job.plan
    device, device_type = plan.device, plan.device_type
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler,
                    attn="sdpa", sdpa_backends=plan.sdpa_backends, vocab=50304,
                    fused=device_type == "cuda", loss=modes.loss, ckpt=modes.ckpt)
    precision.set_tf32(settings["tf32"])
    free_memory(device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    raw, model, optimizers = job.build(settings, job.size, job.micro_batch, job.seq_len,
                                       rung_plan(device, settings), modes.optimizer)
    # raw.loss_impl: for auto, the head the trainer would run here, eager
    step = Step(raw.config, job.seq_len, dtype=plan.dtype, device_type=device_type,
                optimizer=modes.optimizer, activation_checkpointing=modes.ckpt,
                loss_impl=raw.loss_impl)
    title = (f"memory of a training step: {job.size} at {job.micro_batch}x{job.seq_len}, "
             f"{plan.describe()}, vocab 50304, {step.loss_impl} loss, activation checkpointing "
             f"{modes.ckpt}, eager, on {plan.device_name or device_type}")
    x, y = random_batch(job.micro_batch, job.seq_len, device)
    scaler = torch.amp.GradScaler(device_type, enabled=settings["scaler"])
    kept = activation_lines(raw, x, y, plan, step)  # before the step: no gradients yet
    # CUDA: the 2nd step's peak has the optimizer state
    for _ in range(2 if device_type == "cuda" else 1):
        train_step(model, Stepping(plan, scaler, optimizers), x, y)
    precision.synchronize(device)
    lines = [title, *state_lines(raw, optimizers, step), *kept, *allocator_lines(device_type)]
    del raw, model, optimizers, x, y
    precision.set_tf32(False)
    free_memory(device_type)
    return step, lines


def state_lines(raw, optimizers, step):
    """What the weights, their gradients and the optimizer state hold, after a step."""
    params = list(raw.parameters())
    p, g = tensor_bytes(params), tensor_bytes(p_.grad for p_ in params)
    o = tensor_bytes(optimizer_state_tensors(optimizers))
    return [f"  parameters        {fmt_bytes(p):>10}  ({sum(t.numel() for t in params):,} fp32)",
            f"  gradients         {fmt_bytes(g):>10}",
            f"  optimizer state   {fmt_bytes(o):>10}  ({OPTIMIZER_STATE[step.optimizer]})"]


def activation_lines(raw, x, y, plan, step):
    """What one forward keeps for backward and returns, and the step's peak, measured on the batch
    (x, y), each against memory.py's estimate."""
    micro_batch = x.size(0)  # x: (B, T)
    saved, logits = saved_activation_bytes(raw, x, y, plan)
    peak = step_peak_bytes(raw, x, y, plan)
    est, est_logits = activation_bytes_estimate(step, micro_batch)
    return [f"  activations       {fmt_bytes(saved):>10}  measured: saved for backward "
            f"({precision.dtype_name(plan.dtype)}); estimate {fmt_bytes(est)}",
            f"  logits            {fmt_bytes(logits):>10}  returned by forward, alive until "
            f"backward; estimate {fmt_bytes(est_logits)}",
            f"  step peak         {fmt_bytes(peak):>10}  measured: most bytes alive at once in "
            "forward + backward, parameters left out (tensors counted, not the allocator)"]


def allocator_lines(device_type):
    """The caching allocator's view now and at its peak (CUDA), the step's tensors still alive."""
    if device_type != "cuda":
        return [f"  allocator         n/a on {device_type} (no caching-allocator statistics)"]
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    peak_a, peak_r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return [f"  allocated now     {fmt_bytes(alloc):>10}  (params + grads + optimizer state "
            "+ batch)",
            f"  peak allocated    {fmt_bytes(peak_a):>10}  (peak - steady = activations + "
            f"backward temporaries: {fmt_bytes(peak_a - alloc)})",
            f"  reserved now      {fmt_bytes(reserved):>10}  (allocator cache on top of "
            f"allocated: {fmt_bytes(reserved - alloc)})",
            f"  peak reserved     {fmt_bytes(peak_r):>10}  "
            f"(fragmentation at the peak: {fmt_bytes(peak_r - peak_a)})"]


def tf32_workspace(job, steps=3):
    """fp32 steps of the job's size and shape with TF32 off and on: (peak allocated, peak
    reserved) for each (CUDA only)."""
    out = {}
    settings = dict(BASELINE, attn="sdpa", vocab=50304)
    for tf32 in (False, True):
        _, _, peak, *_ = time_rung({**settings, "tf32": tf32},
                                   dataclasses.replace(job, warmup=1, steps=steps))
        out[tf32] = peak
    precision.set_tf32(False)
    return out


def tf32_lines(job):
    """TF32 off vs on: the peaks of fp32 steps (CUDA)."""
    device_type = job.plan.device_type
    if device_type != "cuda":
        return [f"  TF32 off vs on    n/a on {device_type} (TF32 is CUDA-only)"]
    ws = tf32_workspace(job)
    (a0, r0), (a1, r1) = ws[False], ws[True]
    return [f"  TF32 off vs on (fp32 steps): peak allocated {fmt_bytes(a0)} vs "
            f"{fmt_bytes(a1)} ({fmt_bytes(a1 - a0)}), peak reserved {fmt_bytes(r0)} vs "
            f"{fmt_bytes(r1)} ({fmt_bytes(r1 - r0)}): "
            "TF32 changes the matmul math, not the fp32 storage"]


def estimate_lines(step, micro_batch, modes):
    """Computed: the activations in fp32 and under bf16 autocast, then what one rank of
    modes.world_size needs (training_bytes_estimate), by part."""
    lines = []
    for d in (torch.float32, torch.bfloat16):
        a, lg = activation_bytes_estimate(dataclasses.replace(step, dtype=d, device_type="cuda"),
                                          micro_batch)
        what = "fp32" if d == torch.float32 else "bf16 autocast"
        lines.append(f"  estimate {what}: activations {fmt_bytes(a)} + logits {fmt_bytes(lg)}")
    how = "1 process"
    if modes.fsdp:
        how = f"FSDP over {modes.world_size}"
    elif modes.world_size > 1:
        how = f"DDP x {modes.world_size}"
    parts = training_bytes_estimate(dataclasses.replace(step, world_size=modes.world_size,
                                                        fsdp=modes.fsdp), micro_batch)
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


def fit_report(configs, seq_len, headroom, optimizer):
    """--fit: what the table shows, a blank line, the table."""
    return [f"largest micro-batch at seq_len {seq_len} within {1 - headroom:.0%} of the GPU's "
            "memory, computed by training_bytes_estimate (the full loss compiled, the rest eager; "
            f"vocab 50304; fp16 on the T4, bf16 elsewhere; optimizer {optimizer})", "",
            *fit_table(configs, seq_len, headroom, optimizer)]


def fit_table(configs, seq_len=1024, headroom=0.1, optimizer="adamw"):
    """Markdown: the largest micro-batch at seq_len whose training_bytes_estimate stays within
    1 - headroom of each GPU's memory, for each model ({size: GPTConfig}) and mode ("-": not even
    1)."""
    lines = ["| model | GPU | " + " | ".join(m[0] for m in FIT_MODES) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in FIT_MODES) + " |"]
    for size, config in configs.items():
        for gpu, gib, dtype in GPUS:
            cells = []
            for _, world, fsdp, loss, ckpt in FIT_MODES:
                step = Step(config, seq_len, world_size=world, dtype=dtype, optimizer=optimizer,
                            activation_checkpointing=ckpt, fsdp=fsdp, loss_impl=loss,
                            compiled=loss == "full")  # the full column: the trainer's compiled head
                b = estimated_micro_batch(step, (1 - headroom) * gib * 2**30)
                cells.append(str(b) if b else "-")
            n = param_counts(config)[0]
            lines.append(f"| {size} ({n / 1e6:.0f}M) | {gpu} | " + " | ".join(cells) + " |")
    return lines
