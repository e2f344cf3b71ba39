"""optim.py: AdamW's decay groups, Muon's split, its Newton-Schulz dtype per plan, GradScaler; and the one training
step (accumulate_gradients, optimizer_step): accumulation, skipping a non-finite step on the device or the host.

    python -m pytest -q tests/test_optim.py
"""
import copy
import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2train import optim
from gpt2train import precision
from conftest import adamw, tiny_model
from gpt2train.config import Config
from gpt2train.data import TokenLoader
from gpt2train.fileio import UserError

def batch(seed=1, B=4, T=16):
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, 64, (9,), generator=g).repeat(4)  # a repeating pattern: learnable in a few steps
    x = torch.stack([row[i:i + T + 1] for i in range(B)])
    return x[:, :-1], x[:, 1:]


def train(model, optimizers, steps, scaler=None, lr_scale=1.0, start=0):
    losses = []
    for step in range(start, start + steps):
        optim.set_lr(optimizers, lr_scale)
        x, y = batch(step % 3)
        _, loss = model(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        for opt in optimizers:
            if scaler:
                scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            scaler.step(opt) if scaler else opt.step()
            opt.zero_grad(set_to_none=True)
        if scaler:
            scaler.update()
        losses.append(loss.item())
    return losses


def test_adamw_decays_exactly_the_matrices(capsys):
    """Zero gradients: AdamW's update is its weight decay alone. Each 2-D tensor (the matmuls and embeddings,
    wte once though lm_head shares it) shrinks by lr * weight_decay at the schedule's lr (base_lr times the
    scale); the biases and layer norms do not move."""
    model = tiny_model(n_layer=2)
    (opt,) = optim.build_optimizers(model, "adamw", lr=1e-2, weight_decay=0.1)
    assert "AdamW, 10 tensors (" in capsys.readouterr().out  # wte(=lm_head), wpe, 4 matmuls per layer
    params = list(model.parameters())
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(map(id, params))  # each once
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optim.set_lr([opt], 0.5)
    opt.step()
    for (name, p), b in zip(model.named_parameters(), before):
        expected = b * (1 - 0.5 * 1e-2 * 0.1) if p.dim() == 2 else b
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-8, msg=name)


def test_muon_split_by_name():
    model = tiny_model(n_layer=2)
    muon, decay, no_decay = optim.split_params(model, "muon")
    assert [n for n, _ in muon] == [f"transformer.h.{i}.{m}" for i in range(2) for m in optim.MUON_MATRICES]
    assert [n for n, _ in decay] == ["transformer.wte.weight", "transformer.wpe.weight"]  # wte is lm_head, once
    assert all(p.dim() == 1 for _, p in no_decay) and "transformer.ln_f.bias" in dict(no_decay)
    every = [p for _, p in muon + decay + no_decay]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    adamw, muon_opt = optim.build_optimizers(model, "muon", lr=1e-3, muon_lr=2e-3, muon_momentum=0.9)
    assert isinstance(muon_opt, torch.optim.Muon)
    assert muon_opt.param_groups[0]["param_names"] == [n for n, _ in muon]  # states keyed by name in its state_dict
    assert muon_opt.param_groups[0]["momentum"] == 0.9 and muon_opt.param_groups[0]["base_lr"] == 2e-3
    assert [g["base_lr"] for g in adamw.param_groups] == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    optim.set_lr([adamw, muon_opt], 0.5)
    assert [g["lr"] for o in (adamw, muon_opt) for g in o.param_groups] == [5e-4, 5e-4, 1e-3]
    assert optim.split_params(model, "adamw")[0] == []
    with pytest.raises(UserError, match="adamw, muon"):
        optim.split_params(model, "sgd")


def test_muon_trains_and_beats_nothing():
    model = tiny_model(n_layer=2)
    losses = train(model, optim.build_optimizers(model, "muon", lr=1e-2, muon_lr=1e-2), 40)
    assert losses[-1] < 0.5 * losses[0], losses[::8]


