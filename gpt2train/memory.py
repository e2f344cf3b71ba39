"""
What a training step holds in memory, counted from one frozen Step (the step's shape), and the loss
head that fits: chosen once, the same for the trainer, bench.py and the micro-batch finder
(microbatch.py, which sizes the micro-batch by these counts). How the estimate counts:
docs/benchmarks.md#how-the-estimate-counts; reports: bench.py --memory.

    step = Step(model.config, seq_len=1024, dtype=torch.bfloat16)  # the shape, built once
    parts = training_bytes_estimate(step, 64)  # {part: bytes} at micro-batch 64
    loss_impl, why = use_loss_head(model, plan, step, 64)  # THE loss head at micro-batch 64, set
"""
import dataclasses
import functools
import os
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from gpt2train.fileio import UserError
from gpt2train.logger import warn0
from gpt2train.loss import (CE_CHUNK_ROWS, full_head_bytes, fused_head_bytes, fused_probe,
                            loss_chunk_rows, loss_head_temp_bytes)
from gpt2train.precision import ALLOC_CONF, available_ram, fsdp_param_dtype


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
# the loss head that fits: chosen by its bytes, once, for trainer, bench and finder


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
