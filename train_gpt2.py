"""
Train GPT-2. (Skeleton: the training loop lands with the trainer issue.)

    python train_gpt2.py configs/quickstart.py
"""
from dataclasses import dataclass

import torch

# -----------------------------------------------------------------------------
# precision path: chosen from the GPU's compute capability, in exactly one place


@dataclass(frozen=True)
class PrecisionPlan:
    dtype: torch.dtype  # autocast dtype; torch.float32 means no autocast
    grad_scaler: bool  # fp16 needs loss scaling
    tf32: bool  # TF32 tensor cores for fp32 matmuls
    compile: bool  # torch.compile by default
    sdpa_backends: tuple  # SDPA kernels allowed, best first ("flash", "efficient", "math"); () = torch decides
    small_gpu_preset: bool  # sm7x: smaller micro-batch / seq_len, same total batch

    def describe(self):
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        return (f"{name} autocast" if self.dtype != torch.float32 else "fp32") + \
            f", grad scaler {'on' if self.grad_scaler else 'off'}, TF32 {'on' if self.tf32 else 'off'}, " \
            f"compile {'on' if self.compile else 'off'}, attention {'/'.join(self.sdpa_backends) or 'auto'}"


def precision_plan(device_type, capability=None):
    """The default precision path for a device type ('cuda', 'cpu', 'mps') and, on CUDA, its compute
    capability (major, minor). Decided from the capability, not torch.cuda.is_bf16_supported(),
    which says True on a T4 (sm75) where bf16 is only emulated and slow."""
    if device_type == "cuda":
        major, _ = capability
        if major >= 8:  # Ampere, Ada, Hopper, Blackwell: bf16 tensor cores, flash attention
            return PrecisionPlan(torch.bfloat16, False, True, True, ("flash", "efficient"), False)
        if major == 7:  # Volta, Turing: fp16 tensor cores only; no flash kernel; Triton runs on sm70+
            return PrecisionPlan(torch.float16, True, False, True, ("efficient",), True)
        return PrecisionPlan(torch.float32, False, False, False, (), False)  # Pascal and older
    return PrecisionPlan(torch.float32, False, False, False, (), False)  # CPU, MPS
