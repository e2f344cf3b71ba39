"""memory.py: the memory estimate of a training step (checked against what the forward keeps and the
measured peak), the memory line; microbatch.py, the finder over it: the sm7x fit, the micro-batch search (with
injected memory and speed functions, checked against brute force), the CPU side of the probing, and the one
micro-batch decision."""
import dataclasses
import os
import re
from types import SimpleNamespace

import pytest
import torch

import bench
from gpt2train import loss
from gpt2train import optim
from gpt2train import memory
from gpt2train import memory_report
from gpt2train import microbatch
from gpt2train import precision
from conftest import ROOT, adamw, cpu_plan, tiny_model
from gpt2train.fileio import UserError
from gpt2train.loss import CE_CHUNK_ROWS
from gpt2train.memory import Step, param_counts, training_bytes_estimate
from gpt2train.microbatch import fit_micro_batch
from model import GPT, GPTConfig, PRETRAINED
from gpt2train.precision import default_plan

FP16 = torch.float16
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)  # bf16/fp32: a disabled scaler, a no-op

# -----------------------------------------------------------------------------
# what a training step holds: parameters, gradients, optimizer state, activations


@pytest.mark.parametrize("attn,dtype", [("sdpa", torch.float32), ("naive", torch.float32), ("sdpa", torch.bfloat16),
                                        ("naive", torch.bfloat16)])
@pytest.mark.parametrize("loss_impl", ["full", "chunked", "fused"])
@pytest.mark.parametrize("ckpt", ["none", "blocks", "every_other"])
def test_activation_estimate_matches_what_the_forward_keeps(attn, dtype, loss_impl, ckpt):
    torch.manual_seed(0)
    config = GPTConfig(block_size=32, vocab_size=300, n_layer=3, n_head=4, n_embd=32, attn_impl=attn)
    model = GPT(config, activation_checkpointing=ckpt, loss_impl=loss_impl)
    x, y = torch.randint(0, 300, (3, 24)), torch.randint(0, 300, (3, 24))
    saved, logits = memory_report.saved_activation_bytes(model, x, y, cpu_plan(dtype))
    step = Step(config, 24, dtype=dtype, device_type="cpu", activation_checkpointing=ckpt, loss_impl=loss_impl)
    assert (saved, logits) == memory.activation_bytes_estimate(step, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_impl,ckpt", [("full", "none"), ("chunked", "none"), ("chunked", "every_other"),
                                            ("chunked", "blocks"), ("fused", "none")])
