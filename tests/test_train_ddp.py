"""torchrun with 2 CPU processes (gloo) against 1 process with the same global batch: same losses,
same weights. The 2-rank run accumulates 2 micro-steps per rank, so DDP's no_sync path is used."""
import os
import sys

from conftest import Launched, torchrun_env
from test_train import load_ckpt, read_log, step_losses, tiny_args, write_shards
from train_gpt2 import main


def test_two_ranks_match_one(tmp_path):
    data = write_shards(str(tmp_path / "data"))
    common = dict(max_steps=4, total_batch_size=128, eval_interval=4, checkpoint_interval=0, max_lr=1e-3, min_lr=1e-4)
    one = str(tmp_path / "one")
    assert main(tiny_args(data, one, **common, val_steps=4)) == 0  # 1 rank x 4 micro-steps of 2 x 16

    two = str(tmp_path / "two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py",
           *tiny_args(data, two, **common, val_steps=2)]  # 2 ranks x 2 micro-steps of 2 x 16; val: 2 batches per rank
    with Launched([cmd], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0], run.logs()
        assert run.logs().count("tokens per step = 2 x 16 x 2 rank(s) x 2 accumulation step(s)") == 1  # rank 0 prints alone

    a, b = step_losses(one), step_losses(two)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)
    val_a = [e["val_loss"] for e in read_log(one) if "val_loss" in e]
    val_b = [e["val_loss"] for e in read_log(two) if "val_loss" in e]
    assert len(val_a) == len(val_b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(val_a, val_b))
    wa = load_ckpt(os.path.join(one, "ckpt_000004.pt"))["model"]
    wb = load_ckpt(os.path.join(two, "ckpt_000004.pt"))["model"]
    assert set(wa) == set(wb)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5
