"""
Where the trainer's steps go: train_gpt2.py's own loop (setup, then train), profiled with
torch.profiler, and where the GPU waits for the host.

    python dev/profile_step.py configs/gpt2_124m.py --micro_batch_size=64        # on the GPU
    NANOGPT=.gpu/nanogpt/model.py python dev/profile_step.py configs/gpt2_124m.py # + nanoGPT's model
    python dev/profile_step.py configs/quickstart.py --device=cpu --n_layer=1     # CPU: host side only

The arguments are train_gpt2.py's (a config file, --key=value); evals, samples, HellaSwag and
checkpoints are turned off and max_steps set to PROFILE_WARM + PROFILE_ACTIVE + 1 (env, 3 and 2).
The trainer runs as it always does; this script only labels the loop's own functions (the loader's
next_batch, the forward under autocast, backward, optim.optimizer_step, log_step: wrapped in
torch.profiler.record_function) and records the ACTIVE steps after the WARM ones. It prints:

- per step: the wall time (the profiler's step, log_step to log_step), the GPU busy (the union of
  kernels, copies and fills), the GPU idle (wall - busy), and the host syncs (the CUDA runtime's
  synchronize calls and blocking copies);
- GPU idle by host phase: each gap between GPU work charged to what the host was doing when the GPU
  ran out of work (where the host fell behind, or waited for it), and again to what it was doing
  when the GPU started again (the phase whose launch ended the wait);
- the host's time per phase, and the aten ops the host ran outside compiled code, per step;
- the top kernels by GPU time (the top ops by CPU time on a CPU).

NANOGPT: a file defining GPT and GPTConfig as nanoGPT's model.py does; its model (bias on, compiled,
fused AdamW, bf16 autocast) runs one micro-step + optimizer step on the same batch shape, beside.
SMOKE=1 runs on the CPU as the arguments say (dev/gpu_session.sh's smoke run).
"""
import contextlib
import functools
import importlib.util
import os
import re
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import train_gpt2  # noqa: E402
from gpt2train import data, optim, precision  # noqa: E402

PHASES = ("next_batch", "forward", "backward", "optimizer_step", "log_step")
SYNC_CALLS = re.compile(r"^(cuda(Stream|Device|Event)Synchronize|cudaMemcpy|cuMemcpyDtoH(_v2)?)$")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of the GPU's own work
OFF = ["--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0",
       "--checkpoint_interval=0", "--checkpoint_minutes=0"]

# -----------------------------------------------------------------------------
# the trainer's loop, its phases labelled, the profiler stepped at each step line


