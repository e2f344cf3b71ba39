"""precision.py: the plan per GPU generation, user overrides, the arch check, the one autocast context,
peak FLOPs, and static-shape compile with an eager fallback. (The sm7x micro-batch fit: tests/test_memory.py.)"""
import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gpt2train import precision
from conftest import ROOT, tiny_model
from gpt2train.fileio import UserError
from gpt2train.precision import (arch_supported, autocast, compile_model, compiles, default_plan, estimate_mfu,
                                 make_plan, peak_flops)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("cap,dtype,scaler,tf32,compile_,attention,fit", [
    ((10, 0), BF16, False, True, True, ("cudnn", "flash", "efficient", "math"), False),  # B200
    ((9, 0), BF16, False, True, True, ("cudnn", "flash", "efficient", "math"), False),  # H100: cuDNN leads
    ((8, 9), BF16, False, True, True, ("flash", "efficient", "math"), False),  # L4 / RTX 4090
    ((8, 6), BF16, False, True, True, ("flash", "efficient", "math"), False),  # A10 / RTX 3090
    ((8, 0), BF16, False, True, True, ("flash", "efficient", "math"), False),  # A100
    ((7, 5), FP16, True, False, True, ("efficient", "math"), True),  # T4: is_bf16_supported() says True; not trusted
    ((7, 0), FP16, True, False, True, ("efficient", "math"), True),  # V100
    ((6, 1), FP32, False, False, False, (), False),  # P40 / GTX 1080: fp16 at 1/64 rate
    ((6, 0), FP16, True, False, False, ("efficient", "math"), False),  # P100: fp16 at 2x the fp32 rate
])
def test_cuda_plans(cap, dtype, scaler, tf32, compile_, attention, fit):
    plan = default_plan("cuda:0", cap)
    assert (plan.dtype, plan.grad_scaler, plan.tf32, plan.compile) == (dtype, scaler, tf32, compile_)
    assert plan.sdpa_backends == attention and plan.fit_to_memory == fit
    assert not plan.sdpa_backends or plan.sdpa_backends[-1] == "math"  # never "No available kernel"


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_cpu_and_mps_plans_are_plain_fp32(device):
    plan = default_plan(device)
    assert (plan.dtype, plan.grad_scaler, plan.tf32, plan.compile, plan.sdpa_backends) == \
        (FP32, False, False, False, ())

# -----------------------------------------------------------------------------
# user overrides on top of the plan


def fake_gpu(monkeypatch, cap, name="NVIDIA Test GPU", memory=80 * 2**30):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=memory))


@pytest.mark.parametrize("device,cap,prec,dtype,scaler,tf32", [  # TF32: sm80+ only, whatever the precision
    ("cuda:0", (9, 0), "auto", BF16, False, True),
    ("cuda:0", (9, 0), "fp16", FP16, True, True),  # fp16 override: always with a GradScaler
    ("cuda:0", (8, 0), "fp32", FP32, False, True),
    ("cuda:0", (7, 5), "auto", FP16, True, False),
    ("cuda:0", (7, 5), "fp32", FP32, False, False),
    ("cuda:0", (6, 1), "fp16", FP16, True, False),
    ("cpu", None, "fp16", FP16, True, False),
    ("cpu", None, "bf16", BF16, False, False),
])
def test_precision_override(monkeypatch, device, cap, prec, dtype, scaler, tf32):
    if cap:
        fake_gpu(monkeypatch, cap)
    plan = make_plan(device, prec)
    assert (plan.dtype, plan.grad_scaler, plan.tf32, plan.capability) == (dtype, scaler, tf32, cap)


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1), (6, 0)])
def test_bf16_refused_below_sm80(monkeypatch, cap):
    fake_gpu(monkeypatch, cap)
    with pytest.raises(UserError, match=f"bf16 needs an sm80\\+ GPU.*sm{cap[0]}{cap[1]}.*--precision=fp16"):
        make_plan("cuda:0", "bf16")


