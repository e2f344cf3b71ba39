"""checkpoint.py: the atomic save, the newest readable checkpoint, pruning, the RNG state, the finite
check, THE resume decision (resume_overrides): what a checkpoint fixes of a run, returned, never
written into the frozen Config; and the out_dir lock (one live run per out_dir; runs that hold it:
tests/test_out_dir.py).

    python -m pytest -q tests/test_checkpoint.py
"""
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys

import pytest
import torch

from gpt2train import checkpoint
from gpt2train.config import Config, parse_args
from gpt2train.checkpoint import OutDirLock
from conftest import adamw, end_processes, load_ckpt, tiny_args, tiny_model, wait_for
from gpt2train.data import TokenLoader
from gpt2train.fileio import UserError, umask
from model import GPT, GPTConfig
from gpt2train.precision import make_plan
from gpt2train.optim import Stepping, train_step

NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
# what tiny_args' run fixes: the RUN_KEYS as that run saved them
TINY_RUN = {"init_from": "scratch", "seq_len": 16, "total_batch_size": 64, "warmup_steps": 2, "max_lr": 1e-2,
            "min_lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0, "muon_lr": 6e-3, "muon_momentum": 0.95,
            "lr_schedule": "cosine", "cooldown_frac": 0.2, "embed_lr_mult": 1.0, "scalar_lr_mult": 1.0,
            "muon_momentum_warmup": 0, "muon_split_qkv": True, "zero_init_proj": False}


def trained_model(data_dir, steps=1):
    """tiny_args' model and AdamW after `steps` steps on data_dir (the optimizer then holds state), its loader."""
    model = tiny_model()
    optimizer = adamw(model)
    loader = TokenLoader(data_dir, "train", 2, 16)
    for _ in range(steps):
        train_step(model, Stepping(make_plan("cpu"), NO_SCALER, [optimizer]), *loader.next_batch())
    return model, optimizer, loader


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory):
    """out_dir/ckpt_000008.pt of tiny_args' run, written by save_checkpoint (the path)."""
    out = tmp_path_factory.mktemp("saved")
    cfg, _ = parse_args(tiny_args(data_dir, str(out)))
    model, optimizer, loader = trained_model(data_dir)
    path = checkpoint.checkpoint_path(str(out), 8)
    checkpoint.save_checkpoint(path, checkpoint.TrainState(model, [optimizer], NO_SCALER, loader, "cpu"), step=8,
                               config=dataclasses.asdict(cfg))
    return path


