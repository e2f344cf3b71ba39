"""
Bytes per logit of the chunked loss head (loss.ChunkedCrossEntropy.forward) at 124M shapes, eager against
compiled, on the H200 plan and the sm75 plan. No GPU and no big memory: run from the project root,

    python dev/loss_head_traffic.py

Each plan is counted twice: with the fp32-out weight-gradient matmul (loss.addmm_fp32, aten's addmm with
out_dtype, which has a meta kernel: counted like any op; fp16 chunks then grow to the memory share) and with the
fallback where a device lacks it (a 16-bit (V, C) product added into the fp32 sum; fp16 chunks capped at 1024 rows).
The sm75 plan's chunk rows are memory.loss_chunk's for a 15 GiB T4 on each path.

Eager: every op is counted on the meta device (its inputs read, its new outputs written, an in-place or out=
output written too; views free; gather and scatter_add_, which touch n of the n x V elements, left out, as
/work/shared/tools/loss_traffic.py counts). Compiled: the ops around the body (the weight's cast, the dL/dh and
dL/dW matmuls, the padding) are counted the same way; the body, chunk_loss, is compiled with inductor on the
CPU at the chunk's shape (compiled, never run) and each kernel of inductor's schedule after fusion is charged
the buffers it reads and writes, once each (the matmul whole; a fused kernel what its loops touch).
"""
import collections
import contextlib
import os
import sys
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.getcwd())  # run from the project root
from gpt2train import loss, memory  # noqa: E402
from gpt2train.precision import default_plan  # noqa: E402

FREE = {"view", "t", "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "expand", "transpose",
        "_unsafe_view", "as_strided"}
PLANS = [  # name, rows (B*T), chunk rows (None: memory.loss_chunk's for a T4), compute dtype
    ("H200 (bf16, 64x1024)", 65536, 21888, torch.bfloat16),
    ("H200 (bf16, 64x1024)", 65536, 13120, torch.bfloat16),
    ("sm75 (fp16, 16x1024)", 16384, None, torch.float16),
]
T4 = default_plan("cuda:0", (7, 5), "Tesla T4", 15 * 2**30)  # the sm75 plan's card (precision.EMULATED_PLANS)
V, C = 50304, 768  # padded vocab, 124M width


def nbytes(t):
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes per op on the meta device: inputs read, new outputs written, in-place outputs written too."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls, self.paused = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in FREE:
            return out
        kwargs = kwargs or {}
        ins = [t for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
               if isinstance(t, torch.Tensor)]  # out= is written, not read (an addmm's self is read)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        b = sum(map(nbytes, ins)) + sum(nbytes(t) for t in outs if not any(t is i for i in ins))
        b += sum(nbytes(t) for t in outs if any(t is i for i in ins)) if name.endswith("_") or "out" in kwargs \
            else 0  # in place (or out= one of the inputs): written too
        self.bytes[name] += b
        self.calls[name] += 1
        return out

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def around_body(N, rows, dtype, body):
    """Traffic of ChunkedCrossEntropy.forward on meta tensors at (N, V, C); body None (eager) or a stub. Which
    weight-gradient path it takes is the caller's (fp32_out)."""
    h = torch.empty(N, C, device="meta")  # fp32: ln_f's output under autocast
    w = torch.empty(V, C, device="meta")
    targets = torch.zeros(N, dtype=torch.long, device="meta")
    ctx = type("Ctx", (), {"save_for_backward": lambda self, *a: None})()
    count = Traffic()
    with mock.patch.object(torch, "autocast", lambda *a, **k: contextlib.nullcontext()), count:
        loss.ChunkedCrossEntropy.forward(ctx, h, w, targets, dtype, rows, True, body and body(count))
    count.bytes.pop("gather", None), count.bytes.pop("scatter_add_", None)  # n elements each, not n x V
    return count


def inductor_kernels(rows, dtype):
    """[(kernel, bytes read and written)] of chunk_loss compiled by inductor (CPU) at a (rows, C) chunk."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import scheduler
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering
    kernels, count_bytes = [], GraphLowering.count_bytes

    def record(graph):
        for node in graph.scheduler.nodes:
            if isinstance(node, scheduler.ExternKernelSchedulerNode):  # a library matmul: its buffers whole
                names = [d.name for d in node.read_writes.reads | node.read_writes.writes]
                size = sum(b.get_numel() * b.get_dtype().itemsize for b in map(graph.get_buffer, names))
                kernels.append((node.get_name(), int(size)))
            else:  # a generated kernel: what its loops touch, each buffer once (inductor's own sum caps a fused
                touched = collections.Counter()  # kernel at 1e9 elements per buffer: taken per loop nest here)
                for sub in node.get_nodes():
                    for buf, b in sub.get_read_write_buffer_accesses(True, True).items():
                        touched[buf] = max(touched[buf], b)
                outside = node.get_read_write_buffer_accesses(True, True)  # without the buffers kept inside
                kernels.append((node.get_name(), sum(touched[buf] for buf in outside)))
        return count_bytes(graph)

    args = [torch.empty(rows, C, dtype=dtype), torch.empty(V, C, dtype=dtype),
            torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, dtype=torch.bool)]
    log = compile_fx_module.inductor_metrics_log  # inductor calls count_bytes when this log is on
    with mock.patch.object(GraphLowering, "count_bytes", record), \
            mock.patch.object(log, "isEnabledFor", lambda level: True), mock.patch.object(log, "info", print_nothing):
        compile_fx(torch.fx.symbolic_trace(loss.chunk_loss), args)
    return kernels


def print_nothing(*args, **kwargs):
    pass


def stub(rows_seen):
    """A body for the meta run: chunk_loss's outputs (shapes only), its traffic not counted here."""
    def make(count):
        def body(hc, w, tgt, keep):
            rows_seen.append(hc.size(0))
            with count.pause():
                return loss.chunk_loss(hc, w, tgt, keep)
        return body
    return make


@contextlib.contextmanager
def fp32_out(available):
    """The device has the fp32-out matmul (available) or not: loss's one decision, taken as given here."""
    with mock.patch.object(loss, "fp32_out_matmul", lambda device, dtype: available):
        yield


def report(name, N, rows, dtype):
    eager = around_body(N, rows, dtype, None)
    seen = []
    around = around_body(N, rows, dtype, stub(seen))
    kernels = inductor_kernels(seen[0], dtype)
    body = sum(b for _, b in kernels) * len(seen)  # every chunk (a short last one padded) runs the same graph
    logits = N * V
    e, a = sum(eager.bytes.values()), sum(around.bytes.values())
    print(f"{name}, {rows}-row chunks ({len(seen)}): eager {e / logits:.1f} B/logit ({sum(eager.calls.values())} "
          f"ops); compiled {(a + body) / logits:.1f} B/logit (body {body / logits:.1f}: "
          f"{', '.join(f'{k} {b / (seen[0] * V):.2f}' for k, b in kernels)}; around it {a / logits:.1f}: "
          f"{', '.join(f'{k} {b / logits:.2f}' for k, b in around.bytes.most_common(4))})")
    return e / logits, (a + body) / logits


if __name__ == "__main__":
    for name, N, rows, dtype in PLANS:
        for available in (True, False):
            with fp32_out(available):
                chunk = rows or memory.loss_chunk(T4, N, V)
                report(f"{name}, {'fp32-out weight gradient' if available else 'fallback (16-bit product)'}",
                       N, chunk, dtype)
