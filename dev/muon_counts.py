"""
Muon's kernel launches and transient memory per step at 124M (meta device) and the host reads of
optim.optimizer_step for each (precision, optimizer) pair (CPU stand-in: aten._local_scalar_dense, a sync
on CUDA). Run from the project root:

    python dev/muon_counts.py

A copy of /work/shared/tools/muon_kernels_and_host_reads.py that also counts the batched matmuls' FLOPs,
the first step (state created) apart from the next ones, and Muon with found_inf (the trainer's on-device skip).
"""
import collections
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.getcwd())  # run from the project root
from gpt2train import optim  # noqa: E402
from gpt2train.logger import redirect0  # noqa: E402
from gpt2train import precision  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

VIEWS = {"view", "t", "transpose", "detach", "alias", "expand", "_unsafe_view", "as_strided", "select", "slice",
         "permute", "unbind", "unsqueeze", "split", "split_with_sizes"}


class Count(TorchDispatchMode):
    """Ops dispatched (a kernel launch each, views free; a foreach op is one), matmul FLOPs, host reads, and
    the peak bytes of the storages made inside it and alive at once (the step's transient memory)."""

    def __init__(self):
        super().__init__()
        self.ops, self.flops, self.reads = collections.Counter(), 0, 0
        self.live, self.peak, self.made = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            key = t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None
            if key is not None and key not in given and key not in self.made:  # a new storage
                self.made.add(key)
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self.freed, key, t.untyped_storage().nbytes())
        name = func.overloadpacket.__name__
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        if name not in VIEWS:
            self.ops[name] += 1
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return out

    def freed(self, key, nbytes):
        self.live -= nbytes
        self.made.discard(key)


def muon_launches():
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=50304))
    for p in m.parameters():
        p.grad = torch.empty_like(p)
    with redirect0(None):
        muon = optim.build_optimizers(m, "muon", device_type="cuda", fused=False, ns_dtype=torch.bfloat16)[1]
    for label, found_inf in (("first step", None), ("next step", None),
                             ("next step, found_inf given", torch.zeros((), device="meta"))):
        if found_inf is not None:
            muon.found_inf, muon.grad_scale = found_inf, None
        c = Count()
        with c:
            muon.step()
        print(f"Muon step at 124M, {label}: {sum(c.ops.values())} kernels, {c.flops / 1e12:.2f} TFLOP "
              f"({', '.join(f'{k} {v}' for k, v in c.ops.most_common(6))}), peak transient {c.peak / 2**30:.2f} GiB")


def extra_reads(precision_name, optimizer):
    """Host reads of one trainer step (2 micro-steps, clip, update) besides its one loss/norm transfer."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=32))
    plan = precision.make_plan("cpu", precision_name)
    with redirect0(None):
        opts = optim.build_optimizers(m, optimizer, lr=1e-3, device_type="cpu", fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.grad_scaler)
    params = [p for p in m.parameters() if p.requires_grad]
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    stepping = optim.Stepping(plan, scaler, opts, params)

    def step():
        loss = optim.accumulate_gradients(m, optim.FixedBatch(x, y), 2, stepping)
        return optim.optimizer_step(stepping, 1.0, loss)
    step()  # the state and the loss scale exist from here on
    c = Count()
    with c:
        step()
    return optim.skips_on_device(opts, None), c.reads


def host_reads():
    for name in ("bf16", "fp16"):
        for opt in ("adamw", "muon"):
            before, reads = extra_reads(name, opt)
            print(f"({name}, {opt}): update launched before the read: {before}, host reads per step: 1 + {reads}")


if __name__ == "__main__":
    muon_launches()
    host_reads()
