"""The optimizers of a GPT and THE optimizer step that the trainer, bench.py and the micro-batch
probes run.

    from gpt2train import optim
    optimizers = optim.build_optimizers(model, "muon", lr=6e-4, muon_lr=6e-3)  # [AdamW, Muon]
    stepping = optim.Stepping(plan, scaler, optimizers, params, grad_clip=1.0)  # built once
    loss = optim.accumulate_gradients(model, loader, grad_accum, stepping)  # forward/backward
    scale = optim.lr_multiplier(step, cfg)  # the schedule
    stepped = optim.optimizer_step(stepping, scale, loss)

AdamW alone ("adamw", the GPT-2 recipe), or Muon on the blocks' hidden matrices with AdamW on the
rest ("muon"). The schedule is one multiplier (lr_multiplier: warmup, then cosine, linear or wsd):
every param group's lr = its "base_lr" x the multiplier, in every optimizer; nowhere else is an lr
computed."""
import dataclasses
import inspect
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed
from torch.distributed.tensor import DTensor, Replicate

from gpt2train.fileio import UserError
from gpt2train.logger import print0
from gpt2train.precision import autocast

OPTIMIZERS = ("adamw", "muon")
MUON_LR = 6e-3  # with adjust_lr_fn="match_rms_adamw" Muon's lr lives on AdamW's scale (dev/muon.md)
MUON_MOMENTUM = 0.95
MUON_MOMENTUM_START = 0.85  # muon_momentum_warmup starts here (modded-nanogpt's 0.85 -> 0.95)
# c_attn as q, k, v: -0.054 val (seed spread 0.017) in issue 33's ablation (dev/recipe.md)
MUON_SPLIT_QKV = True
SCHEDULES = ("cosine", "linear", "wsd")
MUON_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MUON_TORCH = "2.9"  # the first torch with torch.optim.Muon


def ns_dtype_for(plan_dtype, device_type):
    """The dtype Muon's Newton-Schulz runs in on a plan: bf16 on bf16 plans; fp16 on CUDA fp16 plans
    (sm7x/sm60 compute it natively; the input is normalized in fp32 first, so it stays in range);
    fp32 otherwise."""
    if plan_dtype == torch.bfloat16:
        return torch.bfloat16
    if plan_dtype == torch.float16 and device_type == "cuda":
        return torch.float16
    return torch.float32


def is_muon_param(name, p):
    """The 2-D weight matrices inside the transformer blocks: qkv, attention projection, MLP fc and
    projection."""
    return name.startswith("transformer.h.") and p.dim() == 2 and name.endswith(MUON_MATRICES)


def split_params(model, optimizer="adamw"):
    """(muon, decay, no_decay): lists of (name, param), each trainable parameter in exactly one (the
    tied wte/lm_head weight once, as named_parameters gives it). muon is empty for "adamw"."""
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [(n, p) for n, p in named if optimizer == "muon" and is_muon_param(n, p)]
    taken = {n for n, _ in muon}
    decay = [(n, p) for n, p in named if n not in taken and p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if n not in taken and p.dim() < 2]
    return muon, decay, no_decay


