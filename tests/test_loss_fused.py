"""The fused loss head (loss_impl=fused: one Triton kernel over the logits, dL/dlogits written over them, in place),
on CPU under Triton's interpreter: the loss and gradients of F.cross_entropy (fp32 to 1e-5, bf16/fp16 within their
rounding, fp16 with a large loss scale finite), odd vocab sizes, ignored rows, rows that end inside a block; a whole
GPT fused against full, eager and compiled (one graph, no break, no logit-sized aten op outside compiled code, one
logits-sized buffer kept: the estimate's); the trainer with it; the one-line errors where Triton cannot run it; auto's
choice. The interpreter is slow: small shapes. The GPU twins are in test_cuda.py.

    python -m pytest -q tests/test_loss_fused.py
"""
import os

import pytest
import torch

if torch.cuda.is_available():  # conftest.py sets TRITON_INTERPRET=1 only where there is no GPU
    pytest.skip("the CPU interpreter's tests; on a GPU test_cuda.py runs the fused head", allow_module_level=True)
pytest.importorskip("triton", reason="requirements-dev.txt installs it (Linux)")

import io  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from contextlib import redirect_stdout  # noqa: E402
from dataclasses import replace  # noqa: E402

from torch.nn import functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from conftest import (ROOT, aten_outside_compiled, has_input_of, one_line, step_losses, tiny_args,  # noqa: E402
                      write_shards)
from gpt2train import loss, loss_kernels, memory, optim, precision  # noqa: E402
from gpt2train.data import Sampling, TokenLoader  # noqa: E402
from gpt2train.fileio import UserError  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from train_gpt2 import main  # noqa: E402