def test_compile_override_and_bad_names(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    assert make_plan("cuda:0", compile="false").compile is False
    assert make_plan("cpu", compile="true").compile is True
    assert make_plan("cpu", compile=True).compile is True
    with pytest.raises(UserError, match="precision must be one of auto, bf16, fp16, fp32; got 'fp8'"):
        make_plan("cpu", "fp8")
    for bad in ("gpu", "cuda:x", "cpu:0", "tpu"):
        with pytest.raises(UserError, match=f"device {bad!r} is not one of"):
            precision.resolve_device(bad)


@pytest.mark.parametrize("device,compile_,mode,cudagraphs,note", [
    ("cuda:0", "auto", "reduce-overhead", True, ""),
    ("cuda:0", "auto", "max-autotune-no-cudagraphs", False, ""),
    ("cuda:0", "false", "reduce-overhead", False, "has no effect: this run does not compile"),
    ("cpu", "true", "reduce-overhead", False, "has no effect on cpu: it adds CUDA graphs, which are CUDA-only"),
    ("cpu", "true", "max-autotune-no-cudagraphs", False, ""),
    ("cpu", "auto", "default", False, ""),
])
def test_compile_mode_is_the_plans(monkeypatch, device, compile_, mode, cudagraphs, note):
    """compile_mode is validated once, kept on the plan, and brings CUDA graphs only where they run: a compiled
    plan on CUDA; elsewhere reduce-overhead is accepted and said (one note) to change nothing."""
    fake_gpu(monkeypatch, (9, 0))
    plan = make_plan(device, compile=compile_, compile_mode=mode)
    assert (plan.compile_mode, plan.cudagraphs) == (mode, cudagraphs)
    said = precision.compile_mode_note(plan)
    assert note in said and bool(note) == bool(said)
    assert ("CUDA graphs" in plan.describe()) == cudagraphs
    with pytest.raises(UserError, match="compile_mode must be one of default, reduce-overhead, "
                                        "max-autotune-no-cudagraphs; got 'max-autotune'"):
        make_plan(device, compile_mode="max-autotune")


@pytest.mark.parametrize("device,mode,passed,subproc", [
    ("cuda:0", "default", None, False), ("cuda:0", "reduce-overhead", "reduce-overhead", False),
    ("cuda:0", "max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs", True),
    ("cpu", "reduce-overhead", None, False),  # no CUDA graphs off CUDA: compiled as the default mode
    ("cpu", "max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs", False),
])
def test_compile_model_passes_the_mode(monkeypatch, device, mode, passed, subproc):
    """torch.compile gets the plan's mode (None for default); under max-autotune on CUDA inductor benchmarks its
    candidate kernels in child processes, where one that crashes (an illegal memory access on the H200) costs
    the child, not the run."""
    import torch._inductor.config as inductor_config
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(inductor_config, "autotune_in_subproc", False)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.update(kw) or model)
    compile_model(tiny_model(n_embd=16), make_plan(device, compile="true", compile_mode=mode))
    assert seen["mode"] == passed and seen["dynamic"] is False
    assert inductor_config.autotune_in_subproc is subproc


@pytest.mark.parametrize("before,asked,after", [
    (None, False, None), (None, True, "expandable_segments:True"),
    ("max_split_size_mb:512", True, "max_split_size_mb:512,expandable_segments:True"),  # the user's others kept
    ("expandable_segments:False", True, "expandable_segments:False"),  # the user's own word wins
])
def test_expandable_segments_is_set_for_cuda_s_allocator(monkeypatch, before, asked, after):
    if before is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", before)
    assert precision.set_allocator(asked) == (after or "")
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == after


def test_resolve_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "nvidia_driver", lambda *a: "")  # no GPU either (tests/test_no_silent_cpu.py: one)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert precision.resolve_device("auto") == "cpu"
    with pytest.raises(UserError, match="sees no CUDA GPU: use --device=cpu"):
        precision.resolve_device("cuda")

# -----------------------------------------------------------------------------
# the arch check: new wheels dropped Pascal/Volta kernels


CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]


