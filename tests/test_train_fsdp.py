"""fsdp=true (FSDP2, 2 CPU ranks on gloo) against 1 process with the same global batch (conftest's one_process,
shared with the two-node DDP run of test_multinode.py): same losses, same weights, with and without activation
checkpointing; and checkpoints resumed across modes (an FSDP checkpoint without FSDP, a plain one under FSDP).
The ranks are started here, one process each with torchrun's environment (127.0.0.1, a free port), and killed
by pid on every path."""
import os
import shutil

import pytest
import torch

from gpt2train import memory
from gpt2train import optim
from conftest import TWO_RANK_STEPS, assert_same_run, load_ckpt, run_ranks, step_losses, tiny_args, val_losses
from model import GPT, GPTConfig
from gpt2train.sharding import load_optimizer_state
from train_gpt2 import main

ONE, TWO = dict(TWO_RANK_STEPS, val_steps=4), dict(TWO_RANK_STEPS, val_steps=2, fsdp="true")  # val: the same 4


@pytest.fixture(scope="module")
def runs(data_dir, one_process, tmp_path_factory):
    """The 1-process reference (4 steps, conftest's) and a 2-rank FSDP run of the same."""
    fsdp = str(tmp_path_factory.mktemp("fsdp"))
    out = run_ranks(tiny_args(data_dir, fsdp, **TWO), fsdp)
    return data_dir, one_process, fsdp, out


def test_fsdp_two_ranks_match_one_process(runs):
    data, one, fsdp, out = runs
    assert out.count("tokens per step = 2 x 16 x 2 rank(s) x 2 accumulation step(s)") == 1  # rank 0 prints alone
    assert " fsdp=true" in out  # the start-up's config block: set
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    shard = sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in model.parameters())  # rank 0's rows of each, fp32
    assert f"memory: per rank (FSDP over 2): params {memory.fmt_bytes(shard)}, grads {memory.fmt_bytes(shard)}, " in out
    assert_same_run(one, fsdp, [0, 1, 2, 3])
    val_a, val_b = val_losses(one), val_losses(fsdp)
    assert len(val_a) == len(val_b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(val_a, val_b))


def test_fsdp_checkpoint_resumes_without_fsdp(runs, tmp_path):
    data, one, fsdp, _ = runs
    out = str(tmp_path / "plain")
    os.makedirs(out)
    shutil.copy(os.path.join(fsdp, "ckpt_000002.pt"), out)
    assert main(tiny_args(data, out, **ONE, resume="true")) == 0
    assert_same_run(one, out, [2, 3])


def test_plain_checkpoint_resumes_under_fsdp_with_activation_checkpointing(runs, tmp_path):
    """The other way round, and with every other block checkpointed: still the reference's numbers."""
    data, one, _, _ = runs
    out = str(tmp_path / "fsdp_ac")
    os.makedirs(out)
    shutil.copy(os.path.join(one, "ckpt_000002.pt"), out)
    run_ranks(tiny_args(data, out, **TWO, activation_checkpointing="every_other", resume="true"), out)
    assert_same_run(one, out, [2, 3])
    ckpt = load_ckpt(os.path.join(out, "ckpt_000004.pt"))
    assert ckpt["config"]["activation_checkpointing"] == "every_other"  # the run's setting, not the model's
    assert "activation_checkpointing" not in ckpt["model_args"] and "ce_chunk_rows" not in ckpt["model_args"]


def test_checkpoint_from_before_the_named_format_resumes(runs, tmp_path):
    """A checkpoint whose optimizer state is optimizer.state_dict() itself (integer ids, as written
    before this format) resumes bit-exactly in one process."""
    data, one, _, _ = runs
    out = str(tmp_path / "old")
    os.makedirs(out)
    ckpt = load_ckpt(os.path.join(one, "ckpt_000002.pt"))
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    optimizer = optim.build_optimizers(model, "adamw", lr=1e-3, weight_decay=0.1)[0]  # the trainer's
    load_optimizer_state(model, [optimizer], ckpt["optimizer"])
    ckpt["optimizer"] = optimizer.state_dict()
    assert isinstance(next(iter(ckpt["optimizer"]["state"])), int)
    torch.save(ckpt, os.path.join(out, "ckpt_000002.pt"))
    assert main(tiny_args(data, out, **ONE, resume="true")) == 0
    a, b = step_losses(one), step_losses(out)
    assert sorted(b) == [2, 3] and all(a[s] == b[s] for s in b)


def test_fsdp_needs_torchrun(runs, tmp_path, capsys):
    data = runs[0]
    assert main(tiny_args(data, str(tmp_path), fsdp="true")) == 2
    assert "run under torchrun" in capsys.readouterr().err
