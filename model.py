"""
The GPT-2 model, in one file.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig())            # 124M, random init
    model = GPT.load("gpt2")            # OpenAI weights (hub), a save_pretrained dir or a ckpt_*.pt
    logits, _ = model(idx)              # idx: (B, T) int64 -> logits (B, T, vocab)
    _, loss = model(idx, targets)       # the chunked cross-entropy: the loss, no logits

GPTConfig is the architecture a checkpoint saves; how a run executes the model is set apart from it
(GPT(config, loss_impl="full") or model.set_runtime(...)): loss_impl="full" returns the logits with
the loss (F.cross_entropy, fused into the graph when compiled), "fused" writes dL/dlogits over them
in one Triton pass (a custom op, in the graph too), the default "chunked" never builds them
(ce_chunk_rows rows of logits at a time); activation_checkpointing="blocks" or "every_other"
recomputes those blocks in backward instead of keeping their activations.

Also here: FLOPs per token (gpt2train/precision.py has the MFU). The loss head is
gpt2train/loss.py's. Checkpoints are read and checked by gpt2train/checkpoint.py; export.py writes
the Hugging Face directory and the GGUF file. From the command line:

    python model.py                                  # parameter count and FLOPs of each GPT-2 size
    python model.py --help                           # the usage
"""
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from gpt2train.checkpoint import check_config, read_checkpoint
from gpt2train.fileio import UserError, fail
from gpt2train.kernels import GELU_IMPLS, QKV_IMPLS, linear_gelu, qkv_split
from gpt2train.logger import print0
from gpt2train.loss import CE_CHUNK_ROWS, LOSS_IMPLS, loss_head

GPT2_VOCAB_SIZE = 50257  # real tokens; a padded vocab (50304) has extra rows that are never targets

# -----------------------------------------------------------------------------
# configuration


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length
    vocab_size: int = 50257  # 50257 BPE tokens; 50304 (a multiple of 64) is faster to train
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attn_impl: str = "sdpa"  # "sdpa" (flash / memory-efficient kernels) or "naive" (masked softmax)


# activation checkpointing: no block, all, blocks 0, 2, 4, ...
CHECKPOINTING = ("none", "blocks", "every_other")
# run-time: older checkpoints' model_args
RUNTIME_KEYS = ("activation_checkpointing", "ce_chunk_rows", "loss_impl")


# the four OpenAI checkpoints
PRETRAINED = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# -----------------------------------------------------------------------------
# the network