@pytest.mark.parametrize("cap,arch_list,ok", [
    ((7, 0), CU128, False),  # V100 on a CUDA 12.8 wheel: no sm70 cubin, and PTX only for sm120
    ((6, 0), CU128, False),  # P100
    ((7, 0), CU126, True),
    ((6, 1), CU126, True),  # sm61 runs the sm60 cubin (same major, lower minor)
    ((8, 9), CU126, True),  # Ada on the sm86 cubin
    ((9, 0), CU128, True),
    ((12, 0), ["sm_80", "sm_90", "compute_90"], True),  # a newer GPU JIT-compiles the PTX
    ((8, 0), ["sm_90"], False),  # a cubin for a newer minor/major never runs on an older GPU
    ((7, 5), [], False),  # a CPU build
])
def test_arch_supported(cap, arch_list, ok):
    assert arch_supported(cap, arch_list) is ok


def test_arch_check_stops_with_the_fix(monkeypatch):
    fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU128)
    with pytest.raises(UserError) as e:
        precision.check_arch("cuda:0")
    msg = str(e.value)
    assert "Tesla V100-SXM2-16GB (sm70" in msg and precision.CU126_INDEX in msg and "--device=cpu" in msg
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU126)
    precision.check_arch("cuda:0")  # no error


def test_resolve_device_runs_the_arch_check(monkeypatch):
    fake_gpu(monkeypatch, (6, 0), "Tesla P100-PCIE-16GB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU128)
    with pytest.raises(UserError, match="no kernels for Tesla P100"):
        precision.resolve_device("auto")
    with pytest.raises(UserError, match="only 1 CUDA GPU"):
        precision.resolve_device("cuda:3")

# -----------------------------------------------------------------------------
# autocast and peak FLOPs


def test_autocast_on_cpu():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for name, dtype in [("fp16", FP16), ("bf16", BF16), ("fp32", FP32)]:
        with autocast(make_plan("cpu", name)):
            assert (x @ w).dtype == dtype


@pytest.mark.parametrize("name,row", [  # torch.cuda.get_device_name(): the pattern of the row it must find
    ("NVIDIA B200", r"B200"), ("NVIDIA H200", r"H200"), ("NVIDIA H100 NVL", r"H100 NVL"),
    ("NVIDIA H100 PCIe", r"H[18]00.*PCIe"), ("NVIDIA H800 PCIe", r"H[18]00.*PCIe"),
    ("NVIDIA H100 80GB HBM3", r"H[18]00"), ("NVIDIA H800", r"H[18]00"),
    ("NVIDIA A100-SXM4-80GB", r"A100"), ("NVIDIA A100-PCIE-40GB", r"A100"),
    ("NVIDIA L40S", r"L40S"), ("NVIDIA L4", r"\bL4\b"), ("NVIDIA A40", r"\bA40\b"), ("NVIDIA A10", r"\bA10\b"),
    ("NVIDIA RTX A6000", r"RTX A6000"), ("NVIDIA GeForce RTX 5090", r"RTX 5090"),
    ("NVIDIA GeForce RTX 4090", r"RTX 4090(?! D)"), ("NVIDIA GeForce RTX 4080", r"RTX 4080(?! SUPER)"),
    ("NVIDIA GeForce RTX 3090", r"RTX 3090(?! Ti)"), ("Tesla V100-SXM2-16GB", r"V100-SXM"),
    ("Tesla V100-PCIE-32GB", r"V100-PCIE"), ("Tesla T4", r"\bT4\b"), ("Tesla P100-SXM2-16GB", r"P100.*SXM"),
    ("Tesla P100-PCIE-16GB", r"P100"), ("Tesla P40", r"\bP40\b"),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 3090 Ti", None), ("Some Future GPU", None), (None, None),
])
def test_peak_flops_reads_each_cards_own_row(name, row):
    """Each card finds its own row of PEAK_TFLOPS, whichever comes first (an L40S is no L4, an A40 no A10, an H100
    PCIe no SXM), for a torch dtype or its name; fp32 with TF32 reads the tf32 rate. A dtype the card has no rate
    for (bf16 on a T4), an unknown card or the CPU (None): None, never a made-up peak; MFU then None too."""
    table = dict(precision.PEAK_TFLOPS)[row] if row else {}
    rate = lambda key: table[key] * 1e12 if key in table else None  # noqa: E731
    for dtype, key in ((BF16, "bf16"), (FP16, "fp16"), (FP32, "fp32")):
        assert peak_flops(name, dtype) == peak_flops(name, key) == rate(key)
    assert peak_flops(name, FP32, tf32=True) == rate("tf32")
    assert peak_flops(name, BF16, tf32=True) == rate("bf16")  # TF32 is fp32's only
    mfu = estimate_mfu(1e9, 100e3, name, BF16)
    assert mfu is None if rate("bf16") is None else mfu == pytest.approx(1e9 * 100e3 / rate("bf16"))


@pytest.mark.parametrize("name,dtype,tflops", [  # dense tensor-core peaks, from NVIDIA's datasheets
    ("NVIDIA H100 80GB HBM3", BF16, 989.4),  # H100 SXM: 1,979 TFLOPS bf16 with sparsity, half of it dense
    ("NVIDIA A100-SXM4-80GB", BF16, 312.0),  # A100: 312 TFLOPS bf16 (624 with sparsity)
    ("NVIDIA A100-SXM4-80GB", FP32, 19.5),  # A100: 19.5 TFLOPS fp32 without tensor cores
    ("Tesla V100-SXM2-16GB", FP16, 125.0),  # V100 SXM2: 125 TFLOPS tensor performance
    ("Tesla T4", FP16, 65.0),  # T4: 65 TFLOPS mixed precision (fp16/fp32)
])
def test_peak_flops_of_known_cards_are_their_datasheets(name, dtype, tflops):
    """Pinned here, not read from PEAK_TFLOPS: a wrong row (a sparse rate, another card's) fails, and MFU with it."""
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)
    assert estimate_mfu(1e9, 100e3, name, dtype) == pytest.approx(1e9 * 100e3 / (tflops * 1e12))


