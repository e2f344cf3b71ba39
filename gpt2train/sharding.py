"""
FSDP2 for train_gpt2.py (fsdp=true): each rank keeps 1/world_size of the parameters, gradients and
AdamW state, and the checkpoints stay one format, with or without FSDP.

    from gpt2train.sharding import shard_model, full_state, load_optimizer_state
    shard_model(model, plan.dtype, "cuda")  # after model.to(device), before the optimizer
    # every rank calls; rank 0 gets full CPU tensors
    model_sd, optim_sd = full_state(model, optimizers)
    # a full state into a sharded or a plain model
    load_optimizer_state(model, optimizers, optim_sd)

The model's own state goes in as a plain state dict before shard_model (model.load_state_dict), so
GPT.from_checkpoint, hellaswag.py and the Hugging Face export read every checkpoint the same way.
The engine is PyTorch's: torch.distributed.fsdp.fully_shard and torch.distributed.checkpoint.
"""
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from gpt2train.precision import fsdp_param_dtype


def shard_model(model, dtype, device_type):
    """fully_shard the GPT in place: one FSDP unit per transformer block (its parameters gathered
    just before its forward and again for its backward, freed after each), and the root for the rest
    (the embeddings, ln_f and the tied lm_head, gathered once per micro-step). Sharded master
    weights, the gradients' reduce-scatter and AdamW stay fp32. Block inputs are not cast and the
    root keeps fp32 weights, so the residual stream, the layer norms and the loss run in the dtypes
    autocast gives them without FSDP; only the blocks' matmul weights arrive already in the compute
    dtype."""
    # torch >= 2.6 (checked at start-up)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    param_dtype = fsdp_param_dtype(dtype, device_type)
    block_dtype = None if param_dtype == torch.float32 else param_dtype
    block_policy = MixedPrecisionPolicy(param_dtype=block_dtype,
                                        reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return model


def full_state(model, optimizers):
    """(model state, optimizers' state): full CPU tensors on rank 0, {} on the other ranks. The
    model's is keyed as model.state_dict() keys it; the optimizers' (AdamW alone, or AdamW + Muon,
    in one) by parameter name (torch.distributed's format, the same with and without FSDP, so either
    kind of run resumes the other's checkpoint).
    Under FSDP it gathers the shards, so every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def load_optimizer_state(model, optimizers, state):
    """Load a full optimizers' state (every rank holds it) into the optimizers of a sharded or plain
    model; each rank keeps its shard. Checkpoints from before this format hold one AdamW's
    optimizer.state_dict() itself (integer parameter ids); those load the plain way."""
    groups = state["param_groups"]
    if groups and groups[0]["params"] and isinstance(groups[0]["params"][0], int):
        optimizers[0].load_state_dict(state)
    else:
        set_optimizer_state_dict(model, optimizers, state,
                                 options=StateDictOptions(full_state_dict=True))
