"""
Every hardware decision, in one place: which device, which GPU it is, and how to run on it.

    from gpt2train.precision import resolve_device, make_plan, autocast
    device = resolve_device("auto")  # "cuda:0", "mps" or "cpu"; one clear error when unusable
    plan = make_plan(device, precision="auto")  # dtype, loss scaling, TF32, compile, SDPA kernels
    with autocast(plan):  # the one autocast + SDPA-kernel context (all who run the model)
        logits, loss = model(x, y)

The plan comes from the GPU's compute capability (never torch.cuda.is_bf16_supported(), which says
yes on a T4 where bf16 is emulated):

    sm80+ (A100, A10, L4, RTX 30xx/40xx/50xx, H100, B200)
        bf16 autocast, TF32, compile, SDPA flash (cuDNN first on sm90+)
    sm70-75 (V100, T4, RTX 20xx)
        fp16 autocast + GradScaler, compile, SDPA memory-efficient, micro-batch (then, only if
        needed, seq_len) fitted to memory
    sm60 (P100)
        fp16 autocast + GradScaler (2x fp32 rate, no tensor cores)
    sm61/62 (GTX 10xx, P40), older GPUs, CPU, MPS
        fp32

Also here: dtype names, the peak-FLOPs table for MFU, torch.compile with its probe. The one training
step is optim.py's; the memory estimate is memory.py's, the micro-batch finder microbatch.py's.
Imports torch and fileio only: every module may import it, it imports none of them.
"""
import dataclasses
import gc
import logging
import os
import re
import shutil
import subprocess
from contextlib import contextmanager

import torch

from gpt2train.fileio import UserError
from gpt2train.logger import warn0

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISIONS = ("auto", *DTYPES)
# torch.compile's modes a run may ask for (compile_mode): "default"; "reduce-overhead", CUDA graphs
# of the compiled graphs (CUDA only); "max-autotune-no-cudagraphs", GEMM and kernel autotuning
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
CU126_INDEX = "https://download.pytorch.org/whl/cu126"
MIN_TORCH = (2, 6)  # fully_shard's public import and sdpa_kernel(set_priority=True)
GiB = 1024 ** 3
# plan=smXY: another generation's plan on the GPU at hand, for testing ((capability), its card, that
# card's memory)
EMULATED_PLANS = {
    "sm60": ((6, 0), "Tesla P100-PCIE-16GB", 16 * GiB),
    "sm70": ((7, 0), "Tesla V100-SXM2-16GB", 16 * GiB),
    "sm75": ((7, 5), "Tesla T4", 15 * GiB),
    "sm80": ((8, 0), "NVIDIA A100-SXM4-40GB", 40 * GiB),
    "sm86": ((8, 6), "NVIDIA A10", 24 * GiB),
    "sm89": ((8, 9), "NVIDIA L4", 24 * GiB),
    "sm90": ((9, 0), "NVIDIA H100 80GB HBM3", 80 * GiB),
}


