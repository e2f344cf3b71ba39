"""
GPT-2's loss head, the one function model.py calls: lm_head's logits and their cross-entropy, in one
of three ways.

    from gpt2train.loss import loss_head, loss_chunk_rows
    logits, loss = loss_head(h, lm_head.weight, targets, "full")  # inside the compiled graph
    _, loss = loss_head(h, lm_head.weight, targets, "fused")  # one Triton pass, in place
    _, loss = loss_head(h, lm_head.weight, targets, "chunked", rows)  # never the (B*T, V) logits

"full" is F.cross_entropy over the whole (B*T, V) logits: where the model is compiled, inductor
fuses it into the model's one graph (no graph break; what autograd keeps is the logits in the
compute dtype, ~2 bytes a logit; its backward writes a second logits-sized tensor). "fused" is
llm.c's fused classifier: the logits by one GEMM, then one Triton kernel (loss_kernels.py) writes
each row's loss and dL/dlogits over the logits, in place, so that backward is the two GEMMs on that
one buffer; a torch.library custom op, inside the compiled graph (docs/loss_head.md). "chunked" is
the memory fallback (micro-batches where the logits do not fit): an eager loop over rows of logits,
in place, by design outside any compiled graph (one graph break). Which one a run uses is
memory.py's decision (memory.choose_loss_impl); loss_chunk_rows sizes the chunks; memory.py counts
the heads' bytes (loss_head_temp_bytes, full_head_bytes, fused_head_bytes) without importing
model.py.
"""
import functools

import torch
from torch.nn import functional as F

CE_CHUNK_ROWS = 1024  # the default chunk: 1024 x 50304 fp32 logits = 197 MiB
# the loss head's forms (the trainer's loss_impl adds "auto": memory.py's)
LOSS_IMPLS = ("full", "chunked", "fused")


def loss_head(h, weight, targets, impl="chunked", chunk_rows=CE_CHUNK_ROWS):
    """(logits (B, T, V) or None, the mean cross-entropy) of h (B, T, C) against targets (B, T), -1
    ignored, through weight (V, C): impl "full" (the logits too), "fused" (one Triton pass over
    the logits, which become dL/dlogits) or "chunked" (chunk_rows rows of logits at a time)."""
    if impl == "chunked":  # (the graph ends at h: the call breaks it, by design)
        return None, chunked_cross_entropy(h, weight, targets, chunk_rows)
    if impl == "fused":
        return None, fused_loss(h, weight, targets)
    logits = F.linear(h, weight)  # (B, T, V)
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)

# -----------------------------------------------------------------------------
# chunked cross-entropy: the loss without the (B*T, vocab) logits and log-softmax
#
# Eager by design: the chunk loop is kept out of torch.compile (torch.compiler.disable, one graph
# break), each chunk computed in place over one fp32 buffer. Traced, the loop unrolled into the
# graph and inductor's compile time grew with the chunk count (tiny model, CPU, 64x1024: 28.8 s at 1
# chunk, 110.8 s at 64); a per-chunk body compiled on its own and called from this disabled region
# ran op by op on a GPU under torch 2.11 (71 bytes a logit instead of 11, +15 GiB: dev/ records it).
# Where the model compiles and the logits fit, "full" is faster.

def loss_chunk_bytes(chunk_rows, vocab_size, dtype=torch.float32):
    """Bytes one chunk of the chunked loss holds at once: its (rows, V) fp32 logits/probabilities
    plus their copy in the compute dtype (none in fp32): the bf16 logits, then the bf16
    dL/dlogits."""
    cast = 0 if dtype == torch.float32 else torch.finfo(dtype).bits // 8
    return chunk_rows * vocab_size * (4 + cast)


# fp16: a chunk's unscaled (V, C) weight-gradient product sums its rows; keep it < 65504
FP16_CHUNK_ROWS = 1024


def addmm_fp32(acc, a, b):
    """acc += a @ b, in place, for a fp32 acc and 16-bit a, b: the product summed in fp32 inside the
    matmul and added to acc there (aten's addmm with out_dtype: CUDA only), no 16-bit product
    tensor."""
    return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


