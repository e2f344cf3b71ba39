"""The chunked loss head before and after, on CPU (dev/results/loss_head_cpu.md has the numbers).

    python dev/loss_head_bench.py compile MODEL_PY [chunk_rows]   # torch.compile time, 64x1024, tiny model
    python dev/loss_head_bench.py memory MODEL_PY [chunk_rows]    # eager forward+backward peak, 8x1024
    python dev/loss_head_bench.py check MODEL_PY                  # loss and gradients against F.cross_entropy

MODEL_PY is a model.py to measure: this tree's, or `git show HEAD:model.py > /tmp/model_before.py`.
Each mode runs in its own process (maxrss is per process); one thread unless THREADS is set.
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


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    mode, path = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    print(f"{path}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    {"compile": lambda: compile_time(load(path), rows), "memory": lambda: memory(load(path), rows),
     "check": lambda: check(load(path))}[mode]()