def labelled(name, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def forward_autocast(plan):
    with record_function("forward"), precision.autocast(plan):
        yield


def profile_trainer(argv, warm, active):
    """Run train_gpt2.main(argv) for warm + active + 1 steps with the loop's phases labelled;
    returns (the profiler of the active steps, the exit code)."""
    device = "cpu" if os.environ.get("SMOKE") else None
    cuda = torch.cuda.is_available() and device is None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=max(warm - 1, 0), warmup=1, active=active, repeat=1)
    prof = torch.profiler.profile(activities=acts, schedule=schedule)
    original_train, original_log = train_gpt2.train, train_gpt2.log_step

    def log_step(*args, **kwargs):
        with record_function("log_step"):
            original_log(*args, **kwargs)
        prof.step()  # a profiler step: from one step line to the next

    def train(run, argv):
        with prof:
            return original_train(run, argv)
    patches = [(train_gpt2, "train", train), (train_gpt2, "log_step", log_step),
               (optim, "autocast", forward_autocast),
               (optim, "optimizer_step", labelled("optimizer_step", optim.optimizer_step)),
               (data.TokenLoader, "next_batch", labelled("next_batch", data.TokenLoader.next_batch)),
               (torch.Tensor, "backward", labelled("backward", torch.Tensor.backward))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        code = train_gpt2.main([*argv, *OFF, f"--max_steps={warm + active + 1}"])
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
    return prof, code

# -----------------------------------------------------------------------------
# reading the trace


def union_ns(intervals):
    """Nanoseconds covered by the (start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def idle_by_phase(gpu, phases, min_gap_ns=2000, at_end=False):
    """{phase: [idle ns, gaps]}: each gap of at least min_gap_ns between GPU work (gpu: (start, end)
    intervals) charged to the host phase ((name, start, end), the innermost where nested) running
    when the GPU ran out of work (at_end: when it started again, i.e. the phase whose launch ended
    the wait); "loop" where none was (the loop's own Python)."""
    out, end = {}, None
    for s, e in sorted(gpu):
        if end is not None and s - end >= min_gap_ns:
            t = s if at_end else end
            inside = [(pe - ps, name) for name, ps, pe in phases if ps <= t <= pe]
            name = min(inside)[1] if inside else "loop"
            slot = out.setdefault(name, [0, 0])
            slot[0] += s - end
            slot[1] += 1
        end = e if end is None else max(end, e)
    return out


def outside_compiled(cpu_events):
    """{aten op name: count} of the aten ops the host ran at top level, outside compiled code and
    outside another aten op (cpu_events: (name, start, end, thread))."""
    counts, stack = {}, []
    for name, s, e, thread in sorted(cpu_events, key=lambda ev: (ev[3], ev[1], -ev[2])):
        while stack and (stack[-1][2] != thread or stack[-1][1] <= s):
            stack.pop()
        inside = any(n.startswith(("aten::", "CompiledFunction", "Torch-Compiled Region",
                                   "## Call CompiledFxGraph"))
                     for n, _, _ in stack)
        if name.startswith("aten::") and not inside:
            counts[name] = counts.get(name, 0) + 1
        stack.append((name, e, thread))
    return counts


def report(prof, active):
    """Print the per-step numbers, the GPU's idle by host phase, the host's phases and aten ops."""
    events = prof.profiler.kineto_results.events()
    gpu = [(ev.start_ns(), ev.end_ns()) for ev in events if ev.activity_type() in GPU_WORK]
    cpu = [(ev.name(), ev.start_ns(), ev.end_ns(), ev.start_thread_id()) for ev in events
           if ev.device_type() == torch.autograd.DeviceType.CPU]  # ops, labels, runtime calls
    steps = [(s, e) for name, s, e, _ in cpu if name.startswith("ProfilerStep#")]
    phases = [(name, s, e) for name, s, e, _ in cpu if name in PHASES]
    syncs = sum(bool(SYNC_CALLS.match(name)) for name, *_ in cpu)
    for i, (s, e) in enumerate(steps):
        busy = union_ns((max(a, s), min(b, e)) for a, b in gpu if b > s and a < e)
        line = f"profiled step {i}: wall {(e - s) / 1e6:.1f} ms"
        if gpu:
            line += f", GPU busy {busy / 1e6:.1f} ms, idle {(e - s - busy) / 1e6:.1f} ms"
        print(line)
    print(f"host syncs: {syncs / max(active, 1):.1f} a step (synchronize calls, blocking copies)"
          if gpu else "host syncs: n/a (no GPU trace)")
    for at_end, when in ((False, "ran out of work"), (True, "started again")):
        if gpu:
            print(f"GPU idle by host phase (what the host was doing when the GPU {when}), a step:")
            idle = idle_by_phase(gpu, phases, at_end=at_end)
            for name, (ns, n) in sorted(idle.items(), key=lambda kv: -kv[1][0]):
                print(f"  {name:15s} {ns / 1e6 / active:8.2f} ms in {n / active:.0f} gaps")
    print("host time by phase, a step:")
    for name in PHASES:
        spans = [e - s for n, s, e in phases if n == name]
        if spans:
            print(f"  {name:15s} {sum(spans) / 1e6 / active:8.2f} ms in {len(spans) / active:.0f} "
                  f"calls (median {statistics.median(spans) / 1e3:.0f} us)")
    print("aten ops the host ran outside compiled code, a step:")
    counts = outside_compiled(cpu)
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {name:40s} {n / active:6.1f}")
    key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90))

# -----------------------------------------------------------------------------
# nanoGPT's model beside, one micro-step + optimizer step on a fixed batch


def nanogpt(path, B, T, device):
    """ms a micro-step + optimizer step of nanoGPT's model (path: its model.py) at B x T, and its
    kernel table."""
    spec = importlib.util.spec_from_file_location("ref_model", path)
    ng = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ng)
    torch.manual_seed(0)
    cfg = dict(n_layer=12, n_head=12, n_embd=768) if device == "cuda" else dict(n_layer=1, n_head=2,
                                                                                 n_embd=32)
    ref = ng.GPT(ng.GPTConfig(**cfg, block_size=T, vocab_size=50304, dropout=0.0, bias=True))
    ref = ref.to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=device == "cuda")
    model = torch.compile(ref) if device == "cuda" else ref
    x = torch.randint(0, 50257, (B, T), device=device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(4):
        step()
    precision.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    precision.synchronize(device)
    ms = (time.perf_counter() - t0) / 5 * 1000
    print(f"\n=== nanoGPT's model: {ms:.1f} ms a micro-step + optimizer step at {B}x{T} "
          f"({B * T / ms * 1000:,.0f} tok/s)")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        step()
        precision.synchronize(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90))


def main(argv):
    warm = int(os.environ.get("PROFILE_WARM", 3))
    active = int(os.environ.get("PROFILE_ACTIVE", 2))
    prof, code = profile_trainer(argv, warm, active)
    if code != 0:
        return code
    print(f"\n=== the trainer's loop: {active} steps profiled after {warm}")
    report(prof, active)
    path = os.environ.get("NANOGPT")
    if path:
        cfg, _ = train_gpt2.parse_args(argv)
        B = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 16
        device = "cpu" if os.environ.get("SMOKE") or not torch.cuda.is_available() else "cuda"
        nanogpt(path, B, cfg.seq_len, device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