@functools.cache
def fp32_out_matmul(device, dtype):
    """Whether addmm_fp32 runs on this device for this 16-bit dtype and gives the fp32 sum: a tiny
    probe, once per (device, dtype) a process (older torch, a GPU without the kernel, the CPU:
    False; the caller keeps the 16-bit product and fp16's FP16_CHUNK_ROWS cap)."""
    try:
        # the forward may ask first, under the model's autocast
        with torch.autocast(device.type, enabled=False):
            # a.t() @ a: 64 * 64 * 64 = 262144 > 65504
            a = torch.full((64, 8), 64, dtype=dtype, device=device)
            acc = torch.ones(8, 8, device=device)
            addmm_fp32(acc, a.t(), a)
            return acc.dtype == torch.float32 and bool((acc == 262145).all().item())
    except Exception:  # any failure means "not here", never a dead trainer
        return False


def fp16_capped(dtype, device):
    """Whether a chunk's rows stay at FP16_CHUNK_ROWS: fp16 where the weight-gradient product is an
    fp16 tensor (no fp32-out matmul on device; device None: the cap, as if none)."""
    if dtype != torch.float16:
        return False
    return device is None or not fp32_out_matmul(torch.device(device), dtype)


def loss_chunk_rows(n_rows, vocab_size, budget_bytes=None, dtype=torch.float32, device=None):
    """Rows per chunk for n_rows = B*T rows of logits: the fewest equal chunks, a multiple of 64
    rows each (tensor-core shapes) when the budget allows 64, of at most budget_bytes each
    (loss_chunk_bytes); budget None: 1024-row chunks. fp16 chunks stay at FP16_CHUNK_ROWS or fewer
    unless device has the fp32-out matmul (fp16_capped)."""
    cap = CE_CHUNK_ROWS
    if budget_bytes is not None:
        cap = budget_bytes // loss_chunk_bytes(1, vocab_size, dtype)
    cap = max(1, min(cap, FP16_CHUNK_ROWS) if fp16_capped(dtype, device) else cap)
    if n_rows <= cap:
        return n_rows  # one chunk
    align = 64 if cap >= 64 else 1
    cap -= cap % align
    n_chunks = -(-n_rows // cap)
    # ceil(n_rows / n_chunks), rounded up to align: still <= cap
    return -(-n_rows // (n_chunks * align)) * align


def loss_head_temp_bytes(n_rows, vocab_size, n_embd, chunk_rows, dtype=torch.float32, device=None):
    """An upper bound on what the chunked loss allocates beyond what it keeps for backward (dL/dh
    and dL/dW fp32), for memory.training_bytes_estimate: one chunk (loss_chunk_bytes); in a 16-bit
    dtype lm_head's weight cast and one (V, C) weight-gradient product (none in fp32: addmm_; none
    where device has the fp32-out matmul: addmm_fp32); an (N, C) fp32."""
    cast = 0 if dtype == torch.float32 else torch.finfo(dtype).bits // 8
    fp32_out = device is not None and fp32_out_matmul(torch.device(device), dtype)
    product = 0 if cast == 0 or fp32_out else cast
    chunk = loss_chunk_bytes(min(chunk_rows, n_rows), vocab_size, dtype)
    return chunk + (cast + product) * vocab_size * n_embd + n_rows * n_embd * 4


def full_head_bytes(n_rows, vocab_size, dtype=torch.float32, compiled=False):
    """(bytes the full head keeps for backward, bytes its backward allocates on top) for n_rows =
    B*T rows of vocab_size logits, lm_head's input and the returned logits not counted. Eager
    F.cross_entropy under autocast keeps an fp32 (N, V) log-softmax, and its backward allocates two
    fp32 (N, V) gradients and the dL/dlogits in the compute dtype. Compiled (inductor fuses the
    softmax into its reductions) it keeps a log-sum-exp per row beside the logits, and its backward
    writes only dL/dlogits in the compute dtype (H200, 64 x 1024: +11.9 GiB)."""
    a = torch.finfo(dtype).bits // 8
    if compiled:
        return n_rows * 4, n_rows * vocab_size * a
    return n_rows * vocab_size * 4, n_rows * vocab_size * (8 + (a if a == 2 else 0))


def compute_dtype(h, weight):
    """The dtype lm_head's matmul runs in: autocast's where autocast is on, else weight's."""
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return weight.dtype


@torch.compiler.disable
def chunked_cross_entropy(h, weight, targets, chunk_rows=CE_CHUNK_ROWS):
    """F.cross_entropy(h @ weight.T, targets, ignore_index=-1) for h (..., C), weight (V, C),
    targets (...), chunk_rows rows of logits at a time (loss_chunk_rows picks them). The matmuls run
    in the autocast dtype (else weight's), the softmax in fp32, as autocast would run the unchunked
    version; eager, in place."""
    h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)  # (N, C), (N,)
    dtype = compute_dtype(h, weight)
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(h, weight, targets, dtype, chunk_rows, need_grad)


def chunk_loss(hc, w, tgt, keep, need_grad=True):
    """One chunk's (summed loss, n_valid * dL/dlogits in hc's dtype) for hc (n, C), w (V, C), tgt
    (n, 1) and keep (n,) bool, in place over one fp32 (n, V) buffer (loss_chunk_bytes); dlogits None
    without need_grad."""
    logits = (hc @ w.t()).float()  # (n, V)
    target_logit = logits.gather(1, tgt)  # (n, 1)
    top = logits.amax(dim=-1, keepdim=True)  # (n, 1)
    # (n, V) in place of the logits: one exp pass serves loss and grad
    exp = logits.sub_(top).exp_()
    total = exp.sum(dim=-1, keepdim=True)  # (n, 1)
    # logsumexp - target logit
    loss_sum = ((top + total.log() - target_logit).squeeze(1) * keep).sum()
    if not need_grad:
        return loss_sum, None
    # 1/n_valid is applied after the matmuls, in fp32: folded into fp16 dlogits it would flush small
    # probabilities to 0
    exp.mul_(keep[:, None] / total)
    # softmax minus the one-hot target; ignored rows 0
    exp.scatter_add_(1, tgt, -keep[:, None].float())
    return loss_sum, exp.to(hc.dtype)  # (n, V) n_valid * dL/dlogits, in the compute dtype


class ChunkedCrossEntropy(torch.autograd.Function):
    """The loss is the end of the graph, so its gradients are known in the forward pass: each
    chunk's logits give softmax - one_hot (dL/dlogits in the compute dtype), turned at once into
    that chunk's rows of dL/dh and added into one fp32 dL/dweight. backward only scales them, once,
    by the incoming gradient (1/grad_accum, the loss scale) over n_valid. No second
    lm_head matmul, no recompute; what stays for backward is dL/dh (N, C) and dL/dweight (V, C,
    fp32) instead of the (N, V) fp32 log-softmax (and the (N, V) logits)."""

    @staticmethod
    def forward(ctx, h, weight, targets, dtype, chunk_rows, need_grad):
        N = h.size(0)
        # probed once per process
        fp32_out = dtype != torch.float32 and fp32_out_matmul(h.device, dtype)
        rows = min(N, chunk_rows, FP16_CHUNK_ROWS if fp16_capped(dtype, h.device) else chunk_rows)
        with torch.autocast(h.device.type, enabled=False):  # dtypes are explicit here
            h = h.detach()
            w = weight.detach().to(dtype)  # (V, C)
            valid = targets != -1  # (N,)
            n_valid = valid.sum().float()
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if need_grad else None  # (N, C)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32,
                                 device=weight.device) if need_grad else None
            for i in range(0, N, rows):
                hc, keep = h[i:i + rows].to(dtype), valid[i:i + rows]  # (n, C), (n,)
                tgt = targets[i:i + rows].clamp(min=0)[:, None]  # (n, 1); ignored rows point at 0
                loss_sum, dlogits = chunk_loss(hc, w, tgt, keep, need_grad)
                loss += loss_sum
                if need_grad:
                    if dtype == h.dtype:
                        torch.mm(dlogits, w, out=grad_h[i:i + rows])  # (n, C)
                    else:
                        grad_h[i:i + rows] = dlogits @ w  # (n, C)
                    if dtype == torch.float32:
                        grad_w.addmm_(dlogits.t(), hc)  # (V, C), accumulated inside the matmul
                    elif fp32_out:
                        # (V, C), summed and accumulated in fp32 inside it
                        addmm_fp32(grad_w, dlogits.t(), hc)
                    else:
                        grad_w += dlogits.t() @ hc  # (V, C) compute-dtype product into the fp32 sum
                    del dlogits  # the chunk goes before the next one comes
            if need_grad:
                # n_valid * the gradients: backward divides
                ctx.save_for_backward(grad_h, grad_w, n_valid)
            ctx.weight_dtype = weight.dtype
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        # (): one pass over each gradient for the mean and the incoming gradient
        scale = grad_loss / n_valid
        return grad_h * scale, (grad_w * scale).to(ctx.weight_dtype), None, None, None, None