def test_training_estimate_is_on_the_safe_side(dtype, loss_impl, ckpt):
    """The estimate, less the parameters and AdamW state (not made by a step), is at least the measured
    peak of forward + backward and not wildly above it."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=3000, n_layer=3, n_head=4, n_embd=64)
    x, y = torch.randint(0, 3000, (4, 64)), torch.randint(0, 3000, (4, 64))
    model = GPT(config, activation_checkpointing=ckpt, loss_impl=loss_impl)
    measured = memory_report.step_peak_bytes(model, x, y, cpu_plan(dtype))
    parts = memory.training_bytes_estimate(Step(config, 64, dtype=dtype, device_type="cpu",
                                                activation_checkpointing=ckpt, loss_impl=loss_impl), 4)
    n = sum(p.numel() for p in GPT(config).parameters())
    assert parts["parameters"] == parts["gradients"] == 4 * n and parts["optimizer state"] == 8 * n
    step = sum(parts.values()) - parts["parameters"] - parts["optimizer state"]
    assert measured <= step <= 1.5 * measured


def test_training_estimate_shards_under_fsdp_and_adds_ddp_buckets():
    config = GPTConfig(vocab_size=50304, **bench.SIZES["gpt2-xl"])
    n, block = memory.param_counts(config)
    assert round(n / 1e6) == 1558
    step = Step(config, 1024, dtype=torch.bfloat16)
    one = memory.training_bytes_estimate(step, 1)
    ddp = memory.training_bytes_estimate(dataclasses.replace(step, world_size=8), 1)
    fsdp = memory.training_bytes_estimate(dataclasses.replace(step, world_size=8, fsdp=True), 1)
    assert one["parameters"] + one["gradients"] + one["optimizer state"] == 16 * n  # ~25 GB
    assert ddp["DDP buckets"] == 4 * n and one["DDP buckets"] == 0
    assert fsdp["optimizer state"] == 8 * n // 8 and fsdp["FSDP gathered"] == 2 * 4 * (n - 48 * block) + 3 * 2 * block
    assert fsdp["activations"] == one["activations"] - 2 * 48 * 12 * 1600 ** 2  # no autocast copies of block weights


def test_estimated_micro_batch_is_the_largest_that_fits():
    config = GPTConfig(vocab_size=50304, **bench.SIZES["gpt2-medium"])
    step = Step(config, 1024, dtype=torch.bfloat16, activation_checkpointing="every_other")
    total = lambda b: sum(memory.training_bytes_estimate(step, b).values())  # noqa: E731
    budget = 0.9 * 40 * 2**30
    b = microbatch.estimated_micro_batch(step, budget)
    assert b > 1 and total(b) <= budget < total(b + 1)
    assert microbatch.estimated_micro_batch(step, total(1) - 1) == 0
    cap, note = microbatch.micro_batch_cap(step, budget)
    assert cap == 4 * b and f"fits {b}" in note and "every_other" in note


def test_memory_summary_counts_the_tensors_on_cpu():
    model = tiny_model(vocab_size=50257)
    opt = adamw(model)
    stepping = optim.Stepping(default_plan("cpu"), NO_SCALER, [opt])
    optim.train_step(model, stepping, *microbatch.random_batch(2, 16, "cpu"))
    line = memory.memory_summary(model, [opt], default_plan("cpu"), 2, 16)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)  # the tied wte/lm_head weight once
    assert f"params {memory.fmt_bytes(4 * n)}" in line and f"grads {memory.fmt_bytes(4 * n)}" in line
    state = 2 * 4 * n + 4 * len(params)  # exp_avg, exp_avg_sq, and a float32 step counter per tensor
    assert f"optimizer state {memory.fmt_bytes(state)}" in line
    assert "activations ~" in line and "n/a on cpu" in line
    assert "\n" not in line


def test_allocator_line_splits_the_peak(monkeypatch):
    """The CUDA allocator's part of the memory line: the peak's share beyond the parameters, gradients and
    optimizer state (the step's activations, logits, temporaries), the slack reserved beyond the peak allocated,
    and the allocator's settings, from the allocator's own counters."""
    GiB = 2**30
    for name, value in (("memory_allocated", 3 * GiB), ("memory_reserved", 5 * GiB),
                        ("max_memory_allocated", 40 * GiB), ("max_memory_reserved", 46 * GiB)):
        monkeypatch.setattr(torch.cuda, name, lambda device=None, v=value: v)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    line = memory.allocator_line("cuda:0", 2 * GiB)
    assert line == ("allocated 3.0 GiB, reserved 5.0 GiB (+2.0 GiB cached), peak allocated 40.0 GiB (the step's "
                    "own 38.0 GiB), peak reserved 46.0 GiB (slack 6.0 GiB), allocator expandable_segments:True")


def test_fmt_bytes():
    values = (None, 512, 2048, 3 * 2**20, 5 * 2**30)
    assert [memory.fmt_bytes(v) for v in values] == ["n/a", "512 B", "2.0 KiB", "3.0 MiB", "5.0 GiB"]

# -----------------------------------------------------------------------------
# sm7x: micro-batch first, seq_len only when even one sequence does not fit


GB = 1024 ** 3
GPT2 = GPTConfig(vocab_size=50304, **PRETRAINED["gpt2"])
GPT2_MEDIUM = GPTConfig(vocab_size=50304, **PRETRAINED["gpt2-medium"])


def test_param_count_matches_the_model():
    with torch.device("meta"):
        for config in (GPT2, GPT2_MEDIUM, GPTConfig(block_size=64, vocab_size=300, n_layer=3, n_head=2, n_embd=16)):
            assert param_counts(config)[0] == GPT(config).num_params(non_embedding=False)


def fits(config, b, t, memory, headroom=0.15):
    return sum(training_bytes_estimate(Step(config, t, dtype=FP16), b).values()) <= (1 - headroom) * memory


@pytest.mark.parametrize("gpu,memory,config,expect", [
    ("T4 16 GB", 15 * GB, GPT2, (16, 1024)),
    ("RTX 2070 8 GB", 7.8 * GB, GPT2, (8, 1024)),
    ("V100 32 GB", 31.7 * GB, GPT2, (64, 1024)),
    ("T4 16 GB, 350M", 15 * GB, GPT2_MEDIUM, (4, 1024)),
    ("V100 32 GB, 350M", 31.7 * GB, GPT2_MEDIUM, (16, 1024)),
    ("RTX 2070 8 GB, 350M", 7.8 * GB, GPT2_MEDIUM, (1, 256)),  # not even 1 x 1024 (nor 512) fits: the sequence halves
])
def test_fit_micro_batch(gpu, memory, config, expect):
    b, t, reason = fit_micro_batch(Step(config, 1024, 524288, 1, FP16), memory)
    assert (b, t) == expect, gpu
    assert fits(config, b, t, memory) and not fits(config, 2 * b, t, memory)  # the largest that fits
    assert 524288 % (b * t) == 0 and f"{b} x {t}" in reason
    if t < 1024:
        assert not fits(config, 1, 2 * t, memory) and f"seq_len 1024 -> {t}" in reason


def test_fit_keeps_a_user_seq_len_and_says_when_nothing_fits():
    with pytest.raises(UserError, match="does not fit in 7.8 GiB at seq_len 1024"):
        fit_micro_batch(Step(GPT2_MEDIUM, 1024, 524288, 1, FP16, shrink_seq=False), 7.8 * GB)
    xl = GPTConfig(vocab_size=50304, **PRETRAINED["gpt2-xl"])
    with pytest.raises(UserError, match="1558M-parameter model does not fit in 15.0 GiB at seq_len 64"):
        fit_micro_batch(Step(xl, 1024, 524288, 1, FP16), 15 * GB)
    b, t, _ = fit_micro_batch(Step(GPT2, 1024, 524288, 8, FP16), 15 * GB)  # 8 ranks: 64 rows per rank per step
    assert (b, t) == (16, 1024) and 524288 % (b * t * 8) == 0

# -----------------------------------------------------------------------------
# micro-batch search


def brute_force(limit, seq_len, total, world, headroom, speed, n_timed=3):
    """The rule spelled out: divisors of total/(seq_len*world) that fit, multiples of 8 if any fit,
    the fastest of the n_timed largest."""
    rows = total // (seq_len * world)
    fit = [b for b in range(1, rows + 1) if rows % b == 0 and b <= limit]
    pool = [b for b in fit if b % 8 == 0] or fit
    return max(reversed(pool[-n_timed:]), key=speed)  # ties go to the larger micro-batch


def linear_usage(limit, headroom=0.1):
    """Memory use that crosses the 1 - headroom line just above micro-batch `limit`; None (OOM) past 1."""
    def usage(b):
        u = (1 - headroom) * (b + 0.5) / (limit + 0.5) - 1e-9 if b <= limit else 0.95 + 0.01 * (b - limit)
        return None if u > 1 else u
    return usage


@pytest.mark.parametrize("limit,seq_len,total,world", [
    (70, 1024, 524288, 1), (50, 1024, 480 * 1024, 1), (100, 1024, 524288, 4), (5, 1024, 524288, 1),
    (1000, 1024, 524288, 1), (23, 256, 240 * 256, 2), (9, 1, 96, 1),
])
@pytest.mark.parametrize("speed", [lambda b: 1000.0 * b, lambda b: -abs(b - 40.0)])  # monotone; best at 40
def test_search_matches_brute_force(limit, seq_len, total, world, speed):
    calls = []
    usage = linear_usage(limit)
    b, reason = microbatch.search_micro_batch(lambda b: calls.append(b) or usage(b), speed,
                                          Step(GPT2, seq_len, total, world))
    assert b == brute_force(limit, seq_len, total, world, 0.1, speed)
    accum = total // (b * seq_len * world)
    assert b * seq_len * world * accum == total
    assert f"micro_batch {b}" in reason and f"grad_accum {accum}" in reason
    assert len(calls) <= 2 * max(1, total // (seq_len * world)).bit_length()  # bisection, not a scan


def test_search_prefers_multiples_of_8_without_needing_powers_of_two():
    b, reason = microbatch.search_micro_batch(linear_usage(60), lambda b: float(b), Step(GPT2, 1024, 480 * 1024))
    assert b == 48  # 60 fits but 48 is the largest multiple of 8 dividing 480; 56 and 64 do not divide it
    assert "grad_accum 10" in reason and "80 runs out of memory" in reason


def test_search_falls_back_below_8_and_says_so():
    b, reason = microbatch.search_micro_batch(linear_usage(6), lambda b: float(b), Step(GPT2, 1024, 524288))
    assert b == 4 and "no multiple of 8 fits" in reason


def test_search_keeps_headroom():
    usage = lambda b: {8: 0.5, 16: 0.85, 32: 0.95}.get(b, 2.0 if b > 32 else 0.1)  # noqa: E731
    speed = lambda b: float(b)  # noqa: E731
    assert microbatch.search_micro_batch(usage, speed, Step(GPT2, 1024, 65536), headroom=0.1)[0] == 16
    assert microbatch.search_micro_batch(usage, speed, Step(GPT2, 1024, 65536), headroom=0.0)[0] == 32
    assert microbatch.search_micro_batch(usage, speed, Step(GPT2, 1024, 65536), headroom=0.2)[0] == 8


def test_search_treats_oom_as_not_fitting():
    b, reason = microbatch.search_micro_batch(lambda b: None if b > 16 else 0.5, lambda b: float(b),
                                          Step(GPT2, 1024, 524288))
    assert b == 16 and "32 runs out of memory" in reason


def test_search_respects_max_micro_batch():
    step = Step(GPT2, 1024, 524288)
    assert microbatch.search_micro_batch(lambda b: 0.1, lambda b: float(b), step, max_micro_batch=100)[0] == 64


def test_search_refuses_what_cannot_divide_or_fit():
    with pytest.raises(ValueError, match="not divisible by seq_len x world_size = 2048"):
        microbatch.search_micro_batch(lambda b: 0.1, lambda b: 1.0, Step(GPT2, 1024, 500000, 2))
    with pytest.raises(ValueError, match="no micro-batch fits"):
        microbatch.search_micro_batch(lambda b: None, lambda b: 1.0, Step(GPT2, 1024, 524288))

# -----------------------------------------------------------------------------
# probing on the real model (the CPU half of what runs on CUDA)


def test_search_skips_sizes_that_fail_when_timed():
    """The timed model (compiled) may fail where the eager probe fit: such sizes are out, and while none of
    the timed ones ran the search goes on down the sizes that fit."""
    usage = linear_usage(64)  # 64 rows: 8, 16, 32 and 64 divide them, all fit
    timed = []

    def measure(b):
        timed.append(b)
        return None if b > 16 else float(b)
    b, reason = microbatch.search_micro_batch(usage, measure, Step(GPT2, 1024, 64 * 1024))
    assert timed == [64, 32, 16]
    assert b == 16 and "out of memory or over the 90% limit" in reason, reason
    timed.clear()
    b, reason = microbatch.search_micro_batch(lambda b: 0.1, lambda b: timed.append(b) or (None if b > 8 else 1.0),
                                             Step(GPT2, 1024, 64 * 1024))
    assert timed == [64, 32, 16, 8] and b == 8, (timed, reason)  # past the 3 timed: on until one runs
    with pytest.raises(ValueError, match="could be timed"):
        microbatch.search_micro_batch(lambda b: 0.1, lambda b: None, Step(GPT2, 1024, 64 * 1024))


def test_auto_micro_batch_falls_back_on_cpu(monkeypatch):
    model = tiny_model(vocab_size=256)
    opt = adamw(model)
    monkeypatch.setattr(microbatch, "DEFAULT_MICRO_BATCH", 16)  # the config's default, off CUDA
    b, reason, timed = microbatch.auto_micro_batch(model, [opt], default_plan("cpu"), Step(model.config, 32, 4096, 2))
    assert b == 16 and "needs CUDA" in reason and "cpu" in reason and "grad_accum 4" in reason and timed is None
    monkeypatch.setattr(microbatch, "DEFAULT_MICRO_BATCH", 12)
    with pytest.raises(ValueError, match="not divisible"):
        microbatch.auto_micro_batch(model, [opt], default_plan("cpu"), Step(model.config, 32, 4096, 1))


def test_probe_steps_leave_weights_grads_and_optimizer_untouched():
    model = tiny_model(vocab_size=50257)  # random_batch draws real GPT-2 token ids
    opt = adamw(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lrs = [g["lr"] for g in opt.param_groups]
    seconds = microbatch.probe_steps(model, [opt], 2, 16, default_plan("cpu"), steps=2)
    assert seconds > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == 0
    assert [g["lr"] for g in opt.param_groups] == lrs
    stepping = optim.Stepping(default_plan("cpu"), NO_SCALER, [opt])
    optim.train_step(model, stepping, *microbatch.random_batch(2, 16, "cpu"))
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])  # the optimizer still trains

# -----------------------------------------------------------------------------
# THE micro-batch of a run: choose_micro_batch, decided once before step 0


def gpu_plan(cap, memory_gib):
    """A CUDA plan for a GPU of this generation and memory (a plan is data: no GPU needed to decide from it)."""
    return default_plan("cuda:0", cap, "a test GPU", int(memory_gib * GB))


def shape(model, plan, seq_len=1024, total=524288, world_size=1, **asked):
    """The step's shape setup builds for this model, plan and batch (memory.Step); asked: fit, divide, shrink_seq."""
    return Step(model.config, seq_len, total, world_size, plan.dtype, plan.device_type,
                activation_checkpointing=model.activation_checkpointing, **asked)


def test_choose_micro_batch_fits_sm7x_always_and_others_when_the_asked_one_does_not_fit():
    gpt2 = SimpleNamespace(config=GPT2, activation_checkpointing="none")  # what it reads of a model, not probing
    t4, a100, rtx = gpu_plan((7, 5), 15), gpu_plan((8, 0), 40), gpu_plan((8, 6), 24)
    b, t, why, timed = microbatch.choose_micro_batch(gpt2, [], t4, shape(gpt2, t4), 64)
    assert (b, t, timed) == (16, 1024, None) and "fitted to 15.0 GiB: 16 x 1024" in why and "grad_accum 32" in why
    assert why.endswith("(set micro_batch_size/seq_len to choose yourself)")
    kept = microbatch.choose_micro_batch(gpt2, [], t4, shape(gpt2, t4, fit=False, divide=False), 64)  # the user's
    assert kept == (64, 1024, "", None)
    assert microbatch.choose_micro_batch(gpt2, [], a100, shape(gpt2, a100), 64) == (64, 1024, "", None)
    # 24 GB at sm86: 64 x 1024 needs ~24 GiB, over 85% of the card, 32 x 1024 fits: fitted although not sm7x
    assert memory.training_bytes(Step(GPT2, 1024, dtype=torch.bfloat16), 64) > 0.85 * 24 * GB
    assert memory.training_bytes(Step(GPT2, 1024, dtype=torch.bfloat16), 32) <= 0.85 * 24 * GB
    b, t, why, _ = microbatch.choose_micro_batch(gpt2, [], rtx, shape(gpt2, rtx), 64)
    assert (b, t) == (32, 1024) and "grad_accum 16" in why
    assert microbatch.choose_micro_batch(gpt2, [], rtx, shape(gpt2, rtx, world_size=8), 64)[:2] == (32, 1024)


def test_choose_micro_batch_shortens_seq_len_only_when_allowed():
    medium = SimpleNamespace(config=GPT2_MEDIUM, activation_checkpointing="none")
    small = gpu_plan((7, 5), 7.8)
    b, t, why, _ = microbatch.choose_micro_batch(medium, [], small, shape(medium, small), 64)
    assert (b, t) == (1, 256) and "seq_len 1024 -> 256" in why
    with pytest.raises(UserError, match="355M-parameter model does not fit in 7.8 GiB at seq_len 1024"):
        microbatch.choose_micro_batch(medium, [], small, shape(medium, small, shrink_seq=False), 64)


def test_choose_micro_batch_on_cpu_keeps_the_asked_one_or_says_what_divides(monkeypatch):
    model = tiny_model(vocab_size=256)
    opt = adamw(model)
    cpu = default_plan("cpu")
    assert microbatch.choose_micro_batch(model, [opt], cpu, shape(model, cpu, 32, 4096, 2), 4) == (4, 32, "", None)
    monkeypatch.setattr(microbatch, "DEFAULT_MICRO_BATCH", 16)  # auto off CUDA: the config's default
    b, t, why, timed = microbatch.choose_micro_batch(model, [opt], cpu, shape(model, cpu, 32, 4096, 2), None)
    assert (b, t, timed) == (16, 32, None) and "micro_batch_size=auto needs CUDA; on cpu" in why
    flag = shape(model, cpu, 32, 4096, fit=False, divide=False)  # set on the command line: kept or refused
    with pytest.raises(UserError, match=r"x 1 = 1536: --micro_batch_size=32 keeps 4,096 tokens per step \(or "
                                        r"--total_batch_size=4608 makes it 4,608\)$"):  # 4096 / 1536 = 2.7
        microbatch.choose_micro_batch(model, [opt], cpu, flag, 48)
    left = shape(model, cpu, 32, 4096)
    assert microbatch.choose_micro_batch(model, [opt], cpu, left, 48)[0] == 32  # left to its default: what divides
    with pytest.raises(UserError, match=r"x 1 = 1536: e\.g\. --total_batch_size=4608$"):  # no micro-batch divides
        microbatch.choose_micro_batch(model, [opt], cpu, shape(model, cpu, 32, 4100), 48)
    monkeypatch.setattr(microbatch, "DEFAULT_MICRO_BATCH", 12)
    with pytest.raises(UserError, match="^micro_batch_size=auto: total_batch_size 4096 is not divisible"):
        microbatch.choose_micro_batch(model, [opt], cpu, left, None)


@pytest.mark.parametrize("error,device_type,batch,expect", [
    (torch.OutOfMemoryError("CUDA out of memory"), None, None, "out of GPU memory while setting up"),
    (MemoryError(), None, None, "out of CPU RAM while setting up"),
    (RuntimeError("CUDA out of memory"), "cuda", (8, 1024, 4),
     "out of GPU memory at micro-batch 8 x 1024 (grad_accum 4)"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory"), "cpu", (2, 64, 1),
     "out of CPU RAM at micro-batch 2 x 64"),
])
def test_out_of_memory_is_one_line_with_what_ran_out_and_what_to_try(error, device_type, batch, expect):
    line = precision.out_of_memory_message(error, device_type, *(batch or ()))
    assert line.startswith(expect) and "\n" not in line
    assert ("--micro_batch_size=auto" in line) == (device_type == "cuda")  # on CPU auto keeps the same micro-batch

# -----------------------------------------------------------------------------
# the loss-chunk rows: the device's, decided at every start-up, never a checkpoint's


def h200_chunk(micro_batch=64):
    """The rows a chunk an H200 run (141 GiB, bf16) trains 124M with at micro_batch x 1024: what its checkpoint's
    model_args carry."""
    return memory.loss_chunk(gpu_plan((9, 0), 139.8), micro_batch * 1024, 50304)


def gpt2_on_meta(**runtime):
    """GPT-2 124M (padded vocab) with no storage: what the micro-batch decision reads of a model."""
    with torch.device("meta"):
        return GPT(GPT2, **runtime)


def test_loss_chunk_comes_from_the_device_not_the_model():
    assert h200_chunk() == 21888 and memory.loss_chunk(gpu_plan((7, 5), 15), 65536, 50304) == 1024  # fp16: capped
    assert memory.loss_chunk(default_plan("cpu"), 65536, 50304) == CE_CHUNK_ROWS == GPT(GPTConfig()).ce_chunk_rows
    model = gpt2_on_meta(ce_chunk_rows=h200_chunk())
    memory.set_loss_head(model, default_plan("cpu"), 64, 1024, "chunked")  # a resumed run on the CPU: 1024
    assert model.ce_chunk_rows == 1024 and GPT2 == GPTConfig(vocab_size=50304, **PRETRAINED["gpt2"])  # config as was


def test_fp16_loss_chunks_grow_past_1024_rows_only_where_the_gpu_sums_in_fp32(monkeypatch):
    """sm75 (fp16): a T4's chunk is 1024 rows (the fp16 weight-gradient product's cap) unless the device has the
    fp32-out matmul (loss.fp32_out_matmul, probed; no CUDA here: no), then its memory share's 2368 rows, and the
    estimate's head temporary drops the fp16 (V, C) product; the T4 still fits 16 x 1024."""
    t4, V, C = gpu_plan((7, 5), 15), 50304, 768
    head = lambda rows: training_bytes_estimate(Step(GPT2, 1024, dtype=FP16, ce_chunk_rows=rows), 16)[  # noqa: E731
        "largest temporary"]
    capped = head(1024)
    assert memory.loss_chunk(t4, 16384, V) == 1024
    monkeypatch.setattr(loss, "fp32_out_matmul", lambda device, dtype: True)  # the probe passing on this GPU
    assert memory.loss_chunk(t4, 16384, V) == 2368
    assert capped - head(1024) == 2 * V * C  # no fp16 product
    assert head(2368) - head(1024) == (2368 - 1024) * V * 6  # the larger chunk: fp32 + fp16 logits
    gpt2 = SimpleNamespace(config=GPT2, activation_checkpointing="none")  # what it reads of a model
    assert microbatch.choose_micro_batch(gpt2, [], t4, shape(gpt2, t4), 64)[:2] == (16, 1024)


@pytest.mark.parametrize("cap, gib, optimizer", [((8, 6), 22, "adamw"), ((8, 9), 23.6, "adamw"), ((8, 6), 24, "muon")])
def test_docs_say_what_a_24_gb_card_fits(cap, gib, optimizer):
    """Issue 44 item 7: docs/precision.md gave a 24 GB card (RTX 3090/4090, A10, L4) the config's micro-batch; the
    trainer fits it. The page's figures are the code's pick for configs/gpt2_124m.py (micro-batch not set, loss_impl
    auto, compiled) on an sm86/sm89 card of 22 to 24 GiB, the micro-batch and the loss head both."""
    text = " ".join(open(os.path.join(ROOT, "docs", "precision.md")).read().split())
    said = re.search(r"64 × 1024 needs ~([\d.]+) GiB by the estimate, so the trainer fits (\d+) × 1024 \(grad_accum "
                     r"(\d+) .*?\(`loss_impl=full`, ~([\d.]+) GiB estimated", text)
    assert said and f"(24 GB: {said[2]} × 1024)" in text, "docs/precision.md: the 24 GB card's paragraph"
    gpu, model = gpu_plan(cap, gib), gpt2_on_meta()
    step = dataclasses.replace(shape(model, gpu), optimizer=optimizer, loss_impl="auto", compiled=True)
    b, t, why, _ = microbatch.choose_micro_batch(model, [], gpu, step, 64)
    assert (b, t) == (int(said[2]), 1024) and f"grad_accum {said[3]} " in why, why
    head, head_why = memory.choose_loss_impl(gpu, step, b)
    assert head == "full"
    if optimizer == "adamw":  # the figures the page quotes
        chunk = memory.loss_chunk(gpu, 64 * 1024, GPT2.vocab_size)
        assert memory.fmt_bytes(memory.training_bytes(dataclasses.replace(step, ce_chunk_rows=chunk), 64)) == \
            f"{said[1]} GiB"
        assert f"(~{said[4]} GiB estimated" in head_why, head_why


@pytest.mark.parametrize("plan", [*precision.EMULATED_PLANS, "22 GiB"])
def test_a_resumed_run_fits_as_a_fresh_one_would(plan):
    """An H200 checkpoint resumed on a smaller GPU (each emulated plan's card; and a 24 GB card with 22 GiB
    to CUDA, where the H200's 21,888-row chunks in the estimate fitted 16 instead of 32) gets a fresh run's
    micro-batch."""
    cap, _, card = precision.EMULATED_PLANS.get(plan, ((8, 6), None, 22 * GB))
    gpu = gpu_plan(cap, card / GB)
    resumed = gpt2_on_meta(ce_chunk_rows=h200_chunk())
    fresh = microbatch.choose_micro_batch(gpt2_on_meta(), [], gpu, shape(gpt2_on_meta(), gpu), 64)
    assert microbatch.choose_micro_batch(resumed, [], gpu, shape(resumed, gpu), 64) == fresh
    if plan == "22 GiB":
        assert fresh[0] == 32 and fit_micro_batch(Step(GPT2, 1024, dtype=torch.bfloat16,
                                                       ce_chunk_rows=resumed.ce_chunk_rows), 22 * GB)[0] == 16


def test_finder_times_each_size_with_the_chunk_training_will_use(monkeypatch):
    """micro_batch_size=auto: every probe of size b runs with loss_chunk(plan, b x T), the value the trainer then
    sets (set_loss_head) before compile, so the finder's compiled graph for the chosen size is the trainer's
    (the value is in its guards): no compile after the finder."""
    plan = dataclasses.replace(gpu_plan((9, 0), 80), compile=False)
    model = gpt2_on_meta(ce_chunk_rows=h200_chunk())
    probed, now = [], {}

    def fake_probe(step_model, optimizers, b, seq_len, plan, steps):
        probed.append((b, step_model.ce_chunk_rows))
        now["b"] = b
        return 0.01 * b ** 0.9  # a larger batch: more tokens a second

    monkeypatch.setattr(microbatch, "probe_steps", fake_probe)
    monkeypatch.setattr(microbatch, "free_memory", lambda device_type: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: now["b"] * 0.6 * GB)
    b, _, _ = microbatch.auto_micro_batch(model, [], plan, dataclasses.replace(shape(model, plan), loss_impl="auto"))
    assert probed and all(chunk == memory.loss_chunk(plan, size * 1024, 50304) for size, chunk in probed), probed
    assert len({chunk for _, chunk in probed}) > 1  # the sizes do differ in their chunks here
    memory.set_loss_head(model, plan, b, 1024, "chunked")  # what the trainer sets after the finder
    assert model.ce_chunk_rows == dict(probed)[b]


def test_finder_says_the_compile_before_it(monkeypatch, capsys):
    """Issue 44 item 6: micro_batch_size=auto on a GPU compiles in the finder, the run's first compile: the note
    (precision.compile_note) comes right before it, once, however many sizes are timed after."""
    plan, model, now, said_before = gpu_plan((9, 0), 80), gpt2_on_meta(), {}, []

    def fake_probe(step_model, optimizers, b, seq_len, plan, steps):
        now["b"] = b
        return 0.01 * b ** 0.9

    def fake_compile(m, plan):
        said_before.append(capsys.readouterr().out)
        return m  # (the model itself: nothing compiled, nothing probed)

    monkeypatch.setattr(microbatch, "probe_steps", fake_probe)
    monkeypatch.setattr(microbatch, "compile_model", fake_compile)
    monkeypatch.setattr(microbatch, "free_memory", lambda device_type: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: now["b"] * 0.6 * GB)
    note = precision.compile_note("/runs/.compile_cache")
    timed = microbatch.choose_micro_batch(model, [], plan, shape(model, plan), None, note)[3]
    assert said_before == [note + "\n"] and "compiling" not in capsys.readouterr().out, said_before
    assert timed is model  # (the fake compile: the model itself)
    microbatch.choose_micro_batch(model, [], plan, shape(model, plan), 64, note)  # no finder: the trainer says it
    microbatch.choose_micro_batch(model, [], dataclasses.replace(plan, compile=False), shape(model, plan), None, note)
    assert said_before[1:] == [""] and "compiling" not in capsys.readouterr().out  # a plan without compile: none
