import pytest
import torch

from train_gpt2 import (SMALL_GPU_PRESET, Config, UserError, amp_context, apply_small_gpu_preset, parse_args,
                        precision_plan, resolve_plan)


@pytest.mark.parametrize("cap,dtype,scaler,tf32,compile_", [
    ((9, 0), torch.bfloat16, False, True, True),  # H100
    ((8, 6), torch.bfloat16, False, True, True),  # A10 / RTX 3090
    ((7, 5), torch.float16, True, False, True),  # T4: is_bf16_supported() says True, we must not trust it
    ((7, 0), torch.float16, True, False, True),  # V100
    ((6, 1), torch.float32, False, False, False),  # P40 / GTX 1080
])
def test_cuda_plans(cap, dtype, scaler, tf32, compile_):
    plan = precision_plan("cuda", cap)
    assert (plan.dtype, plan.grad_scaler, plan.tf32, plan.compile) == (dtype, scaler, tf32, compile_)
    assert plan.small_gpu_preset == (cap[0] == 7)
    assert ("flash" in plan.sdpa_backends) == (cap[0] >= 8)


def test_cpu_plan():
    plan = precision_plan("cpu", None)
    assert (plan.dtype, plan.grad_scaler, plan.tf32, plan.compile) == (torch.float32, False, False, False)


def test_mps_plan_needs_no_scaler():
    plan = precision_plan("mps", None)
    assert (plan.dtype, plan.grad_scaler, plan.compile) == (torch.float32, False, False)

# -----------------------------------------------------------------------------
# user overrides on top of the plan (train_gpt2.resolve_plan), the sm7x preset, autocast



@pytest.mark.parametrize("device,cap,precision,dtype,scaler", [
    ("cuda", (9, 0), "auto", torch.bfloat16, False),
    ("cuda", (9, 0), "fp16", torch.float16, True),  # fp16 override: always with a GradScaler
    ("cuda", (8, 0), "fp32", torch.float32, False),
    ("cuda", (7, 5), "auto", torch.float16, True),
    ("cuda", (7, 5), "fp32", torch.float32, False),
    ("cuda", (6, 1), "fp16", torch.float16, True),
    ("cpu", None, "fp16", torch.float16, True),
    ("cpu", None, "bf16", torch.bfloat16, False),
])
def test_precision_override(device, cap, precision, dtype, scaler):
    plan = resolve_plan(Config(precision=precision), device, cap)
    assert (plan.dtype, plan.grad_scaler) == (dtype, scaler)
    assert plan.tf32 == precision_plan(device, cap).tf32


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1)])
def test_bf16_refused_below_sm80(cap):
    with pytest.raises(UserError, match=f"bf16 needs an sm80\\+ GPU.*sm{cap[0]}{cap[1]}.*--precision=fp16"):
        resolve_plan(Config(precision="bf16"), "cuda", cap)


def test_compile_override():
    assert resolve_plan(Config(compile="false"), "cuda", (9, 0)).compile is False
    assert resolve_plan(Config(compile="true"), "cpu", None).compile is True
    assert resolve_plan(Config(compile="auto"), "cuda", (7, 0)).compile is True


def test_small_gpu_preset_only_for_unset_keys(tmp_path):
    cfg, given = parse_args([])
    assert apply_small_gpu_preset(cfg, given) == SMALL_GPU_PRESET
    assert (cfg.micro_batch_size, cfg.seq_len) == (SMALL_GPU_PRESET["micro_batch_size"], SMALL_GPU_PRESET["seq_len"])
    assert cfg.total_batch_size == 524288 and cfg.total_batch_size % (cfg.micro_batch_size * cfg.seq_len) == 0
    cfg, given = parse_args(["--micro_batch_size=4"])
    assert apply_small_gpu_preset(cfg, given) == {"seq_len": SMALL_GPU_PRESET["seq_len"]}
    assert cfg.micro_batch_size == 4
    path = tmp_path / "c.py"
    path.write_text("micro_batch_size = 32\nseq_len = 1024\n")  # set in a config file: also the user's choice
    cfg, given = parse_args([str(path)])
    assert apply_small_gpu_preset(cfg, given) == {} and (cfg.micro_batch_size, cfg.seq_len) == (32, 1024)


def test_amp_context_on_cpu():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    for precision, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        with amp_context("cpu", resolve_plan(Config(precision=precision), "cpu", None)):
            assert (x @ w).dtype == dtype
