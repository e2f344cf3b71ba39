"""distributed.py: the launcher's environment read once (DistEnv), the command that continues a run, the
grace note, peer failures, and what the ranks do together: agree() and rank0_first() in real 2-process
gloo groups (spawned here, joined with a bound and killed by pid on every path)."""
import datetime
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gpt2train import distributed
from conftest import ROOT, one_line, tiny_args, write_shards
from gpt2train.distributed import DistEnv, RestartFailed, agree, attempt_prefix, peer_failure, rank0_first
from gpt2train.fileio import UserError
from train_gpt2 import main


def spawn_two(target, *args, timeout=60):
    """target(rank, *args) in two spawned processes; both must exit 0 within timeout seconds."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()

# -----------------------------------------------------------------------------
# the launcher's environment, read once


def test_dist_env_from_environ():
    env = DistEnv.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert env == DistEnv(ddp=True, rank=3, local_rank=1, world_size=8, local_world_size=4)
    assert not env.master and env.nodes == 2
    one = DistEnv.from_environ({"PATH": "/bin"})  # not under torchrun
    assert one == DistEnv() and (one.ddp, one.rank, one.world_size, one.master, one.nodes) == (False, 0, 1, True, 1)
    assert DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}).master
    restarted = DistEnv.from_environ({"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2",
                                      "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (restarted.restarts, restarted.agent_store) == (2, True)
    assert not DistEnv.from_environ({"RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store


def test_dist_env_is_read_from_os_environ_by_default(monkeypatch):
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert DistEnv.from_environ() == DistEnv(ddp=True, rank=1, local_rank=1, world_size=2, local_world_size=2)


def test_the_command_that_continues_a_run(monkeypatch):
    monkeypatch.chdir(ROOT)
    script, python = os.path.join(ROOT, "train_gpt2.py"), os.path.basename(sys.executable)
    argv = ["configs/x.py", "--resume=auto", "--max_steps=5", "--sample_prompt=a b"]
    assert DistEnv().command(script, argv) == \
        f"{python} train_gpt2.py configs/x.py --max_steps=5 '--sample_prompt=a b' --resume=true"
    one_node = DistEnv(ddp=True, world_size=2, local_world_size=2)
    assert one_node.command(script, ["--max_steps=5"]) == \
        "torchrun --standalone --nproc_per_node=2 train_gpt2.py --max_steps=5 --resume=true"
    two_nodes = DistEnv(ddp=True, rank=5, world_size=8, local_world_size=4)
    assert two_nodes.command(script, []) == "torchrun --nnodes=2 --nproc_per_node=4 train_gpt2.py --resume=true"


def test_shutdown_grace_note_when_a_stop_outlasts_torchruns_grace(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    ranks = DistEnv(ddp=True, world_size=2, local_world_size=2)
    assert ranks.shutdown_grace_note(30) == "" and DistEnv().shutdown_grace_note(100) == ""  # within 30 s; no torchrun
    note = ranks.shutdown_grace_note(100)
    assert note.startswith("note: a step and a save take 100 s, more than the 30 s") and "\n" not in note
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=200 " in note  # twice the time, rounded up to 10 s
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=70 " in ranks.shutdown_grace_note(31)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert ranks.shutdown_grace_note(100) == ""
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "10")
    assert "more than the 10 s" in ranks.shutdown_grace_note(20) and "TIMEOUT=60 " in ranks.shutdown_grace_note(20)


def test_peer_failure_tells_a_lost_peer_from_other_errors():
    assert peer_failure(dist.DistError("anything"))
    for text in ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
                 "Timed out waiting 600000ms for send operation to complete",
                 "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"):
        assert peer_failure(RuntimeError(text)), text
    assert not peer_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not peer_failure(ValueError("a bad shape"))


def test_one_process_needs_no_group():
    assert not dist.is_initialized()
    assert distributed.init(DistEnv(), "cpu", 10) is None and not dist.is_initialized()
    distributed.teardown()  # nothing to tear down: no error
    assert rank0_first(lambda: 42, DistEnv(), None) == 42
    with pytest.raises(UserError, match="bad"):
        rank0_first(lambda: (_ for _ in ()).throw(UserError("bad")), DistEnv(), None)

# -----------------------------------------------------------------------------
# start-up after a torchrun restart: one store outlives the attempts


def _attempt(port, world_size, first=(), delay=0.0, timeout_s=30):
    """attempt_prefix on every rank (threads, one store client each); the ranks in first start delay s
    before the others. Returns {rank: prefix or the exception}."""
    got = {}

    def rank(r):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            got[r] = attempt_prefix(store, DistEnv(ddp=True, rank=r, world_size=world_size), timeout_s)
        except RuntimeError as e:
            got[r] = e
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world_size)]
    for r in sorted(range(world_size), key=lambda r: r not in first):
        threads[r].start()
        if r in first and delay:
            time.sleep(delay)
    for t in threads:
        t.join(timeout=timeout_s + 10)
    return got


def test_a_restarted_attempt_agrees_on_keys_no_earlier_attempt_used():
    """torchrun keeps one store over its restarts: the ranks of a new attempt must not take the last attempt's
    name, even when they read the store before the new rank 0 has written to it (the restart's race)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    first = _attempt(server.port, 3)
    assert len(set(first.values())) == 1 and str(first[0]).startswith("gpt2train/"), first
    second = _attempt(server.port, 3, first=(1, 2), delay=1.0)  # ranks 1 and 2 read the old name first
    assert len(set(second.values())) == 1 and second[0] != first[0], (first, second)
    third = _attempt(server.port, 3)  # and once more, rank 0 first
    assert len(set(third.values())) == 1 and third[0] not in (first[0], second[0])


def test_a_rank_whose_rank_0_never_comes_gives_up_within_the_timeout():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    _attempt(server.port, 2)  # an earlier attempt's name is in the store; its rank 0 is gone
    t0 = time.monotonic()
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    with pytest.raises(dist.DistStoreError, match="rank 0 did not answer rank 1 at start-up within 1 s"):
        attempt_prefix(store, DistEnv(ddp=True, rank=1, world_size=2), 1)
    assert 1 <= time.monotonic() - t0 < 10


GLOO_RESTART_ERROR = ("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                      "pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:47014$0")


def fail_to_connect(monkeypatch):
    """torchrun's environment for global rank 0 of one rank after a restart, its store on 127.0.0.1; the
    group's connection then fails as a restart on torch 2.13 can."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    environ = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(server.port), TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_USE_AGENT_STORE="True")
    for key, value in environ.items():
        monkeypatch.setenv(key, value)

    def init_process_group(*args, **kwargs):
        raise RuntimeError(GLOO_RESTART_ERROR)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return server


def test_a_restart_that_cannot_connect_names_the_variable(monkeypatch):
    server = fail_to_connect(monkeypatch)  # noqa: F841 - the store lives through the test
    env = DistEnv.from_environ()
    with pytest.raises(RestartFailed) as e:
        distributed.init(env, "cpu", 10)
    line = str(e.value)
    assert line.startswith("error: rank 0: the workers torchrun restarted could not start together (Gloo connectF")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and "--resume=auto" in line and "\n" not in line
    # a first start, or a restart without the shared store: not this failure, the error as it came
    for other in (DistEnv(ddp=True, agent_store=True), DistEnv(ddp=True, restarts=1)):
        with pytest.raises(RuntimeError, match="connectFullMesh") as e:
            distributed.init(other, "cpu", 10)
        assert not isinstance(e.value, RestartFailed)


def test_the_trainer_says_a_failed_restart_in_one_line(tmp_path, monkeypatch, capsys):
    server = fail_to_connect(monkeypatch)  # noqa: F841
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert main(tiny_args(write_shards(str(tmp_path / "data")), str(tmp_path / "out"))) == 1
    line = one_line(capsys.readouterr().err)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and "connectFullMesh" in line
    assert json.load(open(tmp_path / "error.json"))["message"]["message"] == line  # torchrun's summary shows it too

# -----------------------------------------------------------------------------
# the ranks together: 2 gloo processes


def _agree_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mine = [3.0, 5.0][rank]  # the ranks hold different values
        got = [agree(mine, "max", "cpu"), agree(mine, "min", "cpu"),
               agree([float("inf"), 1.0][rank], "min", "cpu")]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_agree_all_reduces_under_torch_distributed(tmp_path):
    """Two gloo processes holding 3 and 5: max is 5 and min 3 on both (one process could not tell MAX from MIN)."""
    assert agree(3.5, "min", "cpu") == 3.5  # no process group: unchanged
    spawn_two(_agree_worker, str(tmp_path / "pg"), str(tmp_path))
    for r in range(2):
        assert json.load(open(tmp_path / f"rank{r}.json")) == [5.0, 3.0, 1.0]


def _rank0_first_worker(rank, init_file, out_dir):
    """Three turns of rank0_first: a file rank 0 makes and rank 1 then reads; rank 0 failing on bad input;
    rank 1 failing on the machine. What each rank saw goes to rank{rank}.json."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    env, seen = DistEnv(ddp=True, rank=rank, local_rank=rank, world_size=2, local_world_size=2), []
    made = os.path.join(out_dir, "made.txt")

    def make():
        if rank == 0:
            with open(made, "w") as f:
                f.write("rank 0 was here")
        return open(made).read()  # rank 1 runs after rank 0: the file is there

    def fail(who, error):
        def work():
            if rank == who:
                raise error
            return "done"
        return work
    try:
        startup = dist.new_group(backend="gloo")
        seen.append(rank0_first(make, env, startup))
        for work in (fail(0, UserError("no such data_dir")), fail(1, OSError("disk full"))):
            try:
                seen.append(["returned", rank0_first(work, env, startup)])
            except (UserError, OSError) as e:
                seen.append([type(e).__name__, str(e)])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_rank0_first_runs_rank_0_first_and_a_failure_stops_every_rank(tmp_path, capfd):
    spawn_two(_rank0_first_worker, str(tmp_path / "pg"), str(tmp_path))
    rank0, rank1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert rank0[0] == rank1[0] == "rank 0 was here"
    # rank 0's bad input: its own error there, exit-2 kind (UserError) on the other rank, which never ran the work
    assert rank0[1] == ["UserError", "no such data_dir"]
    assert rank1[1] == ["UserError", "stopped: rank 0 failed at start-up; its error is in its output"]
    # another rank's machine failure: rank 0 ran its turn, then stops with the exit-1 kind (OSError)
    assert rank1[2] == ["OSError", "disk full"]
    assert rank0[2] == ["OSError", "stopped: another rank failed at start-up; its error is in its output"]
    err = capfd.readouterr().err
    assert err.count("error: ") == 1 and "error: rank 1: disk full" in err  # one node: rank 0 says its own error
