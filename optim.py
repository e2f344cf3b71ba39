"""The optimizers of a GPT: AdamW alone ("adamw", the GPT-2 recipe), or Muon on the blocks' hidden
matrices with AdamW on the rest ("muon"). Parameters go in by name, so states can be keyed by name.

The schedule contract: every param group carries "base_lr"; the trainer's one schedule (warmup +
cosine) sets group["lr"] = group["base_lr"] * scale, scale = get_lr(step) / max_lr, in every optimizer
(precision.set_lr, called by precision.optimizer_step)."""
import inspect
import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from fileio import UserError

OPTIMIZERS = ("adamw", "muon")
MUON_LR = 6e-3  # with adjust_lr_fn="match_rms_adamw" Muon's lr lives on AdamW's scale (bench/muon.md)
MUON_MOMENTUM = 0.95
MUON_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MUON_TORCH = "2.9"  # the first torch with torch.optim.Muon


def ns_dtype_for(plan_dtype, device_type):
    """The dtype Muon's Newton-Schulz runs in on a plan: bf16 on bf16 plans; fp16 on CUDA fp16 plans
    (sm7x/sm60 compute it natively; the input is normalized in fp32 first, so it stays in range); fp32 otherwise."""
    if plan_dtype == torch.bfloat16:
        return torch.bfloat16
    if plan_dtype == torch.float16 and device_type == "cuda":
        return torch.float16
    return torch.float32


def is_muon_param(name, p):
    """The 2-D weight matrices inside the transformer blocks: qkv, attention projection, MLP fc and projection."""
    return name.startswith("transformer.h.") and p.dim() == 2 and name.endswith(MUON_MATRICES)


def split_params(model, optimizer="adamw"):
    """(muon, decay, no_decay): lists of (name, param), each trainable parameter in exactly one (the tied
    wte/lm_head weight once, as named_parameters gives it). muon is empty for "adamw"."""
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [(n, p) for n, p in named if optimizer == "muon" and is_muon_param(n, p)]
    taken = {n for n, _ in muon}
    decay = [(n, p) for n, p in named if n not in taken and p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if n not in taken and p.dim() < 2]
    return muon, decay, no_decay


def zeropower(G, ns_dtype=torch.float32, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7):
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of G: a matrix (A, B) or a stack of them
    (n, A, B), each on its own (batched matmuls: one launch per product for the whole stack), in ns_dtype."""
    X = G.float()
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)  # (n, 1, 1) or (1, 1)
    X = (X / norm.clamp(min=eps)).to(ns_dtype)  # normalized in fp32: fp16 can neither overflow nor underflow here
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    a, b, c = coefficients
    mm_add = torch.baddbmm if X.dim() == 3 else torch.addmm  # beta * input + alpha * (m1 @ m2)
    for _ in range(steps):
        A = X @ X.mT
        B = mm_add(A, A, A, beta=b, alpha=c)
        X = mm_add(X, B, X, beta=a)
    return X.mT if tall else X


class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon (kwargs as its) whose Newton-Schulz runs in ns_dtype (see ns_dtype_for), batched over
    the matrices of a shape. Like fused AdamW it takes found_inf (set by precision.optimizer_step or the
    GradScaler): nonzero skips the step on the device, weights and momentum left as they were, no host read."""
    # torch.optim.Muon casts to bf16 inside step(), which fp16 GPUs and CPUs only emulate: same update, own dtype

    def __init__(self, params, ns_dtype=torch.float32, **kwargs):
        if not hasattr(torch.optim, "Muon"):
            raise UserError(f"optimizer='muon' needs torch >= {MUON_TORCH} (torch.optim.Muon); this is torch "
                            f"{torch.__version__}: upgrade torch, or use optimizer='adamw'")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype  # not in the state_dict: a resume on another device picks its own
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        self._step_supports_amp_scaling = not sharded  # FSDP: one matrix at a time, the skip decided on the host

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
            by_shape = {}
            for p in params:
                by_shape.setdefault((p.shape, p.dtype, p.grad.dtype), []).append(p)
            for same in by_shape.values():
                new = [p for p in same if "momentum_buffer" not in self.state[p]]
                for p, buf in zip(new, torch.zeros((len(new), *same[0].shape), dtype=same[0].grad.dtype,
                                                   device=same[0].device).unbind(0) if new else ()):
                    self.state[p]["momentum_buffer"] = buf  # (A, B) each, one zeros for the stack
                self.step_stack(group, same, skip, grad_scale)
        return loss

    def step_stack(self, group, params, skip, grad_scale):
        """One update of same-shape matrices, stacked: a few launches for all of them, whatever their number."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        G = torch.stack([p.grad for p in params])  # (n, A, B)
        if grad_scale is not None:  # the GradScaler's, when it did not unscale these gradients itself
            G = G / grad_scale
        M = torch.stack(bufs)  # (n, A, B)
        M_new = M.lerp(G, 1 - mu)
        update = G.lerp(M_new, mu) if group["nesterov"] else M_new
        X = zeropower(update, self.ns_dtype, group["ns_steps"], group["ns_coefficients"], group["eps"])
        P = torch.stack(params)  # (n, A, B)
        ratio = adjusted_lr_ratio(group["adjust_lr_fn"], P.shape[1:])
        P_new = P.mul(1 - lr * wd).add_(X, alpha=-lr * ratio)  # X promoted to P's dtype inside the add
        if skip is not None:  # a non-finite step: everything as it was
            M_new, P_new = torch.where(skip, M, M_new), torch.where(skip, P, P_new)
        torch._foreach_copy_(bufs, list(M_new.unbind(0)))
        torch._foreach_copy_(params, list(P_new.unbind(0)))

    def step_one(self, group, p):
        """One matrix's update (FSDP: a DTensor, orthogonalized whole; see orthogonalize)."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        buf = self.state[p]["momentum_buffer"]
        buf.lerp_(p.grad, 1 - mu)
        update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
        update = orthogonalize(update, self.ns_dtype, group["ns_steps"], group["ns_coefficients"], group["eps"])
        p.mul_(1 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr * adjusted_lr_ratio(group["adjust_lr_fn"], p.shape))


