"""Surviving the session (train_gpt2.py), on CPU with tiny models: SIGINT/SIGTERM sent to a real run
(one process, and 2-rank torchrun) stop it after a whole optimizer step with one checkpoint, and the
resume command it prints continues it bit-identically to a run that was never interrupted; a second
signal quits without leaving a broken file; time_limit; every resume rule; keep_last; divergence and
outlier skipping. Every process started here is waited for with a time bound and killed by pid."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gpt2train import distributed
from gpt2train import optim
from gpt2train import guard
from conftest import ROOT, assert_same_state, load_ckpt, straight_args
from train_gpt2 import main

ENV = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))  # the same threads as the in-process runs
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
DDP_ENV = dict(os.environ, OMP_NUM_THREADS="1")  # 2 ranks on 2 cores


def args(data_dir, out_dir, **over):
    """straight_args without its periodic checkpoints (checkpoint_interval=0, keep_last as the trainer's default)."""
    return straight_args(data_dir, out_dir, **{"checkpoint_interval": 0, "keep_last": None, **over})


def rows(out_dir):
    """log.jsonl without its timings; lines cut short (a run still writing) are left out."""
    path, out = os.path.join(out_dir, "log.jsonl"), []
    if os.path.isfile(path):
        for line in open(path).read().splitlines():
            try:
                out.append({k: v for k, v in json.loads(line).items() if k not in ("dt_ms", "tok_per_s")})
            except ValueError:
                pass
    return out


def ckpts(out_dir):
    return sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt_"))


def reference(data_dir, tmp_path, max_steps, launcher=None, env=ENV, **over):
    """The run that was never interrupted: in this process, or under the given launcher."""
    out = str(tmp_path / "reference")
    if launcher is None:
        assert main(args(data_dir, out, max_steps=max_steps, **over)) == 0
    else:
        r = subprocess.run(launcher + ["train_gpt2.py", *args(data_dir, out, max_steps=max_steps, **over)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
    return out

# -----------------------------------------------------------------------------
# real signals to real processes


def child_pids(pid):
    """The processes pid started (Linux /proc), {RANK: pid} for torchrun's workers."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{tid}/children").read().split():
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            found[rank] = int(child)
    return found


def kill(pids):
    """SIGKILL what is still running of the processes we started (ours: their command line is ours)."""
    for pid in pids:
        try:
            if b"train_gpt2.py" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def running(pids):
    """Those of pids still running (not gone, not a zombie)."""
    alive = []
    for pid in pids:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def interrupt(cmd, out_dir, tmp_path, send, after_step=2, timeout=90, env=ENV):
    """Start cmd, wait until it logged after_step, call send(proc), wait for its exit. Returns (exit code,
    stdout, stderr); asserts that nothing it started outlived it, and kills all of it on every way out."""
    stdout, stderr = open(tmp_path / "stdout.txt", "w+"), open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    started = [proc.pid]
    try:
        end = time.time() + timeout
        while not any(r.get("step", -1) >= after_step and "loss" in r for r in rows(out_dir)):
            assert proc.poll() is None, f"exited early ({proc.returncode}): {open(stderr.name).read()[-2000:]}"
            assert time.time() < end, "no training step logged in time"
            time.sleep(0.05)
        started += child_pids(proc.pid).values()
        send(proc)
        rc = proc.wait(timeout=max(1, end - time.time()))
        assert not running(started), "a worker outlived torchrun"
    finally:
        kill(started)
        proc.wait(timeout=10)
    return rc, open(stdout.name).read(), open(stderr.name).read()


def stop_line(stdout):
    """(the step the run stopped after, the checkpoint it saved, the resume command) from its one line."""
    lines = [line for line in stdout.splitlines() if "resume with: " in line]
    assert len(lines) == 1, stdout[-3000:]
    m = re.search(r"stopped after step (\d+)(?: \(in the evaluation at step \d+\))?, saved (\S+); resume with: (.*)$",
                  lines[0])
    return int(m[1]), m[2], shlex.split(m[3])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_after_a_step_and_resumes_bit_exact(sig, data_dir, tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "train_gpt2.py", *args(data_dir, out, max_steps=100000)]
    rc, stdout, stderr = interrupt(cmd, out, tmp_path, lambda proc: proc.send_signal(sig))
    assert rc == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr
    step, path, resume = stop_line(stdout)
    assert f"{sig.name}: stopped after step {step}" in stdout
    again = "Ctrl-C" if sig == signal.SIGINT else sig.name
    assert f"{sig.name}: stopping: " in stderr and f"{again} again quits at once" in stderr, stderr[-3000:]
    assert ckpts(out) == [f"ckpt_{step + 1:06d}.pt"] and path == os.path.join(out, ckpts(out)[0])
    assert max(r["step"] for r in rows(out) if "loss" in r) == step  # every step done is in the checkpoint
    assert resume[:2] == [os.path.basename(sys.executable), "train_gpt2.py"] and resume[-1] == "--resume=true"

    # the printed command's arguments (run in this process: no second start-up), to 3 steps past the stop
    assert main(resume[2:] + [f"--max_steps={step + 3}"]) == 0
    ref = reference(data_dir, tmp_path, step + 3)
    assert rows(out) == rows(ref)  # every step and eval once, in order, the same numbers bit for bit
    assert_same_state(os.path.join(out, f"ckpt_{step + 3:06d}.pt"), os.path.join(ref, f"ckpt_{step + 3:06d}.pt"))


def test_torchrun_one_rank_signalled_all_stop_at_one_step(data_dir, tmp_path):
    """SIGTERM to rank 1 only: rank 0 hears of it through the loss all_reduce; both stop after the same
    step, one checkpoint, no hang; the printed torchrun command resumes bit-exactly."""
    out = str(tmp_path / "run")
    over = dict(total_batch_size=128)  # 2 ranks x 2 micro-steps of 2 x 16
    cmd = TORCHRUN + ["train_gpt2.py", *args(data_dir, out, max_steps=100000, **over)]
    rc, stdout, stderr = interrupt(cmd, out, tmp_path, lambda proc: os.kill(child_pids(proc.pid)[1], signal.SIGTERM),
                                   env=DDP_ENV)
    assert rc != 0  # torchrun reports its workers' exit codes: 143 (or -15: torchrun sends SIGTERM to the
    assert "exitcode  : 143" in stderr, stderr[-3000:]  # ranks still there when the first one has exited)
    step, path, resume = stop_line(stdout)
    assert f"SIGTERM: stopped after step {step}" in stdout  # said by rank 0, which got no signal itself
    assert ckpts(out) == [f"ckpt_{step + 1:06d}.pt"]
    assert resume[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "train_gpt2.py"]

    r = subprocess.run(TORCHRUN + resume[3:] + [f"--max_steps={step + 3}"], cwd=ROOT, env=DDP_ENV,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = reference(data_dir, tmp_path, step + 3, launcher=TORCHRUN, env=DDP_ENV, **over)
    assert rows(out) == rows(ref)
    assert_same_state(os.path.join(out, f"ckpt_{step + 3:06d}.pt"), os.path.join(ref, f"ckpt_{step + 3:06d}.pt"))


def test_torchrun_ctrl_c(data_dir, tmp_path):
    """SIGINT to torchrun (what Ctrl-C in a terminal does): it passes it on, the workers stop together."""
    out = str(tmp_path / "run")
    cmd = TORCHRUN + ["train_gpt2.py", *args(data_dir, out, max_steps=100000, total_batch_size=128)]
    rc, stdout, stderr = interrupt(cmd, out, tmp_path, lambda proc: proc.send_signal(signal.SIGINT), env=DDP_ENV)
    assert rc != 0
    step, path, resume = stop_line(stdout)
    assert "SIGINT: stopped after step" in stdout
    assert ckpts(out) == [f"ckpt_{step + 1:06d}.pt"]
    assert torch.isfinite(load_ckpt(path)["model"]["lm_head.weight"]).all()

def test_signal_during_a_long_eval_is_answered_at_once_and_stops_it(data_dir, straight, tmp_path):
    """SIGINT while an eval of 500,000 batches runs (step 2's checkpoint resumed: it trains step 2, then
    evaluates at step 3): a line says so at once, the eval stops at its next batch, step 3 is saved and the run
    exits 130 within seconds (~2 s; 30 allowed), not after the eval (~150 s); the printed command continues it
    as the straight run."""
    out = copy_run(straight, tmp_path / "run", ["ckpt_000002.pt"], log=False)
    # the same train shards and a val split 30,000 times as long, its head the same (val_steps is capped to the split)
    long_val = str(tmp_path / "long_val")
    shutil.copytree(data_dir, long_val)
    val = np.load(os.path.join(data_dir, "toy_val_000000.npy"))
    np.save(os.path.join(long_val, "toy_val_000000.npy"), np.tile(val, 30000))
    data_dir = long_val
    cmd = [sys.executable, "train_gpt2.py", *straight_args(data_dir, out, val_steps=500000, resume="true")]
    sent = []

    def send(proc):  # 1 s after step 2's row: inside the eval (~150 s), not between the row and the eval
        time.sleep(1)
        sent.append(time.monotonic())
        proc.send_signal(signal.SIGINT)
    rc, stdout, stderr = interrupt(cmd, out, tmp_path, send, timeout=90)
    assert time.monotonic() - sent[0] < 30 and rc == 130, (rc, stderr[-3000:])
    assert ("SIGINT: stopping: the evaluation stops at its next batch, then step 3 is saved; Ctrl-C again quits "
            "at once without saving the last 1 step(s)") in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "val_loss" not in open(os.path.join(out, "log.jsonl")).read()
    step, path, resume = stop_line(stdout)
    assert "SIGINT: stopped after step 2 (in the evaluation at step 3), saved" in stdout, stdout[-2000:]
    assert step == 2 and path == os.path.join(out, "ckpt_000003.pt") and os.path.isfile(path)

    assert main(resume[2:] + ["--val_steps=1"]) == 0  # the printed command, with a sane val_steps
    assert rows(out) == [r for r in rows(straight) if r["step"] >= 2]
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))


def test_a_peers_signal_heard_in_an_eval_stops_this_rank_with_it(data_dir, straight, tmp_path, monkeypatch, capsys):
    """Under torchrun a signal may reach another rank only, during an evaluation: this rank, which caught none,
    hears of it through the eval's all_reduce (the max over the ranks: a peer's SIGTERM, 15), stops the eval,
    saves and exits 143 naming the peer's signal, as the signalled rank does (it once indexed its own empty list
    of signals: IndexError, seen under torchrun in test_torchrun_one_rank_signalled_all_stop_at_one_step)."""
    out = copy_run(straight, tmp_path / "run", ["ckpt_000002.pt"], log=False)  # trains step 2, evaluates at 3
    peer = float(signal.SIGTERM)
    monkeypatch.setattr(distributed, "agree",  # the eval's stop check: distributed.agreed_signal's
                        lambda value, op, device, group=None: max(value, peer) if op == "max" else value)
    assert main(straight_args(data_dir, out, resume="true")) == 128 + signal.SIGTERM
    stdout = capsys.readouterr().out
    assert "SIGTERM: stopped after step 2 (in the evaluation at step 3), saved" in stdout, stdout[-2000:]
    step, path, _ = stop_line(stdout)
    assert step == 2 and path == os.path.join(out, "ckpt_000003.pt") and os.path.isfile(path)
    assert "val_loss" not in open(os.path.join(out, "log.jsonl")).read()


def test_a_peer_gone_while_stopping_promises_no_save_and_names_the_newest(data_dir, tmp_path, monkeypatch, capfd):
    """Issue 44 item 3: a worker SIGKILLed under torchrun (torchrun then SIGTERMs the others) made rank 0 promise
    "finishing step 31, then step 32 is saved", then fail with "a peer did not answer": no step 32 was saved. Here
    one rank under torchrun's environment (a real 1-rank gloo group) catches SIGTERM in step 5, whose all_reduce
    then fails as a gone peer's does: the notice says the save needs every rank, the last line that nothing was
    saved since the newest checkpoint on disk, naming it."""
    from conftest import free_port
    from gpt2train import distributed
    ranks = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()))
    for key, value in ranks.items():
        monkeypatch.setenv(key, value)
    real, n = distributed.over_ranks, [0]

    def peer_gone(*a, **k):  # the step's all_reduce: at step 5, SIGTERM (torchrun's), then the peer is gone
        n[0] += 1
        if n[0] == 6:
            os.kill(os.getpid(), signal.SIGTERM)
            raise torch.distributed.DistError("Connection closed by peer [127.0.0.1]:29500")
        return real(*a, **k)
    monkeypatch.setattr(distributed, "over_ranks", peer_gone)
    out = str(tmp_path / "run")
    assert main(args(data_dir, out, max_steps=100, checkpoint_interval=2)) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert "SIGTERM: stopping: finishing step 5, then step 6 is saved if every rank answers; SIGTERM again quits " \
        "at once without saving the last 2 step(s)" in err, err
    newest = os.path.join(out, "ckpt_000004.pt")
    assert err[-1].startswith("error: rank 0: a peer did not answer within dist_timeout or went away (Connection ")
    assert err[-1].endswith(f"; nothing was saved since {newest}, the newest checkpoint: --resume=auto continues "
                            "from it"), err[-1]
    assert ckpts(out) == ["ckpt_000002.pt", "ckpt_000004.pt"]


# -----------------------------------------------------------------------------
# in this process: a second signal, the time limit


def signal_at(monkeypatch, calls):
    """Send this process SIGINT during the accumulate_gradients calls numbered in calls (0-based)."""
    real, n = optim.accumulate_gradients, [0]

    def wrapped(*a, **k):
        if n[0] in calls:
            os.kill(os.getpid(), signal.SIGINT)
        n[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(optim, "accumulate_gradients", wrapped)


def test_second_signal_while_saving_leaves_no_broken_file(data_dir, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    signal_at(monkeypatch, {4})  # during step 4: stop after it, and save ckpt_000005

    def slow_save(obj, f, real=torch.save):
        real(obj, f)
        if getattr(f, "name", f).endswith("ckpt_000005.pt.tmp"):  # written, not yet renamed: Ctrl-C again
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(torch, "save", slow_save)
    handler = signal.getsignal(signal.SIGINT)
    assert main(args(data_dir, out, max_steps=100, checkpoint_interval=2)) == 130
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers are put back
    err = capsys.readouterr().err
    assert err.strip() == "SIGINT: stopped at once, nothing saved (the checkpoints in out_dir are as they were)"
    assert sorted(os.listdir(out)) == ["ckpt_000002.pt", "ckpt_000004.pt", "config.json", "curves.png", "log.jsonl"]
    assert load_ckpt(os.path.join(out, "ckpt_000004.pt"))["step"] == 4


def test_keep_last_after_a_truncated_checkpoint_keeps_the_readable_ones(data_dir, tmp_path, monkeypatch, capsys):
    """Issue 31's reproduction: Ctrl-C after 2 and then 6 steps, ckpt_000006.pt cut to half its size (a copy
    killed), resume=auto and Ctrl-C twice more. The truncated file is skipped, never counted among keep_last's
    two: the readable ckpt_000005.pt stays beside ckpt_000009.pt (it was deleted, with ckpt_000002.pt)."""
    out = str(tmp_path / "run")
    run = lambda: main(args(data_dir, out, max_steps=60, resume="auto", keep_last=2))  # noqa: E731
    signal_at(monkeypatch, {1})  # during step 1: saves ckpt_000002
    assert run() == 130
    signal_at(monkeypatch, {3})  # steps 2..5: saves ckpt_000006
    assert run() == 130
    assert ckpts(out) == ["ckpt_000002.pt", "ckpt_000006.pt"]
    broken = os.path.join(out, "ckpt_000006.pt")
    data = open(broken, "rb").read()
    open(broken, "wb").write(data[:len(data) // 2])
    capsys.readouterr()
    signal_at(monkeypatch, {2})  # from ckpt_000002, steps 2..4: saves ckpt_000005
    assert run() == 130
    assert f"warning: skipping {broken}: not a readable checkpoint" in capsys.readouterr().out
    signal_at(monkeypatch, {3})  # from ckpt_000005, steps 5..8: saves ckpt_000009
    assert run() == 130
    assert ckpts(out) == ["ckpt_000005.pt", "ckpt_000006.pt", "ckpt_000009.pt"]
    assert [load_ckpt(os.path.join(out, f))["step"] for f in ("ckpt_000005.pt", "ckpt_000009.pt")] == [5, 9]
    assert open(broken, "rb").read() == data[:len(data) // 2]  # the user's file, as it was


def test_time_limit_stops_in_time_and_resumes(data_dir, tmp_path, capsys, monkeypatch):
    """time_limit=0.05 min (3 s) on the trainer's clock, patched: it stands still but for 0.4 s a step (start-up,
    evals and saves take none), so that a busy machine cannot move the stop. The run stops once the time left is
    less than the longest loop iteration + a step + a save (0.4 + 0.4 + ~0 s): after step 5, at 2.4 s (after
    step 4, at 2.0 s, 0.8 s still fit), saves and exits 124; the printed command resumes it."""
    out, limit, dt = str(tmp_path / "run"), 0.05, 0.4  # minutes: 3 s; seconds a step
    start = now = time.time()
    accumulate = optim.accumulate_gradients

    def step_takes_dt(*a, **k):  # called once per optimizer step, at its start
        nonlocal now
        now += dt
        return accumulate(*a, **k)
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: now)
        patch.setattr(optim, "accumulate_gradients", step_takes_dt)
        assert main(args(data_dir, out, max_steps=5000, time_limit=limit)) == 124
    text = capsys.readouterr().out
    step, path, resume = stop_line(text)
    assert "time_limit=0.05 min: stopped after step 5, saved" in text, text[-2000:]
    assert step == 5 and now - start == pytest.approx(6 * dt)  # 6 steps, 2.4 s of the 3: in time on its clock
    assert ckpts(out) == [f"ckpt_{step + 1:06d}.pt"]
    assert resume[-1] == "--resume=true" and f"--time_limit={limit}" in resume
    assert main(args(data_dir, out, max_steps=step + 2, resume="true")) == 0
    assert [r["step"] for r in rows(out) if "loss" in r] == list(range(step + 2))

# -----------------------------------------------------------------------------
# resume: which checkpoint, which config, which log rows


def copy_run(src, dst, names, log=True):
    os.makedirs(dst)
    for name in names:
        shutil.copy(os.path.join(src, name), dst)
    if log:
        shutil.copy(os.path.join(src, "log.jsonl"), dst)
    return str(dst)


def test_fresh_run_into_a_used_out_dir_is_refused(data_dir, straight, tmp_path, capsys):
    out = copy_run(straight, tmp_path / "used", ["ckpt_000004.pt"])
    before = open(os.path.join(out, "log.jsonl")).read()
    assert main(args(data_dir, out, max_steps=8)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "holds another run's checkpoints (ckpt_000004.pt): --resume=auto continues it" in err
    assert open(os.path.join(out, "log.jsonl")).read() == before and ckpts(out) == ["ckpt_000004.pt"]


def test_resume_auto_starts_then_continues_then_says_finished(data_dir, straight, tmp_path, capsys):
    out = str(tmp_path / "auto")
    assert main(args(data_dir, out, max_steps=4, resume="auto")) == 0  # nothing there: a fresh run
    assert main(args(data_dir, out, max_steps=8, resume="auto")) == 0  # max_steps raised: continues
    assert "resuming from" in capsys.readouterr().out
    steps = [r for r in rows(out) if "loss" in r]
    assert steps == [r for r in rows(straight) if "loss" in r]  # (the 4-step run also evaluated at its end, 4)
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))
    log = open(os.path.join(out, "log.jsonl")).read()
    assert main(args(data_dir, out, max_steps=8, resume="auto")) == 0
    said = capsys.readouterr().out
    assert "ckpt_000008.pt holds a finished run (step 8, max_steps=8): nothing to do" in said
    assert open(os.path.join(out, "log.jsonl")).read() == log


def test_resume_takes_the_newest_held_step_and_skips_broken_files(data_dir, straight, tmp_path, capsys):
    """The file named ckpt_000001.pt holds step 6: it is newer than ckpt_000004.pt, whatever its name;
    ckpt_000009.pt is cut short (a copy that died): skipped with a warning that names it."""
    out = copy_run(straight, tmp_path / "mixed", ["ckpt_000004.pt"])
    shutil.copy(os.path.join(straight, "ckpt_000006.pt"), os.path.join(out, "ckpt_000001.pt"))
    data = open(os.path.join(straight, "ckpt_000008.pt"), "rb").read()
    open(os.path.join(out, "ckpt_000009.pt"), "wb").write(data[:len(data) // 2])
    assert main(args(data_dir, out, max_steps=8, resume="true")) == 0
    said = capsys.readouterr().out
    assert f"warning: skipping {os.path.join(out, 'ckpt_000009.pt')}: not a readable checkpoint" in said
    assert f"resuming from {os.path.join(out, 'ckpt_000001.pt')} at step 6" in said
    assert rows(out) == rows(straight)
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))


def test_resume_refuses_an_out_dir_of_broken_files_only(data_dir, straight, tmp_path, capsys):
    out = str(tmp_path / "broken")
    os.makedirs(out)
    data = open(os.path.join(straight, "ckpt_000008.pt"), "rb").read()
    open(os.path.join(out, "ckpt_000008.pt"), "wb").write(data[:1000])
    assert main(args(data_dir, out, max_steps=8, resume="auto")) == 2  # not a fresh run over them
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds ckpt_*.pt files but none is readable" in err


def test_resume_refuses_another_model_shape(data_dir, straight, tmp_path, capsys):
    out = copy_run(straight, tmp_path / "shape", ["ckpt_000004.pt"])
    assert main(args(data_dir, out, max_steps=8, resume="auto", n_layer=2)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ckpt_000004.pt holds a run with n_layer=1, not 2 as asked" in err
    assert ckpts(out) == ["ckpt_000004.pt"]


def test_resume_keeps_the_runs_meaning_and_says_so(data_dir, straight, tmp_path, capsys):
    """A changed learning rate, batch or seed is reported and not taken; a new interval is."""
    out = copy_run(straight, tmp_path / "keys", ["ckpt_000004.pt"])
    assert main(args(data_dir, out, max_steps=8, resume="true", max_lr=0.5, seed=7, checkpoint_interval=3)) == 0
    said = capsys.readouterr().out
    notes = [line for line in said.splitlines() if line.startswith("note: resuming keeps")]
    assert notes == ["note: resuming keeps the checkpoint's max_lr=0.01 (not 0.5), seed=0 (not 7): they would "
                     "change the run; to change them start a new run in another out_dir"]
    assert rows(out) == rows(straight)
    assert ckpts(out) == ["ckpt_000006.pt", "ckpt_000008.pt"]  # checkpoint_interval=3 is taken; keep_last=2


def test_log_has_no_rows_twice_after_a_hard_kill(data_dir, straight, tmp_path):
    """A run killed at step 7 (its log written up to there, a last line cut in half) resumed from
    ckpt_000004: the redone steps' rows are not there twice."""
    out = copy_run(straight, tmp_path / "killed", ["ckpt_000004.pt"], log=False)
    with open(os.path.join(straight, "log.jsonl")) as f:
        lines = [line for line in f if json.loads(line)["step"] < 8]
    open(os.path.join(out, "log.jsonl"), "w").write("".join(lines) + '{"step": 7, "lo')
    assert main(args(data_dir, out, max_steps=8, resume="true")) == 0
    assert rows(out) == rows(straight)


