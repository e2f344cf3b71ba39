"""The loss head as the trainer runs it under a compile plan (issue 37's CPU proxies): a tiny GPT with the real
50,304 vocab, memory.set_loss_head + precision.compile_model + the compile probe + optim.accumulate_gradients on a
real TokenLoader. Full logits live inside the one compiled graph: no aten op on a logit-sized tensor outside it,
no graph break, one graph, a handful of eager launches a micro-step, ~2 bytes a logit kept for backward, and the
loss and gradients of F.cross_entropy on the whole logits. A graph that falls back to eager is said in one line.

    python -m pytest -q tests/test_loss_head.py
"""
import io
import json
import os
from collections import Counter
from contextlib import redirect_stdout

import pytest
import torch
import torch._inductor.compile_fx
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from conftest import aten_outside_compiled, has_input_of, read_log, tiny_args, write_shards
from gpt2train import memory, optim, precision
from gpt2train.data import Sampling, TokenLoader
from model import GPT, GPTConfig
from train_gpt2 import main

V, B, T, ACCUM = 50304, 4, 32, 2  # 128 rows of 50,304 logits a micro-step, two micro-steps a step
N = B * T
CONFIG = GPTConfig(block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=32)
VIEWS = {"aten::view", "aten::slice", "aten::select", "aten::detach", "aten::alias", "aten::as_strided",
         "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::expand", "aten::_unsafe_view",
         "aten::reshape", "aten::lift_fresh", "aten::empty"}  # no kernel: not a launch


def loader(data_dir):
    return TokenLoader(data_dir, "train", B, T, Sampling(shuffle=False), vocab_size=V)


def trainer_model(plan, impl):
    """A fresh model with the trainer's loss head set (memory.set_loss_head), compiled and probed as
    train_gpt2.compile_and_wrap does; (raw, compiled)."""
    torch.manual_seed(0)
    raw = GPT(CONFIG)
    memory.set_loss_head(raw, plan, B, T, impl)
    compiled = precision.compile_model(raw, plan)
    with redirect_stdout(io.StringIO()) as said:
        assert compiled is not raw and precision.compiles(compiled, B, T, plan)
    assert "warning" not in said.getvalue(), said.getvalue()  # no compiler failure, no graph break
    return raw, compiled


def outside_compiled(events):
    """conftest.aten_outside_compiled's top-level ops (one a launch from Python)."""
    ops = aten_outside_compiled(events)
    return [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]


def logit_sized(e):
    return has_input_of(e, N * V)


def profiled_step(model, data_dir, plan):
    """One optimizer step's forward/backward through the trainer's accumulate_gradients, profiled."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optim.accumulate_gradients(model, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))
    return prof.events()


def saved_bytes(model, x, y, plan):
    """{storage: bytes} autograd keeps for backward from one forward (parameters and the batch left out)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast(plan):
        model(x, y)
    return saved


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("head") / "data"), n_train=4000, n_val=600)


