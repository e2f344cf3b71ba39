"""Several machines, simulated on one: two torchrun launchers meet through a c10d rendezvous on 127.0.0.1
(--nnodes=2 --nproc_per_node=1) and must train exactly the run that one process trains."""
import os
import sys

from conftest import Launched, free_port, torchrun_env
from test_train import load_ckpt, step_losses, tiny_args, write_shards
from train_gpt2 import main

COMMON = dict(max_steps=4, total_batch_size=128, eval_interval=4, checkpoint_interval=0, max_lr=1e-3, min_lr=1e-4)


def launcher(port, args):
    """What each node runs (the README's multi-node line, with the loopback address)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test", "--local_addr=127.0.0.1", "train_gpt2.py", *args]


def test_two_nodes_match_one_process(tmp_path):
    data = write_shards(str(tmp_path / "data"))
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(tiny_args(data, one, **COMMON, val_steps=4)) == 0  # 1 rank x 4 micro-steps of 2 x 16
    port = free_port()
    args = tiny_args(data, two, **COMMON, val_steps=2)  # 2 nodes x 1 rank x 2 micro-steps; val: 2 batches per rank
    with Launched([launcher(port, args), launcher(port, args)], tmp_path, env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0, 0], run.logs()
        assert run.logs().count("tokens per step = 2 x 16 x 2 rank(s) x 2 accumulation step(s)") == 1  # global rank 0 only
    a, b = step_losses(one), step_losses(two)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)
    wa = load_ckpt(os.path.join(one, "ckpt_000004.pt"))["model"]
    wb = load_ckpt(os.path.join(two, "ckpt_000004.pt"))["model"]
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5