def test_checkpoint_by_the_clock(data_dir, straight, tmp_path):
    """checkpoint_minutes: saves with no checkpoint_interval (here 0.6 ms after the last: at every step), and
    changes nothing else."""
    out = str(tmp_path / "clock")
    assert main(args(data_dir, out, max_steps=8, checkpoint_minutes=0.00001, keep_last=0)) == 0
    assert len(ckpts(out)) > 2 and "ckpt_000008.pt" in ckpts(out)
    assert rows(out) == rows(straight)
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))


def test_keep_last(data_dir, tmp_path):
    out = str(tmp_path / "keep")
    os.makedirs(out)
    open(os.path.join(out, "ckpt_000003.pt.tmp"), "w").write("left by a killed save")
    assert main(args(data_dir, out, max_steps=8, checkpoint_interval=2, keep_last=2, resume="auto")) == 0
    assert sorted(os.listdir(out)) == ["ckpt_000006.pt", "ckpt_000008.pt", "config.json", "curves.png", "log.jsonl"]

# -----------------------------------------------------------------------------
# divergence and outliers


def all_finite(out_dir):
    weights = [load_ckpt(os.path.join(out_dir, name))["model"] for name in ckpts(out_dir)]
    return all(torch.isfinite(v).all() for model in weights for v in model.values())