def run_dir(tmp_path, saved, *names):
    """A copy of saved under each of names in tmp_path/run (a folder of the run's checkpoints)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in names:
        shutil.copy(saved, out / name)
    return str(out)

# -----------------------------------------------------------------------------
# save, read, newest, prune


def test_save_writes_what_resume_reads(saved, data_dir):
    ckpt = load_ckpt(saved)  # weights_only=True must work
    assert {"model", "model_args", "optimizer", "scaler", "step", "config", "loader", "rng"} <= set(ckpt)
    assert ckpt["step"] == 8 and ckpt["config"]["data_dir"] == data_dir and ckpt["rng"].keys() == {"torch"}
    assert ckpt["model_args"] == dataclasses.asdict(GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2,
                                                              n_embd=32))
    model, _, _ = trained_model(data_dir)
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())  # bare names, bit-exact
    assert ckpt["optimizer"]["state"] and ckpt["loader"]["pos"] > 0


def test_checkpoint_write_is_atomic(saved, tmp_path, monkeypatch, capsys):
    """A save that dies half-way (a full disk) leaves the previous checkpoint intact and no debris, and
    resume ignores what a killed machine leaves: a .tmp, a truncated checkpoint, a file of another name."""
    good = saved
    path = str(tmp_path / "ckpt_000008.pt")
    shutil.copy(good, path)
    ckpt = load_ckpt(path)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    optimizer = adamw(model)

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", dying_save)
    loader = TokenLoader(ckpt["config"]["data_dir"], "train", 2, 16)
    with pytest.raises(OSError, match="No space left"):
        state = checkpoint.TrainState(model, [optimizer], torch.amp.GradScaler("cpu", enabled=False), loader, "cpu")
        checkpoint.save_checkpoint(path, state, step=9, config=dataclasses.asdict(Config()))
    monkeypatch.undo()
    assert torch.equal(load_ckpt(path)["model"]["lm_head.weight"], ckpt["model"]["lm_head.weight"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000008.pt"]  # the temp file is gone

    # the debris of a killed machine, all holding or claiming steps newer than 8
    shutil.copy(good, tmp_path / "ckpt_000004.pt")
    torch.save({**ckpt, "step": 12}, tmp_path / "ckpt_000012.pt.tmp")  # complete, but never renamed
    torch.save({**ckpt, "step": 13}, tmp_path / "ckpt_best.pt")  # a copy the user made: not ours to resume
    data = open(good, "rb").read()
    open(tmp_path / "ckpt_000010.pt", "wb").write(data[:len(data) // 2])  # cut short
    capsys.readouterr()
    assert checkpoint.latest_checkpoint(str(tmp_path))[0] == path
    warnings = capsys.readouterr().out.splitlines()
    assert len(warnings) == 1 and "skipping " + str(tmp_path / "ckpt_000010.pt") in warnings[0]


def test_checkpoint_files_are_ours_only_newest_first(tmp_path):
    for name in ("ckpt_000002.pt", "ckpt_000010.pt", "ckpt_000004.pt", "ckpt_000006.pt.tmp", "ckpt_best.pt", "x.pt"):
        (tmp_path / name).write_bytes(b"")
    assert checkpoint.checkpoint_path(str(tmp_path), 10) == str(tmp_path / "ckpt_000010.pt")
    assert checkpoint.checkpoint_files(str(tmp_path)) == [(10, str(tmp_path / "ckpt_000010.pt")),
                                                          (4, str(tmp_path / "ckpt_000004.pt")),
                                                          (2, str(tmp_path / "ckpt_000002.pt"))]
    assert checkpoint.checkpoint_files(str(tmp_path / "nowhere")) == []
    assert checkpoint.latest_checkpoint(str(tmp_path / "nowhere")) == (None, None)


@pytest.mark.parametrize("keep_last,left", [(2, [8, 10, 12]), (1, [10, 12]), (0, [2, 4, 6, 8, 10, 12])])
def test_prune_keeps_the_newest_and_what_is_above_the_step(tmp_path, keep_last, left):
    """Once ckpt_10 is in place: the older ones beyond keep_last go, and a killed save's .tmp; ckpt_12 (above
    the step: one resume skipped as unreadable) is not this run's to delete."""
    for step in (2, 4, 6, 8, 10, 12):
        torch.save({"step": step}, tmp_path / f"ckpt_{step:06d}.pt")
    (tmp_path / "ckpt_000011.pt.tmp").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("mine")
    checkpoint.prune_checkpoints(str(tmp_path), 10, keep_last)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt_{s:06d}.pt" for s in left] + ["notes.txt"]