def check_torch(version=None):
    """One line when this torch is older than the trainer needs (not an ImportError later)."""
    version = version or torch.__version__
    have = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if have < MIN_TORCH:
        raise UserError(f"torch {version} is too old: this trainer needs torch >= "
                        f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (`pip install -U torch`, see the README's "
                        "Install)")


def dtype_name(dtype):
    """'bf16', 'fp16' or 'fp32' for a torch dtype."""
    return {v: k for k, v in DTYPES.items()}[dtype]

# -----------------------------------------------------------------------------
# device: which one, and whether this torch build has kernels for it


def resolve_device(name="auto", local_rank=0):
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' | 'mps' -> a torch device string, or UserError saying what
    to do. 'cuda' means cuda:local_rank (one GPU per torchrun process). 'auto' never falls back to
    the CPU where an NVIDIA GPU is present that this torch cannot use (one line: what torch has,
    what the driver says)."""
    if name == "auto":
        if not torch.cuda.is_available() and nvidia_driver():
            raise UserError(unusable_gpu("torch.cuda.is_available() is False"))
        name = "cpu"
        if torch.cuda.is_available():
            name = "cuda"
        elif torch.backends.mps.is_available():
            name = "mps"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device {name!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available here: use --device=cpu")
    if kind != "cuda":
        return kind
    if not torch.cuda.is_available():
        if nvidia_driver():
            raise UserError(unusable_gpu("torch.cuda.is_available() is False"))
        raise UserError(f"device={name} but this torch ({torch.__version__}) sees no CUDA GPU: "
                        "use --device=cpu or install a CUDA build of torch")
    device = f"cuda:{index or local_rank}"
    if int(device[5:]) >= torch.cuda.device_count():
        raise UserError(f"device={device} but only {torch.cuda.device_count()} CUDA GPU(s) are "
                        f"visible: use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    check_arch(device)
    return device


NVIDIA_PROC = "/proc/driver/nvidia/version"  # the kernel driver's version, where one is loaded
NVIDIA_DEV = "/dev/nvidia0"


def nvidia_driver(proc=NVIDIA_PROC, dev=NVIDIA_DEV):
    """What the NVIDIA driver here reports, found without CUDA: nvidia-smi's 'name, driver version'
    of the first GPU, else the kernel module's version line, else 'a device /dev/nvidia0'; '' where
    there is none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            first = out.stdout.strip().splitlines()[:1]
            if out.returncode == 0 and first:
                name, _, version = first[0].rpartition(",")
                if not name:
                    return f"nvidia-smi: {first[0]}"
                return f"nvidia-smi: {name.strip()}, driver {version.strip()}"
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open(proc) as f:
            line = f.readline()
        found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", line)
        return f"{proc}: driver {found[1] if found else line.strip()[:80]}"
    except OSError:
        pass
    return f"a device {dev}" if os.path.exists(dev) else ""


def unusable_gpu(why, driver=None):
    """The one line for an NVIDIA GPU that this torch cannot use: what torch has, what the driver
    says, the fix."""
    driver = driver or nvidia_driver() or "no driver answer"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build, no CUDA"
    return (f"an NVIDIA GPU is here ({driver}) but torch {torch.__version__} ({cuda}) cannot use "
            f"it ({why}): install a torch whose CUDA this driver runs (`nvidia-smi` shows the "
            "newest CUDA it supports; a notebook's preinstalled torch usually does; else e.g. "
            f"`pip install torch --index-url {CU126_INDEX}`) or update the driver; --device=cpu "
            "runs on the CPU on purpose")


def arch_supported(capability, arch_list):
    """Whether a torch built for arch_list (torch.cuda.get_arch_list(): 'sm_80', 'compute_90', ...)
    has kernels for a GPU of this capability: a cubin of the same major and no higher minor, or PTX
    of an equal or lower capability that the driver can compile. An empty list (a CPU build) says
    False."""
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
    """Stop at start-up, not at the first kernel, when this torch has no kernels for the GPU.
    PyTorch's default CUDA 12.8+/13 wheels dropped sm50-sm70 (Maxwell, Pascal, Volta); the cu126
    wheels keep them."""
    cap = torch.cuda.get_device_capability(device)
    arch_list = torch.cuda.get_arch_list()
    if arch_list and not arch_supported(cap, arch_list):
        name = torch.cuda.get_device_name(device)
        raise UserError(unusable_gpu(f"no kernels for {name} (sm{cap[0]}{cap[1]}; it was built for "
                                     f"{' '.join(arch_list)}; the cu126 builds keep sm50-sm70)"))


def capability(device):
    """(major, minor) of a CUDA device, None for cpu/mps."""
    return torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else None


def synchronize(device):
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def free_memory(device_type):
    """Give cached blocks back so that the next measurement starts clean."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def available_ram():
    """Bytes of RAM free for a new process (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            lines = (line for line in f if line.startswith("MemAvailable:"))
            return next(int(line.split()[1]) * 1024 for line in lines)
    except (OSError, StopIteration, ValueError):
        return None


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def set_allocator(expandable_segments):
    """expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF for this process when asked: CUDA's
    caching allocator then maps more memory into a segment as it grows instead of reserving new
    blocks of fixed size, so less is reserved beyond what is allocated. Call it before anything
    touches CUDA (the allocator reads the variable once); the variable's other settings are kept,
    and one that names expandable_segments itself wins (the user's own). Returns the allocator's
    settings as they now are, "" for none."""
    conf = os.environ.get(ALLOC_CONF, "")
    if expandable_segments and "expandable_segments" not in conf:
        conf = ",".join(filter(None, [conf, "expandable_segments:True"]))
        os.environ[ALLOC_CONF] = conf
    return conf


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
    # SDPA kernels by priority ("cudnn", "flash", "efficient", "math"); () = torch decides
    sdpa_backends: tuple = ()
    # sm7x: micro-batch (then seq_len) chosen from the GPU's memory, same total batch
    fit_to_memory: bool = False
    # (major, minor) on CUDA: the plan's (plan=smXY: the emulated generation's)
    capability: tuple = None
    # torch.cuda.get_device_name(), for the MFU peak (always the real GPU's)
    device_name: str = None
    # CUDA: bytes the micro-batch fit plans for (plan=smXY: at most that generation's card's)
    memory: int = None
    # "sm75" etc. when the plan is another generation's, run on this GPU for testing
    emulated: str = ""
    # torch.compile's mode where the plan compiles (COMPILE_MODES)
    compile_mode: str = "default"
    # the compiled graphs replay as CUDA graphs (compile_mode=reduce-overhead on CUDA): the step
    # keeps its gradients in place and marks each micro-step (optim.accumulate_gradients)
    cudagraphs: bool = False

    @property
    def device_type(self):
        return torch.device(self.device).type

    def describe(self):
        def on(flag):
            return "on" if flag else "off"
        text = f"{dtype_name(self.dtype)} autocast" if self.dtype != torch.float32 else "fp32"
        text += (f", grad scaler {on(self.grad_scaler)}, TF32 {on(self.tf32)}, "
                 f"compile {on(self.compile)}")
        if self.compile and self.compile_mode != "default":
            text += f" ({self.compile_mode}{', CUDA graphs' if self.cudagraphs else ''})"
        text += f", attention {'/'.join(self.sdpa_backends) or 'auto'}"
        if self.emulated:
            text += f", emulating {self.emulated} ({fmt_gib(self.memory)} GiB)"
        return text


def fmt_gib(n):
    return f"{n / GiB:.0f}"


def default_plan(device, capability=None, device_name=None, memory=None):
    """The plan for a device ('cuda:0', 'cpu', 'mps') and, on CUDA, its compute capability."""
    common = dict(device=device, capability=capability, device_name=device_name, memory=memory)
    if torch.device(device).type != "cuda":  # CPU, MPS
        return Plan(dtype=torch.float32, grad_scaler=False, tf32=False, compile=False, **common)
    major, minor = capability
    # Hopper, Blackwell: torch's own order puts cuDNN attention first (faster than flash-2 here)
    if major >= 9:
        return Plan(dtype=torch.bfloat16, grad_scaler=False, tf32=True, compile=True,
                    sdpa_backends=("cudnn", "flash", "efficient", "math"), **common)
    if major == 8:  # Ampere, Ada: bf16 tensor cores, flash attention
        return Plan(dtype=torch.bfloat16, grad_scaler=False, tf32=True, compile=True,
                    sdpa_backends=("flash", "efficient", "math"), **common)
    # Volta, Turing: fp16 tensor cores only, no flash kernel; Triton (compile) runs here
    if major == 7:
        return Plan(dtype=torch.float16, grad_scaler=True, tf32=False, compile=True,
                    sdpa_backends=("efficient", "math"), fit_to_memory=True, **common)
    # P100: fp16 at twice the fp32 rate, no tensor cores; Triton needs sm70+
    if (major, minor) == (6, 0):
        return Plan(dtype=torch.float16, grad_scaler=True, tf32=False, compile=False,
                    sdpa_backends=("efficient", "math"), **common)
    # sm61/62 (GTX 10xx, P40: fp16 at 1/64 rate) and older
    return Plan(dtype=torch.float32, grad_scaler=False, tf32=False, compile=False, **common)


def cpu_note(plan):
    """A note for a plan that runs far slower than the CPU's default, or "": fp16 on CPU (its
    matmuls have no fast CPU kernels; timings in docs/benchmarks.md)."""
    if plan.device_type == "cpu" and plan.dtype == torch.float16:
        return ("note: precision=fp16 on CPU runs far slower than fp32 (no fast float16 kernels: "
                "~10x on the quickstart's shape); fp32 is the CPU's default (--precision=auto), "
                "bf16 runs at about its speed")
    return ""


def start_lines(plan, world_size):
    """The run's first line (torch, the device and its compute capability, the plan: how to check
    which precision path a GPU got), then the plan's notes."""
    where = plan.device
    if plan.capability:
        where = f"{where} ({plan.device_name}, sm{plan.capability[0]}{plan.capability[1]})"
    first = f"torch {torch.__version__} | device {where} x {world_size} | {plan.describe()}"
    return [line for line in (first, cpu_note(plan), compile_mode_note(plan)) if line]


def compile_mode_note(plan):
    """A note for a compile_mode that changes nothing here, or "": any mode where the plan does not
    compile, reduce-overhead (CUDA graphs) off CUDA."""
    if plan.compile_mode == "default":
        return ""
    if not plan.compile:
        return f"note: compile_mode={plan.compile_mode} has no effect: this run does not compile"
    if plan.compile_mode == "reduce-overhead" and not plan.cudagraphs:
        return (f"note: compile_mode=reduce-overhead has no effect on {plan.device_type}: it adds "
                "CUDA graphs, which are CUDA-only; the model compiles as in the default mode")
    return ""


def make_plan(device, precision="auto", compile="auto", emulate="auto", compile_mode="default"):
    """default_plan() for a resolved device with the user's overrides: precision auto|bf16|fp16|fp32
    and compile auto|true|false (or a bool). fp16 always brings the GradScaler; bf16 below sm80 is
    refused. emulate "smXY" (CUDA only): the plan another GPU generation gets (dtype, scaler,
    attention kernels, compile, memory fit within that card's memory), run on this GPU, so an H100
    exercises a T4's path. compile_mode: torch.compile's mode where the plan compiles
    (COMPILE_MODES); reduce-overhead brings CUDA graphs on CUDA only (inductor's are CUDA's)."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if compile_mode not in COMPILE_MODES:
        raise UserError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}; got "
                        f"{compile_mode!r}")
    cap = capability(device)
    name = torch.cuda.get_device_name(device) if cap else None
    memory = torch.cuda.get_device_properties(device).total_memory if cap else None
    if emulate not in ("auto", None, ""):
        if emulate not in EMULATED_PLANS:
            raise UserError(f"plan must be auto or one of {', '.join(EMULATED_PLANS)}; got "
                            f"{emulate!r}")
        if not cap:
            raise UserError(f"plan={emulate} runs another GPU generation's plan on a CUDA GPU; on "
                            f"{device} drop --plan")
        cap, _, card_memory = EMULATED_PLANS[emulate]
        memory = min(memory, card_memory)
    plan = default_plan(device, cap, name, memory)
    if emulate not in ("auto", None, ""):
        plan = dataclasses.replace(plan, emulated=emulate)
    if precision == "bf16":
        if cap and cap[0] < 8:
            raise UserError("precision=bf16 needs an sm80+ GPU (Ampere or newer); this one is "
                            f"sm{cap[0]}{cap[1]}, where bf16 is only emulated: use "
                            "--precision=fp16 (with loss scaling) or --precision=fp32")
        plan = dataclasses.replace(plan, dtype=torch.bfloat16, grad_scaler=False)
    elif precision == "fp16":  # fp16's narrow exponent range needs loss scaling, wherever it runs
        plan = dataclasses.replace(plan, dtype=torch.float16, grad_scaler=True)
    elif precision == "fp32":
        plan = dataclasses.replace(plan, dtype=torch.float32, grad_scaler=False)
    if compile not in ("auto", None):
        plan = dataclasses.replace(plan, compile=compile in (True, "true"))
    cudagraphs = plan.compile and compile_mode == "reduce-overhead" and plan.device_type == "cuda"
    return dataclasses.replace(plan, compile_mode=compile_mode, cudagraphs=cudagraphs)


def fsdp_param_dtype(dtype, device_type):
    """The dtype FSDP all-gathers the blocks' weights in for compute: the autocast dtype on CUDA
    (its autocast runs layer norms in fp32 whatever their weights' dtype). On CPU, fp32: its layer
    norm kernel refuses bf16 weights on fp32 inputs, so there autocast does the casting, as without
    FSDP."""
    return dtype if device_type == "cuda" else torch.float32


_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
         "math": "MATH"}


@contextmanager
def autocast(plan):
    """Autocast to the plan's dtype (none for fp32) and, on CUDA, the plan's SDPA kernels in its
    order. Every restricted list ends in math, so an odd head size never finds "No available
    kernel"."""
    with torch.autocast(plan.device_type, dtype=plan.dtype, enabled=plan.dtype != torch.float32):
        if plan.device_type != "cuda" or not plan.sdpa_backends:
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, _SDPA[b]) for b in plan.sdpa_backends],
                         set_priority=True):
            yield


