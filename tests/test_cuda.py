"""The CUDA paths, on a real GPU (skipped without one): every plan this GPU can run trains, compile agrees
with eager, HellaSwag agrees with the CPU, the micro-batch finder's choice runs, resume continues the
run, and torchrun (NCCL) equals one process.

    python3 -m pytest -q tests/test_cuda.py     # on a machine with an NVIDIA GPU
"""
import dataclasses
import math
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)

import hellaswag  # noqa: E402
from gpt2train import ladder  # noqa: E402
from gpt2train import loss  # noqa: E402
from gpt2train import memory  # noqa: E402
from gpt2train import microbatch  # noqa: E402
from gpt2train import optim  # noqa: E402
from gpt2train import precision  # noqa: E402
from gpt2train.data import TokenLoader  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from conftest import (aten_outside_compiled, has_input_of, load_ckpt, make_rows, step_losses,  # noqa: E402
                      tiny_args, write_rows, write_shards)
from train_gpt2 import main  # noqa: E402

CAP = torch.cuda.get_device_capability(0)
SMALL = GPTConfig(block_size=128, vocab_size=64, n_layer=2, n_head=4, n_embd=64)


def runnable_plans():
    """(name, plan) for each plan this GPU runs: its own, an A100's (sm80+ GPUs: bf16, flash), a T4's (fp16 +
    GradScaler, memory-efficient attention) and fp32; eager (compile is tested below)."""
    plans = [("auto", precision.make_plan("cuda:0"))]
    if CAP >= (8, 0):
        plans.append(("sm80", precision.make_plan("cuda:0", emulate="sm80")))
    plans += [("sm75", precision.make_plan("cuda:0", emulate="sm75")), ("fp32", precision.make_plan("cuda:0", "fp32"))]
    return [(n, dataclasses.replace(p, compile=False)) for n, p in plans]


def counting_batch(B, T, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (B, 1), generator=g)
    seq = (start + torch.arange(T + 1)) % vocab  # (B, T+1): learnable, +1 each position
    return seq[:, :-1].cuda(), seq[:, 1:].cuda()


