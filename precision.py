"""
Every hardware decision, in one place: which device, which GPU it is, and how to run on it.

    from precision import resolve_device, make_plan, autocast
    device = resolve_device("auto")                 # "cuda:0", "mps" or "cpu"; one clear error when unusable
    plan = make_plan(device, precision="auto")      # dtype, loss scaling, TF32, compile, attention kernels
    with autocast(plan):                            # the one autocast + SDPA-kernel context (trainer, eval, bench, sampling)
        logits, loss = model(x, y)

The plan comes from the GPU's compute capability (never torch.cuda.is_bf16_supported(), which says
yes on a T4 where bf16 is emulated):

    sm80+ (A100, A10, L4, RTX 30xx/40xx/50xx, H100, B200)  bf16 autocast, TF32, compile, SDPA flash (cuDNN first on sm90+)
    sm70-75 (V100, T4, RTX 20xx)                      fp16 autocast + GradScaler, compile, SDPA memory-efficient,
                                                      micro-batch (then, only if needed, seq_len) fitted to memory
    sm60 (P100)                                       fp16 autocast + GradScaler (2x fp32 rate, no tensor cores)
    sm61/62 (GTX 10xx, P40), older GPUs, CPU, MPS     fp32

Also here: dtype names, the peak-FLOPs table for MFU, the activation-memory estimate, the micro-batch
fit for small GPUs and the probing micro-batch finder (micro_batch_size=auto). Imports torch and
fileio only: every script may import it, it imports none of them.
"""
import dataclasses
import gc
import re
import statistics
import time
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from fileio import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISIONS = ("auto", *DTYPES)
CU126_INDEX = "https://download.pytorch.org/whl/cu126"


def dtype_name(dtype):
    """'bf16', 'fp16' or 'fp32' for a torch dtype."""
    return {v: k for k, v in DTYPES.items()}[dtype]

# -----------------------------------------------------------------------------
# device: which one, and whether this torch build has kernels for it