# compile_cache_dir=auto: this folder beside out_dir (in out_dir's parent)
COMPILE_CACHE = ".compile_cache"


def compile_cache_dir(asked, out_dir):
    """Where torch.compile's caches live: compile_cache_dir=auto is out_dir's parent's
    .compile_cache (beside the run, on the same storage, shared by the runs there), "" is torch's
    own default (/tmp: gone with the machine), anything else that folder. Returns the folder, or
    None for torch's default."""
    if asked == "auto":
        return os.path.join(os.path.dirname(os.path.abspath(out_dir)), COMPILE_CACHE)
    return os.path.abspath(asked) if asked else None


def use_compile_cache(folder):
    """Inductor's caches in folder (its kernels and Triton's, the FX graph cache, the autograd
    cache), so that a start on the same storage loads the graphs an earlier one compiled instead of
    compiling them again. Call it once, before the first compile (inductor reads the folder when it
    first compiles)."""
    os.makedirs(folder, exist_ok=True)
    # Triton's cache goes under it unless TRITON_CACHE_DIR says
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    import torch._functorch.config
    import torch._inductor.config
    # (on by default in recent torch; say it for the older ones)
    torch._inductor.config.fx_graph_cache = True
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = True  # the backward's graph too


def compile_note(cache):
    """The line said once, before a run's first compile: what the silence that follows is (124M on
    an H200: start-up ~58 s with an empty cache, ~27 s with a warm one: docs/benchmarks.md), and
    where a later start finds the compiled graphs (cache: compile_cache_dir's folder; None:
    torch's default, in /tmp)."""
    where = cache or "torch's default cache in /tmp (compile_cache_dir=\"\")"
    return (f"compiling the model (torch.compile; 124M on an H200: ~1 min at the first start); "
            f"later starts reuse {where}")