@pytest.mark.parametrize("keep_last,kept", [(2, [5]), (1, []), (3, [2, 5]), (0, [2, 5])])
def test_prune_never_counts_an_unreadable_checkpoint(tmp_path, keep_last, kept):
    """ckpt_6 was cut short (resume skipped it) and ckpt_8 is empty: neither is one of the keep_last kept,
    and neither is deleted; the newest readable older ones stay (issue 31: keep_last=2 deleted ckpt_5)."""
    for step in (2, 5, 6, 9):
        torch.save({"step": step, "model": torch.zeros(1000)}, tmp_path / f"ckpt_{step:06d}.pt")
    data = (tmp_path / "ckpt_000006.pt").read_bytes()
    (tmp_path / "ckpt_000006.pt").write_bytes(data[:len(data) // 2])
    (tmp_path / "ckpt_000008.pt").write_bytes(b"")
    checkpoint.prune_checkpoints(str(tmp_path), 9, keep_last)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt_{s:06d}.pt" for s in sorted(kept + [6, 8, 9])]


# -----------------------------------------------------------------------------
# RNG state and the finite check


def test_rng_state_round_trip_on_cpu():
    state = checkpoint.rng_state("cpu")
    assert set(state) == {"torch"}  # no CUDA generator on a CPU run
    first = torch.rand(5)
    torch.rand(100)  # the generator moves on
    checkpoint.set_rng_state(state, "cpu")
    assert torch.equal(torch.rand(5), first)


def test_finite_state_finds_a_non_finite_weight_or_optimizer_value(data_dir):
    model, optimizer, _ = trained_model(data_dir)
    assert checkpoint.finite_state(model, [optimizer], "cpu") is True
    exp_avg = next(iter(optimizer.state.values()))["exp_avg"]
    exp_avg.view(-1)[0] = float("nan")
    assert checkpoint.finite_state(model, [optimizer], "cpu") is False
    exp_avg.view(-1)[0] = 0.0
    with torch.no_grad():
        model.lm_head.weight[1, 2] = float("inf")
    assert checkpoint.finite_state(model, [optimizer], "cpu") is False

# -----------------------------------------------------------------------------
# THE resume decision: resume_overrides returns what the checkpoint fixes


def test_resume_overrides_returns_what_the_checkpoint_fixes(saved, data_dir, tmp_path, capsys):
    out = run_dir(tmp_path, saved, "ckpt_000008.pt")
    cfg, given = parse_args(tiny_args(data_dir, out, resume="true", max_steps=20, max_lr=0.5, seed=7))
    ckpt, overrides = checkpoint.resume_overrides(out, cfg, given)
    said = capsys.readouterr().out.splitlines()
    assert ckpt["path"] == os.path.join(out, "ckpt_000008.pt") and ckpt["step"] == 8
    assert overrides == TINY_RUN  # max_steps (a safe key) is not among them: the user's 20 stays
    assert len(said) == 1 and said[0].startswith("note: resuming keeps the checkpoint's max_lr=0.01 (not 0.5), "
                                                 "seed=0 (not 7): they would change the run")
    assert (cfg.max_lr, cfg.seed, cfg.max_steps) == (0.5, 7, 20)  # returned, not written into the Config
    cfg, given = parse_args(tiny_args(data_dir, out, resume="auto", max_steps=20))
    assert checkpoint.resume_overrides(out, cfg, given)[1] == TINY_RUN
    assert capsys.readouterr().out.splitlines() == []  # no change


def test_a_checkpoint_from_before_a_key_resumes_with_what_it_ran(saved, data_dir, tmp_path, capsys):
    """muon_split_qkv's default became True (issue 33's ablation); a checkpoint written before the key existed ran
    Muon on c_attn whole, and resumes so, saying so."""
    out = run_dir(tmp_path, saved)
    ckpt = load_ckpt(saved)
    del ckpt["config"]["muon_split_qkv"]
    torch.save(ckpt, os.path.join(out, "ckpt_000008.pt"))
    cfg, given = parse_args(tiny_args(data_dir, out, resume="true"))
    capsys.readouterr()
    overrides = checkpoint.resume_overrides(out, cfg, given)[1]
    said = capsys.readouterr().out.splitlines()
    assert cfg.muon_split_qkv is True and overrides == dict(TINY_RUN, muon_split_qkv=False)
    assert said == ["note: resuming keeps the checkpoint's muon_split_qkv=False (not True): they would change the run; "
                    "to change them start a new run in another out_dir"]


def test_resume_overrides_keep_the_checkpoints_model_when_the_user_set_none(saved, data_dir, tmp_path):
    out = run_dir(tmp_path, saved, "ckpt_000008.pt")
    cfg, given = parse_args([f"--out_dir={out}", f"--data_dir={data_dir}", "--resume=true"])  # n_layer: default 12
    ckpt, overrides = checkpoint.resume_overrides(out, cfg, given)
    assert ckpt["model_args"]["n_layer"] == 1 and "n_layer" not in overrides  # the model is built from model_args
    assert overrides["total_batch_size"] == 64 and cfg.total_batch_size == 524288


@pytest.mark.parametrize("resume,names,result", [
    ("false", [], None), ("auto", [], None), ("true", [], "has no ckpt_*.pt: drop --resume"),
    ("false", ["ckpt_000008.pt"], "holds another run's checkpoints (ckpt_000008.pt): --resume=auto continues it"),
])
def test_resume_overrides_by_the_resume_word(saved, data_dir, tmp_path, resume, names, result):
    out = run_dir(tmp_path, saved, *names)
    cfg, given = parse_args(tiny_args(data_dir, out, resume=resume))
    if result is None:
        assert checkpoint.resume_overrides(out, cfg, given) == (None, {})  # a fresh run
    else:
        with pytest.raises(UserError, match=result.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            checkpoint.resume_overrides(out, cfg, given)


@pytest.mark.parametrize("flag,message", [
    ("--n_layer=2", "holds a run with n_layer=1, not 2 as asked: choose another --out_dir"),
    ("--init_from=gpt2", "holds a run with init_from='scratch', not 'gpt2' as asked"),
    ("--optimizer=muon", "was trained with optimizer=adamw, not muon as asked"),
])
def test_resume_overrides_refuse_what_the_checkpoint_cannot_continue(saved, data_dir, tmp_path, flag, message):
    out = run_dir(tmp_path, saved, "ckpt_000008.pt")
    cfg, given = parse_args(tiny_args(data_dir, out, resume="true") + [flag])
    with pytest.raises(UserError, match=message):
        checkpoint.resume_overrides(out, cfg, given)


def test_resume_overrides_refuse_an_out_dir_of_unreadable_checkpoints(tmp_path, data_dir, capsys):
    (tmp_path / "ckpt_000004.pt").write_bytes(b"not a checkpoint")
    cfg, given = parse_args(tiny_args(data_dir, str(tmp_path), resume="auto"))
    with pytest.raises(UserError, match="holds ckpt_\\*.pt files but none is readable"):
        checkpoint.resume_overrides(str(tmp_path), cfg, given)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"warning: skipping {tmp_path / 'ckpt_000004.pt'}")

# -----------------------------------------------------------------------------
# the out_dir lock


def write_lock(out_dir, age_s=0, **held):
    """out_dir/run.lock as another run would have left it, its mtime age_s seconds ago."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "run.lock")
    with open(path, "w") as f:
        json.dump(dict({"pid": 1, "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00"}, **held), f)
    t = os.path.getmtime(path) - age_s
    os.utime(path, (t, t))
    return path


def test_which_locks_are_live_and_which_are_stale(tmp_path):
    """Live: this host's holder still running as the same process; another host's lock beaten within STALE
    seconds. Stale (taken over): a pid gone or reused by another program, another boot, another host's silence,
    a lock half-written long ago. A live one is refused with its holder; a stale one is replaced by ours."""
    me, out = OutDirLock().me, str(tmp_path / "out")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        wait_for(lambda: checkpoint._process_start(sleeper.pid), 30, "the sleeper's /proc entry")
        live = {"pid": sleeper.pid, "boot_id": me["boot_id"], "process_start": checkpoint._process_start(sleeper.pid)}
        cases = [  # (what the lock holds, its age in seconds, live?)
            (live, 0, True),
            (dict(live, process_start="1"), 0, False),  # the pid now belongs to another process
            (dict(live, boot_id="another boot"), 0, False),  # the machine rebooted since
            ({"pid": 2**22 + 7, "boot_id": me["boot_id"]}, 0, False),  # no such process
            ({"pid": 4242, "host": "elsewhere"}, 10, True),  # another machine, heartbeat recent
            ({"pid": 4242, "host": "elsewhere"}, OutDirLock.STALE + 60, False),  # another machine, silent
        ]
        for held, age, is_live in cases:
            shutil.rmtree(out, ignore_errors=True)
            write_lock(out, age, **held)
            lock = OutDirLock()
            if is_live:
                holder = f"pid {held['pid']} on {held.get('host', socket.gethostname())}, since 2026-01-01"
                with pytest.raises(UserError, match="is in use by a live run: " + re.escape(holder)):
                    lock.acquire(out)
                assert json.load(open(os.path.join(out, "run.lock")))["pid"] == held["pid"]  # left as it was
            else:
                lock.acquire(out)
                try:
                    assert json.load(open(os.path.join(out, "run.lock")))["pid"] == os.getpid(), held
                finally:
                    lock.release()
                assert not os.path.exists(os.path.join(out, "run.lock"))
        for age, is_live in ((1, True), (60, False)):  # half-written: a run killed while taking it
            shutil.rmtree(out, ignore_errors=True)
            write_lock(out)
            open(os.path.join(out, "run.lock"), "w").write('{"pid": 12')
            t = os.path.getmtime(os.path.join(out, "run.lock")) - age
            os.utime(os.path.join(out, "run.lock"), (t, t))
            if is_live:
                with pytest.raises(UserError, match="in use by a live run: pid \\?"):
                    OutDirLock().acquire(out)
            else:
                lock = OutDirLock().acquire(out)
                lock.release()
    finally:
        end_processes([sleeper.pid])
        sleeper.wait()


def test_a_lock_is_the_runs_own_and_goes_with_it(tmp_path):
    """Taking it again in the same process is a no-op; release removes only our own lock, and the folders
    acquire made for out_dir when they are left empty (a refused run leaves no out/ behind)."""
    out = str(tmp_path / "out" / "my_book")
    lock = OutDirLock().acquire(out)
    try:
        assert lock.acquire(out) is lock
        assert json.load(open(os.path.join(out, "run.lock")))["pid"] == os.getpid()
        assert stat.S_IMODE(os.stat(os.path.join(out, "run.lock")).st_mode) == 0o666 & ~umask()
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []  # out/my_book and out/, made for the run, gone with it
    os.makedirs(out)
    lock = OutDirLock().acquire(out)
    write_lock(out, pid=12345)  # someone else's now (taken over while we were away): not ours to delete
    lock.release()
    assert os.path.exists(os.path.join(out, "run.lock"))