@pytest.fixture(scope="module")
def fp32_run(data_dir):
    """The fp32 compile plan's full head: counters after the probe and one step, the step's profile, the model."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plan = precision.make_plan("cpu", "fp32", compile="true")
    raw, compiled = trainer_model(plan, "full")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optim.accumulate_gradients(compiled, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))  # compiles nothing more
    counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
    raw.zero_grad(set_to_none=True)
    events = profiled_step(compiled, data_dir, plan)
    yield dict(plan=plan, raw=raw, compiled=compiled, counters=counters, events=events)
    torch._dynamo.reset()


def test_full_head_is_one_graph_without_a_break(fp32_run):
    c = fp32_run["counters"]
    assert c["stats"]["unique_graphs"] == 1 and c["frames"]["total"] == c["frames"]["ok"] == 1
    assert not c.get("graph_break"), c.get("graph_break")
    assert not precision.graph_breaks()


def test_no_logit_sized_op_and_few_launches_outside_the_compiled_graph(fp32_run, data_dir):
    ops = outside_compiled(fp32_run["events"])
    assert not [e.name for e in ops if logit_sized(e)]
    launches = Counter(e.name for e in ops if e.name not in VIEWS)
    assert sum(launches.values()) <= 10 * ACCUM, launches  # <= 10 a micro-step: the batch, the loss scaling
    # the counter sees what it is meant to: the same step eager runs the head's ops on (N, V) tensors
    raw = fp32_run["raw"]
    raw.zero_grad(set_to_none=True)
    eager = outside_compiled(profiled_step(raw, data_dir, fp32_run["plan"]))
    names = {e.name for e in eager if logit_sized(e)}
    assert len(names) >= 2 and any("cross_entropy" in n or "softmax" in n for n in names), names
    assert sum(e.name not in VIEWS for e in eager) > 4 * sum(launches.values())  # 1 block: 107 against 15


def test_full_head_equals_f_cross_entropy_on_the_whole_logits(fp32_run, data_dir):
    """The trainer's step (compiled) against an independent eager reference written out here: the same loss and
    gradients, fp32 to 1e-5."""
    raw, compiled, plan = fp32_run["raw"], fp32_run["compiled"], fp32_run["plan"]
    raw.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = optim.accumulate_gradients(compiled, loader(data_dir), ACCUM, optim.Stepping(plan, scaler))
    got = {k: p.grad.clone() for k, p in raw.named_parameters()}
    raw.zero_grad(set_to_none=True)
    data, ref = loader(data_dir), 0.0
    for _ in range(ACCUM):
        x, y = data.next_batch("cpu")
        h = raw.hidden_states(x)  # (B, T, C)
        logits = h @ raw.lm_head.weight.t()  # (B, T, V)
        micro = F.cross_entropy(logits.view(-1, V), y.view(-1)) / ACCUM
        micro.backward()
        ref += micro.item()
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    for k, p in raw.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-5, msg=k)
    raw.zero_grad(set_to_none=True)


def test_bf16_full_head_keeps_two_bytes_a_logit_within_the_estimate(data_dir):
    """Under bf16 autocast the compiled head keeps the bf16 logits for backward (2 bytes a logit; eager
    F.cross_entropy keeps an fp32 log-softmax: 4), as memory.py's compiled estimate says, and gives
    the eager bf16 loss and gradients within bf16's rounding."""
    torch._dynamo.reset()
    plan = precision.make_plan("cpu", "bf16", compile="true")
    raw, compiled = trainer_model(plan, "full")
    x, y = loader(data_dir).next_batch("cpu")
    logit_bytes = lambda saved: sum(n for n in saved.values() if n >= N * V * 2)  # noqa: E731
    saved = saved_bytes(compiled, x, y, plan)
    assert logit_bytes(saved) / (N * V) <= 2.1
    step = memory.Step(CONFIG, T, dtype=torch.bfloat16, device_type="cpu", loss_impl="full", compiled=True)
    act, logits = memory.activation_bytes_estimate(step, B)
    assert logit_bytes(saved) == logits == N * V * 2  # the head: exactly the estimate's
    assert sum(saved.values()) <= 1.01 * (act + logits)  # the blocks: inductor picks what it saves (here +3.5 KB)
    assert logit_bytes(saved_bytes(raw, x, y, plan)) / (N * V) >= 4  # eager: the check can fail
    with precision.autocast(plan):
        got = compiled(x, y)[1]
    got.backward()
    grads = {k: p.grad.clone() for k, p in raw.named_parameters()}
    raw.zero_grad(set_to_none=True)
    with precision.autocast(plan):
        ref = F.cross_entropy(F.linear(raw.hidden_states(x), raw.lm_head.weight).view(-1, V), y.view(-1))
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-2)
    for k, p in raw.named_parameters():  # bf16: 8 mantissa bits
        torch.testing.assert_close(grads[k], p.grad, rtol=2e-2, atol=2e-2 * p.grad.abs().max().item(), msg=k)
    torch._dynamo.reset()


def test_a_graph_that_falls_back_to_eager_is_said_in_one_line(tmp_path, capsys, monkeypatch):
    """The trainer compiles (compile=true on CPU; loss_impl auto resolves to full there), then a later graph (the
    step-0 eval's) fails to compile: dynamo runs it eagerly, and the run says so in one line naming the frame and
    the error, with a "compile" row in log.jsonl; the run itself finishes."""
    real, calls = torch._inductor.compile_fx.compile_fx, []

    def failing_after_the_probe(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected: Triton is not available for this graph")
        return real(*args, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", failing_after_the_probe)
    data = write_shards(str(tmp_path / "data"))
    out = str(tmp_path / "out")
    args = tiny_args(data, out, max_steps=2, eval_interval=2, checkpoint_interval=0, compile="true",
                     compile_cache_dir="")
    try:
        assert main(args) == 0
    finally:
        torch._dynamo.reset()
    printed = capsys.readouterr().out
    warned = [line for line in printed.splitlines() if line.startswith("warning: torch.compile:")]
    assert len(warned) == 1 and "failed to compile and runs eagerly (RuntimeError: injected" in warned[0], printed
    assert "forward" in warned[0] and "loss_impl=full: the logits inside the compiled graph" in printed
    assert [e["compile"] for e in read_log(out) if "compile" in e] == warned
    config = json.load(open(os.path.join(out, "config.json")))
    assert "loss_impl" not in config["asked"] and config["resolved"]["loss_impl"] == "full"  # asked: the default
    assert "loss_impl" in config["decided"]