def compile_model(model, plan, backend="inductor"):
    """torch.compile(model) with static shapes (dynamic=False: eval and HellaSwag batches of other
    shapes get graphs of their own instead of turning the training graph symbolic), or the model
    itself when the plan says no. The loss head is in the model's graph (loss_impl=full) or,
    chunked, an eager region by design. The plan's compile_mode is torch.compile's mode (none for
    "default"; reduce-overhead only where it brings CUDA graphs); under max-autotune on CUDA the
    candidate kernels are benchmarked in child processes (inductor's autotune_in_subproc): on an
    H200 one candidate's illegal memory access in this process took the whole run down (issue
    43), in a child it costs that child. Compilation happens at the first call: see compiles()."""
    if not plan.compile:
        return model
    mode = plan.compile_mode
    if mode == "default" or (mode == "reduce-overhead" and not plan.cudagraphs):
        mode = None
    if mode == "max-autotune-no-cudagraphs" and plan.device_type == "cuda":
        from torch._inductor import config as inductor_config
        inductor_config.autotune_in_subproc = True
    return torch.compile(model, dynamic=False, backend=backend, mode=mode)


def root_error(e):
    """The compiler's own error under dynamo's wrappers (BackendCompilerFailed and the like)."""
    while getattr(e, "inner_exception", None) or getattr(e, "__cause__", None):
        e = getattr(e, "inner_exception", None) or e.__cause__
    return e