def resolve_device(name="auto", local_rank=0):
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' | 'mps' -> a torch device string, or UserError saying what to
    do. 'cuda' means cuda:local_rank (one GPU per torchrun process)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device {name!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available here: use --device=cpu")
    if kind != "cuda":
        return kind
    if not torch.cuda.is_available():
        raise UserError(f"device={name} but this torch ({torch.__version__}) sees no CUDA GPU: "
                        "use --device=cpu or install a CUDA build of torch")
    device = f"cuda:{index or local_rank}"
    if int(device[5:]) >= torch.cuda.device_count():
        raise UserError(f"device={device} but only {torch.cuda.device_count()} CUDA GPU(s) are visible: "
                        f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    check_arch(device)
    return device


def arch_supported(capability, arch_list):
    """Whether a torch built for arch_list (torch.cuda.get_arch_list(): 'sm_80', 'compute_90', ...) has
    kernels for a GPU of this capability: a cubin of the same major and no higher minor, or PTX of an
    equal or lower capability that the driver can compile. An empty list (a CPU build) says False."""
    major, minor = capability
    for arch in arch_list:
        kind, _, num = arch.partition("_")
        if not num.isdigit():
            continue
        a_major, a_minor = int(num[:-1]), int(num[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def check_arch(device):
    """Stop at start-up, not at the first kernel, when this torch has no kernels for the GPU. PyTorch's
    default CUDA 12.8+/13 wheels dropped sm50-sm70 (Maxwell, Pascal, Volta); the cu126 wheels keep them."""
    cap = torch.cuda.get_device_capability(device)
    arch_list = torch.cuda.get_arch_list()
    if arch_list and not arch_supported(cap, arch_list):
        raise UserError(f"this torch {torch.__version__} has no kernels for {torch.cuda.get_device_name(device)} "
                        f"(sm{cap[0]}{cap[1]}; it was built for {' '.join(arch_list)}): install a build that has them, "
                        f"`pip install torch --index-url {CU126_INDEX}`, or use --device=cpu")


def capability(device):
    """(major, minor) of a CUDA device, None for cpu/mps."""
    return torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else None


def synchronize(device):
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def set_tf32(on):
    """TF32 tensor cores for fp32 matmuls (CUDA sm80+); 'highest' is plain fp32."""
    torch.set_float32_matmul_precision("high" if on else "highest")

# -----------------------------------------------------------------------------
# the precision plan


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str  # "cuda:0", "cpu", "mps"
    dtype: torch.dtype  # autocast dtype; torch.float32 means no autocast
    grad_scaler: bool  # fp16 needs loss scaling
    tf32: bool  # TF32 tensor cores for fp32 matmuls
    compile: bool  # torch.compile by default
    sdpa_backends: tuple = ()  # SDPA kernels, in priority order ("cudnn", "flash", "efficient", "math"); () = torch decides
    fit_to_memory: bool = False  # sm7x: micro-batch (then seq_len) chosen from the GPU's memory, same total batch
    capability: tuple = None  # (major, minor) on CUDA
    device_name: str = None  # torch.cuda.get_device_name(), for the MFU peak

    @property
    def device_type(self):
        return torch.device(self.device).type

    def describe(self):
        name = dtype_name(self.dtype)
        return (f"{name} autocast" if self.dtype != torch.float32 else "fp32") + \
            f", grad scaler {'on' if self.grad_scaler else 'off'}, TF32 {'on' if self.tf32 else 'off'}, " \
            f"compile {'on' if self.compile else 'off'}, attention {'/'.join(self.sdpa_backends) or 'auto'}"


def default_plan(device, capability=None, device_name=None):
    """The plan for a device ('cuda:0', 'cpu', 'mps') and, on CUDA, its compute capability."""
    common = dict(device=device, capability=capability, device_name=device_name)
    if torch.device(device).type != "cuda":  # CPU, MPS
        return Plan(dtype=torch.float32, grad_scaler=False, tf32=False, compile=False, **common)
    major, minor = capability
    if major >= 9:  # Hopper, Blackwell: torch's own order puts cuDNN attention first (faster than flash-2 here)
        return Plan(dtype=torch.bfloat16, grad_scaler=False, tf32=True, compile=True,
                    sdpa_backends=("cudnn", "flash", "efficient", "math"), **common)
    if major == 8:  # Ampere, Ada: bf16 tensor cores, flash attention
        return Plan(dtype=torch.bfloat16, grad_scaler=False, tf32=True, compile=True,
                    sdpa_backends=("flash", "efficient", "math"), **common)
    if major == 7:  # Volta, Turing: fp16 tensor cores only, no flash kernel; Triton (compile) runs here
        return Plan(dtype=torch.float16, grad_scaler=True, tf32=False, compile=True,
                    sdpa_backends=("efficient", "math"), fit_to_memory=True, **common)
    if (major, minor) == (6, 0):  # P100: fp16 at twice the fp32 rate, no tensor cores; Triton needs sm70+
        return Plan(dtype=torch.float16, grad_scaler=True, tf32=False, compile=False,
                    sdpa_backends=("efficient", "math"), **common)
    # sm61/62 (GTX 10xx, P40: fp16 at 1/64 rate) and older
    return Plan(dtype=torch.float32, grad_scaler=False, tf32=False, compile=False, **common)


def make_plan(device, precision="auto", compile="auto"):
    """default_plan() for a resolved device with the user's overrides: precision auto|bf16|fp16|fp32 and
    compile auto|true|false (or a bool). fp16 always brings the GradScaler; bf16 below sm80 is refused."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    cap = capability(device)
    name = torch.cuda.get_device_name(device) if cap else None
    plan = default_plan(device, cap, name)
    if precision == "bf16":
        if cap and cap[0] < 8:
            raise UserError(f"precision=bf16 needs an sm80+ GPU (Ampere or newer); this one is sm{cap[0]}{cap[1]}, "
                            "where bf16 is only emulated: use --precision=fp16 (with loss scaling) or --precision=fp32")
        plan = dataclasses.replace(plan, dtype=torch.bfloat16, grad_scaler=False)
    elif precision == "fp16":  # fp16's narrow exponent range needs loss scaling, wherever it runs
        plan = dataclasses.replace(plan, dtype=torch.float16, grad_scaler=True)
    elif precision == "fp32":
        plan = dataclasses.replace(plan, dtype=torch.float32, grad_scaler=False)
    if compile not in ("auto", None):
        plan = dataclasses.replace(plan, compile=compile in (True, "true"))
    return plan


def fsdp_param_dtype(dtype, device_type):
    """The dtype FSDP all-gathers the blocks' weights in for compute: the autocast dtype on CUDA (its
    autocast runs layer norms in fp32 whatever their weights' dtype). On CPU, fp32: its layer norm
    kernel refuses bf16 weights on fp32 inputs, so there autocast does the casting, as without FSDP."""
    return dtype if device_type == "cuda" else torch.float32


_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


@contextmanager
def autocast(plan):
    """Autocast to the plan's dtype (none for fp32) and, on CUDA, the plan's SDPA kernels in its order.
    Every restricted list ends in math, so an odd head size never finds "No available kernel"."""
    with torch.autocast(plan.device_type, dtype=plan.dtype, enabled=plan.dtype != torch.float32):
        if plan.device_type != "cuda" or not plan.sdpa_backends:
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, _SDPA[b]) for b in plan.sdpa_backends], set_priority=True):
            yield


def compile_model(model, plan, probe=None, backend="inductor", warn=print):
    """torch.compile(model) with static shapes (dynamic=False: eval and HellaSwag batches of other
    shapes get graphs of their own instead of turning the training graph symbolic), or the model itself
    when the plan says no. probe(compiled) runs one forward/backward at once, so that a compiler that
    fails here (old Triton, Windows, sm7x quirks) costs one warning line and the run goes on eagerly;
    later failures fall back to eager per graph (torch._dynamo's suppress_errors). Returns the model to use."""
    if not plan.compile:
        return model
    compiled = torch.compile(model, dynamic=False, backend=backend)
    torch._dynamo.config.suppress_errors = False  # the probe must see the failure
    if probe is not None:
        try:
            probe(compiled)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raised, eager still works
            torch._dynamo.reset()
            while getattr(e, "inner_exception", None) or e.__cause__:  # the compiler's own error, not dynamo's wrapper
                e = getattr(e, "inner_exception", None) or e.__cause__
            msg = (str(e).strip().splitlines() or [""])[0][:200]
            warn(f"warning: torch.compile failed ({type(e).__name__}: {msg}); continuing without compile "
                 "(--compile=false skips the attempt)")
            return model
    torch._dynamo.config.suppress_errors = True
    return compiled

def compile_probe(micro_batch, seq_len, plan):
    """For compile_model: one forward/backward of the compiled model on a (micro_batch, seq_len) batch,
    so that a compiler failure shows at once; the gradients it leaves are dropped."""
    def probe(compiled):
        x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=plan.device)
        with autocast(plan):
            _, loss = compiled(x, x)
        loss.backward()
        for p in compiled.parameters():
            p.grad = None
    return probe

# -----------------------------------------------------------------------------
# peak FLOP/s and MFU


# Dense peak TFLOP/s from the vendors' datasheets and architecture whitepapers (no 2:4 sparsity), per
# operand type of the matmuls: 'fp32' plain FP32 FMA, 'tf32' FP32 matmuls on tensor cores, 'bf16'/'fp16'
# tensor cores with FP32 accumulate (GeForce cards run that at half their fp16-accumulate rate).
# Each entry: (regex on torch.cuda.get_device_name(), {dtype: TFLOP/s}). First match wins.
PEAK_TFLOPS = [
    (r"B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),  # HGX B200 (1000 W)
    (r"H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # H200 SXM
    (r"H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),  # H100 NVL product brief
    (r"H[18]00.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),  # H100/H800 PCIe
    (r"H[18]00", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # H100/H800 SXM (HBM3)
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"RTX 5090", {"bf16": 209.5, "fp16": 209.5, "tf32": 104.8, "fp32": 104.8}),  # Blackwell GeForce whitepaper
    (r"RTX 4090(?! D)", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 4080(?! SUPER)", {"bf16": 97.5, "fp16": 97.5, "tf32": 48.7, "fp32": 48.7}),  # Ada whitepaper
    (r"RTX 3090(?! Ti)", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"V100-SXM", {"fp16": 125.0, "fp32": 15.7}),
    (r"V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"P100.*SXM", {"fp16": 21.2, "fp32": 10.6}),  # no tensor cores: fp16 is the 2x-rate FMA
    (r"P100", {"fp16": 18.7, "fp32": 9.3}),  # P100 PCIe
    (r"\bP40\b", {"fp16": 0.18, "fp32": 11.8}),  # fp16 at 1/64 rate: the plan keeps fp32
]


def peak_flops(device_name, dtype, tf32=False):
    """Peak FLOP/s of this GPU for matmuls in dtype (torch dtype or 'bf16'/'fp16'/'fp32'/'tf32'),
    or None for an unknown device, a CPU (device_name None) or a dtype the chip has no rate for."""
    if not device_name:
        return None
    key = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    if key == "fp32" and tf32:
        key = "tf32"
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return table[key] * 1e12 if key in table else None
    return None


def estimate_mfu(flops_per_tok, tokens_per_s, device_name, dtype, tf32=False):
    """Model FLOPs utilisation in [0, 1], or None where the peak is unknown."""
    peak = peak_flops(device_name, dtype, tf32)
    return None if peak is None else flops_per_tok * tokens_per_s / peak

# -----------------------------------------------------------------------------
# memory: what a training step holds, estimated from the model's shape


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def unwrap(model):
    """The GPT inside DDP and/or torch.compile wrappers."""
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def tensor_bytes(tensors):
    """Bytes of distinct storages (a tied weight counts once); of an FSDP-sharded tensor (a DTensor),
    this rank's shard."""
    seen = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def checkpointed_layers(config):
    """How many blocks run under activation checkpointing (GPT.checkpointed says which)."""
    return {"none": 0, "blocks": config.n_layer, "every_other": (config.n_layer + 1) // 2}[config.activation_checkpointing]


def activation_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", fsdp=False):
    """Arithmetic estimate of what one forward of our GPT leaves alive for backward, in bytes, and the
    logits it returns. Per layer it saves, in the autocast dtype (a bytes/element):
    ln_1 and ln_2 outputs, qkv (3), attention output, c_fc output (4) and GELU output (4) = 14 BTC,
    plus the two residual-stream inputs of the layer norms in fp32 (2 BTC) and their mean/rstd;
    SDPA adds its logsumexp (B, nh, T); the masked softmax instead keeps the (B, nh, T, T) attention
    and the (T, T) mask; under CUDA autocast softmax runs in fp32 and att @ v keeps a second, bf16
    copy (6 bytes per element, more than fp32's 4), CPU autocast keeps one bf16 copy. A checkpointed
    layer keeps only its fp32 input (BTC). The head keeps ln_f's input and statistics and the position
    ids, and then either (loss_impl="full") lm_head's input, cross-entropy's fp32 log-softmax (B, T, V)
    and the logits it returns, or (chunked) dL/dh (BTC, fp32) and dL/dlm_head (V x C, fp32).
    Autocast also keeps a copy of every matmul weight of the layers that are not checkpointed (and of
    lm_head for the full loss), except under FSDP on CUDA, where the blocks' weights are gathered in
    the autocast dtype already and freed after the forward. The batch (idx, targets) is the caller's,
    not counted. Checked against saved_activation_bytes."""
    B, T, C, L, nh, V = micro_batch, seq_len, config.n_embd, config.n_layer, config.n_head, config.vocab_size
    a = 4 if dtype == torch.float32 else 2
    per_layer = 14 * B * T * C * a + 2 * B * T * C * 4 + 2 * 2 * B * T * 4
    if config.attn_impl == "sdpa":
        per_layer += B * nh * T * 4
    else:
        per_layer += B * nh * T * T * (4 if a == 4 else 6 if device_type == "cuda" else 2) + T * T
    n_ckpt = checkpointed_layers(config)
    layers = (L - n_ckpt) * per_layer + n_ckpt * B * T * C * 4
    head = B * T * C * 4 + 2 * B * T * 4 + T * 8  # ln_f input, mean/rstd; position ids
    full = config.loss_impl == "full"
    head += B * T * C * a + B * T * V * 4 + 4 if full else B * T * C * 4 + V * C * 4  # + total_weight | dL/dh, dL/dW
    block_copies = 0 if fsdp and device_type == "cuda" else (L - n_ckpt) * 12 * C * C  # c_attn 3CC, c_proj CC, c_fc 4CC, mlp c_proj 4CC
    weights = 0 if a == 4 else 2 * (block_copies + (V * C if full else 0))
    return layers + head + weights, B * T * V * a if full else 0


def param_counts(config):
    """(all parameters, those of one block) of a GPT of this shape, the tied embedding once."""
    C = config.n_embd
    block = 12 * C * C + 13 * C  # c_attn 3CC+3C, c_proj CC+C, c_fc 4CC+4C, mlp c_proj 4CC+C, two layer norms 4C
    return config.vocab_size * C + config.block_size * C + config.n_layer * block + 2 * C, block


def training_bytes_estimate(config, micro_batch, seq_len, dtype=torch.float32, device_type="cuda", world_size=1,
                            fsdp=False):
    """Bytes one rank needs for a training step, by part (a dict), computed from the shapes for the
    eager model (torch.compile fuses some activations away). Meant to be safe for "does it fit": it
    counts all the gradients as alive together with all the activations and adds the largest
    temporary on top, which no single moment of a step holds. Parts: fp32 parameters, gradients
    and AdamW state (divided by world_size under FSDP); DDP's gradient buckets (a second copy of the
    gradients, world_size > 1 without FSDP); under FSDP the gathered root (fp32, with its unsharded
    gradient) and two blocks in the compute dtype (the one running and the one prefetched) plus one
    block's unsharded gradient; activations and logits (activation_bytes_estimate); the largest
    temporary: the loss's (full: two (B*T, V) fp32 gradients; chunked: one chunk of fp32 logits and
    a (V, C) product) or a block's in backward (its recomputed activations when checkpointed, and
    about 8 x B*T*C fp32 of gradients flowing through it). Gradients and activations do meet from
    the second micro-step of an accumulating step on. On CPU it lies 7-110% above the measured peak
    of forward + backward (step_peak_bytes, tests/test_bench.py)."""
    n, block = param_counts(config)
    B, T, C, V, L = micro_batch, seq_len, config.n_embd, config.vocab_size, config.n_layer
    a = 4 if dtype == torch.float32 else 2
    shard = world_size if fsdp else 1
    parts = {"parameters": 4 * n // shard, "gradients": 4 * n // shard, "optimizer state": 8 * n // shard,
             "DDP buckets": 4 * n if world_size > 1 and not fsdp else 0}
    if fsdp:
        p = torch.finfo(fsdp_param_dtype(dtype, device_type)).bits // 8
        parts["FSDP gathered"] = 2 * 4 * (n - L * block) + 3 * p * block
    parts["activations"], parts["logits"] = activation_bytes_estimate(config, B, T, dtype, device_type, fsdp)
    if config.loss_impl == "full":
        head = B * T * V * (8 + (a if a == 2 else 0))
    else:
        cast = a if a == 2 else 0  # the compute-dtype copies next to the fp32 ones
        head = min(config.ce_chunk_rows, B * T) * V * (4 + cast) + V * C * (a + cast) + B * T * C * 4
    per_layer = activation_bytes_estimate(dataclasses.replace(config, n_layer=1, activation_checkpointing="none"),
                                          B, T, dtype, device_type)[0] - activation_bytes_estimate(
        dataclasses.replace(config, n_layer=0, activation_checkpointing="none"), B, T, dtype, device_type)[0]
    layer = (per_layer if checkpointed_layers(config) else 0) + 8 * B * T * C * 4
    parts["largest temporary"] = max(head, layer)
    return parts


def estimated_micro_batch(config, seq_len, dtype, budget, device_type="cuda", world_size=1, fsdp=False, limit=4096):
    """The largest micro-batch whose training_bytes_estimate fits in budget bytes (0 if none does)."""
    fits = lambda b: sum(training_bytes_estimate(config, b, seq_len, dtype, device_type, world_size, fsdp).values()) <= budget  # noqa: E731
    lo, hi = 0, limit
    while lo < hi:  # the estimate grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def is_sharded(model):
    return any(isinstance(p, DTensor) for p in model.parameters())


def memory_summary(model, optimizer, device, micro_batch=None, seq_len=None, dtype=torch.float32):
    """One line for the trainer after its first step: parameter, gradient and optimizer-state bytes
    (from the tensors, so on every device; this rank's shards under FSDP), activations (an estimate
    for the model's loss and checkpointing modes when micro_batch and seq_len are given), and on
    CUDA what the allocator holds: allocated, reserved (cached on top) and the peaks."""
    device_type = torch.device(device).type
    params = list(model.parameters())
    sharded = is_sharded(model)
    grads = tensor_bytes(p.grad for p in params)
    if grads == 0:  # freed after the step (zero_grad(set_to_none=True)): what backward allocates again
        local = [p.to_local() if isinstance(p, DTensor) else p for p in {id(p): p for p in params if p.requires_grad}.values()]
        grads = sum(p.numel() * p.element_size() for p in local)
    parts = [f"params {fmt_bytes(tensor_bytes(params))}",
             f"grads {fmt_bytes(grads)}",
             f"optimizer state {fmt_bytes(tensor_bytes(optimizer_state_tensors(optimizer)))}"]
    if sharded:
        import torch.distributed as dist
        parts[0] = f"per rank (FSDP over {dist.get_world_size()}): " + parts[0]
    if micro_batch and seq_len:
        config = unwrap(model).config
        act, logits = activation_bytes_estimate(config, micro_batch, seq_len, dtype, device_type, fsdp=sharded)
        parts.append(f"activations ~{fmt_bytes(act + logits)} (estimate, {micro_batch}x{seq_len}, "
                     f"{config.loss_impl} loss, checkpointing {config.activation_checkpointing})")
    if device_type == "cuda":
        alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        parts.append(f"allocated {fmt_bytes(alloc)}, reserved {fmt_bytes(reserved)} (+{fmt_bytes(reserved - alloc)} cached), "
                     f"peak allocated {fmt_bytes(torch.cuda.max_memory_allocated(device))}, "
                     f"peak reserved {fmt_bytes(torch.cuda.max_memory_reserved(device))}")
    else:
        parts.append(f"allocator stats n/a on {device_type}")
    return "memory: " + ", ".join(parts)


# -----------------------------------------------------------------------------
# the micro-batch: fitted to a small GPU's memory (sm7x), or probed (micro_batch_size=auto)


def free_memory(device_type):
    """Give cached blocks back so that the next measurement starts clean."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e):
    """CUDA out of memory, including cuBLAS failing to allocate its workspace."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e) or "ALLOC_FAILED" in str(e)


def train_step(model, optimizer, scaler, x, y, plan):
    """One plain training step (no accumulation) under the plan's autocast: the benchmark's and probes' step."""
    optimizer.zero_grad(set_to_none=True)
    with autocast(plan):
        _, loss = model(x, y)
    if scaler is not None:  # fp16: scale the loss so small gradients survive, unscale before clipping
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return loss


def random_batch(micro_batch, seq_len, device, seed=1337):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)  # real token ids, never padding rows
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)  # (B, T), (B, T)


def fit_micro_batch(config, memory_bytes, seq_len, total_batch_size, world_size=1, dtype=torch.float16,
                    shrink_seq=True, headroom=0.15):
    """For GPUs that start small (sm7x: 8-32 GB): the largest micro-batch whose training step fits in
    memory_bytes by training_bytes_estimate (which counts the model's loss and checkpointing modes),
    within 1 - headroom, among those that keep total_batch_size by accumulation. The micro-batch
    shrinks first; seq_len is halved only when not even one sequence of it fits (and shrink_seq
    allows). Returns (micro_batch, seq_len, reason)."""
    need = lambda b, t: sum(training_bytes_estimate(config, b, t, dtype, "cuda", world_size).values())  # noqa: E731
    budget = (1 - headroom) * memory_bytes
    T = seq_len
    while True:
        rows = total_batch_size // (T * world_size) if total_batch_size % (T * world_size) == 0 else 0
        fitting = [b for b in range(1, rows + 1) if rows % b == 0 and need(b, T) <= budget]
        if fitting:
            b = max(fitting)
            how = f"seq_len {seq_len} -> {T}: not even 1 x {seq_len} fits, " if T != seq_len else ""
            return b, T, (f"micro-batch fitted to {fmt_bytes(memory_bytes)}: {how}{b} x {T} "
                          f"(~{fmt_bytes(need(b, T))} estimated, grad_accum {rows // b} keeps total_batch_size {total_batch_size})")
        if not shrink_seq or rows == 0 or T <= 64:
            break
        T //= 2
    fixed = training_bytes_estimate(config, 1, T, dtype, "cuda", world_size)
    state = fixed["parameters"] + fixed["gradients"] + fixed["optimizer state"]
    raise UserError(f"a {param_counts(config)[0] / 1e6:.0f}M-parameter model does not fit in {fmt_bytes(memory_bytes)} "
                    f"at seq_len {T} with total_batch_size {total_batch_size} (estimate: "
                    f"{fmt_bytes(state)} of weights, gradients and AdamW state alone): use a smaller model, "
                    "activation_checkpointing=blocks, fsdp=true over several GPUs, or set micro_batch_size/seq_len yourself")


def search_micro_batch(usage, measure, seq_len, total_batch_size, world_size=1, max_micro_batch=None,
                       headroom=0.1, n_timed=3):
    """Pick the micro-batch for a fixed total_batch_size (tokens per optimizer step).

    usage(b) -> peak memory of a step at micro-batch b as a fraction of the device's memory, or None
    when it ran out; it must grow with b. measure(b) -> tokens/s, or None when b ran out of memory or
    went over the limit while timed (the timed model may differ: compiled). Candidates divide the batch
    (total_batch_size = b * seq_len * world_size * grad_accum); multiples of 8 are preferred, powers
    of two are not required. The largest candidate using at most 1 - headroom of memory is found by
    bisection, it and the next n_timed-1 smaller ones are timed (and smaller ones after them while
    none could be timed), the fastest wins.
    Returns (micro_batch, reason). Raises ValueError when no micro-batch can keep the total, or
    none fits."""
    per_row = seq_len * world_size
    if total_batch_size % per_row:
        raise ValueError(f"total_batch_size {total_batch_size} is not divisible by seq_len x world_size = {per_row}: "
                         f"no micro-batch keeps it; use a multiple of {per_row}")
    rows = total_batch_size // per_row  # micro_batch * grad_accum
    limit = rows if max_micro_batch is None else min(rows, max_micro_batch)
    divisors = [b for b in range(1, limit + 1) if rows % b == 0]
    used = {}

    def fits(b):
        if b not in used:
            used[b] = usage(b)
        return used[b] is not None and used[b] <= 1 - headroom

    pool = [b for b in divisors if b % 8 == 0]
    k = largest_fitting(pool, fits)
    note = ""
    if k is None:
        pool = [b for b in divisors if b % 8]
        k = largest_fitting(pool, fits)
        note = "; no multiple of 8 fits"
    if k is None:
        raise ValueError(f"no micro-batch fits in {1 - headroom:.0%} of memory at seq_len {seq_len} "
                         f"(tried {sorted(used)}); shorten seq_len or use a smaller model")
    speed = {}
    for b in reversed(pool[:k + 1]):  # the n_timed largest that fit, and on while none of them ran
        if len(speed) >= n_timed and any(v is not None for v in speed.values()):
            break
        speed[b] = measure(b)
    ran = {b: v for b, v in speed.items() if v is not None}
    tried = ", ".join(f"{b}: {speed[b]:,.0f} tok/s" if speed[b] is not None else
                      f"{b}: out of memory or over the {1 - headroom:.0%} limit" for b in speed)
    if not ran:
        raise ValueError(f"no micro-batch that fits could be timed ({tried}); shorten seq_len or use a smaller model")
    best = max(ran, key=ran.get)
    if k + 1 < len(pool):
        nxt = pool[k + 1]
        why = f"{nxt} " + ("runs out of memory" if used[nxt] is None else
                           f"uses {used[nxt]:.0%} of memory, over the {1 - headroom:.0%} limit")
    else:
        why = f"{pool[k]} is the largest that divides the batch" + (f" within max {max_micro_batch}" if max_micro_batch else "")
    reason = (f"micro_batch {best}: fastest of the largest that fit ({tried}); {why}{note}; "
              f"grad_accum {rows // best} keeps total_batch_size {total_batch_size}")
    return best, reason


def largest_fitting(pool, fits):
    """Index of the largest b in the ascending pool with fits(b), assuming fits is monotone; or None."""
    lo, hi, best = 0, len(pool) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(pool[mid]):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def probe_steps(model, optimizer, micro_batch, seq_len, device, plan, steps):
    """Run `steps` training steps on random tokens with the learning rate at 0, so the weights stay
    as they were; the gradients and the optimizer state it created are dropped afterwards.
    Returns the median seconds per step."""
    device_type = torch.device(device).type
    lrs = [group["lr"] for group in optimizer.param_groups]
    scaler = torch.amp.GradScaler(device_type) if plan.grad_scaler else None  # fp16: skips steps on inf grads
    times = []
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # AdamW with lr 0: no update and no weight decay
        x, y = random_batch(micro_batch, seq_len, device)
        for _ in range(steps):  # the second step is the steady state: optimizer state alive during backward
            synchronize(device)
            t0 = time.perf_counter()
            train_step(model, optimizer, scaler, x, y, plan)
            synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
    return statistics.median(times)


def agree(value, op, device, group=None):
    """The same number on every DDP rank: all_reduce with op ('max' or 'min') over group (None: all
    ranks, the default process group; a gloo group takes device "cpu"); unchanged without DDP."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return t.item()


def micro_batch_cap(config, seq_len, dtype, budget, world_size=1, fsdp=False, slack=4):
    """The finder probes no micro-batch above slack x the largest that training_bytes_estimate fits in
    budget: the estimate is on the safe side (the measured peak is lower; torch.compile lowers it
    more), so the probes skip sizes that would only run out of memory. Returns (cap, note)."""
    est = estimated_micro_batch(config, seq_len, dtype, budget, "cuda", world_size, fsdp)
    return slack * max(est, 1), (f"the estimate for {config.loss_impl} loss, checkpointing "
                                 f"{config.activation_checkpointing}{', FSDP' if fsdp else ''} fits {est}; "
                                 f"probed up to {slack * max(est, 1)}")


def auto_micro_batch(model, optimizer, seq_len, total_batch_size, world_size, device, plan, default,
                     max_micro_batch=None, headroom=0.1, compile=None):
    """micro_batch_size="auto": on CUDA, probe the raw model (before torch.compile and DDP) and its
    optimizer with OOM-guarded steps at lr 0 (weights untouched, grads and optimizer state freed,
    cache emptied after every probe) for the largest micro-batches that fit, then time those with
    compile(model, b) -> the model to train (compiled at b; called once, at the largest timed): eager
    steps misjudge the compiled model's speed and memory. Every DDP rank probes the same sizes (peak
    use is the maximum over ranks, speed the minimum) and the result is the minimum over ranks.
    Returns (micro_batch, reason, the model the sizes were timed with, or None when none was timed).
    On CPU/MPS returns (default, reason, None) without probing."""
    device_type = torch.device(device).type
    if device_type != "cuda":
        if total_batch_size % (default * seq_len * world_size):
            raise ValueError(f"total_batch_size {total_batch_size} is not divisible by micro_batch x seq_len x world_size "
                             f"= {default} x {seq_len} x {world_size}; change one of them")
        return default, (f"micro_batch_size=auto needs CUDA; on {device_type} using the default micro_batch {default} "
                         f"(grad_accum {total_batch_size // (default * seq_len * world_size)})"), None
    free_memory(device_type)
    capacity = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)  # free + what we hold
    cap, note = micro_batch_cap(unwrap(model).config, seq_len, plan.dtype, (1 - headroom) * capacity, world_size,
                                is_sharded(model))
    max_micro_batch = cap if max_micro_batch is None else min(max_micro_batch, cap)

    def peak(step_model, b, steps):
        """(peak memory as a fraction of capacity, seconds per step) of `steps` probe steps at b, both
        inf when it ran out of memory; the maximum use and the longest step over the ranks."""
        free_memory(device_type)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds = probe_steps(step_model, optimizer, b, seq_len, device, plan, steps)
            used = torch.cuda.max_memory_reserved(device) / capacity
        except RuntimeError as e:
            if not is_oom(e):
                raise
            seconds = used = float("inf")
        free_memory(device_type)  # outside the except: the traceback no longer pins the step's tensors
        return agree(used, "max", device), agree(seconds, "max", device)

    def usage(b):
        used, _ = peak(model, b, steps=2)
        return None if used == float("inf") else used

    timed = []  # the model the sizes are timed with: compiled once, at the first (largest) size timed

    def measure(b):
        if not timed:
            timed.append(model if compile is None else compile(model, b))
        used, seconds = peak(timed[0], b, steps=4)
        return None if used > 1 - headroom else b * seq_len / seconds

    b, reason = search_micro_batch(usage, measure, seq_len, total_batch_size, world_size, max_micro_batch, headroom)
    reason += f"; timed {'eager' if not timed or timed[0] is model else 'compiled'} ({note})"
    agreed = int(agree(b, "min", device))
    if agreed != b:
        b, reason = agreed, f"micro_batch {agreed}: the minimum over DDP ranks (this rank: {reason})"
    return b, reason, timed[0] if timed else None