def zeropower(G, ns_dtype=torch.float32, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7):
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of G: a matrix (A, B) or a stack
    of them (n, A, B), each on its own (batched matmuls: one launch per product for the whole
    stack), in ns_dtype."""
    X = G.float()
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)  # (n, 1, 1) or (1, 1)
    # normalized in fp32: fp16 can neither overflow nor underflow here
    X = (X / norm.clamp(min=eps)).to(ns_dtype)
    tall = G.size(-2) > G.size(-1)
    X = newton_schulz(X.mT if tall else X, steps, coefficients)
    return X.mT if tall else X


def newton_schulz(X, steps, coefficients):
    """The quintic iteration on a normalized wide (A <= B) matrix (A, B) or stack (n, A, B)."""
    a, b, c = coefficients
    mm_add = torch.baddbmm if X.dim() == 3 else torch.addmm  # beta * input + alpha * (m1 @ m2)
    for _ in range(steps):
        A = X @ X.mT
        B = mm_add(A, A, A, beta=b, alpha=c)
        X = mm_add(X, B, X, beta=a)
    return X


def in_stack(X, i, n, tall):
    """Matrices i..i+n-1 of a wide stack X (m, a, b) as (n, A, B): a view, transposed for a tall
    shape."""
    return X[i:i + n].mT if tall else X[i:i + n]


class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon (kwargs as its) whose Newton-Schulz runs in ns_dtype (see ns_dtype_for),
    batched over the matrices of a wide shape, the elementwise work done once over all of them
    (step_flat). Like fused AdamW it takes found_inf (set by optimizer_step or the GradScaler):
    nonzero skips the step on the device, weights and momentum left as they were, no host read."""
    # torch.optim.Muon casts to bf16 inside step(), which fp16 GPUs and CPUs only emulate: same
    # update, own dtype

    def __init__(self, params, ns_dtype=torch.float32, split=(), **kwargs):
        if not hasattr(torch.optim, "Muon"):
            raise UserError(f"optimizer='muon' needs torch >= {MUON_TORCH} (torch.optim.Muon); "
                            f"this is torch {torch.__version__}: upgrade torch, or use "
                            "optimizer='adamw'")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype  # not in the state_dict: a resume on another device picks its own
        # c_attn (3C, C) orthogonalized as q, k, v: three (C, C) (config's)
        self.split = {id(p): 3 for p in split}
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        # FSDP: one matrix at a time, the skip decided on the host
        self._step_supports_amp_scaling = not sharded

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        skip = None if found_inf is None else found_inf > 0  # () bool on the device
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not self._step_supports_amp_scaling:
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                    self.step_one(group, p)
                continue
            by_dtype = {}
            # stable: a shape's matrices side by side
            for p in sorted(params, key=self.matrix_shape):
                by_dtype.setdefault((p.device, p.dtype, p.grad.dtype), []).append(p)
            for same in by_dtype.values():
                new = [p for p in same if "momentum_buffer" not in self.state[p]]
                if new:  # the first step: one zeros for them all, (A, B) views of it
                    zeros = torch.zeros(sum(p.numel() for p in new), dtype=new[0].grad.dtype,
                                        device=new[0].device)
                    for p, buf in zip(new, zeros.split([p.numel() for p in new])):
                        self.state[p]["momentum_buffer"] = buf.view(p.shape)
                self.step_flat(group, same, skip, grad_scale)
        return loss

    def matrix_shape(self, p):
        """(A, B) of the matrices p is orthogonalized as: p's shape, or a third of its rows when
        split."""
        k = self.split.get(id(p), 1)
        return p.shape[0] // k, p.shape[1]

    def step_flat(self, group, params, skip, grad_scale):
        """One update of matrices of one dtype, sorted by shape: each elementwise op runs once on a
        flat copy of them all, Newton-Schulz once per stack of one wide shape (see orthogonalized).
        A few launches in all."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        sizes = [p.numel() for p in params]
        G = torch.cat([p.grad.reshape(-1) for p in params])  # (N,): every gradient in a row
        # the GradScaler's, when it did not unscale these gradients itself
        if grad_scale is not None:
            G = G / grad_scale
        M = torch.cat([buf.reshape(-1) for buf in bufs])  # (N,)
        M_new = M.lerp(G, 1 - mu)
        update = G.lerp_(M_new, mu) if group["nesterov"] else M_new  # G is a copy: updated in place
        if skip is not None:  # a non-finite step: everything as it was
            torch.where(skip, M, M_new, out=M_new)
        torch._foreach_copy_(bufs, [m.view(p.shape) for m, p in zip(M_new.split(sizes), params)])
        del M, M_new  # the momentum is done: two copies fewer held through Newton-Schulz
        P = torch.cat([p.reshape(-1) for p in params])  # (N,)
        P_new = P * (1 - lr * wd)
        for (A, B), rows, X in self.orthogonalized(group, params, update):  # X (n, A, B)
            ratio = adjusted_lr_ratio(group["adjust_lr_fn"], (A, B))
            # X promoted to P's dtype inside the add
            P_new[rows].view(-1, A, B).add_(X, alpha=-lr * ratio)
        if skip is not None:
            torch.where(skip, P, P_new, out=P_new)
        torch._foreach_copy_(params, [q.view(p.shape) for q, p in zip(P_new.split(sizes), params)])

    def orthogonalized(self, group, params, update):
        """Newton-Schulz of update's matrices, batched per wide shape (A <= B): a tall shape (B, A)
        joins its wide twin transposed, as NS(X^T) = NS(X)^T (c_fc (3072, 768) with c_proj (768,
        3072)). update: (N,), params' matrices in a row, sorted by matrix_shape (a split c_attn:
        three (C, C) rows-slices in a row, its flat as it is). Yields ((A, B), the shape's slice of
        the flat, its (n, A, B) result)."""
        kinds, offset = {}, 0  # (A, B) -> [n, flat offset]: each shape's matrices side by side
        for p in params:
            kinds.setdefault(self.matrix_shape(p), [0, offset])[0] += self.split.get(id(p), 1)
            offset += p.numel()
        wide = {}
        for (A, B), (n, start) in kinds.items():
            rows = slice(start, start + n * A * B)
            wide.setdefault((min(A, B), max(A, B)), []).append(((A, B), rows, n))
        for (a, b), members in wide.items():
            X = torch.empty(sum(n for *_, n in members), a, b, dtype=self.ns_dtype,
                            device=update.device)
            parts, i = [], 0  # ((A, B), flat slice, first matrix in X, n)
            for (A, B), rows, n in members:
                U = update[rows].view(n, A, B)
                norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True, dtype=torch.float32)
                out = in_stack(X, i, n, A > B)  # norm (n, 1, 1): fp32 math, written in ns_dtype
                torch.div(U, norm.clamp_(min=group["eps"]), out=out)
                parts.append(((A, B), rows, i, n))
                i += n
            X = newton_schulz(X, group["ns_steps"], group["ns_coefficients"])  # (sum of n, a, b)
            for (A, B), rows, i, n in parts:
                yield (A, B), rows, in_stack(X, i, n, A > B)

    def step_one(self, group, p):
        """One matrix's update (FSDP: a DTensor, orthogonalized whole; see orthogonalize)."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        buf = self.state[p]["momentum_buffer"]
        buf.lerp_(p.grad, 1 - mu)
        update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
        k = self.split.get(id(p), 1)
        update = orthogonalize(update, self.ns_dtype, group["ns_steps"], group["ns_coefficients"],
                               group["eps"], k)
        p.mul_(1 - lr * wd)
        ratio = adjusted_lr_ratio(group["adjust_lr_fn"], self.matrix_shape(p))
        p.add_(update.to(p.dtype), alpha=-lr * ratio)