@pytest.mark.parametrize("name,plan", runnable_plans(), ids=[n for n, _ in runnable_plans()])
def test_each_plan_trains(name, plan):
    torch.manual_seed(0)
    model = GPT(SMALL).cuda()
    optimizers = optim.build_optimizers(model, lr=3e-3, weight_decay=0.0, device_type="cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=plan.grad_scaler)
    stepping = optim.Stepping(plan, scaler, optimizers)  # clipped at 1.0, as the trainer's default
    precision.set_tf32(plan.tf32)
    losses = []
    for step in range(20):
        x, y = counting_batch(8, 64, seed=step)
        losses.append(optim.train_step(model, stepping, x, y).loss)  # the trainer's step
    precision.set_tf32(False)
    assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
    assert losses[-1] < losses[0] - 1.0, (name, losses)


def test_compiled_equals_eager():
    plan = precision.make_plan("cuda:0")
    torch.manual_seed(0)
    model = GPT(SMALL).cuda()
    x, y = counting_batch(4, 64)
    with torch.no_grad(), precision.autocast(plan):
        eager = model(x, y)[1].float()
    compiled = precision.compile_model(model, dataclasses.replace(plan, compile=True))
    with torch.no_grad(), precision.autocast(plan):
        got = compiled(x, y)[1].float()
    tol = 2e-2 if plan.dtype != torch.float32 else 1e-4
    assert torch.allclose(eager, got, rtol=tol, atol=tol), (eager.item(), got.item())
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_weight_gradient_sums_in_fp32_inside_the_matmul(dtype):
    """loss.addmm_fp32 (aten's addmm with out_dtype) runs here in fp16 and bf16: the probe passes, and 4096 rows of
    16-bit products accumulated into an fp32 sum equal the float64 reference where fp16's own product overflows."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no bf16 matmul on this GPU")
    loss.fp32_out_matmul.cache_clear()
    assert loss.fp32_out_matmul(torch.device("cuda:0"), dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.rand(4096, 256, device="cuda", generator=g).to(dtype)  # (n, V): dL/dlogits' place
    b = (40 + torch.randn(4096, 64, device="cuda", generator=g)).to(dtype)  # (n, C): sums ~ 4096 x 0.5 x 40 = 81920
    acc = torch.randn(256, 64, device="cuda", generator=g)  # (V, C) fp32
    want = acc.double() + a.double().t() @ b.double()
    assert loss.addmm_fp32(acc, a.t(), b) is acc and acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if dtype == torch.float16:
        assert (a.t() @ b).isinf().any()  # the fallback's fp16 product of these rows


def test_a_4096_row_fp16_chunk_gives_the_fp32_weight_gradient(monkeypatch):
    """With the fp32-out matmul, fp16 chunks are not capped at 1024 rows: one 4096-row chunk whose fp16 product
    would overflow gives the fp32 loss's dL/dW (and dL/dh) within fp16's rounding."""
    loss.fp32_out_matmul.cache_clear()
    assert loss.loss_chunk_rows(4096, 512, 10**12, torch.float16, "cuda:0") == 4096
    rows, eager = [], loss.chunk_loss
    monkeypatch.setattr(loss, "chunk_loss", lambda hc, *a, **k: rows.append(hc.size(0)) or eager(hc, *a, **k))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 64, device="cuda", generator=g)
    h[:, 0] = 20.0  # every row aims at token 0: dL/dW[0, 0] sums 4096 x 20 > 65504
    h.requires_grad_()
    w = (0.1 * torch.randn(512, 64, device="cuda", generator=g)).requires_grad_()
    targets = torch.zeros(4096, dtype=torch.long, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        ours = loss.chunked_cross_entropy(h, w, targets, chunk_rows=4096)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), targets)
    assert rows == [4096] and abs(ours.item() - ref.item()) < 1e-3
    for a, b in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert torch.isfinite(a).all() and ((a - b).abs().max() / b.abs().max()).item() < 5e-3


def test_hellaswag_on_gpu_equals_cpu(hf_dir, tmp_path):
    examples = hellaswag.load_examples(data_file=write_rows(tmp_path / "rows.jsonl", make_rows(24)))
    model = GPT.load(hf_dir)
    cpu = hellaswag.evaluate(model, examples, plan=precision.make_plan("cpu"), batch_size=8)
    gpu = hellaswag.evaluate(model.cuda(), examples, plan=precision.make_plan("cuda:0", "fp32"), batch_size=8)
    assert [r["pred"] for r in gpu["examples"]] == [r["pred"] for r in cpu["examples"]]
    assert [r["pred_norm"] for r in gpu["examples"]] == [r["pred_norm"] for r in cpu["examples"]]


def test_hellaswag_compiled_packed_on_gpu_equals_eager(hf_dir, tmp_path):
    """The in-training path: inductor on the GPU, packed rows with a mask at one fixed shape, several
    examples per row. fp32 (TF32 off): the predictions of the eager CPU run; the GPU's own plan
    (bf16, its SDPA kernel list): runs, compiles once, and mostly agrees."""
    examples = hellaswag.load_examples(data_file=write_rows(tmp_path / "rows.jsonl", make_rows(24)))
    model = GPT.load(hf_dir)
    cpu = hellaswag.evaluate(model, examples, plan=precision.make_plan("cpu"), batch_size=8)
    model.cuda()
    fp32 = dataclasses.replace(precision.make_plan("cuda:0", "fp32"), tf32=False)
    for plan, agree in ((fp32, 24), (precision.make_plan("cuda:0"), 20)):
        torch._dynamo.reset()
        compiled = precision.compile_model(model, dataclasses.replace(plan, compile=True))
        precision.set_tf32(plan.tf32)
        first = hellaswag.evaluate(compiled, examples, plan=plan, batch_size=8)
        again = hellaswag.evaluate(compiled, examples, plan=plan, batch_size=8)
        precision.set_tf32(False)
        assert first["examples"] == again["examples"]
        same = sum(a["pred"] == b["pred"] and a["pred_norm"] == b["pred_norm"]
                   for a, b in zip(first["examples"], cpu["examples"]))
        assert same >= agree, (plan.describe(), same)
    torch._dynamo.reset()


def test_count_syncs_sees_item():
    assert ladder.count_syncs(lambda: torch.ones(3, device="cuda").sum().item()) == 1
    assert ladder.count_syncs(lambda: torch.ones(3, device="cuda").sum()) == 0


@pytest.mark.parametrize("precision_name,optimizer", [("auto", "adamw"), ("fp16", "adamw"), ("auto", "muon"),
                                                    ("fp16", "muon")])
def test_trainer_step_syncs_the_host_at_most_once(precision_name, optimizer, data_dir):
    """The trainer's step (2 micro-steps, clip, fused AdamW (+ Muon), fp16's GradScaler) reads loss and norm
    in one transfer and waits for the GPU nowhere else. The batches come from the trainer's own loader (rows
    gathered on the host, one pinned buffer, one non-blocking copy), so its syncs would count too."""
    plan = precision.make_plan("cuda:0", precision_name)
    torch.manual_seed(0)
    model = GPT(SMALL).cuda()
    optimizers = optim.build_optimizers(model, optimizer, lr=1e-3, weight_decay=0.1, device_type="cuda",
                                        ns_dtype=optim.ns_dtype_for(plan.dtype, "cuda"))  # fused AdamW
    scaler = torch.amp.GradScaler("cuda", enabled=plan.grad_scaler)
    params = [p for p in model.parameters() if p.requires_grad]
    loader = TokenLoader(data_dir, "train", 4, 64, vocab_size=SMALL.vocab_size)  # the toy shards: vocab 64

    stepping = optim.Stepping(plan, scaler, optimizers, params)

    def step():
        loss = optim.accumulate_gradients(model, loader, 2, stepping)
        return optim.optimizer_step(stepping, 1.0, loss)

    step()  # the first step creates the optimizer state and the loss scale
    assert ladder.count_syncs(step) <= 1


def test_finder_times_the_compiled_model_and_its_choice_runs(monkeypatch):
    plan = precision.make_plan("cuda:0")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=2, n_head=4, n_embd=128)).cuda()
    optimizers = optim.build_optimizers(model, lr=1e-3, weight_decay=0.1, device_type="cuda")
    compiled_at = []

    def compiles(step_model, b, seq_len, plan):
        compiled_at.append(b)
        return precision.compiles(step_model, b, seq_len, plan)
    monkeypatch.setattr(microbatch, "compiles", compiles)  # the finder's own name for precision.compiles
    step = memory.Step(model.config, 256, 256 * 64, dtype=plan.dtype, loss_impl="auto",  # 64 rows: at most 64
                       activation_checkpointing=model.activation_checkpointing)
    b, reason, timed = microbatch.auto_micro_batch(model, optimizers, plan, step)
    assert 1 <= b <= 64 and (256 * 64) % (b * 256) == 0, reason
    assert len(compiled_at) == 1 and compiled_at[0] >= b, (compiled_at, reason)  # once, at the largest size timed
    assert ("timed compiled" in reason) == (timed is not model) == plan.compile, reason
    x, y = microbatch.random_batch(b, 256, "cuda:0")
    scaler = torch.amp.GradScaler("cuda", enabled=plan.grad_scaler)
    assert math.isfinite(optim.train_step(timed, optim.Stepping(plan, scaler, optimizers), x, y).loss)
    torch._dynamo.reset()


def test_resume_on_gpu_continues_the_run(tmp_path):
    data = write_shards(str(tmp_path / "data"))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    args = dict(device="cuda", compile="false")
    assert main(tiny_args(data, straight, **args)) == 0
    os.makedirs(resumed)
    shutil.copy(os.path.join(straight, "ckpt_000004.pt"), resumed)
    assert main(tiny_args(data, resumed, resume="true", **args)) == 0
    a, b = step_losses(straight), step_losses(resumed)
    assert sorted(b) == [4, 5, 6, 7]
    assert all(abs(a[s] - b[s]) < 1e-5 for s in b)  # GPU kernels may differ in the last bits, not more
    wa, wb = load_ckpt(os.path.join(straight, "ckpt_000008.pt")), load_ckpt(os.path.join(resumed, "ckpt_000008.pt"))
    assert all(torch.allclose(wa["model"][k], wb["model"][k], atol=1e-5) for k in wa["model"])
    assert torch.is_tensor(wa["rng"]["cuda"])  # one GPU generator: resumable with any number of GPUs


def test_reduce_overhead_trains_like_eager_with_accumulation(tmp_path, capsys):
    """compile_mode=reduce-overhead: the compiled micro-steps replay as CUDA graphs over 2 accumulation steps and
    the evals; the gradients accumulate into buffers outside the graphs (a replay must not overwrite them), so the
    run's losses are the eager run's; inductor kept no graph out of CUDA graphs."""
    data = write_shards(str(tmp_path / "data"))
    eager, graphs = str(tmp_path / "eager"), str(tmp_path / "graphs")
    args = dict(device="cuda", precision="fp32", max_steps=4, eval_interval=2, checkpoint_interval=0)
    assert main(tiny_args(data, eager, compile="false", **args)) == 0
    capsys.readouterr()
    try:
        assert main(tiny_args(data, graphs, compile="true", compile_mode="reduce-overhead", **args)) == 0
    finally:
        torch._dynamo.reset()
    printed = capsys.readouterr().out
    assert "compile on (reduce-overhead, CUDA graphs)" in printed and "warning" not in printed, printed
    a, b = step_losses(eager), step_losses(graphs)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3] and all(abs(a[s] - b[s]) < 2e-3 for s in a), (a, b)

def test_the_kernel_layouts_on_the_gpu_give_the_default_loss_and_gradients():
    """gelu_impl=epilogue (cuBLASLt's GELU epilogue through torch._addmm_activation: the tanh GELU, as the model's)
    and qkv_impl=split, compiled as the trainer compiles, in the GPU's plan: one graph, the default layout's loss
    and gradients within the dtype's rounding."""
    plan = precision.make_plan("cuda:0")
    x, y = counting_batch(4, 128)
    results = []
    for runtime in ({}, dict(gelu_impl="epilogue", qkv_impl="split")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = GPT(SMALL, loss_impl="full").cuda().set_runtime(**runtime)
        compiled = precision.compile_model(model, plan)
        assert precision.compiles(compiled, 4, 128, plan) and not precision.graph_breaks()
        with precision.autocast(plan):
            _, loss = compiled(x, y)
        loss.backward()
        results.append((loss.item(), [p.grad.float() for p in model.parameters()]))
    torch._dynamo.reset()
    (l0, g0), (l1, g1) = results
    tol = 2e-2 if plan.dtype != torch.float32 else 1e-4
    assert abs(l0 - l1) <= tol * abs(l0), (l0, l1)
    assert all((a - b).abs().max() <= tol * a.abs().max() for a, b in zip(g0, g1))

def test_torchrun_on_one_gpu_equals_one_process(tmp_path):
    """torchrun with one worker on the GPU: NCCL for the training collectives (the loss and stop requests'
    all_reduce), gloo for the start-up waits; the run equals the plain process's."""
    import sys
    from conftest import Launched, torchrun_env
    data = write_shards(str(tmp_path / "data"))
    plain, launched = str(tmp_path / "plain"), str(tmp_path / "launched")
    args = dict(device="cuda", compile="false", max_steps=4)
    assert main(tiny_args(data, plain, **args)) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_gpt2.py",
           *tiny_args(data, launched, **args)]
    env = torchrun_env(NCCL_SOCKET_IFNAME="lo")  # NCCL's bootstrap on the loopback too: a machine with no network
    with Launched([cmd], tmp_path, env=env) as run:
        assert run.wait(timeout=300) == [0], run.logs()
    a, b = step_losses(plain), step_losses(launched)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3] and all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)