# -----------------------------------------------------------------------------
# fused cross-entropy: llm.c's fused classifier, one custom op inside the compiled graph
#
# The op owns the logits GEMM: it allocates the (N, V) logits, the Triton kernel (loss_kernels.py)
# turns them into dL/dlogits in place, and the op returns that buffer as an output autograd saves:
# no mutated input for functionalization to copy, one logits-sized tensor, no host sync. dL/dlogits
# is written unscaled (softmax - one_hot, in [-1, 1]); the incoming gradient (1/n_valid,
# 1/grad_accum, the loss scale) is a per-row factor applied on the (N, C) side of the two backward
# GEMMs, never folded into the 16-bit buffer (docs/loss_head.md: why, and how fp16 stays right).

def fused_loss(h, weight, targets):
    """F.cross_entropy(h @ weight.T, targets, ignore_index=-1) for h (..., C), weight (V, C) and
    targets (...), the matmuls in the compute dtype, through the fused op."""
    dtype = compute_dtype(h, weight)
    targets = targets.reshape(-1)  # (N,)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    losses, _ = fused_cross_entropy(h.reshape(-1, h.size(-1)).to(dtype), weight.to(dtype), targets,
                                    grad)  # (N,) fp32
    return losses.sum() / (targets != -1).sum()  # the mean over valid rows (none: nan, as F's)


