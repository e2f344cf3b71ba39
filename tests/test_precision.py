import pytest
import torch

from train_gpt2 import precision_plan


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
