"""
The fused loss head's Triton kernel (loss_impl=fused): one program a row of the (N, V) logits reads
the row with an online max and sum, writes the row's loss (fp32) and then dL/dlogits over the
logits, in place, as llm.c's fused classifier does. gpt2train/loss.py wraps it in a torch.library
custom op (the GEMMs, autograd, the compiled graph); nothing else calls it.

    from gpt2train import loss_kernels  # imported by loss.py at the fused head's first use
    loss_kernels.cross_entropy_rows(logits, targets, losses, grad=True)

Triton is imported here and only here, so every other module imports without it. On CPU the kernel
runs under Triton's interpreter (numpy, slow: for the tests), which Triton reads from the
environment when the kernel is defined: start the process with TRITON_INTERPRET=1.
"""
import triton
import triton.language as tl

# the columns a program reads at once: on a GPU a register tile (measured on the lease); under the
# interpreter each block is a numpy call, so the whole row (fewer, larger calls: 2x faster on CPU)
BLOCK = 8192
INTERPRETER_BLOCK = 65536
NUM_WARPS = 16


@triton.jit
def cross_entropy_rows_kernel(logits_ptr, targets_ptr, losses_ptr, V,
                              GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id` of the contiguous logits (V columns): losses[row] = logsumexp - the
    target's logit (0 where the target is -1) and, where GRAD, the row overwritten by
    softmax - one_hot(target) (0 where ignored), unscaled: loss.py scales on the (N, C) side."""
    row = tl.program_id(0).to(tl.int64)  # row * V can pass 2^31
    ptr = logits_ptr + row * V
    target = tl.load(targets_ptr + row)
    valid = target != -1
    m = -float("inf")  # the row's running max
    d = 0.0  # sum of exp(x - m) so far
    picked = tl.zeros((BLOCK,), dtype=tl.float32)  # the target's logit, in its lane
    for start in range(0, V, BLOCK):  # the one read of the row from memory
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        # picked up while reading: no load of the target column that a later store could race
        picked += tl.where(cols == target, x, 0.0)
    lse = m + tl.log(d)
    tl.store(losses_ptr + row, tl.where(valid, lse - tl.sum(picked, 0), 0.0))
    if GRAD:
        for start in range(0, V, BLOCK):  # the same row again, now in cache: dL/dlogits over it
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            g = tl.where(valid, g, 0.0)
            tl.store(ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)


# TRITON_INTERPRET=1 when this module was imported: the kernel is the interpreter's
INTERPRETED = type(cross_entropy_rows_kernel).__name__ == "InterpretedFunction"


def cross_entropy_rows(logits, targets, losses, grad=True):
    """Launch the kernel over logits (N, V), contiguous rows, in place; targets (N,) int64 with -1
    ignored, losses (N,) fp32 written."""
    N, V = logits.shape
    assert logits.is_contiguous(), "the kernel reads rows V apart"  # loss.py's h @ weight.t()
    block = min(triton.next_power_of_2(V), INTERPRETER_BLOCK if INTERPRETED else BLOCK)
    cross_entropy_rows_kernel[(N,)](logits, targets, losses, V, GRAD=grad, BLOCK=block,
                                    num_warps=NUM_WARPS)