class CausalSelfAttention(nn.Module):
    qkv_impl = "fused"  # a run-time setting (GPT.set_runtime): one matmul for q, k, v, or "split"

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.attn_impl = config.attn_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.SCALE_INIT = True

    def forward(self, x, attn_mask=None):
        """Causal self-attention of x; attn_mask, if given, a bool mask broadcastable to
        (B, nh, T, T) with True = attend."""
        B, T, C = x.size()
        if self.qkv_impl == "split":  # a matmul each (gpt2train/kernels.py): no cat in backward
            q, k, v = qkv_split(x, self.c_attn.weight, self.c_attn.bias)
        else:
            q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.attn_impl == "sdpa" and attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        elif self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, nh, T, hs)
        else:  # the textbook version, kept for the benchmark ladder
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            mask = attn_mask
            if mask is None:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    gelu_impl = "pointwise"  # a run-time setting (GPT.set_runtime): or "epilogue", in the GEMM

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.SCALE_INIT = True

    def forward(self, x):
        if self.gelu_impl == "epilogue":  # gpt2train/kernels.py: the pre-activation never kept
            return self.c_proj(linear_gelu(x, self.c_fc.weight, self.c_fc.bias))
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None):
        x = x + self.attn(self.ln_1(x), attn_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config, activation_checkpointing="none", ce_chunk_rows=CE_CHUNK_ROWS,
                 loss_impl="chunked"):
        super().__init__()
        self.config = config
        self.set_runtime(activation_checkpointing, ce_chunk_rows, loss_impl)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        self.set_runtime(qkv_impl=CausalSelfAttention.qkv_impl, gelu_impl=MLP.gelu_impl)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            # residual projections: keep the stream's variance
            if getattr(module, "SCALE_INIT", False):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def zero_init_projections(self):
        """The residual output projections' weights (attn.c_proj, mlp.c_proj) to 0: each block
        starts as the identity (modded-nanogpt, nanochat). For a fresh model (the trainer's
        zero_init_proj, scratch runs)."""
        with torch.no_grad():
            for block in self.transformer.h:
                block.attn.c_proj.weight.zero_()
                block.mlp.c_proj.weight.zero_()
        return self

    def set_runtime(self, activation_checkpointing=None, ce_chunk_rows=None, loss_impl=None,
                    qkv_impl=None, gelu_impl=None):
        """How this run executes the model, never part of its config or a checkpoint: the blocks
        recomputed in backward (CHECKPOINTING), the chunked loss's rows of logits at a time, the
        loss head (LOSS_IMPLS), and the kernel layouts of gpt2train/kernels.py (qkv_impl,
        gelu_impl: set on every block). None keeps the value. Set before torch.compile: the
        compiled graph guards on them."""
        if activation_checkpointing is not None:
            if activation_checkpointing not in CHECKPOINTING:
                raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not "
                                 f"one of {', '.join(CHECKPOINTING)}")
            self.activation_checkpointing = activation_checkpointing
        if ce_chunk_rows is not None:
            if type(ce_chunk_rows) is not int or ce_chunk_rows < 1:
                raise ValueError(f"ce_chunk_rows must be a positive integer, got {ce_chunk_rows!r}")
            self.ce_chunk_rows = ce_chunk_rows
        if loss_impl is not None:
            if loss_impl not in LOSS_IMPLS:
                raise ValueError(f"loss_impl={loss_impl!r} is not one of {', '.join(LOSS_IMPLS)}")
            self.loss_impl = loss_impl
        for name, value, choices in (("qkv_impl", qkv_impl, QKV_IMPLS),
                                     ("gelu_impl", gelu_impl, GELU_IMPLS)):
            if value is not None:
                if value not in choices:
                    raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
                setattr(self, name, value)
                for block in self.transformer.h:
                    setattr(block.attn if name == "qkv_impl" else block.mlp, name, value)
        return self

    def hidden_states(self, idx, pos=None, attn_mask=None):
        """The final layer-normed hidden states (B, T, n_embd); lm_head turns them into logits.
        By default token t sits at position t and attends causally. Packed sequences (several
        continuations of one prefix in one row, as in hellaswag.py) pass their own position ids
        pos (B, T) and a bool attn_mask broadcastable to (B, n_head, T, T), True = attend."""
        B, T = idx.size()
        assert T <= self.config.block_size, \
            f"sequence of length {T} is longer than block_size {self.config.block_size}"
        if pos is None:
            pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            if self.checkpointed(i):  # keep only the block's input; rerun it in backward
                x = checkpoint(block, x, attn_mask, use_reentrant=False)
            else:
                x = block(x, attn_mask)
        return self.transformer.ln_f(x)  # (B, T, C)

    def checkpointed(self, i):
        """Whether block i is checkpointed: its mode says so and gradients are being recorded."""
        mode = self.activation_checkpointing
        every_other = mode == "every_other" and i % 2 == 0
        return torch.is_grad_enabled() and (mode == "blocks" or every_other)

    def forward(self, idx, targets=None, pos=None, attn_mask=None):
        """(logits (B, T, vocab_size), None) without targets. With targets, the mean cross-entropy
        (targets of -1 are masked out), from gpt2train/loss.py's loss_head: loss_impl="chunked"
        returns (None, loss) and never builds the full logits; "full" returns (logits, loss) from
        F.cross_entropy; "fused" returns (None, loss), its logits turned into dL/dlogits. pos and
        attn_mask are for packed sequences (see hidden_states): a compiled model takes them here."""
        h = self.hidden_states(idx, pos, attn_mask)  # (B, T, C)
        if targets is None:
            return self.lm_head(h), None  # (B, T, vocab_size)
        return loss_head(h, self.lm_head.weight, targets, self.loss_impl, self.ce_chunk_rows)

    def num_params(self, non_embedding=True):
        """Parameter count; by default without the position embeddings (a lookup, no FLOPs).
        The token embedding stays in: it is the lm_head matmul too."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    # -------------------------------------------------------------------------
    # sampling

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens. temperature=0 is greedy; top_k keeps
        exactly the k most likely tokens. The context is cropped to block_size; padded vocab rows
        beyond the 50257 real tokens are never sampled."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]  # (B, <=block_size)
            logits = self.lm_head(self.hidden_states(idx_cond)[:, -1, :]).float()  # (B, vocab)
            if logits.size(-1) > GPT2_VOCAB_SIZE:
                logits = logits[:, :GPT2_VOCAB_SIZE]
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                cand = None
                if top_k is not None and top_k < logits.size(-1):
                    logits, cand = torch.topk(logits, top_k, dim=-1)  # (B, k), (B, k)
                probs = F.softmax(logits, dim=-1)
                choice = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                idx_next = choice if cand is None else torch.gather(cand, -1, choice)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    # -------------------------------------------------------------------------
    # Hugging Face / OpenAI weights

    @classmethod
    def load(cls, spec, config=None):
        """The one model loader of every script. spec: "scratch" (a fresh GPT(config)), a GPT-2 name
        (gpt2 .. gpt2-xl, from the hub on first use), a save_pretrained directory, or one of
        train_gpt2.py's checkpoints (ckpt_*.pt). Anything else is one UserError line."""
        if spec == "scratch":
            return cls(config or GPTConfig())
        if spec.endswith(".pt") or os.path.isfile(spec):
            return cls.from_checkpoint(spec)
        if os.path.isdir(spec) and any(n.startswith("ckpt_") and n.endswith(".pt")
                                       for n in os.listdir(spec)):
            raise UserError(f"{spec} is a training run's out_dir: pass one of its ckpt_*.pt files")
        return cls.from_pretrained(spec)

    @classmethod
    def from_pretrained(cls, name_or_path):
        """Load OpenAI's GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl; downloaded from the hub on
        first use) or any GPT-2 directory written by transformers' save_pretrained (offline)."""
        from transformers import GPT2LMHeadModel
        if name_or_path not in PRETRAINED and not os.path.isdir(name_or_path):
            raise UserError(f"model {name_or_path!r} is not scratch, a GPT-2 name "
                            f"({', '.join(PRETRAINED)}), a directory written by save_pretrained or "
                            "a ckpt_*.pt file")
        where = "disk"
        if name_or_path in PRETRAINED:
            where = "the Hugging Face hub (cached after the first download)"
        print0(f"loading GPT-2 weights {name_or_path!r} from {where}")
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_path)
        except OSError as e:  # offline, no cache, or a directory without weights
            raise UserError(f"could not load {name_or_path!r}: {str(e).splitlines()[0]} "
                             "(hub names need network on first use; or pass a save_pretrained "
                             "directory)") from None
        c = hf.config
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(f"{name_or_path!r} uses activation {c.activation_function!r}; only "
                            "GPT-2's tanh GELU is supported")
        config = GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer,
                           n_head=c.n_head, n_embd=c.n_embd)
        model = cls(config)
        sd = model.state_dict()
        buffers = (".attn.bias", ".attn.masked_bias")
        sd_hf = {k: v for k, v in hf.state_dict().items() if not k.endswith(buffers)}
        if set(sd) != set(sd_hf):
            raise UserError(f"{name_or_path!r} does not have GPT-2's layout: unexpected "
                            f"{sorted(set(sd_hf) - set(sd))[:3]}, missing "
                            f"{sorted(set(sd) - set(sd_hf))[:3]}")
        with torch.no_grad():
            for k, v in sd_hf.items():
                if k.endswith(CONV1D_WEIGHTS):  # HF's Conv1D: (in, out); nn.Linear: (out, in)
                    v = v.t()
                assert sd[k].shape == v.shape, \
                    f"shape mismatch for {k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}"
                sd[k].copy_(v)
        return model

    @classmethod
    def from_checkpoint(cls, ckpt):
        """Load the model from one of train_gpt2.py's checkpoints (a ckpt_XXXXXX.pt path, or the
        dict read_checkpoint() returned): its 'model_args' build the GPTConfig and 'model' holds the
        state_dict (no compile/DDP prefixes); older ones' run-time settings there (RUNTIME_KEYS) are
        left out. A wrong shape or key is one UserError line."""
        path = "the checkpoint"
        if isinstance(ckpt, str):
            path, ckpt = ckpt, read_checkpoint(ckpt)
        try:
            args = ckpt["model_args"]
            config = GPTConfig(**{k: v for k, v in args.items() if k not in RUNTIME_KEYS})
            # before building: a foreign dict never sizes the model
            check_config(config, ckpt["model"])
            model = cls(config)
            model.load_state_dict(ckpt["model"])
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError) as e:
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"{path} does not hold a GPT of ours "
                            f"({type(e).__name__}: {msg})") from None

        return model


CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")

# -----------------------------------------------------------------------------
# FLOPs (precision.py turns them into MFU against the GPU's peak)


def flops_per_token(model, seq_len):
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12*L*H*Q*T."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * seq_len


def llmc_flops_per_token(model, seq_len):
    """Training FLOPs per token as llm.c counts them (train_gpt2.cu's gpt2_estimate_mfu):
    6N + 6*L*C*T, N every parameter (the position embedding and the biases too, the tied embedding
    once). At 124M, T=1024: 803.5M against our 855.4M, so the same tok/s reads 0.939x the MFU."""
    c = model.config
    return 6 * model.num_params(non_embedding=False) + 6 * c.n_layer * c.n_embd * seq_len


# -----------------------------------------------------------------------------
# command line


def print_sizes():
    for name, kw in PRETRAINED.items():
        with torch.device("meta"):
            m = GPT(GPTConfig(vocab_size=50304, **kw))
        print(f"{name:12s} {m.num_params(non_embedding=False) / 1e6:7.1f}M params, "
              f"{flops_per_token(m, 1024) / 1e9:6.2f} GFLOPs/token at T=1024 "
              f"({llmc_flops_per_token(m, 1024) / 1e9:.2f} as llm.c counts)")


USAGE = "usage: python model.py [sizes]"
HELP = f"""{USAGE}

  sizes (the default)  parameter count and GFLOPs per token of each GPT-2 size

The export (a Hugging Face directory or a GGUF file) is its own command: python export.py --help"""


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    if argv in ([], ["sizes"]):
        print_sizes()
        return 0
    # the export's old home, kept for a while: the same arguments, run by export.py
    if argv[0] == "export":
        print("note: `python model.py export` is now `python export.py`; running that",
              file=sys.stderr)
        export_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export.py")
        return subprocess.call([sys.executable, export_py, *argv[1:]])
    return fail(UserError(f"expected `sizes`, got {' '.join(argv)!r}; {USAGE} "
                          "(the export: python export.py)"))



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