@pytest.mark.parametrize("name", ["auto", "sm75"])
def test_the_full_loss_head_runs_inside_the_compiled_graph_on_the_gpu(name, data_dir):
    """Issue 37 on the GPU's own torch: the trainer's path (set_loss_head, compile_model, the probe,
    accumulate_gradients on its loader) with full logits is one graph, no break, every frame compiled, no
    aten op on a logit-sized tensor outside compiled code (the H200's eager head ran eq, bitwise_and, exp
    there), nothing for CompileWatch to say, and the loss of an eager F.cross_entropy over the logits."""
    plan = dataclasses.replace(precision.make_plan("cuda:0", emulate=None if name == "auto" else name),
                               compile=True)
    B, T, V = 4, 64, 50304
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=128, vocab_size=V, n_layer=2, n_head=4, n_embd=64)).cuda()
    memory.set_loss_head(raw, plan, B, T, "full")
    compiled = precision.compile_model(raw, plan)
    watch = precision.CompileWatch()
    try:
        assert precision.compiles(compiled, B, T, plan)
        scaler = torch.amp.GradScaler("cuda", enabled=plan.grad_scaler)
        loader = TokenLoader(data_dir, "train", B, T, vocab_size=V)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            loss = optim.accumulate_gradients(compiled, loader, 2, optim.Stepping(plan, scaler))
        torch.cuda.synchronize()
        assert watch.check() == []
    finally:
        watch.close()
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["total"] == counters["frames"]["ok"]
    outside = aten_outside_compiled(prof.events())
    logit_sized = [e.name for e in outside if has_input_of(e, B * T * V)]
    assert not logit_sized, logit_sized
    assert not {"aten::eq", "aten::bitwise_and", "aten::exp"} & {e.name for e in outside}
    x, y = TokenLoader(data_dir, "train", B, T, vocab_size=V).next_batch("cuda:0")
    with torch.no_grad(), precision.autocast(plan):
        ref = torch.nn.functional.cross_entropy(raw.lm_head(raw.hidden_states(x)).float().view(-1, V), y.view(-1))
    with torch.no_grad(), precision.autocast(plan):
        got = compiled(x, y)[1]
    assert abs(got.item() - ref.item()) < 1e-2 * ref.item() and math.isfinite(loss.item())
    torch._dynamo.reset()

