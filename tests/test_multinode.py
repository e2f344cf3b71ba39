"""Several machines, simulated on one (127.0.0.1 only, gloo): two torchrun launchers meet through a c10d
rendezvous and train exactly the run one process trains (conftest's one_process; 2 micro-steps a rank: DDP's
no_sync path; the suite's one check that DDP with AdamW equals one process); a worker killed under --max_restarts is
restarted by torchrun and the run resumes to the same weights; a peer that stops answering ends the
others within dist_timeout, with one line. Every process these tests start, torchrun's workers included, is
ended by pid when its `with` block is left (conftest.LaunchedTree), on every path."""
import os
import shutil
import signal
import sys
import time

from conftest import (TWO_RANK_STEPS, LaunchedTree, alive, assert_same_run, free_port, load_ckpt, read_log,
                      step_losses, tiny_args, torchrun_env, torchrun_workers, val_losses, wait_for, write_shards)
from gpt2train.checkpoint import read_checkpoint

COMMON = dict(max_steps=4, total_batch_size=128, eval_interval=4, checkpoint_interval=0, max_lr=1e-3, min_lr=1e-4)


def launcher(port, args):
    """What each node runs (the README's multi-node line, with the loopback address)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test", "--local_addr=127.0.0.1", "train_gpt2.py", *args]


def test_two_nodes_match_one_process(data_dir, one_process, tmp_path):
    """2 nodes x 1 rank x 2 micro-steps of 2 x 16 (val: 2 batches a rank) = 1 rank x 4 micro-steps: the same
    losses, val losses, weights and AdamW state; rank 0 alone prints; and with torchrun's grace at 0 s even a save
    outlasts it, which rank 0 notes once."""
    two = str(tmp_path / "two")
    port = free_port()
    args = tiny_args(data_dir, two, **TWO_RANK_STEPS, val_steps=2)
    env = torchrun_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="0")
    with LaunchedTree([launcher(port, args), launcher(port, args)], tmp_path, env=env) as run:
        assert run.wait(timeout=180) == [0, 0], run.logs()
        logs = run.logs(tail=10**7)  # whole logs: shutdown warnings are long
    assert logs.count("tokens per step = 2 x 16 x 2 rank(s) x 2 accumulation step(s)") == 1  # global rank 0 only
    assert logs.count("note: a step and a save take") == 1, logs
    assert_same_run(one_process, two, [0, 1, 2, 3])
    val_a, val_b = val_losses(one_process), val_losses(two)
    assert len(val_a) == len(val_b) == 2 and all(abs(x - y) <= 1e-5 for x, y in zip(val_a, val_b))


def standalone(args, *flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *flags,
            "train_gpt2.py", *args]


ELASTIC = dict(max_steps=60, total_batch_size=128, eval_interval=20, checkpoint_interval=5, max_lr=1e-3, min_lr=1e-4,
               val_steps=2, resume="auto")


def test_killed_worker_restarts_and_ends_with_the_same_weights(tmp_path):
    """SIGKILL one worker mid-run (no chance to save): torchrun --max_restarts=1 restarts the group, resume=auto
    continues from the newest complete checkpoint, and the run ends as one never interrupted did."""
    data = write_shards(str(tmp_path / "data"))
    straight, elastic = str(tmp_path / "straight"), str(tmp_path / "elastic")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with LaunchedTree([standalone(tiny_args(data, straight, **ELASTIC))], tmp_path / "a", env=torchrun_env()) as run:
        assert run.wait(timeout=180) == [0], run.logs()
    with LaunchedTree([standalone(tiny_args(data, elastic, **ELASTIC), "--max_restarts=1")], tmp_path / "b",
                  env=torchrun_env()) as run:  # the plain command: no TORCH_DISABLE_SHARE_RDZV_TCP_STORE
        wait_for(lambda: os.path.exists(os.path.join(elastic, "ckpt_000010.pt")), 120, "the first checkpoints")
        rank1 = torchrun_workers(run.procs[0].pid)[1]
        os.kill(rank1, signal.SIGSTOP)  # frozen first (rank 0 waits for it), so the kill lands mid-run
        os.kill(rank1, signal.SIGKILL)
        assert run.wait(timeout=180) == [0], run.logs()
        logs = run.logs(tail=100000)
    assert "resuming from" in logs and "ckpt_0000" in logs
    a, b = load_ckpt(os.path.join(straight, "ckpt_000060.pt")), load_ckpt(os.path.join(elastic, "ckpt_000060.pt"))
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) <= 1e-6
    steps = [e["step"] for e in read_log(elastic) if "loss" in e]
    assert steps == list(range(60))  # every step once: the redone ones were not logged twice
    assert step_losses(elastic) == step_losses(straight)


def gone(pid):
    """Whether a process has exited (a zombie not yet reaped by torchrun counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_hung_peer_ends_the_others_within_dist_timeout(tmp_path):
    """A rank that stops answering without dying (SIGSTOP: a paused VM, a stuck node): the others give up after
    dist_timeout (5 s here, 600 by default, gloo's own is 30 minutes) with one line and a non-zero exit."""
    data = write_shards(str(tmp_path / "data"))
    out = str(tmp_path / "out")
    args = tiny_args(data, out, max_steps=5000, total_batch_size=128, eval_interval=0, checkpoint_interval=5,
                     max_lr=1e-3, min_lr=1e-4, dist_timeout=5)
    with LaunchedTree([standalone(args)], tmp_path, env=torchrun_env()) as run:
        wait_for(lambda: os.path.exists(os.path.join(out, "ckpt_000010.pt")), 120, "the first checkpoints")
        workers = torchrun_workers(run.procs[0].pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        line = "error: rank 0: a peer did not answer within dist_timeout"
        wait_for(lambda: line in run.logs(tail=100000), 60, "rank 0's line")  # ~5 s idle: dist_timeout
        assert time.monotonic() - stopped >= 4  # it did wait for the peer, about dist_timeout
        wait_for(lambda: gone(workers[0]), 15, "rank 0's exit")  # torchrun then stops the frozen rank (30 s grace)
        assert "exitcode  : 1" in run.logs(tail=100000) or run.procs[0].poll() is None  # rank 0 failed, not 0
        ours = [line for line in run.logs(tail=100000).splitlines() if line.startswith("[rank0]")]
        assert not ours, ours  # no traceback of ours: the one line only
    newest = max(f for f in os.listdir(out) if f.startswith("ckpt_") and f.endswith(".pt"))
    assert read_checkpoint(os.path.join(out, newest))["step"] >= 10  # what was written stays loadable


def test_a_frozen_orphaned_worker_is_ended_by_pid(tmp_path):
    """The cleanup itself, in a second: a launcher's worker in a session of its own (as torchrun starts them,
    out of killpg's reach) is frozen, the launcher dies first; leaving the block still ends the worker."""
    worker = "import os, time; os.setsid(); time.sleep(600)"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
            "print(p.pid, flush=True); time.sleep(600)")
    with LaunchedTree([[sys.executable, "-c", code]], tmp_path) as run:
        wait_for(lambda: open(tmp_path / "proc0.log").read().strip(), 30, "the worker's pid")
        pid = int(open(tmp_path / "proc0.log").read())
        os.kill(pid, signal.SIGSTOP)
        run.procs[0].kill()
        run.procs[0].wait()
        assert alive(pid)
    assert not alive(pid)


def test_nodes_that_see_different_checkpoints_refuse_to_start(data_dir, one_process, tmp_path):
    """out_dir not shared between the nodes: node 0 holds a checkpoint, node 1 none. Every rank must stop at
    start-up with one line, not train on from different steps (or hang)."""
    node0, node1 = str(tmp_path / "node0"), str(tmp_path / "node1")
    os.makedirs(node0)
    shutil.copy(os.path.join(one_process, "ckpt_000004.pt"), node0)  # a finished 4-step run's checkpoint
    port = free_port()
    more = dict(TWO_RANK_STEPS, max_steps=8, val_steps=2, resume="auto")
    with LaunchedTree([launcher(port, tiny_args(data_dir, node0, **more)),
                       launcher(port, tiny_args(data_dir, node1, **more))], tmp_path, env=torchrun_env()) as run:
        codes = run.wait(timeout=120)
        logs = run.logs(tail=100000)
    assert codes[0] != 0 and "the ranks find different checkpoints in out_dir" in logs, logs
    assert not [line for line in logs.splitlines() if line.startswith("[rank")]  # one line per rank, no traceback
    assert sorted(f for f in os.listdir(node0) if f.endswith(".pt")) == ["ckpt_000004.pt"]  # nothing trained on


def test_a_node_that_cannot_start_stops_every_node_with_its_reason(tmp_path):
    """data_dir not shared: node 1 finds no shards. Its rank says why on its own node, rank 0 says which rank
    failed, both exit 2 at once: no rank waits for a peer that is gone, none blames the network."""
    data = write_shards(str(tmp_path / "data"))
    args = dict(COMMON, dist_timeout=600)
    port = free_port()
    t0 = time.monotonic()
    with LaunchedTree([launcher(port, tiny_args(data, str(tmp_path / "out"), **args)),
                   launcher(port, tiny_args(str(tmp_path / "not_here"), str(tmp_path / "out"), **args))],
                  tmp_path, env=torchrun_env()) as run:
        run.wait(timeout=300)
        node0, node1 = (open(os.path.join(tmp_path, f"proc{i}.log")).read() for i in (0, 1))
    assert time.monotonic() - t0 < 300  # ~12 s idle; a rank waiting for the node that is gone: dist_timeout, 600
    errors0 = [line for line in node0.splitlines() if line.startswith("error:")]
    errors1 = [line for line in node1.splitlines() if line.startswith("error:")]
    assert errors0 == ["error: stopped: another rank failed at start-up; its error is in its output"], node0
    assert len(errors1) == 1 and errors1[0].startswith("error: rank 1: ") and "not_here" in errors1[0], node1
    assert "exitcode  : 2" in node0 and "exitcode  : 2" in node1
    assert "did not answer" not in node0 + node1
    assert not [line for line in (node0 + node1).splitlines() if line.startswith("[rank")]