def one_line(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


# graph breaks by design: the chunked loss head's eager region
EXPECTED_BREAKS = ("chunked_cross_entropy",)


def graph_breaks():
    """{first line of the reason: count} of the graph breaks dynamo made so far, those by design
    left out."""
    from torch._dynamo.utils import counters
    breaks = {}
    for why, n in counters["graph_break"].items():
        if not any(name in why for name in EXPECTED_BREAKS):
            first = why.strip().splitlines()[0][:200]
            breaks[first] = breaks.get(first, 0) + n
    return breaks


class CompileWatch(logging.Handler):
    """No silent eager: check() returns one line for each graph the plan compiled that has run
    eagerly since the last check: a frame dynamo could not compile (suppress_errors turns the error
    into an eager run and a log record, caught here), a recompile limit hit (the frame runs eagerly
    from then on), or a graph break that is not by design (the model then runs as several graphs
    with eager code between them). close() stops watching."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.events = []
        self.breaks = graph_breaks()  # the probe's are said by compiles()
        logging.getLogger("torch._dynamo").addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        # "WON'T CONVERT forward /x/model.py line 214"
        found = re.match(r"WON'T CONVERT (\S+) (.+) line (\d+)", msg)
        if found:
            name, path, line = found.groups()
            why = "see the log above"
            if record.exc_info:
                why = one_line(root_error(record.exc_info[1]))
            self.events.append((f"{name} ({os.path.basename(path)}:{line})", why))
        elif "recompile_limit" in msg or "cache_size_limit" in msg:
            self.events.append((msg.strip().splitlines()[0][:200],
                                "the recompile limit: eager from now on"))

    def check(self):
        now = graph_breaks()
        lines, seen = [], {}
        # a frame that fails, then each frame it calls (dynamo tries them in turn)
        for where, why in self.events:
            seen.setdefault(why, []).append(where)
        for why, frames in seen.items():
            inner = ""
            if len(frames) > 1:
                more = ", ...)" if len(frames) > 4 else ")"
                calls = ", ".join(frames[1:4])
                inner = f"; so did {len(frames) - 1} frame(s) it calls ({calls}{more}"
            lines.append(f"warning: torch.compile: {frames[0]} failed to compile and runs eagerly "
                         f"({why}){inner}")
        lines += [f"warning: torch.compile: a graph break in the model ({why}): it runs as several "
                  "graphs with eager code between them"
                  for why, n in now.items() if n > self.breaks.get(why, 0)]
        self.events, self.breaks = [], now
        return lines

    def close(self):
        logging.getLogger("torch._dynamo").removeHandler(self)
        super().close()


def compiles(step_model, micro_batch, seq_len, plan):
    """Compile now, with one forward/backward of step_model (compiled, maybe inside DDP: then dynamo
    splits the graph at DDP's buckets) on a (micro_batch, seq_len) batch whose inputs and targets
    are distinct tensors, as in training, so the first real step reuses this graph. A compiler
    failure (old Triton, Windows, sm7x quirks) costs one warning and returns False (the caller goes
    on eagerly); running out of memory and CUDA errors are raised, not mistaken for a compiler
    problem. Later failures fall back to eager per graph (torch._dynamo's suppress_errors). The
    gradients are dropped."""
    torch._dynamo.config.suppress_errors = False  # the probe must see the failure
    skips = cudagraph_skips()
    x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=plan.device)  # (B, T)
    # (B, T), not x: no aliasing guard
    y = torch.ones(micro_batch, seq_len, dtype=torch.long, device=plan.device)
    try:
        with autocast(plan):
            _, loss = step_model(x, y)
        loss.backward()
    except Exception as e:  # noqa: BLE001 - whatever the compiler raised, eager still works
        root = root_error(e)  # the compiler's error, not dynamo's wrapper
        accelerator = isinstance(root, getattr(torch, "AcceleratorError", ()))
        if is_oom(root) or accelerator or "CUDA error" in str(root):
            raise root from None
        torch._dynamo.reset()
        warn0(f"torch.compile failed ({one_line(root)}); continuing without compile "
              "(--compile=false skips the attempt)")
        return False
    finally:
        for p in step_model.parameters():
            p.grad = None
    torch._dynamo.config.suppress_errors = True
    # compiled, but in pieces: said once here, the run's later ones by CompileWatch
    for why in graph_breaks():
        warn0(f"torch.compile: a graph break in the model ({why}): it runs as several graphs "
              "with eager code between them")
    if plan.cudagraphs and cudagraph_skips() > skips:
        warn0(f"torch.compile: compile_mode=reduce-overhead, but inductor kept "
              f"{cudagraph_skips() - skips} graph(s) out of CUDA graphs (TORCH_LOGS=cudagraphs "
              "says why): those run as in the default mode")
    return True


def cudagraph_skips():
    """How many compiled graphs inductor has kept out of CUDA graphs so far in this process."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def is_oom(e):
    """Whether e is out of memory: CUDA's (cuBLAS's workspace too) or the CPU allocator's."""
    return isinstance(e, torch.OutOfMemoryError) or any(
        s in str(e) for s in ("out of memory", "ALLOC_FAILED", "can't allocate memory",
                              "DefaultCPUAllocator"))


def out_of_memory_message(e, device_type=None, B=None, T=None, grad_accum=None):
    """One line for a run that ran out of memory (e): what ran out, at which micro-batch, and what
    to try. device_type None: before the run was set up (the model and its optimizer state)."""
    cuda_oom = isinstance(e, torch.OutOfMemoryError)
    cpu = device_type in ("cpu", "mps") or device_type is None and not cuda_oom
    what = "CPU RAM" if cpu else "GPU memory"
    if B is None:
        return (f"out of {what} while setting up (the model and its optimizer state): use a "
                "smaller model, fsdp=true under torchrun, or a device with more memory")
    # (on CPU auto keeps the micro-batch it was given)
    auto = "" if cpu else "--micro_batch_size=auto, "
    # keeps the step's rows
    smaller = max((b for b in range(1, B) if (B * grad_accum) % b == 0), default=None)
    eg = f" (e.g. {smaller}" if smaller else " ("
    return (f"out of {what} at micro-batch {B} x {T} (grad_accum {grad_accum}): try {auto}a "
            f"smaller --micro_batch_size{eg}{'; ' if smaller else ''}total_batch_size stays, by "
            "more accumulation steps) or --activation_checkpointing=blocks")

# -----------------------------------------------------------------------------
# peak FLOP/s and MFU


# Dense peak TFLOP/s from the vendors' datasheets and architecture whitepapers (no 2:4 sparsity),
# per operand type of the matmuls: 'fp32' plain FP32 FMA, 'tf32' FP32 matmuls on tensor cores,
# 'bf16'/'fp16' tensor cores with FP32 accumulate (GeForce cards run that at half their
# fp16-accumulate rate). Each entry: (regex on torch.cuda.get_device_name(), {dtype: TFLOP/s});
# the first match wins.
PEAK_TFLOPS = [
    (r"B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),  # HGX B200 (1000 W)
    (r"H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # H200 SXM
    # H100 NVL product brief
    (r"H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    # H100/H800 PCIe
    (r"H[18]00.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    # H100/H800 SXM (HBM3)
    (r"H[18]00", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # Blackwell GeForce whitepaper
    (r"RTX 5090", {"bf16": 209.5, "fp16": 209.5, "tf32": 104.8, "fp32": 104.8}),
    (r"RTX 4090(?! D)", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    # Ada whitepaper
    (r"RTX 4080(?! SUPER)", {"bf16": 97.5, "fp16": 97.5, "tf32": 48.7, "fp32": 48.7}),
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
