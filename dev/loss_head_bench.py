"""The chunked loss head before and after, on CPU (dev/results/loss_head_cpu.md has the numbers), and the fused
head's forms on a GPU (docs/loss_head.md).

    python dev/loss_head_bench.py compile MODEL_PY [chunk_rows]   # torch.compile time, 64x1024, tiny model
    python dev/loss_head_bench.py memory MODEL_PY [chunk_rows]    # eager forward+backward peak, 8x1024
    python dev/loss_head_bench.py check MODEL_PY                  # loss and gradients against F.cross_entropy
    python dev/loss_head_bench.py fused [N C V]                   # CUDA: full vs fused (a) vs (b), block sweep

MODEL_PY is a model.py to measure: this tree's, or `git show HEAD:model.py > /tmp/model_before.py`.
Each mode runs in its own process (maxrss is per process); one thread unless THREADS is set. `fused` defaults to
GPT-2's head at 64 x 1024 (N 65536, C 768, V 50304, bf16) on CUDA; on CPU it needs TRITON_INTERPRET=1 and small
N C V (its times mean nothing there: it checks (b) against F.cross_entropy).
"""
import importlib.util
import os
import resource
import sys
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
TINY = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=50304, block_size=1024)  # bench.py's "tiny", padded vocab


def load(path):
    spec = importlib.util.spec_from_file_location("model_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_gpt(mod, chunk_rows):
    """The tiny GPT of that model.py, chunk_rows rows a chunk: a run-time setting now, a GPTConfig field before."""
    if "ce_chunk_rows" in mod.GPTConfig.__dataclass_fields__:
        return mod.GPT(mod.GPTConfig(**TINY, ce_chunk_rows=chunk_rows))
    return mod.GPT(mod.GPTConfig(**TINY), ce_chunk_rows=chunk_rows)


def step(model, x, y):
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    return time.perf_counter() - t0, loss.item()


def maxrss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compile_time(mod, chunk_rows, B=64, T=1024):
    torch.manual_seed(0)
    model = tiny_gpt(mod, chunk_rows)
    x, y = torch.randint(0, 50257, (B, T)), torch.randint(0, 50257, (B, T))
    compiled = torch.compile(model, dynamic=False)
    first, loss = step(compiled, x, y)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.zero_grad(set_to_none=True)
    second, _ = step(compiled, x, y)
    again = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs  # recompiled by the second step
    print(f"compile {B}x{T} chunk_rows {chunk_rows} ({-(-B * T // chunk_rows)} chunks): first step {first:.1f} s, "
          f"second {second:.1f} s, compile ~{first - second:.1f} s, {graphs} graphs ({again} more at the second "
          f"step), loss {loss:.4f}, maxrss {maxrss_mib():.0f} MiB")


class PeakTensors(TorchDispatchMode):
    """The most bytes of new storages alive at once, counted op by op (as memory_report.LiveTensors), parameters
    left out."""

    def __init__(self, exclude):
        super().__init__()
        self.exclude, self.refs, self.peak = {t.untyped_storage().data_ptr() for t in exclude}, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        for t in tree_leaves(out):
            s = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if s is not None and s.data_ptr() not in self.exclude | inputs | set(self.refs):
                self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def memory(mod, chunk_rows, B=8, T=1024):
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = tiny_gpt(mod, chunk_rows)
        x, y = torch.randint(0, 50257, (B, T)), torch.randint(0, 50257, (B, T))
        counter = PeakTensors(exclude=model.parameters())
        t0 = time.perf_counter()
        with counter:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(x, y)
            loss.backward()
        dt = time.perf_counter() - t0
        print(f"memory {B}x{T} {str(dtype)[6:]} chunk_rows {chunk_rows}: peak of forward+backward "
              f"{counter.peak / 2**20:.1f} MiB (parameters left out), eager step {dt:.1f} s")
    print(f"maxrss {maxrss_mib():.0f} MiB")


def check(mod):
    g = torch.Generator().manual_seed(0)
    N, C, V = 4096, 64, 50304
    h0 = torch.randn(N, C, generator=g)
    w0 = 0.1 * torch.randn(V, C, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -1
    for dtype, rows in ((torch.float32, 1024), (torch.float32, 1000), (torch.bfloat16, 1024), (torch.bfloat16, 4096)):
        out = []
        for fn in (lambda h, w, rows=rows: mod.chunked_cross_entropy(h, w, targets, rows),
                   lambda h, w: F.cross_entropy(F.linear(h, w), targets, ignore_index=-1)):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = fn(h, w)
            loss.backward()
            out.append((loss.detach(), h.grad, w.grad))
        (l1, gh1, gw1), (l2, gh2, gw2) = out
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        print(f"check {str(dtype)[6:]} chunk_rows {rows}: |loss diff| {abs(l1 - l2).item():.2e}, "
              f"max rel. diff dL/dh {rel(gh1, gh2):.2e}, dL/dW {rel(gw1, gw2):.2e}")


# -----------------------------------------------------------------------------
# the fused head's two forms of the gradient scale (docs/loss_head.md), timed on the head alone
#
# (a) is the package's: the forward's kernel writes softmax - one_hot over the logits, backward scales on the (N, C)
# side of its two GEMMs. (b), kept here only to be timed: the forward's kernel writes no gradient (the logits stay),
# backward reads them again and writes (softmax - one_hot) x grad_output over them, then the same GEMMs.

def scaled_grad_kernel():
    """(b)'s backward kernel: row r of logits overwritten by (exp(x - lse[r]) - one_hot) * scale[r]."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(logits_ptr, stride, targets_ptr, lse_ptr, scale_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ptr = logits_ptr + row * stride
        target, lse, scale = tl.load(targets_ptr + row), tl.load(lse_ptr + row), tl.load(scale_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)
    return triton, kernel


class FusedB(torch.autograd.Function):
    """Form (b): loss in the forward (the kernel without its gradient pass), dL/dlogits written in backward."""

    @staticmethod
    def forward(ctx, h, w, targets):
        from gpt2train import loss_kernels
        logits = h @ w.t()  # (N, V)
        losses = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        loss_kernels.cross_entropy_rows(logits, targets, losses, grad=False)
        valid = targets != -1
        lse = losses + logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1).float()  # (N,)
        ctx.save_for_backward(h, w, targets, logits, lse, valid)
        return losses.sum() / valid.sum()

    @staticmethod
    def backward(ctx, grad):
        from gpt2train import loss_kernels
        h, w, targets, logits, lse, valid = ctx.saved_tensors
        scale = valid * (grad / valid.sum())  # (N,) fp32, 0 on ignored rows
        triton, kernel = scaled_grad_kernel()
        N, V = logits.shape
        block = min(triton.next_power_of_2(V), loss_kernels.INTERPRETER_BLOCK if loss_kernels.INTERPRETED
                    else loss_kernels.BLOCK)
        kernel[(N,)](logits, logits.stride(0), targets, lse, scale, V, BLOCK=block, num_warps=loss_kernels.NUM_WARPS)
        return logits @ w, logits.t() @ h, None


def cuda_ms(fn, steps=10):
    """Median ms of fn() on CUDA (events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def fused(N=65536, C=768, V=50304):
    from gpt2train import loss, loss_kernels
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, C, device=device, generator=g).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(V, C, device=device, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    targets[::97] = -1
    full = torch.compile(lambda h, w, t: loss.loss_head(h, w, t, "full")[1])
    heads = {"full (compiled)": full, "fused (a)": lambda h, w, t: loss.loss_head(h, w, t, "fused")[1],
             "fused (a, compiled)": torch.compile(lambda h, w, t: loss.loss_head(h, w, t, "fused")[1]),
             "fused (b)": FusedB.apply}
    ref = None
    for name, head in heads.items():
        def step(head=head):
            h.grad = w.grad = None
            (head(h, w, targets) / 8).backward()  # 1/grad_accum: grad_output != 1
        step()
        got = [p.grad.float() for p in (h, w)]
        ref = ref or got
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
        line = f"{name:20s} grads vs full: max rel. diff {err:.1e}"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            ms = cuda_ms(step)
            peak = (torch.cuda.max_memory_allocated() - before) / 2**30
            line += f", {ms:.2f} ms forward+backward, peak +{peak:.2f} GiB"
        print(line)
    if not cuda:
        return
    logits = torch.randn(N, V, device=device, dtype=dtype)
    losses = torch.empty(N, device=device)
    gb = N * V * logits.element_size() * 3 / 1e9  # read twice (the second from L2 where it holds), written once
    for block in (1024, 2048, 4096, 8192, 16384, 32768):
        for warps in (4, 8, 16, 32):
            loss_kernels.BLOCK, loss_kernels.NUM_WARPS = block, warps
            ms = cuda_ms(lambda: loss_kernels.cross_entropy_rows(logits, targets, losses, grad=True))
            print(f"kernel BLOCK {block:5d} num_warps {warps:2d}: {ms:.3f} ms ({gb / ms:.0f} GB/s if 3 passes)")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    if sys.argv[1] == "fused":
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
        fused(*map(int, sys.argv[2:5]))
        sys.exit(0)
    mode, path = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    print(f"{path}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    {"compile": lambda: compile_time(load(path), rows), "memory": lambda: memory(load(path), rows),
     "check": lambda: check(load(path))}[mode]()