def orthogonalize(update, ns_dtype, steps, coefficients, eps):
    """zeropower of a whole matrix. Under FSDP (a DTensor sharded by rows) each rank gathers the update
    once, orthogonalizes it whole (the same bits on every rank) and keeps its own rows, instead of
    letting DTensor redistribute inside each of Newton-Schulz's 15 matmuls."""
    if not isinstance(update, DTensor):
        return zeropower(update, ns_dtype, steps, coefficients, eps)
    whole = zeropower(update.full_tensor(), ns_dtype, steps, coefficients, eps)  # (A, B), on every rank
    replicated = DTensor.from_local(whole, update.device_mesh, [Replicate()] * update.device_mesh.ndim)
    return replicated.redistribute(update.device_mesh, update.placements)  # each rank's slice: no communication


def adjusted_lr_ratio(adjust_lr_fn, shape):
    """torch.optim.Muon's per-matrix lr factor: "match_rms_adamw" makes the update's RMS about AdamW's (0.2 lr)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


def build_optimizers(model, optimizer="adamw", lr=6e-4, weight_decay=0.1, muon_lr=MUON_LR,
                     muon_momentum=MUON_MOMENTUM, muon_weight_decay=None, device_type="cpu",
                     ns_dtype=torch.float32, fused=None, verbose=True):
    """[AdamW] for "adamw" (groups and numbers of GPT.configure_optimizers), [AdamW, Muon] for "muon".
    Every group has "base_lr" (lr for AdamW, muon_lr for Muon): see the module's schedule contract.
    muon_weight_decay=None means weight_decay; fused=None means fused AdamW on CUDA where torch has it."""
    muon, decay, no_decay = split_params(model, optimizer)
    if fused is None:
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    groups = [{"params": decay, "weight_decay": weight_decay, "base_lr": lr},
              {"params": no_decay, "weight_decay": 0.0, "base_lr": lr}]
    optimizers = [torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)]
    size = lambda ps: f"{len(ps)} tensors ({sum(p.numel() for _, p in ps):,} parameters)"  # noqa: E731
    if muon:
        wd = weight_decay if muon_weight_decay is None else muon_weight_decay
        optimizers.append(Muon([{"params": muon, "base_lr": muon_lr}], ns_dtype=ns_dtype, lr=muon_lr,
                                    weight_decay=wd, momentum=muon_momentum, adjust_lr_fn="match_rms_adamw"))
        if verbose:
            print(f"optimizer: Muon on {size(muon)}, lr {muon_lr:g}, momentum {muon_momentum:g}, weight decay {wd:g}, "
                  f"Newton-Schulz in {str(ns_dtype).removeprefix('torch.')}; AdamW on {size(decay)} decayed and "
                  f"{size(no_decay)} not, fused AdamW: {fused}")
    elif verbose:
        print(f"optimizer: AdamW, {size(decay)} decayed, {size(no_decay)} not decayed, fused AdamW: {fused}")
    return optimizers
