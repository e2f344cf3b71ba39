"""A full disk or an I/O error while writing loses nothing: one `error:` line, exit 1, the previous
good file intact and loadable, and the same command run again (once there is space) ends exactly as
an uninterrupted run. The write is made to fail by patching it to raise OSError(ENOSPC) part-way,
after some bytes went out; one test makes a real write fail, with a file-size limit on the process.
"""
import errno
import json
import os
import re
import resource
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import fineweb
from gpt2train import logger
import export as export_py
import train_gpt2
from model import GPT
from conftest import (ROOT, assert_same_state, build_shards, one_line, random_model, save_ckpt, snapshot,
                      straight_args, tiny_args)

def failing_on(call, real, write_half):
    """A stand-in for a writer that behaves as `real` except on its call-th call, where it writes
    half of what it was given (write_half(args) does that) and raises ENOSPC."""
    calls = []

    def writer(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            write_half(*args)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)
    return writer


def no_debris(d):
    left = [f for f in os.listdir(d) if ".tmp" in f]
    assert not left, left

# -----------------------------------------------------------------------------
# the trainer: checkpoints and log.jsonl


def log_rows(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    return [{k: v for k, v in r.items() if k not in ("dt_ms", "tok_per_s")} for r in rows]


def test_torchs_short_write_on_a_full_disk_says_how_much_to_free(data_dir, tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk as an internal assert (a RuntimeError, as torch 2.x does when its zip writer
    meets ENOSPC); with the folder's free space below the checkpoint's size that is one line saying so."""
    from gpt2train import checkpoint
    out = str(tmp_path / "run")

    def short_write(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(torch, "save", short_write)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=1000))
    assert train_gpt2.main(tiny_args(data_dir, out, max_steps=4, checkpoint_interval=0)) == 1
    line = one_line(capsys.readouterr().err)
    m = re.fullmatch(rf"error: {re.escape(os.path.join(out, 'ckpt_000004.pt'))}: No space left on device: the "
                     r"checkpoint needs ([\d.]+) MB, 0\.0 MB are free there; free ([\d.]+) MB or choose another "
                     r"out_dir, then run the same command again", line)
    assert m and float(m[1]) > 0.1 and float(m[2]) > 0.1, line
    monkeypatch.undo()
    assert not [f for f in os.listdir(out) if f.startswith("ckpt_")]
    no_debris(out)


def test_checkpoint_on_a_full_disk(data_dir, straight, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    monkeypatch.setattr(torch, "save", failing_on(4, torch.save, lambda obj, f: f.write(b"PK\x03\x04 half a zip")))
    assert train_gpt2.main(straight_args(data_dir, out)) == 1  # its 4th checkpoint, at step 8, fails
    line = one_line(capsys.readouterr().err)
    assert os.path.join(out, "ckpt_000008.pt") in line and "No space left on device; free some space" in line
    monkeypatch.undo()
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt_")) == [f"ckpt_00000{s}.pt" for s in (2, 4, 6)]
    no_debris(out)  # the earlier ones stay
    assert_same_state(os.path.join(out, "ckpt_000006.pt"), os.path.join(straight, "ckpt_000006.pt"))
    GPT.from_checkpoint(os.path.join(out, "ckpt_000006.pt"))  # loadable
    # space again: the same command, continued, ends as the run that never failed
    assert train_gpt2.main(straight_args(data_dir, out, resume="auto")) == 0
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))
    assert log_rows(out) == log_rows(straight)


class FillingUp:
    """A file that takes `rows` writes, then half of the next one, and then fails: a disk filling up."""

    def __init__(self, f, rows):
        self.f, self.rows = f, rows

    def write(self, text):
        self.rows -= 1
        if self.rows < 0:
            self.f.write(text[:len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_log_on_a_full_disk(data_dir, straight, tmp_path, monkeypatch, capsys):
    """log.jsonl is appended to: the rows before the failed one stay, a half-written row is dropped on resume."""
    out = str(tmp_path / "run")
    monkeypatch.setattr(logger, "open", lambda *a, **k: FillingUp(open(*a, **k), 8), raising=False)
    assert train_gpt2.main(straight_args(data_dir, out)) == 1
    assert os.path.join(out, "log.jsonl") in one_line(capsys.readouterr().err)
    monkeypatch.undo()
    lines = open(os.path.join(out, "log.jsonl")).read().splitlines()
    assert len(lines) == 9 and not lines[-1].endswith("}")  # the 9th row (step 6's loss) cut in half;
    assert [{k: v for k, v in json.loads(line).items() if k not in ("dt_ms", "tok_per_s")} for line in lines[:-1]] \
        == log_rows(straight)[:8]  # the rows before it are whole
    assert train_gpt2.main(straight_args(data_dir, out, resume="auto")) == 0
    assert log_rows(out) == log_rows(straight)
    assert_same_state(os.path.join(out, "ckpt_000008.pt"), os.path.join(straight, "ckpt_000008.pt"))


def run_limited(args, limit, tmp_path):
    """train_gpt2.py in a subprocess that may write no file larger than limit bytes (RLIMIT_FSIZE; Python
    ignores SIGXFSZ, so such a write fails with EFBIG, as on a full disk)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))


