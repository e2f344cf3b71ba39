"""optim.py: AdamW as configure_optimizers built it, Muon's split, its Newton-Schulz dtype per plan, GradScaler."""
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2train import optim
from gpt2train.fileio import UserError
from model import GPT, GPTConfig
from conftest import configure_optimizers

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def tiny(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY))


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


def test_adamw_is_configure_optimizers_bit_for_bit():
    a, b = tiny(), tiny()
    ref = configure_optimizers(a, 0.1, 6e-4, "cpu", verbose=False)
    (opt,) = optim.build_optimizers(b, "adamw", lr=6e-4, weight_decay=0.1, verbose=False)
    for g_ref, g in zip(ref.param_groups, opt.param_groups, strict=True):
        names = {id(p): n for n, p in a.named_parameters()}
        assert [names[id(p)] for p in g_ref["params"]] == g["param_names"]  # the same tensors, in the same order
        assert {k: v for k, v in g.items() if k not in ("params", "param_names", "base_lr")} == \
               {k: v for k, v in g_ref.items() if k != "params"}
        assert g["base_lr"] == 6e-4
    for step in range(3):
        for group in ref.param_groups:
            group["lr"] = 6e-4 * (step + 1) / 3
        optim.set_lr([opt], (step + 1) / 3)
        for model, o in ((a, ref), (b, opt)):
            x, y = batch(step)
            model(x, y)[1].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            o.step()
            o.zero_grad(set_to_none=True)
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n


def test_muon_split_by_name():
    model = tiny()
    muon, decay, no_decay = optim.split_params(model, "muon")
    assert [n for n, _ in muon] == [f"transformer.h.{i}.{m}" for i in range(2) for m in optim.MUON_MATRICES]
    assert [n for n, _ in decay] == ["transformer.wte.weight", "transformer.wpe.weight"]  # wte is lm_head, once
    assert all(p.dim() == 1 for _, p in no_decay) and "transformer.ln_f.bias" in dict(no_decay)
    every = [p for _, p in muon + decay + no_decay]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    adamw, muon_opt = optim.build_optimizers(model, "muon", lr=1e-3, muon_lr=2e-3, muon_momentum=0.9, verbose=False)
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
    model = tiny()
    losses = train(model, optim.build_optimizers(model, "muon", lr=1e-2, muon_lr=1e-2, verbose=False), 40)
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
    a, b = tiny(), tiny()
    opt_a = optim.build_optimizers(a, "muon", lr=1e-2, muon_lr=1e-2, ns_dtype=ns_dtype, verbose=False)
    opt_b = optim.build_optimizers(b, "muon", lr=1e-2, muon_lr=1e-2, ns_dtype=ns_dtype, verbose=False)
    opt_b[1]._step_supports_amp_scaling = False  # the one-matrix path
    assert len({p.shape for p in opt_a[1].param_groups[0]["params"]}) < len(opt_a[1].param_groups[0]["params"])
    train(a, opt_a, 3)
    train(b, opt_b, 3)
    moved = max((p - q).abs().max().item() for p, q in zip(tiny().parameters(), b.parameters()))
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
    c_attn (3C, C) is orthogonalized as (C, 3C): 3 stacks of n_layer (2 x n_layer for the MLP), 5 iterations."""
    model = tiny()
    opts = optim.build_optimizers(model, "muon", verbose=False)
    x, y = batch()
    model(x, y)[1].backward()
    with MatmulShapes() as seen:
        opts[1].step()
    assert sorted(set(seen.shapes)) == [(2, 32, 32), (2, 32, 96), (4, 32, 128)] and len(seen.shapes) == 15


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
    model = tiny()
    opts = optim.build_optimizers(model, "muon", ns_dtype=ns_dtype, verbose=False)
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
    a, b = tiny(), tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    train(a, optim.build_optimizers(a, "muon", lr=1e-2, muon_lr=1e-2, verbose=False), 3)
    opts = optim.build_optimizers(b, "muon", lr=1e-2, muon_lr=1e-2, verbose=False)
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
    a = tiny()
    opts = optim.build_optimizers(a, "muon", lr=1e-2, verbose=False)
    train(a, opts, 2)
    saved = copy.deepcopy((a.state_dict(), [o.state_dict() for o in opts]))  # state_dict() holds live tensors
    train(a, opts, 2, start=2)
    b = tiny(seed=5)
    b.load_state_dict(saved[0])
    opts_b = optim.build_optimizers(b, "muon", lr=1e-2, verbose=False)
    for o, s in zip(opts_b, saved[1]):
        o.load_state_dict(s)
    train(b, opts_b, 2, start=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_torch_without_muon_is_one_line(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(UserError, match=r"torch >= 2\.9"):
        optim.build_optimizers(tiny(), "muon", verbose=False)


def test_grad_scaler_decides_per_optimizer_so_the_trainer_skips_both():
    """GradScaler skips each optimizer on its own gradients: a nan in wte's (AdamW) leaves Muon's step on,
    and the clip has made Muon's gradients nan (an inf: zero, and Muon still decays and moves by momentum).
    So a non-finite step skips every optimizer's step and only updates the scale (unscale_ recorded the
    inf), as the trainer must do."""
    def nan_in_wte():
        model = tiny()
        opts = optim.build_optimizers(model, "muon", verbose=False)
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