def orthogonalize(update, ns_dtype, steps, coefficients, eps, k=1):
    """zeropower of a whole matrix, or of its k row-slices each on its own (k=3: c_attn's q, k, v).
    Under FSDP (a DTensor sharded by rows) each rank gathers the update once, orthogonalizes it
    whole (the same bits on every rank) and keeps its own rows, instead of letting DTensor
    redistribute inside each of Newton-Schulz's 15 matmuls."""
    def ns(U):  # (A, B) -> (A, B)
        slices = U.view(k, U.size(0) // k, U.size(1))  # (k, A / k, B)
        return zeropower(slices, ns_dtype, steps, coefficients, eps).view(U.shape)
    if not isinstance(update, DTensor):
        return ns(update)
    whole = ns(update.full_tensor())  # (A, B), on every rank
    mesh = update.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim)
    return replicated.redistribute(mesh, update.placements)  # each rank's slice: no communication


def adjusted_lr_ratio(adjust_lr_fn, shape):
    """torch.optim.Muon's per-matrix lr factor: "match_rms_adamw" makes the update's RMS about
    AdamW's (0.2 lr)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


def adamw_groups(decay, no_decay, lr, weight_decay, embed_lr_mult=1.0, scalar_lr_mult=1.0):
    """AdamW's param groups, each with its "base_lr": the 2-D ones decayed (the embeddings at lr x
    embed_lr_mult: under "adamw" a group of their own, after the matrices', when the multiplier is
    not 1), the 1-D ones (biases, gains) not, at lr x scalar_lr_mult. Multipliers of 1:
    build-nanogpt's two groups."""
    embed = [(n, p) for n, p in decay if n.startswith(("transformer.wte.", "transformer.wpe."))]
    rest = [(n, p) for n, p in decay if not n.startswith(("transformer.wte.", "transformer.wpe."))]
    if embed_lr_mult == 1.0 or not rest:
        decayed = [{"params": decay, "weight_decay": weight_decay, "base_lr": lr * embed_lr_mult}]
    else:
        decayed = [{"params": rest, "weight_decay": weight_decay, "base_lr": lr},
                   {"params": embed, "weight_decay": weight_decay, "base_lr": lr * embed_lr_mult}]
    return decayed + [{"params": no_decay, "weight_decay": 0.0, "base_lr": lr * scalar_lr_mult}]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The optimizers' numbers (build_optimizers' keyword arguments): the trainer's come from its
    Config."""
    lr: float = 6e-4  # AdamW's base lr
    weight_decay: float = 0.1
    muon_lr: float = MUON_LR
    muon_momentum: float = MUON_MOMENTUM
    muon_weight_decay: float = None  # None: weight_decay
    muon_split_qkv: bool = MUON_SPLIT_QKV  # c_attn as q, k, v (Muon.split)
    embed_lr_mult: float = 1.0  # AdamW's embedding group at lr x this
    scalar_lr_mult: float = 1.0  # AdamW's 1-D group (biases, gains) at lr x this
    # torch.optim.Muon's adjust_lr_fn (dev/recipe.py measures "original" against it)
    muon_scaling: str = "match_rms_adamw"


def tensors_line(named):
    """'N tensors (P parameters)' of a list of (name, param)."""
    return f"{len(named)} tensors ({sum(p.numel() for _, p in named):,} parameters)"


def build_optimizers(model, optimizer="adamw", device_type="cpu", ns_dtype=torch.float32,
                     fused=None, **settings):
    """Build [AdamW] for "adamw" (groups and numbers of GPT.configure_optimizers), [AdamW, Muon]
    for "muon". settings: Settings' fields (lr, weight_decay, muon_lr, ...; the rest at their
    defaults). Every group has "base_lr" (lr for AdamW, x embed_lr_mult / scalar_lr_mult for its
    embedding / 1-D groups, muon_lr for Muon): see the module's schedule contract. fused=None means
    fused AdamW on CUDA where torch has it."""
    s = Settings(**settings)
    muon, decay, no_decay = split_params(model, optimizer)
    if fused is None:
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    groups = adamw_groups(decay, no_decay, s.lr, s.weight_decay, s.embed_lr_mult, s.scalar_lr_mult)
    optimizers = [torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)]
    if not muon:
        print0(f"optimizer: AdamW, {tensors_line(decay)} decayed, {tensors_line(no_decay)} not "
               f"decayed, fused AdamW: {fused}")
        return optimizers
    wd = s.weight_decay if s.muon_weight_decay is None else s.muon_weight_decay
    qkv = [p for n, p in muon if s.muon_split_qkv and n.endswith("attn.c_attn.weight")]
    optimizers.append(Muon([{"params": muon, "base_lr": s.muon_lr}], ns_dtype=ns_dtype, split=qkv,
                           lr=s.muon_lr, weight_decay=wd, momentum=s.muon_momentum,
                           adjust_lr_fn=s.muon_scaling))
    split = ", c_attn as q, k, v" if qkv else ""
    print0(f"optimizer: Muon on {tensors_line(muon)}, lr {s.muon_lr:g}, momentum "
           f"{s.muon_momentum:g}, weight decay {wd:g}, Newton-Schulz in "
           f"{str(ns_dtype).removeprefix('torch.')}{split}; AdamW on {tensors_line(decay)} decayed "
           f"and {tensors_line(no_decay)} not, fused AdamW: {fused}")
    return optimizers

# -----------------------------------------------------------------------------
# the schedule: one multiplier of every optimizer's base lr


def optimizers_for(model, cfg, plan):
    """build_optimizers with the run's config keys, on the plan's device (the trainer's)."""
    return build_optimizers(
        model, cfg.optimizer, lr=cfg.max_lr, weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr,
        muon_momentum=cfg.muon_momentum, muon_split_qkv=cfg.muon_split_qkv,
        embed_lr_mult=cfg.embed_lr_mult, scalar_lr_mult=cfg.scalar_lr_mult,
        device_type=plan.device_type, ns_dtype=ns_dtype_for(plan.dtype, plan.device_type))


def lr_multiplier(step, cfg, max_steps=None):
    """Linear warmup to 1 over warmup_steps, then down to min_lr / max_lr at max_steps by
    cfg.lr_schedule: cosine (build-nanogpt's), linear, or wsd (flat, then linear over the last
    cooldown_frac of the run). max_steps: the run's planned length (None: cfg.max_steps)."""
    max_steps = cfg.max_steps if max_steps is None else max_steps
    if not cfg.max_lr:
        return 0.0
    if step < cfg.warmup_steps:
        lr = cfg.max_lr * (step + 1) / cfg.warmup_steps
    elif step >= max_steps:
        lr = cfg.min_lr
    else:
        lr = cfg.min_lr + decay_fraction(step, cfg, max_steps) * (cfg.max_lr - cfg.min_lr)
    return lr / cfg.max_lr  # as a ratio of max_lr, in the exact floats of build-nanogpt's get_lr


def cooldown_start(cfg, max_steps=None):
    """lr_schedule=wsd: the cooldown's first step of a run planned for max_steps (None:
    cfg.max_steps); else None. Before it the lr is flat at max_lr, whatever max_steps is: a
    checkpoint from before it continues with a larger max_steps exactly as a run planned that
    long."""
    if cfg.lr_schedule != "wsd":
        return None
    max_steps = cfg.max_steps if max_steps is None else max_steps
    return max(cfg.warmup_steps, max_steps - round(cfg.cooldown_frac * max_steps))


def extension_note(cfg, planned, step, ckpt_path, branch_path=None):
    """The line a resume says when max_steps grew past the `planned` max_steps of the checkpoint (at
    `step`, ckpt_path): how the schedule goes on, AdamW's base lr (and Muon's, under optimizer=muon:
    the same schedule) from the last step to the next.
    Re-planned on the new max_steps: wsd resumed before its cooldown goes on flat, exactly as a run
    planned that long (no jump); a cosine or linear run stretches to the new end and wsd in or after
    its cooldown goes back to its flat lr, a jump in one step, said with the ways around it (wsd's
    kept cooldown-start checkpoint, branch_path, or a new run from the weights with its own warmup).
    None when max_steps did not grow."""
    if cfg.max_steps <= planned or step < 1 or not cfg.max_lr:
        return None
    before, after = lr_multiplier(step - 1, cfg, planned), lr_multiplier(step, cfg)
    last, now = before * cfg.max_lr, after * cfg.max_lr
    muon = ""
    if cfg.optimizer == "muon":
        muon = f" and Muon's from {before * cfg.muon_lr:.2e} to {after * cfg.muon_lr:.2e}"
    end = f"down to min_lr={cfg.min_lr:.2e} at step {cfg.max_steps}"
    shape = f"{cfg.lr_schedule} {end}"
    if cfg.lr_schedule == "wsd":
        shape = f"flat until the cooldown at step {cooldown_start(cfg)}, then {end}"
    head = (f"note: max_steps {planned} -> {cfg.max_steps}: the {cfg.lr_schedule} schedule is "
            f"re-planned for {cfg.max_steps} steps ({shape})")
    if now <= last * (1 + 1e-6) or now - last <= 1e-12:
        return (f"{head}: AdamW's lr goes on from {last:.2e} to {now:.2e}{muon} at step {step}, no "
                "jump")
    ways = ""
    if branch_path:
        ways = (f"resume its cooldown-start checkpoint {branch_path} instead (copy it into a new "
                f"folder and resume there with --max_steps={cfg.max_steps} --out_dir=<that "
                f"folder>: exactly a {cfg.max_steps}-step run), or ")
    return (f"{head}: AdamW's lr jumps from {last:.2e} (step {step - 1}) to {now:.2e}{muon} at "
            f"step {step}, {now / last if last else math.inf:.1f}x in one step; to avoid the jump, "
            f"{ways}train on from its weights with a fresh warmup: --init_from={ckpt_path} "
            "--out_dir=<a new folder> --max_steps=<the steps to add> (docs/training.md, "
            "'Extending a run')")


def decay_fraction(step, cfg, max_steps):
    """How much of max_lr - min_lr is left at step (warmup_steps <= step < max_steps): 1 -> 0."""
    if cfg.lr_schedule == "wsd":
        start = cooldown_start(cfg, max_steps)
        return 1.0 if step < start else (max_steps - step) / (max_steps - start)
    ratio = (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps)  # 0 -> 1
    return 0.5 * (1.0 + math.cos(math.pi * ratio)) if cfg.lr_schedule == "cosine" else 1.0 - ratio


def muon_momentum(step, cfg):
    """Muon's momentum at step: MUON_MOMENTUM_START -> muon_momentum, linearly over
    muon_momentum_warmup steps (0: muon_momentum throughout)."""
    if cfg.muon_momentum_warmup <= 0:
        return cfg.muon_momentum
    frac = min(step / cfg.muon_momentum_warmup, 1.0)
    return (1 - frac) * MUON_MOMENTUM_START + frac * cfg.muon_momentum


def lrs(optimizers):
    """Each optimizer's base lr as it last stepped, for the step line and log.jsonl: [AdamW's
    (max_lr x the schedule; its embedding and 1-D groups run at embed_lr_mult / scalar_lr_mult times
    it), Muon's (muon_lr x the schedule)]."""
    out = []
    for opt in optimizers:
        group = opt.param_groups[0]
        base = group.get("base_lr", group["lr"])
        out.append(group["lr"] / base * opt.defaults["lr"] if base else group["lr"])
    return out


# -----------------------------------------------------------------------------
# THE training step: gradients over the micro-batches, then one update of every optimizer


@dataclasses.dataclass(frozen=True)
class Stepping:
    """What every training step of a run takes alike: built once (the trainer, bench, the probes),
    passed whole to accumulate_gradients (plan, scaler), optimizer_step and train_step."""
    plan: object  # precision.Plan: device, autocast; under CUDA graphs the gradients stay in place
    scaler: object  # torch.amp.GradScaler, enabled for fp16 only (a no-op otherwise)
    optimizers: list = ()  # AdamW, or AdamW + Muon: stepped together
    params: list = None  # every trained parameter once, the one clip's (None: the optimizers')
    grad_clip: float = 1.0  # the clip's max norm (0: none)

    @property
    def clipped(self):
        """The parameters the one clip runs over: params, else every optimizer's."""
        if self.params is not None:
            return self.params
        return [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]


def accumulate_gradients(model, loader, grad_accum, stepping, ddp=False, bar=None):
    """Forward/backward over grad_accum micro-batches; the gradients end up those of their mean
    loss. DDP all-reduces the gradients only on the last micro-step. Each micro-batch after the
    first is read before the previous one's backward is queued. Returns the mean loss (a tensor on
    the device). bar (logger.micro_step_bar) is told of each micro-step done. Under CUDA graphs
    (plan.cudagraphs) each micro-step is marked as a new replay and the gradients live outside the
    graphs' memory (static_grads): a replay overwrites its outputs, and the first micro-step's
    gradients would be one."""
    plan, scaler = stepping.plan, stepping.scaler
    loss_accum = torch.zeros((), device=plan.device)
    if plan.cudagraphs:
        static_grads(model)
    x, y = loader.next_batch(plan.device)  # (B, T), (B, T)
    for micro_step in range(grad_accum):
        if plan.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        sync = nullcontext() if not ddp or micro_step == grad_accum - 1 else model.no_sync()
        with sync:
            with autocast(plan):
                _, loss = model(x, y)
            # the next batch is gathered while the GPU runs this forward/backward
            if micro_step < grad_accum - 1:
                x, y = loader.next_batch(plan.device)
            # cross-entropy is a mean: scale so the sum over micro-steps is the mean
            loss = loss / grad_accum
            loss_accum += loss.detach().float()
            # a disabled GradScaler (bf16, fp32) returns the loss as it is
            scaler.scale(loss).backward()
        if bar is not None:
            bar.update()
    return loss_accum


def static_grads(model):
    """Give every trained parameter that has none a zero gradient, allocated here, outside any CUDA
    graph: backward then adds into it in place (optimizer_step under CUDA graphs zeroes it)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def evaluate(model, loader, steps, plan, world_size=1, stop_now=lambda: False):
    """The mean loss of model over `steps` batches from the start of loader's split, averaged over
    the ranks; None when stop_now() (asked before each batch, alike on every rank) ends it early."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=plan.device)
    for _ in range(steps):
        if stop_now():
            model.train()
            return None
        x, y = loader.next_batch(plan.device)  # (B, T), (B, T)
        if plan.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(plan):
            _, loss = model(x, y)
        total += loss.float()
    if world_size > 1:
        torch.distributed.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / (steps * world_size)  # sync: once per eval


class Stepped(NamedTuple):
    loss: float  # the step's mean loss
    norm: float  # the gradient norm before clipping
    applied: bool  # whether the update was applied
    flags: list  # the values of optimizer_step's flags, read in the same transfer
    why: str = ""  # why it was skipped: "inf/nan loss or gradients" or "outlier"; "" if applied


def skips_on_device(optimizers, is_outlier):
    """Whether every update can be launched before the step's one host read, a non-finite step
    skipped on the device: every optimizer takes a found_inf flag (fused AdamW, optim.Muon). A
    non-fused AdamW and the outlier test decide on the host, after the read. With or without the
    GradScaler (fp16)."""
    flags = [getattr(opt, "_step_supports_amp_scaling", False) for opt in optimizers]
    return is_outlier is None and all(flags)


def _update(optimizers, scaler, found_inf=None):
    """Step every optimizer, then one loss-scale update (a no-op without the GradScaler, which backs
    off when any optimizer's gradients held inf/nan). found_inf: a 0-d tensor, nonzero to skip, one
    for all the optimizers (they take it as the GradScaler sets it). Never scaler.step: it judges
    each optimizer on its own gradients, but the one clip over all of them spreads one's inf into
    the others' as 0 or nan."""
    for opt in optimizers:
        if found_inf is not None:
            # read by the fused kernel; unscaled already
            opt.grad_scale, opt.found_inf = None, found_inf
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        else:
            opt.step()
    scaler.update()


def set_lr(optimizers, scale, momentum=None):
    """The schedule applied: every group's lr = its base_lr * scale (scale: lr_multiplier), and
    Muon's momentum (muon_momentum) when given. A group built without a base_lr takes its lr as
    one."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group.setdefault("base_lr", group["lr"]) * scale
            if momentum is not None and isinstance(opt, Muon):
                group["momentum"] = momentum


def optimizer_step(stepping, lr_scale, loss, is_outlier=None, flags=None, momentum=None):
    """THE optimizer step of the trainer, bench.py and the micro-batch probes. Every param group's
    lr is set to its base_lr x lr_scale (one schedule for AdamW and Muon); each optimizer is
    unscaled (fp16), one clip (stepping.grad_clip) runs over all parameters, each optimizer steps,
    the loss scale is updated once. A step whose loss or gradients hold inf/nan is skipped in every
    precision, by every optimizer together (the weights never go non-finite; the clip would spread
    one optimizer's inf into the others' gradients); is_outlier(loss, norm) -> True skips a finite
    step too (the loss scale is left as it is). flags: a 1-D tensor on the device (the ranks' stop
    requests) read with loss and norm. Where the optimizers allow (skips_on_device) the update is
    launched before the read, so the device never waits for the host. momentum: Muon's at this step
    (muon_momentum), None: as it is. Under CUDA graphs (plan.cudagraphs) the gradients are zeroed in
    place, not freed. Returns Stepped, read from the device in one transfer."""
    optimizers, scaler, grad_clip = stepping.optimizers, stepping.scaler, stepping.grad_clip
    set_lr(optimizers, lr_scale, momentum)
    for opt in optimizers:
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones (a no-op when disabled)
    norm = torch.nn.utils.clip_grad_norm_(stepping.clipped,
                                          grad_clip if grad_clip > 0 else float("inf"))
    # FSDP: a DTensor over the ranks (the whole model's norm once gathered)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    read = torch.cat([loss.float().view(1), norm.float().to(loss.device).view(1)] +
                     ([flags.float()] if flags is not None else []))  # (2 + flags,)
    on_device = skips_on_device(optimizers, is_outlier)
    if on_device:
        # (), as GradScaler makes it: any inf/nan skips all
        found_inf = (~torch.isfinite(read[:2]).all()).float()
        _update(optimizers, scaler, found_inf)
    loss, norm, *flags = read.tolist()  # sync: the step's one host read
    # decided here, once: the step's result says why
    finite = math.isfinite(loss) and math.isfinite(norm)
    apply = finite and not (is_outlier is not None and is_outlier(loss, norm))
    if not on_device:
        if apply:
            _update(optimizers, scaler)
        else:
            # skipped: the GradScaler lowers its scale if the gradients held inf/nan
            scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=not stepping.plan.cudagraphs)
    why = "" if apply else "outlier"
    if not finite:
        why = "inf/nan loss or gradients"
    return Stepped(loss, norm, apply, flags, why)


class FixedBatch:
    """A loader that gives the same (x, y) every time: the benchmark's and the probes' data."""

    def __init__(self, x, y):
        self.x, self.y = x, y  # (B, T), (B, T)

    def next_batch(self, device):
        return self.x, self.y


def train_step(model, stepping, x, y, lr_scale=1.0):
    """One step of the trainer's own step functions on a fixed batch, no accumulation, clipped at
    stepping.grad_clip (1.0 unless set): what bench.py times and the micro-batch probes run
    (lr_scale 0: no update, the weights stay as they are)."""
    loss = accumulate_gradients(model, FixedBatch(x, y), 1, stepping)
    return optimizer_step(stepping, lr_scale, loss)
