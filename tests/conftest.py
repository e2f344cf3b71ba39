"""Shared fixtures: everything here is local and offline."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, torch.get_num_threads()))


def make_hf_gpt2(path, n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257, seed=0):
    """A small random GPT-2 written with transformers' save_pretrained: the offline stand-in for
    OpenAI's weights. Biases and layer norms are randomised too so that no term is trivially zero."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    return make_hf_gpt2(str(tmp_path_factory.mktemp("hf_gpt2")))