def ce_inputs(N=37, C=16, V=97, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g).requires_grad_()
    w = (scale * torch.randn(V, C, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = -1  # ignored rows, the first among them
    targets[1], targets[2] = 0, V - 1  # the first and the last column, the last in a block's tail
    return h, w, targets


def grads(fn, h, w, incoming=3.0):
    """(loss, dL/dh, dL/dW) of fn(h, w), an incoming gradient other than 1 (1/grad_accum, a loss scale)."""
    out = fn(h, w)
    return (out.detach(), *torch.autograd.grad(incoming * out, (h, w)))


def ref_ce(targets):
    return lambda h, w: F.cross_entropy(F.linear(h, w), targets, ignore_index=-1)

# -----------------------------------------------------------------------------
# the kernel against F.cross_entropy


def test_the_kernel_runs_under_the_interpreter():
    assert loss_kernels.INTERPRETED and loss.fused_unusable("cpu") == ""


@pytest.mark.parametrize("N,C,V", [(37, 16, 97), (5, 8, 50257), (3, 4, 3), (64, 8, 256)])
def test_fused_equals_f_cross_entropy_fp32(N, C, V):
    h, w, targets = ce_inputs(N, C, V)
    ours = grads(lambda h, w: loss.fused_loss(h, w, targets), h, w)
    ref = grads(ref_ce(targets), h, w)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[1][targets == -1].abs().max() == 0  # ignored rows: no gradient


@pytest.mark.parametrize("block", [16, 32, 64])
def test_rows_that_end_inside_a_block(monkeypatch, block):
    """V = 97 over blocks of 16, 32, 64 columns: the online max and sum carried across blocks, the last one
    partly masked, the target picked up in any block."""
    monkeypatch.setattr(loss_kernels, "INTERPRETER_BLOCK", block)
    h, w, targets = ce_inputs(N=13, V=97, scale=3.0)  # logits spread wide: the running max moves
    ours = grads(lambda h, w: loss.fused_loss(h, w, targets), h, w)
    for a, b in zip(ours, grads(ref_ce(targets), h, w)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_contiguous_rows_only():
    """The kernel reads row r at r x V (loss.py's h @ weight.t() is contiguous): a strided view is refused, not
    read wrong; the same rows made contiguous give F.cross_entropy's losses."""
    wide = torch.randn(6, 2 * 97)
    rows, targets, losses = wide[:, :97], torch.randint(0, 97, (6,)), torch.empty(6)
    with pytest.raises(AssertionError, match="rows V apart"):
        loss_kernels.cross_entropy_rows(rows, targets, losses, grad=False)
    loss_kernels.cross_entropy_rows(rows.contiguous(), targets, losses, grad=False)
    torch.testing.assert_close(losses, F.cross_entropy(rows, targets, reduction="none"), rtol=1e-5, atol=1e-5)


def test_fused_under_bf16_autocast():
    """bf16 logits and dL/dlogits (8 mantissa bits), the softmax in fp32, as autocast's F.cross_entropy."""
    h, w, targets = ce_inputs(N=64, C=32, V=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = grads(lambda h, w: loss.fused_loss(h, w, targets), h, w)
        ref = grads(ref_ce(targets), h, w)
    assert ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(ours[1:], ref[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3 * b.abs().max().item())


@pytest.mark.parametrize("N,h_mean,w_std,scale,same_target", [(64, 0.0, 0.5, 2.0 ** 16, False),
                                                                 (256, 300.0, 0.01, 2.0 ** 6, True)])
def test_fp16_with_a_loss_scale_keeps_the_gradient(N, h_mean, w_std, scale, same_target):
    """fp16 as sm7x runs it, under a GradScaler's loss scale: the scale (with 1/n_valid) reaches the (N, C) side of
    the GEMMs, never the fp16 dL/dlogits, so the result is the scaled gradient, finite, equal to the fp32 one within
    fp16's rounding. 2^16 (GradScaler's start) over 64 rows: ~1,200 a row. 2^6 over 256 rows of one target and
    |h| ~ 300: dL/dW's rows sum to ~77,000 unscaled, past fp16's 65,504, where a scale applied after an fp16 GEMM
    would come too late (inf); scaled first they give ~19,000."""
    g = torch.Generator().manual_seed(0)
    C, V = 8, 97
    h = (h_mean + torch.randn(N, C, generator=g)).requires_grad_()
    w = (w_std * torch.randn(V, C, generator=g)).requires_grad_()
    targets = torch.full((N,), 3) if same_target else torch.randint(0, V, (N,), generator=g)
    targets[::7] = -1
    with torch.autocast("cpu", dtype=torch.float16):
        ours = grads(lambda h, w: loss.fused_loss(h, w, targets), h, w, incoming=scale)
    h16, w16 = (t.detach().half().float().requires_grad_() for t in (h, w))  # fp16's inputs, in fp32
    ref = grads(ref_ce(targets), h16, w16, incoming=scale)
    assert all(torch.isfinite(t).all() for t in ours)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(ours[1:], ref[1:]):
        assert ((a - b).abs().max() / b.abs().max()).item() < 5e-3  # fp16: 11 mantissa bits
    if same_target:  # the unscaled sum would not fit fp16
        assert ref[2].abs().max() / scale * (targets != -1).sum() > 65504 > ref[2].abs().max()


def logit_sized_allocations(fn, numel):
    """The aten ops that allocated at least numel bf16 elements at once while fn ran (CPU profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_memory_usage >= 2 * numel)


@pytest.mark.parametrize("compiled", [False, True])
def test_forward_and_backward_allocate_one_logits_sized_buffer(compiled):
    """bf16: the fused head's one GEMM allocates the (N, V) logits; the kernel writes dL/dlogits over them, and
    backward allocates nothing logit-sized (no second buffer, no zeros for the op's dL/dlogits output); the full
    head, eager, allocates several (the check can fail)."""
    h, w, targets = ce_inputs(N=128, C=16, V=257)

    def step(impl):
        head = torch.compile(loss.loss_head) if compiled else loss.loss_head
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = head(h, w, targets, impl)[1]
        out.backward()
    step("fused")  # compiled: compile first
    assert logit_sized_allocations(lambda: step("fused"), 128 * 257) == ["aten::matmul", "aten::mm"]
    if not compiled:
        assert len(logit_sized_allocations(lambda: step("full"), 128 * 257)) > 6
    torch._dynamo.reset()


def test_no_grad_leaves_the_logits_and_gives_the_loss():
    h, w, targets = ce_inputs()
    with torch.no_grad():
        losses, logits = loss.fused_cross_entropy(h, w, targets, False)
        ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-1, reduction="none")
    torch.testing.assert_close(logits, h @ w.t())
    torch.testing.assert_close(losses, ref)

# -----------------------------------------------------------------------------
# the model with it: eager, compiled, the trainer


def test_a_gpt_with_the_fused_head_equals_the_full_one():
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=257, n_layer=2, n_head=2, n_embd=16)
    fused, full = GPT(config, loss_impl="fused"), GPT(config, loss_impl="full")
    full.load_state_dict(fused.state_dict())
    idx, targets = torch.randint(0, 257, (3, 16)), torch.randint(0, 257, (3, 16))
    targets[:, :5] = -1
    none, got = fused(idx, targets)
    assert none is None  # the logits became dL/dlogits: nothing to return
    ref = full(idx, targets)[1]
    torch.testing.assert_close(got, ref)
    got.backward()
    ref.backward()
    for (name, a), b in zip(fused.named_parameters(), full.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


V, B, T, ACCUM = 257, 4, 32, 2  # 128 rows of 257 logits a micro-step: more than any other tensor here
N = B * T
CONFIG = GPTConfig(block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=16)


def loader(data_dir):
    return TokenLoader(data_dir, "train", B, T, Sampling(shuffle=False), vocab_size=V)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("fused") / "data"), n_train=4000, n_val=600)


def trainer_model(plan):
    """A fresh model with the fused head set as the trainer sets it, compiled and probed; (raw, compiled)."""
    torch.manual_seed(0)
    raw = GPT(CONFIG)
    memory.set_loss_head(raw, plan, B, T, "fused")
    compiled = precision.compile_model(raw, plan)
    with redirect_stdout(io.StringIO()) as said:
        assert compiled is not raw and precision.compiles(compiled, B, T, plan)
    assert "warning" not in said.getvalue(), said.getvalue()  # no compiler failure, no graph break
    return raw, compiled


@pytest.fixture(scope="module")
def fp32_run(data_dir):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plan = precision.make_plan("cpu", "fp32", compile="true")
    raw, compiled = trainer_model(plan)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optim.accumulate_gradients(compiled, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))  # compiles nothing more
    counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
    raw.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optim.accumulate_gradients(compiled, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))
    yield dict(plan=plan, raw=raw, compiled=compiled, counters=counters, events=prof.events())
    torch._dynamo.reset()


def test_compiled_fused_head_is_one_graph_without_a_break(fp32_run):
    c = fp32_run["counters"]
    assert c["stats"]["unique_graphs"] == 1 and c["frames"]["total"] == c["frames"]["ok"] == 1
    assert not c.get("graph_break"), c.get("graph_break")
    assert not precision.graph_breaks()


def test_no_logit_sized_aten_op_outside_the_compiled_graph(fp32_run, data_dir):
    """The custom op (its GEMM and kernel) runs inside the compiled region; nothing logit-sized outside it. The
    same step eager shows the op's logit-sized GEMM: the check can fail."""
    events = fp32_run["events"]
    assert any(e.name == "gpt2train::fused_cross_entropy" for e in events)
    assert not [e.name for e in aten_outside_compiled(events) if has_input_of(e, N * V)]
    raw, plan = fp32_run["raw"], fp32_run["plan"]
    raw.zero_grad(set_to_none=True)
    stepping = optim.Stepping(plan, torch.amp.GradScaler("cpu", enabled=False))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optim.accumulate_gradients(raw, loader(data_dir), ACCUM, stepping)
    assert {e.name for e in aten_outside_compiled(prof.events()) if has_input_of(e, N * V)} >= {"aten::mm"}
    raw.zero_grad(set_to_none=True)


def test_compiled_fused_head_equals_f_cross_entropy_on_the_whole_logits(fp32_run, data_dir):
    raw, compiled, plan = fp32_run["raw"], fp32_run["compiled"], fp32_run["plan"]
    raw.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    got = optim.accumulate_gradients(compiled, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))
    grads_got = {k: p.grad.clone() for k, p in raw.named_parameters()}
    raw.zero_grad(set_to_none=True)
    data, ref = loader(data_dir), 0.0
    for _ in range(ACCUM):
        x, y = data.next_batch("cpu")
        micro = F.cross_entropy((raw.hidden_states(x) @ raw.lm_head.weight.t()).view(-1, V), y.view(-1)) / ACCUM
        micro.backward()
        ref += micro.item()
    assert got.item() == pytest.approx(ref, rel=1e-5)
    for k, p in raw.named_parameters():
        torch.testing.assert_close(grads_got[k], p.grad, rtol=1e-5, atol=1e-5, msg=k)
    raw.zero_grad(set_to_none=True)


def test_bf16_compiled_fused_head_keeps_one_logits_sized_buffer_the_estimates(data_dir):
    """Under bf16 autocast the compiled fused head keeps one bf16 (N, V) buffer for backward (dL/dlogits, written
    over the logits) and no other logit-sized tensor, exactly memory.py's estimate; its backward allocates no
    second one (the estimate's largest temporary for the head is below one logits buffer, the full head's is
    one)."""
    torch._dynamo.reset()
    plan = precision.make_plan("cpu", "bf16", compile="true")
    raw, compiled = trainer_model(plan)
    x, y = loader(data_dir).next_batch("cpu")
    skip = {t.untyped_storage().data_ptr() for t in [*raw.parameters(), x, y]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast(plan):
        compiled(x, y)
    logit_sized = [n for n in saved.values() if n >= N * V]
    step = memory.Step(CONFIG, T, dtype=torch.bfloat16, device_type="cpu", loss_impl="fused", compiled=True)
    act, logits = memory.activation_bytes_estimate(step, B)
    assert logit_sized == [loss.fused_head_bytes(N, V, CONFIG.n_embd, torch.bfloat16)[0]] == [N * V * 2]
    assert logits == 0  # none returned: the buffer is an activation
    assert sum(saved.values()) <= 1.01 * act
    fused_temp = loss.fused_head_bytes(N, V, CONFIG.n_embd, torch.bfloat16)[1]
    full_temp = loss.full_head_bytes(N, V, torch.bfloat16, compiled=True)[1]
    assert fused_temp < N * V * 2 <= full_temp
    torch._dynamo.reset()


def test_the_trainer_with_the_fused_head_trains_as_the_full_one(data_dir, tmp_path, capsys):
    """Three steps of the trainer, fused against full (fresh out_dirs, fp32): the same losses to 1e-4; the console
    says which head ran."""
    runs = {}
    for impl in ("full", "fused"):
        out = str(tmp_path / impl)
        assert main(tiny_args(data_dir, out, max_steps=3, eval_interval=0, checkpoint_interval=0,
                              loss_impl=impl)) == 0
        runs[impl] = step_losses(out)
        printed = capsys.readouterr().out
        if impl == "fused":
            assert "loss_impl=fused: one Triton pass over the logits" in printed, printed
    assert sorted(runs["fused"]) == [0, 1, 2]
    assert all(abs(runs["fused"][s] - runs["full"][s]) < 1e-4 for s in runs["full"]), runs

# -----------------------------------------------------------------------------
# where it cannot run: one line; auto's choice


def run_trainer(tmp_path, env, prelude="pass"):
    """train_gpt2.main with loss_impl=fused in a fresh process (env, prelude run first); (exit code, stderr)."""
    data = write_shards(str(tmp_path / "data"))
    args = tiny_args(data, str(tmp_path / "out"), max_steps=1, loss_impl="fused")
    code = f"import sys; {prelude}; import train_gpt2; sys.exit(train_gpt2.main({args!r}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    return p.returncode, p.stderr


def test_fused_on_cpu_without_the_interpreter_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code, err = run_trainer(tmp_path, env)
    assert code == 2, err
    line = one_line(err)
    assert "loss_impl=fused: on CPU its Triton kernel runs only under Triton's interpreter" in line
    assert "TRITON_INTERPRET=1" in line


def test_fused_without_triton_is_one_line(tmp_path):
    code, err = run_trainer(tmp_path, dict(os.environ), prelude="sys.modules['triton'] = None")
    assert code == 2, err
    assert "loss_impl=fused: needs Triton, which does not import here" in one_line(err)


def test_auto_never_picks_the_fused_head_on_cpu():
    plan = precision.make_plan("cpu", "fp32", compile="true")
    step = memory.Step(CONFIG, T, loss_impl="auto", device_type="cpu", compiled=True)
    assert memory.choose_loss_impl(plan, step, B)[0] == "full"  # the interpreter is here, but slow


def cuda_plan(**over):
    """An H100's plan, its memory and capability, for memory.choose_loss_impl's arithmetic (nothing runs)."""
    kw = dict(device="cuda:0", dtype=torch.bfloat16, compile=True, capability=(9, 0), memory=80 * 1024 ** 3)
    return replace(precision.make_plan("cpu"), **{**kw, **over})


def test_auto_picks_the_fused_head_on_cuda_where_the_probe_passes(monkeypatch, capsys):
    probed = []
    monkeypatch.setattr(memory, "fused_probe", lambda device, dtype: probed.append((device, dtype)) or "")
    memory.fused_runs.cache_clear()
    step = memory.Step(CONFIG, 1024, loss_impl="auto", dtype=torch.bfloat16, compiled=True)
    try:
        impl, why = memory.choose_loss_impl(cuda_plan(), step, 64)
        assert impl == "fused" and why.startswith("loss_impl=fused: one Triton pass over the logits"), why
        assert memory.choose_loss_impl(cuda_plan(capability=(6, 0)), step, 64)[0] == "full"  # no Triton: no probe
        assert probed == [("cuda:0", torch.bfloat16)]
        huge = replace(step, config=replace(CONFIG, vocab_size=50304, n_embd=768))
        assert memory.choose_loss_impl(cuda_plan(), huge, 4096)[0] == "chunked"  # the logits do not fit
    finally:
        memory.fused_runs.cache_clear()
    assert "warning" not in capsys.readouterr().out


def test_a_failing_probe_falls_back_to_full_in_one_warning_line(monkeypatch, capsys):
    monkeypatch.setattr(memory, "fused_probe", lambda device, dtype: "its kernel failed the probe (RuntimeError: x)")
    memory.fused_runs.cache_clear()
    step = memory.Step(CONFIG, 1024, loss_impl="auto", dtype=torch.bfloat16, compiled=True)
    try:
        assert [memory.choose_loss_impl(cuda_plan(), step, b)[0] for b in (64, 32)] == ["full", "full"]
        with pytest.raises(UserError, match="^loss_impl=fused: its kernel failed the probe"):
            memory.choose_loss_impl(cuda_plan(), replace(step, loss_impl="fused"), 64)
    finally:
        memory.fused_runs.cache_clear()
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warned == ["warning: loss_impl=auto: the fused loss head is off here, its kernel failed the probe "
                      "(RuntimeError: x); the full or chunked head runs instead"]


def test_the_probe_catches_a_kernel_that_computes_wrong(monkeypatch):
    assert loss.fused_probe("cpu", torch.float32) == ""
    real = loss_kernels.cross_entropy_rows

    def off_by_one_column(logits, targets, losses, grad=True):
        real(logits, (targets + 1) % logits.size(1), losses, grad)
    monkeypatch.setattr(loss_kernels, "cross_entropy_rows", off_by_one_column)
    loss.fused_probe.cache_clear()
    try:
        assert loss.fused_probe("cpu", torch.float32).startswith("its probe's loss is ")
    finally:
        loss.fused_probe.cache_clear()