# -----------------------------------------------------------------------------
# compile: static shapes, and a failure is a warning, not a dead run


class Recorder:
    """A torch.compile backend that runs the graph eagerly and records, per graph, whether its inputs had symbolic
    sizes, and the shapes of the token ids it was compiled for."""
    def __init__(self):
        self.graphs, self.token_shapes = [], set()

    def __call__(self, gm, example_inputs):
        sizes = [s for t in example_inputs if torch.is_tensor(t) for s in t.shape]
        self.graphs.append(any(isinstance(s, torch.SymInt) for s in sizes + list(example_inputs)))
        self.token_shapes |= {tuple(t.shape) for t in example_inputs if torch.is_tensor(t) and t.dtype == torch.int64}
        return gm.forward


def shape_sequence(model):
    """What a run does: train at (4, 16), eval without grad at (4, 16), HellaSwag-like rows at other shapes,
    train again."""
    x = torch.randint(0, 64, (4, 16))
    model(x, x)[1].backward()
    with torch.no_grad():
        model(x, x)
        for b, t in ((8, 24), (16, 10), (8, 24)):
            model(torch.randint(0, 64, (b, t)))
    model(x, x)[1].backward()


def test_compile_uses_static_shapes():
    torch._dynamo.reset()
    plan = dataclasses.replace(make_plan("cpu"), compile=True)
    raw = tiny_model(n_embd=16)
    static = Recorder()
    shape_sequence(compile_model(raw, plan, backend=static))
    assert static.graphs and not any(static.graphs)  # no graph ever saw a symbolic size
    assert {(4, 16), (8, 24), (16, 10)} <= static.token_shapes  # a graph of its own for each shape the run feeds
    torch._dynamo.reset()


def test_compile_failure_falls_back_to_eager(capsys):
    torch._dynamo.reset()
    plan = dataclasses.replace(make_plan("cpu"), compile=True)
    raw = tiny_model(n_embd=16)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("Triton only supports devices of CUDA capability >= 7.5")

    capsys.readouterr()
    assert not compiles(compile_model(raw, plan, backend=broken_backend), 2, 8, plan)
    warnings = capsys.readouterr().out.splitlines()  # logger.warn0's lines
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    assert "torch.compile failed" in warnings[0] and "capability >= 7.5" in warnings[0] and "\n" not in warnings[0]
    assert all(p.grad is None for p in raw.parameters())  # the probe leaves no gradients
    assert compile_model(raw, dataclasses.replace(plan, compile=False)) is raw  # off: never compiled
    torch._dynamo.reset()


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_compile_probe_raises_out_of_memory_and_cuda_errors(error, capsys):
    """Running out of memory or a broken GPU is not a compiler problem: no silent fallback to eager."""
    torch._dynamo.reset()
    plan = dataclasses.replace(make_plan("cpu"), compile=True)
    raw = tiny_model(n_embd=16)

    def failing_backend(gm, example_inputs):
        raise error

    capsys.readouterr()
    with pytest.raises(type(error), match="out of memory|CUDA error"):
        compiles(compile_model(raw, plan, backend=failing_backend), 2, 8, plan)
    assert "warning" not in capsys.readouterr().out
    torch._dynamo.reset()