@torch.library.custom_op("gpt2train::fused_cross_entropy", mutates_args=())
def fused_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss (N,) fp32, dL/dlogits unscaled (N, V) in h's dtype: the logits where not
    grad) for h (N, C) and weight (V, C) in one dtype, targets (N,) with -1 ignored."""
    why = fused_unusable(h.device.type)
    if why:
        raise RuntimeError(f"loss_impl=fused: {why}")
    from gpt2train import loss_kernels
    with torch.autocast(h.device.type, enabled=False):  # the dtype is the caller's
        logits = h @ weight.t()  # (N, V): the one logits-sized tensor
    losses = torch.empty(h.size(0), dtype=torch.float32, device=h.device)  # (N,)
    loss_kernels.cross_entropy_rows(logits, targets.contiguous(), losses, grad)
    return losses, logits


@fused_cross_entropy.register_fake
def _(h, weight, targets, grad):
    return h.new_empty(h.size(0), dtype=torch.float32), h.new_empty(h.size(0), weight.size(0))


def fused_setup_context(ctx, inputs, output):
    _, _, _, ctx.grad = inputs
    ctx.save_for_backward(inputs[0], inputs[1], output[1])  # h, weight, dL/dlogits: no copy
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # its gradient stays None: no logits-sized zeros in backward


def fused_backward(ctx, grad_losses, _):
    """The two GEMMs on the saved dL/dlogits, the incoming per-row gradient applied in fp32 to
    the (N, C) operand or product, never to the (N, V) buffer."""
    if not ctx.grad:
        raise RuntimeError("fused_cross_entropy ran with grad=False: it wrote no gradient")
    h, weight, dlogits = ctx.saved_tensors
    scale = grad_losses[:, None]  # (N, 1) fp32: 1/n_valid x 1/grad_accum x the loss scale
    grad_h = ((dlogits @ weight).float() * scale).to(h.dtype)  # (N, C)
    grad_w = dlogits.t() @ (h.float() * scale).to(h.dtype)  # (V, C)
    return grad_h, grad_w, None, None


fused_cross_entropy.register_autograd(fused_backward, setup_context=fused_setup_context)


@functools.cache
def fused_unusable(device_type):
    """Why the fused head cannot run on this device type, in one line ("" where it can): Triton
    missing or broken, the CPU without Triton's interpreter, a device Triton does not drive."""
    try:
        from gpt2train import loss_kernels
    except Exception as e:  # not installed, or an install that fails to import
        return (f"needs Triton, which does not import here ({type(e).__name__}: {e}): "
                "pip install triton")
    if device_type == "cpu" and not loss_kernels.INTERPRETED:
        return ("on CPU its Triton kernel runs only under Triton's interpreter: start the process "
                "with TRITON_INTERPRET=1 (slow: for tests)")
    if device_type == "cuda" and loss_kernels.INTERPRETED:
        return "TRITON_INTERPRET=1 is set: the kernel would run on the CPU's interpreter; unset it"
    if device_type not in ("cpu", "cuda"):
        return f"Triton drives CUDA GPUs (and the CPU under its interpreter), not {device_type}"
    return ""


