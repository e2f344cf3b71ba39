"""
The model's optional kernel layouts: each a lever the GPU session times (dev/gpu_session.sh), off
by default until a lease shows it faster. model.py calls them; the config keys choose them.

    from gpt2train.kernels import linear_gelu, qkv_split
    h = linear_gelu(x, mlp.c_fc.weight, mlp.c_fc.bias)   # gelu_impl="epilogue": GELU in the GEMM
    q, k, v = qkv_split(x, attn.c_attn.weight, attn.c_attn.bias)  # qkv_impl="split"

linear_gelu: tanh-GELU(x @ W^T + b) with the GELU in the GEMM's epilogue where cuBLASLt has one
(CUDA: torch._addmm_activation(use_gelu=True), whose GELU there is the tanh form; on the CPU that op
computes the erf form, so the CPU runs addmm + the tanh GELU instead, for the same model). That op
has no backward and gives no pre-activation, so the backward recomputes it from x: one GEMM more a
layer, and the (rows, 4C) pre-activation is never kept (64 x 1024 x 3072 x 2 bytes = 384 MiB a layer
in bf16 at 124M's 64 x 1024), against the GELU kernel of the forward saved.

qkv_split: q, k and v as a matmul each on c_attn's rows (the same weights), instead of one matmul
split: the backward then needs no cat of dq, dk and dv into one (rows, 3C) gradient (on the H200,
1.7 ms a micro-step of 'cat_transpose' kernels); whether the three smaller GEMMs and the sum of
their input gradients cost less is what the lease measures.
"""
import torch
from torch.nn import functional as F

GELU_IMPLS = ("pointwise", "epilogue")
QKV_IMPLS = ("fused", "split")


def compute_dtype(x):
    """The dtype autocast runs matmuls in here (x's own where autocast is off)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class LinearGelu(torch.autograd.Function):
    """tanh-GELU(x @ w^T + b) for x (N, C), w (H, C), b (H,), all in one dtype; backward recomputes
    the pre-activation (N, H) from x instead of keeping it."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        if x.is_cuda:  # cuBLASLt's GELU epilogue (the tanh form)
            return torch._addmm_activation(b, x, w.t(), use_gelu=True)  # (N, H)
        return F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")  # (N, H)

    @staticmethod
    def backward(ctx, dy):  # dy (N, H)
        x, w, b = ctx.saved_tensors
        pre = torch.addmm(b, x, w.t())  # (N, H): recomputed
        dpre = torch.ops.aten.gelu_backward(dy, pre, approximate="tanh")  # (N, H)
        return dpre @ w, dpre.t() @ x, dpre.sum(0)  # (N, C), (H, C), (H,)


def linear_gelu(x, weight, bias):
    """tanh-GELU(x @ weight^T + bias) for x (B, T, C), in autocast's dtype: see the module's doc."""
    B, T, C = x.size()
    dt = compute_dtype(x)
    h = LinearGelu.apply(x.reshape(B * T, C).to(dt), weight.to(dt), bias.to(dt))  # (B*T, H)
    return h.view(B, T, -1)  # (B, T, H)


def qkv_split(x, weight, bias):
    """(q, k, v), each (B, T, C), of x (B, T, C) through c_attn's weight (3C, C) and bias (3C,):
    a matmul each on its rows."""
    C = x.size(-1)
    return tuple(F.linear(x, weight[i * C:(i + 1) * C], bias[i * C:(i + 1) * C]) for i in range(3))