# -----------------------------------------------------------------------------
# the fused loss head (loss_impl=fused) on the GPU's Triton: tests/test_loss_fused.py's twins


def fused_dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if CAP >= (8, 0) else [])


@pytest.mark.parametrize("dtype", fused_dtypes(), ids=lambda d: precision.dtype_name(d))
def test_the_fused_head_equals_f_cross_entropy_on_the_gpu(dtype):
    """The compiled Triton kernel at GPT-2's odd vocab (50257), rows that are no multiple of anything, ignored
    rows, an incoming gradient of 2^16 / 8 (a GradScaler's scale over 8 micro-steps): the loss and gradients of
    F.cross_entropy over the same rounded inputs in fp32, within the dtype's rounding, finite."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, C, V = 1031, 64, 50257
    h = torch.randn(N, C, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (0.2 * torch.randn(V, C, device="cuda", generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    targets[::9] = -1
    targets[1], targets[2] = 0, V - 1
    incoming = 2.0 ** 16 / 8
    ours = loss.fused_loss(h, w, targets)
    got = [ours.detach(), *torch.autograd.grad(incoming * ours, (h, w))]
    h32, w32 = (t.detach().float().requires_grad_() for t in (h, w))
    ref = torch.nn.functional.cross_entropy(h32 @ w32.t(), targets, ignore_index=-1)
    want = [ref.detach(), *torch.autograd.grad(incoming * ref, (h32, w32))]
    tol = 1e-5 if dtype == torch.float32 else 5e-3 if dtype == torch.float16 else 2e-2
    assert abs(got[0].item() - want[0].item()) <= tol * want[0].item()
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == dtype and torch.isfinite(a).all()
        assert ((a.float() - b).abs().max() / b.abs().max()).item() <= tol
    assert got[1][targets == -1].abs().max() == 0


@pytest.mark.parametrize("dtype", fused_dtypes()[1:], ids=lambda d: precision.dtype_name(d))
def test_the_fused_head_holds_one_logits_buffer_on_the_gpu(dtype):
    """Forward + backward of the fused head at 8192 x 50304 in a 16-bit dtype: the peak above what was allocated
    before is one logits buffer and the GEMMs' small operands (< 1.1 x N x V x 2 bytes; the compiled full head
    keeps the logits and writes dL/dlogits beside them: the -6.6 GB of issue 43 at 64 x 1024, in small)."""
    N, C, V = 8192, 128, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, C, device="cuda", generator=g).requires_grad_()
    w = (0.1 * torch.randn(V, C, device="cuda", generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    for _ in range(2):  # the second: Triton's kernel compiled, the allocator warm
        h.grad = w.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=dtype):
            out = loss.loss_head(h, w, targets, "fused")[1]
        out.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    assert peak < 1.1 * N * V * 2, peak / (N * V * 2)


@pytest.mark.parametrize("name", ["auto", "sm75"])
def test_the_fused_head_runs_inside_the_compiled_graph_on_the_gpu(name, data_dir):
    """The trainer's path with loss_impl=fused (auto: bf16; sm75: fp16 + GradScaler): auto picks it here (its
    start-up probe passes), one graph, no break, no aten op on a logit-sized tensor outside compiled code (the
    custom op runs inside it), the loss of F.cross_entropy over the logits, and one host sync a trainer step."""
    plan = dataclasses.replace(precision.make_plan("cuda:0", emulate=None if name == "auto" else name),
                               compile=True)
    B, T, V = 4, 64, 50304
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=128, vocab_size=V, n_layer=2, n_head=4, n_embd=64)).cuda()
    step = memory.Step(raw.config, T, B * T * 2, dtype=plan.dtype, loss_impl="auto", compiled=True)
    assert memory.use_loss_head(raw, plan, step, B)[0] == "fused" == raw.loss_impl
    compiled = precision.compile_model(raw, plan)
    watch = precision.CompileWatch()
    try:
        assert precision.compiles(compiled, B, T, plan)
        scaler = torch.amp.GradScaler("cuda", enabled=plan.grad_scaler)
        loader = TokenLoader(data_dir, "train", B, T, vocab_size=V)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            loss_ = optim.accumulate_gradients(compiled, loader, 2, optim.Stepping(plan, scaler))
        torch.cuda.synchronize()
        assert watch.check() == []
        optimizers = optim.build_optimizers(raw, lr=1e-3, weight_decay=0.1, device_type="cuda")
        params = [p for p in raw.parameters() if p.requires_grad]

        stepping = optim.Stepping(plan, scaler, optimizers, params)

        def train_step():
            micro = optim.accumulate_gradients(compiled, loader, 2, stepping)
            return optim.optimizer_step(stepping, 1.0, micro)
        train_step()  # the optimizer state and the loss scale
        assert ladder.count_syncs(train_step) <= 1
    finally:
        watch.close()
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["total"] == counters["frames"]["ok"]
    assert any(e.name == "gpt2train::fused_cross_entropy" for e in prof.events())
    outside = aten_outside_compiled(prof.events())
    assert not [e.name for e in outside if has_input_of(e, B * T * V)]
    x, y = TokenLoader(data_dir, "train", B, T, vocab_size=V).next_batch("cuda:0")
    with torch.no_grad(), precision.autocast(plan):
        ref = torch.nn.functional.cross_entropy(raw.lm_head(raw.hidden_states(x)).float().view(-1, V), y.view(-1))
        got = compiled(x, y)[1]
    assert abs(got.item() - ref.item()) < 1e-2 * ref.item() and math.isfinite(loss_.item())
    torch._dynamo.reset()


def test_the_trainer_with_the_fused_head_on_the_gpu_trains_as_the_full_one(tmp_path):
    """Four fp32 steps of the trainer on the GPU, fused against full: the same losses to 1e-4, and the console
    names the head."""
    data = write_shards(str(tmp_path / "data"))
    runs = {}
    for impl in ("full", "fused"):
        out = str(tmp_path / impl)
        assert main(tiny_args(data, out, device="cuda", precision="fp32", compile="false", max_steps=4,
                              eval_interval=0, checkpoint_interval=0, loss_impl=impl)) == 0
        runs[impl] = step_losses(out)
    assert sorted(runs["fused"]) == [0, 1, 2, 3]
    assert all(abs(runs["fused"][s] - runs["full"][s]) < 1e-4 for s in runs["full"]), runs