def test_absurd_learning_rate_stops_with_one_line(data_dir, tmp_path, capsys):
    """lr 1e20: the first step sends the weights to ~1e20, every later loss is NaN: after max_skipped
    skipped steps in a row the run stops, exit 3, one line; its checkpoints are all finite."""
    out = str(tmp_path / "boom")
    assert main(args(data_dir, out, max_lr=1e20, min_lr=1e20, max_steps=50, checkpoint_interval=1, keep_last=0)) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: the run diverged: 10 optimizer steps in a row were skipped (inf/nan loss or "
                          "gradients), the last at step 10") and err.count("\n") == 1 and "lower max_lr" in err, err
    assert [r["step"] for r in rows(out) if r.get("skipped")] == list(range(1, 11))
    assert all_finite(out) and len(ckpts(out)) == 10
    assert main(args(data_dir, str(tmp_path / "x"), max_lr=1e38)) == 2  # beyond float32's AdamW: one line up front
    assert "max_lr=1e+38 is too large" in capsys.readouterr().err


def test_no_checkpoint_with_non_finite_weights(data_dir, tmp_path, monkeypatch, capsys):
    """Weights gone to inf (here: set so during step 3) are never saved: the next checkpoint stops the run."""
    real, calls = optim.accumulate_gradients, []

    def poisoned(model, loader, *a, **k):
        calls.append(1)
        if len(calls) == 4:  # step 3 (one call per optimizer step)
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("inf")
        return real(model, loader, *a, **k)
    monkeypatch.setattr(optim, "accumulate_gradients", poisoned)
    out = str(tmp_path / "inf")
    assert main(args(data_dir, out, max_steps=8, checkpoint_interval=1, keep_last=0)) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: the weights or optimizer state hold inf/nan before the checkpoint at step 4, so it "
                          f"is not written: the run diverged (newest checkpoint: "
                          f"{os.path.join(out, 'ckpt_000003.pt')})"), err
    assert ckpts(out) == ["ckpt_000001.pt", "ckpt_000002.pt", "ckpt_000003.pt"] and all_finite(out)


def test_outlier_skipping_in_a_run(data_dir, tmp_path, monkeypatch):
    """A gradient spike at step 6 (gradients x 1000) is skipped when skip_outliers_z is set: the
    weights after step 6 are those before it, and the guard's history is in the checkpoint."""
    monkeypatch.setattr(guard, "OUTLIER_WINDOW", 4)
    real, n = optim.accumulate_gradients, [0]

    def spiky(model, *a, **k):
        loss = real(model, *a, **k)
        if n[0] == 6:
            for p in model.parameters():
                p.grad *= 1000
        n[0] += 1
        return loss
    monkeypatch.setattr(optim, "accumulate_gradients", spiky)
    out = str(tmp_path / "spike")
    assert main(args(data_dir, out, max_steps=7, checkpoint_interval=6, keep_last=0, skip_outliers_z=50.0)) == 0
    log = [r for r in rows(out) if "loss" in r]
    assert [r.get("skipped") for r in log] == [None] * 6 + ["outlier"]
    a, b = load_ckpt(os.path.join(out, "ckpt_000006.pt")), load_ckpt(os.path.join(out, "ckpt_000007.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # step 6 changed nothing
    assert len(b["guard"]["norm"]) == 4 and b["guard"]["in_a_row"] == 1