def test_muon_update_is_torch_optim_muons():
    torch.manual_seed(0)
    w = torch.randn(48, 16)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw = dict(lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a, b = optim.Muon([ours], ns_dtype=torch.bfloat16, **kw), torch.optim.Muon([theirs], **kw)
    for _ in range(3):
        g = torch.randn(48, 16)
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
    step = (theirs - w).abs().max()
    assert (ours - theirs).abs().max() < 0.02 * step  # bf16 rounding (our norm is taken in fp32 first)


@pytest.mark.parametrize("ns_dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)])
def test_batched_muon_equals_one_matrix_at_a_time(ns_dtype, tol):
    """The stacked step (same-shape matrices in one batched Newton-Schulz) against the per-matrix update (the
    previous code, kept for FSDP): the same weights and momentum after 3 steps, within the dtype's rounding."""
    a, b = tiny_model(n_layer=2), tiny_model(n_layer=2)
    opt_a = optim.build_optimizers(a, "muon", lr=1e-2, muon_lr=1e-2, ns_dtype=ns_dtype)
    opt_b = optim.build_optimizers(b, "muon", lr=1e-2, muon_lr=1e-2, ns_dtype=ns_dtype)
    opt_b[1]._step_supports_amp_scaling = False  # the one-matrix path
    assert len({p.shape for p in opt_a[1].param_groups[0]["params"]}) < len(opt_a[1].param_groups[0]["params"])
    train(a, opt_a, 3)
    train(b, opt_b, 3)
    moved = max((p - q).abs().max().item() for p, q in zip(tiny_model(n_layer=2).parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p - q).abs().max().item() <= tol * moved
    for p in opt_a[1].param_groups[0]["params"]:
        m_a = opt_a[1].state[p]["momentum_buffer"]
        m_b = opt_b[1].state[dict(zip(a.parameters(), b.parameters()))[p]]["momentum_buffer"]
        torch.testing.assert_close(m_a, m_b, rtol=tol, atol=tol * m_b.abs().max().item())


class MatmulShapes(TorchDispatchMode):
    """The shapes of the bmm's left operand (A = X @ X^T of each Newton-Schulz iteration)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_newton_schulz_runs_once_per_wide_shape():
    """One batched Newton-Schulz per wide shape: c_fc (4C, C), tall, joins c_proj (C, 4C) transposed, and
    c_attn (3C, C) is orthogonalized as (C, 3C): 3 stacks of n_layer (2 x n_layer for the MLP), 5 iterations.
    Split (the default), c_attn's q, k, v join attn.c_proj's (C, C): 2 stacks."""
    for split, shapes in ((False, [(2, 32, 32), (2, 32, 96), (4, 32, 128)]), (True, [(4, 32, 128), (8, 32, 32)])):
        model = tiny_model(n_layer=2)
        opts = optim.build_optimizers(model, "muon", muon_split_qkv=split)
        x, y = batch()
        model(x, y)[1].backward()
        with MatmulShapes() as seen:
            opts[1].step()
        assert sorted(set(seen.shapes)) == shapes and len(seen.shapes) == 5 * len(shapes)


class MatmulDtypes(TorchFunctionMode):
    """The dtypes of the matmuls run inside it."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.addmm, torch.mm, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul):
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("plan_dtype, device_type, expected", [
    (torch.bfloat16, "cuda", torch.bfloat16),  # sm80+
    (torch.float16, "cuda", torch.float16),  # sm7x, sm60: no native bf16
    (torch.float32, "cuda", torch.float32),
    (torch.float32, "cpu", torch.float32),  # the CPU plan
])
def test_newton_schulz_runs_in_the_plans_dtype(plan_dtype, device_type, expected):
    ns_dtype = optim.ns_dtype_for(plan_dtype, device_type)
    assert ns_dtype == expected
    model = tiny_model(n_layer=2)
    opts = optim.build_optimizers(model, "muon", ns_dtype=ns_dtype)
    x, y = batch()
    model(x, y)[1].backward()
    before = [p.clone() for p in model.parameters()]
    with MatmulDtypes() as seen:
        opts[1].step()
    assert seen.dtypes == {ns_dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(not torch.equal(p, q) for p, q in zip(before, model.parameters())) == 8  # the 8 Muon matrices


@pytest.mark.parametrize("scale", [1e-5, 1.0, 1e8])
def test_fp16_newton_schulz_is_safe(scale):
    """Normalized in fp32 before the cast: no overflow or underflow at any gradient scale, and closer to
    the fp64 result than bf16 (torch.optim.Muon's dtype)."""
    torch.manual_seed(0)
    G = torch.randn(96, 32) @ torch.diag(torch.logspace(0, -3, 32)) * scale  # ill-conditioned, like gradients
    ref = optim.zeropower(G.double(), torch.float64)
    err = {d: (optim.zeropower(G, d).double() - ref).abs().max().item() for d in (torch.float16, torch.bfloat16)}
    assert torch.isfinite(optim.zeropower(G, torch.float16)).all()
    assert err[torch.float16] < err[torch.bfloat16] < 0.1, err


def test_grad_scaler_with_two_optimizers():
    """fp16's step path (unscale, clip, step each, update) equals the plain step where scaling is exact,
    and an inf in the Muon matrices' gradients skips Muon's step and halves the scale."""
    a, b = tiny_model(n_layer=2), tiny_model(n_layer=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    train(a, optim.build_optimizers(a, "muon", lr=1e-2, muon_lr=1e-2), 3)
    opts = optim.build_optimizers(b, "muon", lr=1e-2, muon_lr=1e-2)
    train(b, opts, 3, scaler=scaler)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    matrix = dict(b.named_parameters())["transformer.h.0.mlp.c_fc.weight"]
    before = matrix.clone()
    x, y = batch()
    scaler.scale(b(x, y)[1]).backward()
    matrix.grad[0, 0] = float("inf")
    scaler.unscale_(opts[1])
    scaler.step(opts[1])
    scaler.update()
    assert torch.equal(matrix, before) and scaler.get_scale() == 2.0 ** 9


def test_resume_from_state_dicts_is_bit_exact():
    a = tiny_model(n_layer=2)
    opts = optim.build_optimizers(a, "muon", lr=1e-2)
    train(a, opts, 2)
    saved = copy.deepcopy((a.state_dict(), [o.state_dict() for o in opts]))  # state_dict() holds live tensors
    train(a, opts, 2, start=2)
    b = tiny_model(5, n_layer=2)
    b.load_state_dict(saved[0])
    opts_b = optim.build_optimizers(b, "muon", lr=1e-2)
    for o, s in zip(opts_b, saved[1]):
        o.load_state_dict(s)
    train(b, opts_b, 2, start=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_torch_without_muon_is_one_line(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(UserError, match=r"torch >= 2\.9"):
        optim.build_optimizers(tiny_model(n_layer=2), "muon")


def test_grad_scaler_decides_per_optimizer_so_the_trainer_skips_both():
    """GradScaler skips each optimizer on its own gradients: a nan in wte's (AdamW) leaves Muon's step on,
    and the clip has made Muon's gradients nan (an inf: zero, and Muon still decays and moves by momentum).
    So a non-finite step skips every optimizer's step and only updates the scale (unscale_ recorded the
    inf), as the trainer must do."""
    def nan_in_wte():
        model = tiny_model(n_layer=2)
        opts = optim.build_optimizers(model, "muon")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        x, y = batch()
        scaler.scale(model(x, y)[1]).backward()
        model.transformer.wte.weight.grad[0, 0] = float("nan")
        for opt in opts:
            scaler.unscale_(opt)
        assert not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        return model, opts, scaler

    model, opts, scaler = nan_in_wte()
    scaler.step(opts[1])  # what a per-optimizer skip would do
    assert torch.isnan(model.transformer.h[0].mlp.c_fc.weight).all()
    model, opts, scaler = nan_in_wte()
    before = [p.clone() for p in model.parameters()]
    scaler.update()  # no scaler.step: the whole step is skipped
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters())) and scaler.get_scale() == 2.0 ** 9


# -----------------------------------------------------------------------------
# optim.optimizer_step, the one step of the trainer, bench.py and the probes: where the optimizers can skip a
# non-finite step on the device (fused AdamW's found_inf, the GradScaler) the update is launched before the step's
# one host read; the skip semantics are the host path's, bit for bit


def run(steps, fused, on_device, optimizer="adamw", poison=(1,)):
    """steps optimizer steps on fixed data, the gradients made inf at the steps in poison. on_device
    False forces the host path (an outlier test that never fires). Returns (model, [Stepped])."""
    model = tiny_model()
    opts = optim.build_optimizers(model, optimizer, lr=1e-2, weight_decay=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    params = [p for p in model.parameters()]
    stepping = optim.Stepping(precision.make_plan("cpu"), scaler, opts, params)
    assert optim.skips_on_device(opts, None) == fused  # fused AdamW, with or without Muon
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for step in range(steps):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        if step in poison:
            model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = math.inf
        out.append(optim.optimizer_step(stepping, 1.0, loss.detach(),
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
    opts = optim.build_optimizers(model, optimizer, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.grad_scaler)
    params = list(model.parameters())
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    assert optim.skips_on_device(opts, None)

    stepping = optim.Stepping(plan, scaler, opts, params)

    def step():
        loss = optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 2, stepping)
        return optim.optimizer_step(stepping, 1.0, loss)
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
    opts = optim.build_optimizers(model, "muon", lr=1e-2, weight_decay=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=plan.grad_scaler)
    params = list(model.parameters())
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))

    stepping = optim.Stepping(plan, scaler, opts, params, grad_clip)

    def step(poison):
        loss = optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 2, stepping)
        if poison:
            model.transformer.wte.weight.grad[3, 5] = math.inf  # wte: AdamW's, not Muon's
        return optim.optimizer_step(stepping, 1.0, loss)
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


# -----------------------------------------------------------------------------
# accumulation and the fp16/bf16/fp32 step on the toy shards

CPU = precision.make_plan("cpu")


def test_accumulated_gradients_equal_one_big_batch(data_dir):
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    small, big = tiny_model(), tiny_model()
    stepping = optim.Stepping(CPU, scaler)
    optim.accumulate_gradients(small, TokenLoader(data_dir, "train", 2, 16), 4, stepping, ddp=False)
    optim.accumulate_gradients(big, TokenLoader(data_dir, "train", 8, 16), 1, stepping, ddp=False)
    for (name, p), q in zip(small.named_parameters(), big.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), name


def test_train_step_is_the_trainers_step_over_the_optimizers_parameters():
    """train_step (bench's rungs, the finder's probes) is accumulate_gradients + optimizer_step as the trainer calls
    them with its own parameter list: a Stepping without params clips over the optimizers' (each once, the tied
    embedding too), at the Stepping's grad_clip. A clip that bites (0.05) shows it is the one used."""
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    weights = []
    for explicit, grad_clip in ((True, 0.05), (False, 0.05), (False, 1.0)):
        model = tiny_model()
        opts = optim.build_optimizers(model, "muon", lr=1e-2, muon_lr=1e-2)
        params = list(model.parameters()) if explicit else None
        stepping = optim.Stepping(CPU, torch.amp.GradScaler("cpu", enabled=False), opts, params, grad_clip)
        assert sorted(map(id, stepping.clipped)) == sorted(map(id, model.parameters()))
        for _ in range(2):
            if explicit:  # the trainer's two calls
                loss = optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 1, stepping)
                stepped = optim.optimizer_step(stepping, 1.0, loss)
            else:
                stepped = optim.train_step(model, stepping, x[:, :-1], x[:, 1:])
            assert stepped.applied and stepped.norm > 0.05  # the clip at 0.05 bites
        weights.append([p.detach().clone() for p in model.parameters()])
    trainer, bench, unclipped = weights
    for a, b in zip(trainer, bench):
        torch.testing.assert_close(a, b)
    assert not all(torch.allclose(a, b) for a, b in zip(trainer, unclipped))


def test_cuda_graph_steps_keep_their_gradients_and_mark_each_micro_step(data_dir, monkeypatch):
    """compile_mode=reduce-overhead (plan.cudagraphs): a replay overwrites its outputs, so the gradients live in
    buffers made outside the graphs before the first backward and are zeroed in place, never freed; each
    micro-step and each eval batch is marked as a new replay. The bookkeeping, run here on the CPU's eager path,
    gives the losses, gradients and weights of the plain step."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runs = {}
    for graphs in (False, True):
        plan = dataclasses.replace(CPU, cudagraphs=graphs)
        model = tiny_model()
        opt = adamw(model)
        params = list(model.parameters())
        loader, grads, losses = TokenLoader(data_dir, "train", 2, 16), [], []
        stepping = optim.Stepping(plan, scaler, [opt], params)
        for _ in range(3):
            loss = optim.accumulate_gradients(model, loader, 4, stepping)
            grads.append([p.grad.clone() for p in params])
            held = [p.grad for p in params]
            losses.append(optim.optimizer_step(stepping, 1.0, loss).loss)
            assert all(p.grad is g for p, g in zip(params, held)) if graphs else all(p.grad is None for p in params)
            if graphs:
                assert all(not p.grad.any() for p in params)  # zeroed in place for the next step
        val = optim.evaluate(model, TokenLoader(data_dir, "val", 2, 16), 2, plan)
        runs[graphs] = losses, grads, [p.detach().clone() for p in params], val
        assert len(marks) == (3 * 4 + 2 if graphs else 0)
    (l0, g0, w0, v0), (l1, g1, w1, v1) = runs[False], runs[True]
    assert l0 == l1 and v0 == v1
    assert all(torch.equal(a, b) for step0, step1 in zip(g0, g1) for a, b in zip(step0, step1))
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_cuda_graph_gradients_are_made_before_the_first_backward():
    """The gradients a CUDA graph's backward adds into exist before it runs (static_grads), zero, and are the
    ones the step ends with: none is the first backward's own output."""
    model, plan = tiny_model(), dataclasses.replace(CPU, cudagraphs=True)
    made = {}

    def first_backward(module, grad_input, grad_output):
        made.setdefault("grads", [p.grad for p in model.parameters()])
    model.transformer.ln_f.register_full_backward_hook(first_backward)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    optim.accumulate_gradients(model, optim.FixedBatch(x[:, :-1], x[:, 1:]), 2,
                               optim.Stepping(plan, torch.amp.GradScaler("cpu", enabled=False)))
    assert all(g is not None for g in made["grads"])
    assert all(p.grad is g for p, g in zip(model.parameters(), made["grads"]))


def adamw_step(model, optimizer, scaler, loss, grad_clip=1.0):
    """The one optimizer step for model's AdamW alone, at the lr it was built with."""
    stepping = optim.Stepping(CPU, scaler, [optimizer], list(model.parameters()), grad_clip=grad_clip)
    return optim.optimizer_step(stepping, lr_scale=1.0, loss=loss)


def fp16_backward(model, scaler, data_dir):
    x, y = TokenLoader(data_dir, "train", 2, 16).next_batch()
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()


def test_fp16_unscales_before_clipping(data_dir):
    model = tiny_model()
    optimizer = adamw(model)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    fp16_backward(model, scaler, data_dir)
    true_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item() / scaler.get_scale()
    before = copy.deepcopy(model.state_dict())
    _, norm, applied, *_ = adamw_step(model, optimizer, scaler, torch.tensor(1.0), grad_clip=1e-3)
    assert applied and norm == pytest.approx(true_norm, rel=1e-4)  # the norm of the real gradients, not the scaled ones
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scaler.get_scale() == 65536.0


def test_fp16_inf_step_is_skipped(data_dir):
    model = tiny_model()
    optimizer = adamw(model)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    fp16_backward(model, scaler, data_dir)
    model.lm_head.weight.grad[3, 5] = float("inf")  # an fp16 overflow
    before = copy.deepcopy(model.state_dict())
    _, norm, applied, *_ = adamw_step(model, optimizer, scaler, torch.tensor(1.0))
    assert not math.isfinite(norm) and not applied
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # step skipped
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert scaler.get_scale() == 32768.0  # backed off
    assert all(p.grad is None for p in model.parameters())
    fp16_backward(model, scaler, data_dir)  # the next, finite step goes through
    assert adamw_step(model, optimizer, scaler, torch.tensor(1.0)).applied
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("prec,where", [("fp32", "grad"), ("bf16", "grad"), ("fp32", "loss")])
def test_non_finite_step_is_skipped_without_a_scaler(data_dir, prec, where):
    """bf16/fp32 have no GradScaler to skip a bad step: optimizer_step must skip it itself."""
    plan = precision.make_plan("cpu", prec)
    model = tiny_model()
    optimizer = adamw(model)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.grad_scaler)
    stepping = optim.Stepping(plan, scaler)
    loss = optim.accumulate_gradients(model, TokenLoader(data_dir, "train", 2, 16), 1, stepping, ddp=False)
    if where == "grad":
        model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("nan")
    else:
        loss = loss * float("inf")
    before = copy.deepcopy(model.state_dict())
    loss, norm, applied, *_ = adamw_step(model, optimizer, scaler, loss)
    assert not applied and not (math.isfinite(loss) and math.isfinite(norm))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched, finite
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state  # nothing half-applied
    loss = optim.accumulate_gradients(model, TokenLoader(data_dir, "train", 2, 16), 1, stepping, ddp=False)
    assert adamw_step(model, optimizer, scaler, loss).applied  # the next step goes on
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("prec", ["fp16", "fp32"])
def test_outlier_step_is_skipped(prec, data_dir):
    plan = precision.make_plan("cpu", prec)
    model = tiny_model()
    optimizer = adamw(model)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.grad_scaler)
    loader = TokenLoader(data_dir, "train", 2, 16)
    before = copy.deepcopy(model.state_dict())
    loss = optim.accumulate_gradients(model, loader, 1, optim.Stepping(plan, scaler), ddp=False)
    seen = []
    params = list(model.parameters())
    applied = optim.optimizer_step(optim.Stepping(plan, scaler, [optimizer], params), 1.0, loss,
                                   lambda value, norm: seen.append((value, norm)) or True).applied
    assert not applied and len(seen) == 1 and seen[0][1] > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    if plan.grad_scaler:
        assert scaler.get_scale() == 65536.0  # an outlier is not an overflow: the loss scale stays
    loss = optim.accumulate_gradients(model, loader, 1, optim.Stepping(plan, scaler), ddp=False)
    assert optim.optimizer_step(optim.Stepping(plan, scaler, [optimizer], params), 1.0, loss,
                                lambda value, norm: False).applied
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

# -----------------------------------------------------------------------------
# issue 33's levers: c_attn as q, k, v; momentum warmup; AdamW's lr by parameter kind; the schedules


@pytest.mark.parametrize("batched", [True, False])
def test_split_qkv_is_torch_muon_on_three_separate_matrices(batched):
    """muon_split_qkv: c_attn's (3C, C) update is Muon's on q, k and v as three (C, C) parameters of their own
    (each its own Newton-Schulz and lr ratio), in the batched step (the slices join attn.c_proj's stack) and in
    the one-matrix step (FSDP's)."""
    model = tiny_model(n_layer=1)
    (_, muon) = optim.build_optimizers(model, "muon", lr=1e-2, muon_lr=2e-2, muon_split_qkv=True)
    muon._step_supports_amp_scaling = batched
    attn = model.transformer.h[0].attn
    C = attn.c_proj.weight.size(0)
    w_qkv, w_proj = attn.c_attn.weight.detach().clone(), attn.c_proj.weight.detach().clone()
    ref = [torch.nn.Parameter(w.clone()) for w in (*w_qkv.split(C), w_proj)]  # q, k, v, c_proj
    kw = dict(lr=2e-2, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    theirs = optim.Muon(ref, **kw)  # fp32 Newton-Schulz (torch.optim.Muon's is bf16: test_muon_update_is_torch...)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in muon.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=g)
        for r, grad in zip(ref, (*attn.c_attn.weight.grad.split(C), attn.c_proj.weight.grad)):
            r.grad = grad.clone()
        muon.step()
        theirs.step()
    moved = (ref[3] - w_proj).abs().max().item()
    torch.testing.assert_close(attn.c_attn.weight.detach(), torch.cat(ref[:3]).detach(), rtol=0, atol=1e-5 * moved)
    torch.testing.assert_close(attn.c_proj.weight.detach(), ref[3].detach(), rtol=0, atol=1e-5 * moved)
    whole = tiny_model(n_layer=1)  # without the split: another update (the key does something)
    (_, m2) = optim.build_optimizers(whole, "muon", lr=1e-2, muon_lr=2e-2)
    g = torch.Generator().manual_seed(0)
    for p in m2.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=g)
    m2.step()
    assert (whole.transformer.h[0].attn.c_attn.weight - w_qkv).abs().max() > 0
    assert not torch.allclose(whole.transformer.h[0].attn.c_attn.weight, attn.c_attn.weight)


def test_split_qkv_joins_the_square_stack():
    """With the split, c_attn's three slices are orthogonalized in the same batched Newton-Schulz as attn.c_proj:
    one (n, C, C) stack of 3 x layers + layers matrices, no (C, 3C) stack."""
    model = tiny_model(n_layer=2)
    (_, muon) = optim.build_optimizers(model, "muon", muon_split_qkv=True)
    for p in muon.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    with MatmulShapes() as seen:
        muon.step()
    C = model.config.n_embd
    assert {s for s in seen.shapes if s[-1] == s[-2]} == {(8, C, C)}  # A = X X^T of the (C, C) stack: 2 x (3 + 1)
    assert all(s[0] in (8, 4) for s in seen.shapes)  # and the (C, 4C) stack: c_fc and mlp.c_proj


def test_momentum_warmup_from_085():
    cfg = Config(optimizer="muon", muon_momentum=0.95, muon_momentum_warmup=300)
    assert optim.muon_momentum(0, cfg) == 0.85
    assert optim.muon_momentum(150, cfg) == pytest.approx(0.90)
    assert optim.muon_momentum(300, cfg) == optim.muon_momentum(5000, cfg) == pytest.approx(0.95)
    assert optim.muon_momentum(7, Config(muon_momentum=0.9)) == 0.9  # 0: off, as before
    model = tiny_model()
    opts = optim.build_optimizers(model, "muon")
    loss = model(*batch())[1]
    loss.backward()
    stepping = optim.Stepping(CPU, torch.amp.GradScaler("cpu", enabled=False), opts, list(model.parameters()))
    optim.optimizer_step(stepping, 1.0, loss.detach(), momentum=0.87)
    assert opts[1].param_groups[0]["momentum"] == 0.87 and "momentum" not in opts[0].param_groups[0]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embedding_and_scalar_lrs_are_base_lrs(optimizer):
    """embed_lr_mult on wte (lm_head) and wpe, scalar_lr_mult on the 1-D tensors, the matrices (under adamw) at lr;
    each parameter in one group; multipliers of 1 keep build-nanogpt's two groups (old checkpoints load)."""
    model = tiny_model(n_layer=2)
    opt = optim.build_optimizers(model, optimizer, lr=1e-3, embed_lr_mult=3.0, scalar_lr_mult=2.0)[0]
    base = {n: g["base_lr"] for g in opt.param_groups for n in g["param_names"]}
    names = dict(model.named_parameters())
    assert len(base) == sum(len(g["params"]) for g in opt.param_groups)
    for n, lr in base.items():
        want = 3e-3 if n in ("transformer.wte.weight", "transformer.wpe.weight") else 2e-3 if names[n].dim() == 1 \
            else 1e-3
        assert lr == pytest.approx(want, rel=1e-12), n
    assert [g["weight_decay"] for g in opt.param_groups] == ([0.1, 0.1, 0.0] if optimizer == "adamw" else [0.1, 0.0])
    plain = optim.build_optimizers(model, optimizer, lr=1e-3)[0]
    assert [g["base_lr"] for g in plain.param_groups] == [1e-3, 1e-3]


def reference_schedule(step, kind, max_lr=1.0, min_lr=0.1, warmup=10, steps=100, cooldown=0.3):
    """The three schedules written out independently: warmup, then from max_lr to min_lr."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= steps:
        return min_lr
    if kind == "wsd":
        flat_until = steps - cooldown * steps  # 70: flat at max_lr before it, linear to min_lr at 100
        return max_lr if step < flat_until else min_lr + (max_lr - min_lr) * (steps - step) / (steps - flat_until)
    t = (step - warmup) / (steps - warmup)
    return min_lr + (max_lr - min_lr) * ((1 + math.cos(math.pi * t)) / 2 if kind == "cosine" else 1 - t)


@pytest.mark.parametrize("kind", optim.SCHEDULES)
def test_each_schedule_is_its_shape(kind):
    cfg = Config(lr_schedule=kind, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, cooldown_frac=0.3)
    for step in range(0, 120):
        assert optim.lr_multiplier(step, cfg) == pytest.approx(reference_schedule(step, kind), rel=1e-12), step
    if kind == "wsd":
        assert optim.lr_multiplier(69, cfg) == 1.0 and optim.lr_multiplier(85, cfg) == pytest.approx(0.55)


@pytest.mark.parametrize("kind", optim.SCHEDULES)
def test_the_schedule_of_a_planned_length_is_that_runs(kind):
    """A resume asks the schedule of its checkpoint's planned max_steps (issue 45 item 5): the same numbers as a
    config planned that long, and its own when asked of none."""
    cfg = Config(lr_schedule=kind, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=200, cooldown_frac=0.3)
    planned = Config(lr_schedule=kind, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, cooldown_frac=0.3)
    for step in range(0, 120):
        assert optim.lr_multiplier(step, cfg, 100) == optim.lr_multiplier(step, planned), step
        assert optim.lr_multiplier(step, cfg, 100) == pytest.approx(reference_schedule(step, kind), rel=1e-12), step
        assert optim.lr_multiplier(step, cfg, None) == optim.lr_multiplier(step, cfg), step
    assert optim.cooldown_start(cfg, 100) == optim.cooldown_start(planned) == (70 if kind == "wsd" else None)
    assert optim.cooldown_start(cfg) == (140 if kind == "wsd" else None)


def test_the_configs_optimizer_defaults_are_optims():
    """A script that builds optimizers without a Config (bench.py, dev/muon_counts.py) gets the trainer's Muon."""
    c = Config()
    assert (c.muon_lr, c.muon_momentum, c.muon_split_qkv) == (optim.MUON_LR, optim.MUON_MOMENTUM, optim.MUON_SPLIT_QKV)