@pytest.mark.parametrize("emulate,dtype,scaler,backends,fit,compiled,memory", [
    ("sm75", FP16, True, ("efficient", "math"), True, True, 15 * 2**30),  # a T4's plan and memory on an H100
    ("sm60", FP16, True, ("efficient", "math"), False, False, 16 * 2**30),  # P100: no Triton
    ("sm80", BF16, False, ("flash", "efficient", "math"), False, True, 40 * 2**30),
])
def test_another_generations_plan_on_the_gpu_at_hand(monkeypatch, emulate, dtype, scaler, backends, fit, compiled,
                                                     memory):
    fake_gpu(monkeypatch, (9, 0), name="NVIDIA H100 80GB HBM3")
    plan = make_plan("cuda:0", emulate=emulate)
    assert (plan.dtype, plan.grad_scaler, plan.sdpa_backends, plan.fit_to_memory, plan.compile) == \
        (dtype, scaler, backends, fit, compiled)
    assert plan.memory == memory and plan.emulated == emulate and plan.device_name == "NVIDIA H100 80GB HBM3"
    assert f"emulating {emulate}" in plan.describe()
    with pytest.raises(UserError, match="plan must be auto or one of"):
        make_plan("cuda:0", emulate="sm99")


def test_emulated_plan_needs_a_gpu():
    with pytest.raises(UserError, match="plan=sm75 runs another GPU generation's plan on a CUDA GPU"):
        make_plan("cpu", emulate="sm75")


def test_old_torch_is_one_line():
    from gpt2train.precision import check_torch
    check_torch("2.6.0")
    with pytest.raises(UserError, match=r"torch 2.5.1\+cu124 is too old: this trainer needs torch >= 2.6"):
        check_torch("2.5.1+cu124")

# -----------------------------------------------------------------------------
# torch.compile's caches beside out_dir: compiled once per machine (or per storage), not per session


def test_compile_cache_dir_sits_beside_out_dir(tmp_path):
    out_dir = tmp_path / "runs" / "124m"
    assert precision.compile_cache_dir("auto", str(out_dir)) == str(tmp_path / "runs" / ".compile_cache")
    assert precision.compile_cache_dir("", str(out_dir)) is None  # torch's own default, in /tmp
    assert precision.compile_cache_dir(str(tmp_path / "cc"), str(out_dir)) == str(tmp_path / "cc")


COMPILE_TWICE = """import sys, torch
from gpt2train import precision
precision.use_compile_cache(sys.argv[1])
from torch._dynamo.utils import counters
f = torch.compile(lambda x: (x.sin() * 2 + 1).relu().sum(), dynamic=False)
f(torch.randn(16))
print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


def test_a_second_start_loads_its_graphs_from_the_cache(tmp_path):
    """Two processes (two starts) compiling the same graph with use_compile_cache(folder): the first compiles and
    fills the folder, the second loads the graph from it (inductor's FX graph cache: a hit, no miss)."""
    folder = str(tmp_path / ".compile_cache")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR",
                                                           "TORCHINDUCTOR_FORCE_DISABLE_CACHES")}
    runs = [subprocess.run([sys.executable, "-c", COMPILE_TWICE, folder], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    (hit1, miss1), (hit2, miss2) = [map(int, r.stdout.split()[-2:]) for r in runs]
    assert (hit1, miss1) == (0, 1) and (hit2, miss2) == (1, 0)
    assert os.path.isdir(os.path.join(folder, "fxgraph"))
