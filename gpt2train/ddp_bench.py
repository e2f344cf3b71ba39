"""
DDP scaling behind `torchrun --standalone --nproc_per_node=N bench.py --ddp`: where torch.compile
goes around DistributedDataParallel, DDP(compile(model)) (the trainer's) or compile(DDP(model)),
each timed at the trainer's settings with one all-reduce per step.

    rows = run_ddp(job)  # in an initialised process group; job: a ladder.Ladder
    print(ddp_table(rows))
"""
import functools

import torch

from gpt2train import precision
from gpt2train.distributed import agree
from gpt2train.ladder import BASELINE, rung_plan, time_steps, where_label
from gpt2train.microbatch import random_batch
from gpt2train.optim import Stepping, train_step
from gpt2train.precision import free_memory

DDP_ORDERS = ("DDP(compile(model))", "compile(DDP(model))")


def wrap_ddp(raw, order, device_ids, backend="inductor"):
    """raw wrapped in one of DDP_ORDERS. DDP(compile(model)) is the trainer's: DDP's gradient hooks
    fire as the compiled backward hands the gradients over, which it does at its end. In
    compile(DDP(model)) dynamo splits the graph at DDP's bucket boundaries (optimize_ddp), so a
    bucket's all-reduce can start while the backward of the layers below it still runs."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = dict(device_ids=device_ids, gradient_as_bucket_view=True)
    if order == DDP_ORDERS[0]:
        return DDP(torch.compile(raw, dynamic=False, backend=backend), **kw)
    return torch.compile(DDP(raw, **kw), dynamic=False, backend=backend)


def run_ddp(job, force_compile=False, backend="inductor"):
    """Each DDP order of the Ladder job at the trainer's settings (the plan's precision and
    kernels, vocab 50304, fused AdamW on CUDA), one micro-step per optimizer step so every step
    all-reduces. Every rank times its own steps; the slowest rank's median counts. Returns rows
    like the ladder's (tokens/s over all ranks)."""
    plan, size, micro_batch, seq_len = job.plan, job.size, job.micro_batch, job.seq_len
    import torch.distributed as dist
    device, device_type, device_name = plan.device, plan.device_type, plan.device_name
    world = dist.get_world_size()
    settings = dict(BASELINE, tf32=plan.tf32, dtype=plan.dtype, scaler=plan.grad_scaler,
                    attn="sdpa", sdpa_backends=plan.sdpa_backends, vocab=50304,
                    fused=device_type == "cuda")
    skip = None
    if not (plan.compile or force_compile):
        where = where_label(device_type, plan.capability)
        skip = f"precision plan for {where} has compile off (--compile forces it)"
    rows, first = [], None
    for order in DDP_ORDERS:
        row = dict(name=order, ms_per_step=None, tokens_per_s=None, speedup_first=None, mfu=None,
                   skipped=skip, note=f"{world} rank(s), gradient_as_bucket_view")
        if skip is None:
            precision.set_tf32(plan.tf32)
            raw, _, optimizers = job.build(settings, size, micro_batch, seq_len,
                                           rung_plan(device, settings))
            torch._dynamo.reset()
            model = wrap_ddp(raw, order, [device] if device_type == "cuda" else None, backend)
            scaler = torch.amp.GradScaler(device_type, enabled=plan.grad_scaler)
            x, y = random_batch(micro_batch, seq_len, device, seed=1337 + dist.get_rank())
            step = functools.partial(train_step, model, Stepping(plan, scaler, optimizers), x, y)
            seconds = time_steps(step, device, job.warmup, job.steps)
            ms = 1000 * agree(seconds, "max", device)
            tok_s = world * micro_batch * seq_len / (ms / 1000)
            first = first or tok_s
            row.update(ms_per_step=ms, tokens_per_s=tok_s, speedup_first=tok_s / first,
                       mfu=precision.estimate_mfu(job.flops_per_token(raw, seq_len), tok_s / world,
                                                  device_name, plan.dtype, plan.tf32))
            del raw, model, optimizers
            free_memory(device_type)
        rows.append(row)
    precision.set_tf32(False)
    torch._dynamo.reset()
    return rows


def ddp_table(rows):
    lines = ["| order | ms/step | tok/s (all ranks) | vs first | MFU | notes |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["skipped"] is not None:
            lines.append(f"| {r['name']} | skipped | | | | {r['skipped']} |")
        else:
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            lines.append(f"| {r['name']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['speedup_first']:.2f}x | {mfu} | {r['note']} |")
    return "\n".join(lines)
