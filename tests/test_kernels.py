"""gpt2train/kernels.py, the model's optional kernel layouts (qkv_impl, gelu_impl): each gives the default layout's
loss and gradients (fp32 to rounding, bf16 autocast within its own), traces into one compiled graph, and the GELU
epilogue keeps no pre-activation for backward. Their speed is the GPU session's to measure."""
import dataclasses

import pytest
import torch
from torch.nn import functional as F

from gpt2train import memory_report
from gpt2train import kernels, precision
from conftest import cpu_plan
from model import GPT, GPTConfig

SHAPE = GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32)


def model_with(seed=0, **runtime):
    torch.manual_seed(seed)
    return GPT(SHAPE, loss_impl="full").set_runtime(**runtime)


def batch(B=3, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SHAPE.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_and_grads(model, plan):
    x, y = batch()
    with precision.autocast(plan):
        _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_the_gelu_epilogue_is_the_tanh_gelu_and_its_backward_is_exact():
    """linear_gelu's autograd.Function: forward equals F.gelu(F.linear(...), tanh); its backward (the
    pre-activation recomputed) passes gradcheck in float64."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 4), (6, 4), (6,)))
    assert torch.allclose(kernels.LinearGelu.apply(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert torch.autograd.gradcheck(kernels.LinearGelu.apply, (x, w, b))


@pytest.mark.parametrize("runtime", [dict(gelu_impl="epilogue"), dict(qkv_impl="split"),
                                     dict(gelu_impl="epilogue", qkv_impl="split")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_layout_gives_the_default_loss_and_gradients(runtime, dtype, tol):
    plan = cpu_plan(dtype)
    loss0, grads0 = loss_and_grads(model_with(), plan)
    loss1, grads1 = loss_and_grads(model_with(**runtime), plan)
    assert abs(loss0 - loss1) <= tol * abs(loss0)
    for name, g0 in grads0.items():
        scale = g0.abs().max().item()
        assert (grads1[name] - g0).abs().max().item() <= tol * scale, name


def test_the_gelu_epilogue_keeps_no_pre_activation():
    """Autograd's saved tensors (memory_report.saved_activation_bytes: distinct storages, parameters and batch left out)
    shrink by one (B*T, 4C) fp32 tensor a layer: the pre-activation the pointwise GELU keeps for backward."""
    x, y = batch()
    plan = cpu_plan(torch.float32)
    default, _ = memory_report.saved_activation_bytes(model_with(), x, y, plan)
    epilogue, _ = memory_report.saved_activation_bytes(model_with(gelu_impl="epilogue"), x, y, plan)
    B, T = x.shape
    assert default - epilogue == SHAPE.n_layer * B * T * 4 * SHAPE.n_embd * 4


def test_the_layouts_trace_into_one_graph():
    """Dynamo and AOTAutograd take both layouts (the epilogue's autograd.Function, the three slices) into the
    model's one graph: no graph break, the default's loss."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()  # (earlier tests' chunked heads break by design)
    plan = dataclasses.replace(cpu_plan(torch.float32), compile=True)
    try:
        compiled = precision.compile_model(model_with(gelu_impl="epilogue", qkv_impl="split"), plan,
                                           backend="aot_eager")
        loss, _ = loss_and_grads(compiled, plan)
        assert not counters["graph_break"] and not precision.graph_breaks()
        assert loss == pytest.approx(loss_and_grads(model_with(), plan)[0], rel=1e-5)
    finally:
        torch._dynamo.reset()


def test_a_layout_is_one_of_its_choices():
    with pytest.raises(ValueError, match="gelu_impl='fused' is not one of pointwise, epilogue"):
        model_with(gelu_impl="fused")
    model = model_with(qkv_impl="split")
    assert all(block.attn.qkv_impl == "split" and block.mlp.gelu_impl == "pointwise" for block in model.transformer.h)