def test_a_real_log_write_error_is_one_line_and_exit_1(data_dir, tmp_path):
    """Unpatched: log.jsonl outgrows the limit (config.json does not). One line, exit 1, and nothing more
    at exit (the kept-open log.jsonl, closed at exit, holds the rest of the refused row)."""
    out = str(tmp_path / "run")
    limit = 3000  # above config.json (asked + resolved, ~2 KB), below 40 steps of log.jsonl
    r = run_limited(tiny_args(data_dir, out, max_steps=40, eval_interval=0, checkpoint_interval=0), limit, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {os.path.join(out, 'log.jsonl')}: "), r.stderr
    assert os.path.getsize(os.path.join(out, "log.jsonl")) == limit
    assert not [f for f in os.listdir(out) if f.startswith("ckpt_")]


def test_a_real_checkpoint_write_error_is_one_line_and_exit_1(data_dir, straight, tmp_path):
    """Unpatched: no file may be larger than half a checkpoint. One line, exit 1, no file under the
    checkpoint's name, the log up to the failed save."""
    out = str(tmp_path / "run")
    r = run_limited(tiny_args(data_dir, out), os.path.getsize(os.path.join(straight, "ckpt_000004.pt")) // 2, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {os.path.join(out, 'ckpt_000004.pt')}: "), r.stderr
    assert not [f for f in os.listdir(out) if f.startswith("ckpt_")]
    assert [row["step"] for row in log_rows(out) if "loss" in row] == [0, 1, 2, 3]  # the log up to the failed save

# -----------------------------------------------------------------------------
# fineweb.py: shards and manifest.json


def test_shard_on_a_full_disk(corpus, built, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(np, "save", failing_on(3, np.save, lambda f, a: f.write(b"\x93NUMPY half")))
    assert build_shards(corpus, out) == 1
    line = one_line(capsys.readouterr().err)
    assert "_train_000002.npy: No space left on device; free some space and run the same command again" in line
    monkeypatch.undo()
    no_debris(out)
    manifest = json.load(open(out / "manifest.json"))  # the previous one: lists the two shards on disk
    assert {s["name"] for s in manifest["shards"]} == {f for f in os.listdir(out) if f.endswith(".npy")}
    assert len(manifest["shards"]) == 2 and not manifest["complete"]
    assert fineweb.main(["--verify", "--out_dir", str(out)]) == 0  # what is there matches it
    assert "INCOMPLETE" in capsys.readouterr().out
    assert build_shards(corpus, out) == 0  # space again: the same command resumes
    assert snapshot(out) == snapshot(built)


def test_manifest_on_a_full_disk(corpus, built, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(json, "dump", failing_on(2, json.dump, lambda obj, f, **kw: f.write('{"tokenizer": ')))
    assert build_shards(corpus, out) == 1
    assert str(out / "manifest.json") in one_line(capsys.readouterr().err)
    monkeypatch.undo()
    no_debris(out)
    assert len(json.load(open(out / "manifest.json"))["shards"]) == 1  # the previous manifest, whole
    assert build_shards(corpus, out) == 0
    assert snapshot(out) == snapshot(built)

# -----------------------------------------------------------------------------
# export.py


@pytest.mark.parametrize("error", ["ENOSPC", "SafetensorError"])
def test_export_on_a_full_disk(error, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError
    ckpt, out = save_ckpt(random_model(), tmp_path / "ckpt_000010.pt"), str(tmp_path / "hf")
    assert export_py.main([ckpt, out]) == 0
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}

    def dying_save_hf(model, tmp):
        open(os.path.join(tmp, "model.safetensors"), "wb").write(b"half")
        if error == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(export_py, "save_hf", dying_save_hf)
    assert export_py.main([ckpt, out]) == 1
    line = one_line(capsys.readouterr().err)
    assert out in line and "No space left on device" in line
    monkeypatch.undo()
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before  # the previous export
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000010.pt", "hf"]  # no half-built directory beside it
    loaded = GPT.load(out)
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, random_model().transformer.h[0].mlp.c_fc.weight)