@functools.cache
def fused_probe(device, dtype):
    """Whether the fused head runs on device in dtype and gives F.cross_entropy's loss and gradients
    on a small input (odd vocab, ignored rows): "" where it does, else why not, in one line. Once
    per (device, dtype) a process: the start-up check before auto picks it."""
    why = fused_unusable(torch.device(device).type)
    if why:
        return why
    g = torch.Generator().manual_seed(0)
    N, C, V = 24, 32, 1001
    h32, w32 = torch.randn(N, C, generator=g), torch.randn(V, C, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -1
    try:
        with torch.autocast(torch.device(device).type, enabled=False):
            h, w = (t.to(device, dtype).requires_grad_() for t in (h32, w32))
            ours = fused_loss(h, w, targets.to(device))
            got = [ours.detach(), *torch.autograd.grad(ours, (h, w))]
            h, w = (t.detach().float().requires_grad_() for t in (h, w))  # the same values, fp32
            ref = F.cross_entropy(h @ w.t(), targets.to(device), ignore_index=-1)
            want = [ref.detach(), *torch.autograd.grad(ref, (h, w))]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name, a, b in zip(("loss", "dL/dh", "dL/dW"), got, want):
            err = ((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
            if not err <= tol:  # nan too
                return f"its probe's {name} is {err:.1e} off F.cross_entropy's (tolerance {tol})"
    except Exception as e:  # any failure: the head is off here, the run goes on without it
        return f"its kernel failed the probe ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
    return ""


def fused_head_bytes(n_rows, vocab_size, n_embd, dtype=torch.float32):
    """(bytes the fused head keeps for backward beyond lm_head's input and weight cast, bytes its
    backward allocates on top) for n_rows = B*T rows of vocab_size logits: it keeps the one (N, V)
    buffer in the compute dtype (the logits, turned into dL/dlogits; no logits are returned);
    backward's GEMMs write dL/dh (N, C) and dL/dW (V, C) in the compute dtype beside their fp32
    scaled operands (at most an (N, C) fp32 and a (V, C) fp32 cast at once, counted on the safe
    side)."""
    a = torch.finfo(dtype).bits // 8
    return n_rows * vocab_size * a, (n_rows * n_embd + vocab_size * n_embd) * (a + 4)
