"""optim.optimizer_step, the one step of the trainer, bench.py and the probes: where the optimizers
can skip a non-finite step on the device (fused AdamW's found_inf, the GradScaler) the update is
launched before the step's one host read; the skip semantics are the host path's, bit for bit."""
import math

import pytest
import torch

from gpt2train import optim
from torch.utils._python_dispatch import TorchDispatchMode
from gpt2train import precision
from conftest import tiny_model


def run(steps, fused, on_device, optimizer="adamw", poison=(1,)):
    """steps optimizer steps on fixed data, the gradients made inf at the steps in poison. on_device
    False forces the host path (an outlier test that never fires). Returns (model, [Stepped])."""
    model = tiny_model()
    opts = optim.build_optimizers(model, optimizer, lr=1e-2, weight_decay=0.1, fused=fused, verbose=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    params = [p for p in model.parameters()]
    assert optim.skips_on_device(opts, None) == fused  # fused AdamW, with or without Muon
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for step in range(steps):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        if step in poison:
            model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = math.inf
        out.append(optim.optimizer_step(opts, scaler, params, 1.0, 1.0, loss.detach(),
                                            is_outlier=None if on_device else (lambda loss, norm: False)))
    return model, opts, out


def test_on_device_skip_equals_the_host_path_bit_for_bit():
    """Fused AdamW either way: launched before the read with found_inf, or decided on the host after it."""
    a, opts_a, sa = run(4, fused=True, on_device=True)
    b, opts_b, sb = run(4, fused=True, on_device=False)
    assert [s.applied for s in sa] == [s.applied for s in sb] == [True, False, True, True]
    assert [s.loss for s in sa] == [s.loss for s in sb] and math.isinf(sa[1].norm)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    state_a, state_b = opts_a[0].state_dict()["state"], opts_b[0].state_dict()["state"]
    assert all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i])
    assert int(state_a[0]["step"]) == 3  # the skipped step is not counted


def test_a_skipped_step_leaves_weights_and_state_as_they_were():
    """The inf step on the device path changes nothing: same as a run without that step's update."""
    a, _, _ = run(2, fused=True, on_device=True, poison=(1,))
    b, _, _ = run(1, fused=True, on_device=True, poison=())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.isfinite(p).all() for p in a.parameters())


@pytest.mark.parametrize("optimizer,fused", [("adamw", False), ("muon", True), ("muon", False)])
def test_host_path_skips_too(optimizer, fused):
    """Muon with fused AdamW skips on the device; beside a non-fused AdamW it is decided after the read."""
    a, _, steps = run(2, fused=fused, on_device=True, optimizer=optimizer, poison=(1,))
    b, _, _ = run(1, fused=fused, on_device=True, optimizer=optimizer, poison=())
    assert [s.applied for s in steps] == [True, False]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_muon_on_device_skip_equals_the_host_path_bit_for_bit():
    """Muon takes found_inf as fused AdamW does: launched before the read, the inf step skipped on the device,
    weights and momentum as the host path leaves them."""
    a, opts_a, sa = run(4, fused=True, on_device=True, optimizer="muon")
    b, opts_b, sb = run(4, fused=True, on_device=False, optimizer="muon")
    assert [s.applied for s in sa] == [s.applied for s in sb] == [True, False, True, True]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    state_a, state_b = opts_a[1].state_dict()["state"], opts_b[1].state_dict()["state"]
    assert all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i])


class HostReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense: .item(), a tensor's truth value (a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision_name", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_one_host_read_per_step(precision_name, optimizer):
    """bf16 and fp16 (GradScaler) plans, AdamW and Muon: the update is launched before the step's one read
    (loss and norm in one transfer); nothing else is read, the GradScaler's step of Muon included."""
    plan = precision.make_plan("cpu", precision_name)
    model = tiny_model()
    opts = optim.build_optimizers(model, optimizer, lr=1e-3, fused=True, verbose=False)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.grad_scaler)
    params = list(model.parameters())
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    assert optim.skips_on_device(opts, None)

    def step():
        loss = optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 2, plan, scaler)
        return optim.optimizer_step(opts, scaler, params, 1.0, 1.0, loss)
    step()  # the optimizer state and the loss scale are made
    count = HostReads()
    with count:
        stepped = step()
    assert stepped.applied and count.reads == 0  # the one read is .tolist(), which dispatches no op


@pytest.mark.parametrize("fused,grad_clip", [(True, 1.0), (True, 0.0), (False, 1.0)])
def test_an_inf_in_adamw_alone_skips_muon_too_under_the_grad_scaler(fused, grad_clip):
    """fp16 + GradScaler, Muon beside AdamW: an inf in one AdamW gradient only. The one clip over all the
    parameters turns Muon's gradients to 0 (grad_clip 1: max_norm / inf) or nan (no clip: inf / inf), so
    judged on its own gradients Muon would step; every optimizer skips together, the scale backs off.
    fused False: the host path (non-fused AdamW cannot skip on the device)."""
    plan = precision.make_plan("cpu", "fp16")
    model = tiny_model()
    opts = optim.build_optimizers(model, "muon", lr=1e-2, weight_decay=0.1, fused=fused, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=plan.grad_scaler)
    params = list(model.parameters())
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))

    def step(poison):
        loss = optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 2, plan, scaler)
        if poison:
            model.transformer.wte.weight.grad[3, 5] = math.inf  # wte: AdamW's, not Muon's
        return optim.optimizer_step(opts, scaler, params, grad_clip, 1.0, loss)
    assert step(poison=False).applied  # the optimizers' state made
    weights = [p.detach().clone() for p in params]
    momentum = [s["momentum_buffer"].clone() for s in opts[1].state.values()]
    scale = scaler.get_scale()
    stepped = step(poison=True)
    assert not stepped.applied and math.isinf(stepped.norm)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))  # Muon's matrices included
    assert all(torch.equal(s["momentum_buffer"], m) for s, m in zip(opts[1].state.values(), momentum))
    assert all(torch.isfinite(p).all() for p in params)
    assert scaler.get_scale() == scale / 2  # backed off once
    assert step(poison=False).applied  # and the next step goes on
    assert all(torch.isfinite(p).all() for p in params) and not all(torch.equal(p, w) for p, w in zip(params, weights))
