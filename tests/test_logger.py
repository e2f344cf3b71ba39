"""logger.py and the trainer's console: TensorBoard event files and the W&B run carry log.jsonl's
numbers plus MFU and memory; a dashboard whose package is missing stops the run with one line; the
ETA; the micro-step bar shows on a terminal only, and only inside slow steps. (--help: tests/test_config.py.)"""
import glob
import importlib.machinery
import io
import json
import os
import re
import sys
import types

import pytest
import tqdm.std

from gpt2train import logger
from gpt2train import precision
from conftest import read_log, tiny_args
from train_gpt2 import main

STEP_KEYS = ("loss", "lr", "norm", "dt_ms", "tok_per_s")


class Terminal(io.StringIO):
    def isatty(self):
        return True

# -----------------------------------------------------------------------------
# the dashboards


def test_tensorboard_has_the_logs_scalars_plus_mfu_and_memory(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setattr(precision, "estimate_mfu", lambda *a, **k: 0.25)  # a CPU has no peak: pretend one
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, max_steps=4, tensorboard="true")) == 0
    assert glob.glob(os.path.join(out, "events.out.tfevents.*"))
    events = EventAccumulator(out)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {*STEP_KEYS, "val_loss", "mfu", "mem_rss_peak_mib"} <= tags
    log = read_log(out)
    for key in (*STEP_KEYS, "val_loss"):  # the same numbers at the same steps as log.jsonl (float32 there)
        want = {e["step"]: e[key] for e in log if key in e}
        assert {ev.step: ev.value for ev in events.Scalars(key)} == pytest.approx(want, rel=1e-6), key
    assert [ev.value for ev in events.Scalars("mfu")] == [0.25] * 4
    assert all(ev.value > 10 for ev in events.Scalars("mem_rss_peak_mib"))  # torch alone takes more


def fake_wandb(calls):
    """A stand-in `wandb` module that records how the trainer calls it."""
    class Run:
        def __init__(self, id=None, **kw):
            self.id = id or f"run{sum(c[0] == 'init' for c in calls)}"

        def log(self, scalars, step):
            calls.append(("log", step, dict(scalars)))

        def finish(self):
            calls.append(("finish",))

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kw: calls.append(("init", kw)) or Run(**kw)
    return module


def test_wandb_calls(data_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, max_steps=4, wandb_project="gpt2", wandb_run_name="tiny")) == 0
    (_, init), *logs, finish = calls
    assert init["project"] == "gpt2" and init["name"] == "tiny" and init["dir"] == out
    assert init["config"] == json.load(open(os.path.join(out, "config.json")))["resolved"]  # the resolved config
    assert finish == ("finish",)  # once, at the end
    steps = [c[1] for c in logs]
    assert steps == sorted(steps)  # W&B drops a step lower than the last one
    log = read_log(out)
    for event in log:  # every log.jsonl event, with the same numbers
        match = [s for _, st, s in logs if st == event["step"] and set(event) - {"step"} <= set(s)]
        assert len(match) == 1 and all(match[0][k] == v for k, v in event.items() if k != "step")
    train = [s for _, _, s in logs if "loss" in s]
    assert len(train) == 4 and all("mem_rss_peak_mib" in s and "mfu" not in s for s in train)  # no MFU on a CPU


def test_a_resumed_run_goes_on_in_the_same_wandb_run(data_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    out, other = str(tmp_path / "run"), str(tmp_path / "other")
    assert main(tiny_args(data_dir, out, max_steps=2, wandb_project="gpt2")) == 0
    assert main(tiny_args(data_dir, out, max_steps=4, wandb_project="gpt2", resume="auto")) == 0  # from ckpt_000002.pt
    assert main(tiny_args(data_dir, other, max_steps=2, wandb_project="gpt2")) == 0  # a new run
    assert main(tiny_args(data_dir, out, max_steps=6, wandb_project="elsewhere", resume="auto")) == 0  # another project
    runs = []  # (init's keywords, the steps logged to that run)
    for call in calls:
        if call[0] == "init":
            runs.append((call[1], []))
        elif call[0] == "log":
            runs[-1][1].append(call[1])
    assert [(kw.get("id"), kw.get("resume")) for kw, _ in runs] == \
        [(None, None), ("run1", "allow"), (None, None), (None, None)]
    assert runs[0][1][0] == 0 and runs[1][1][0] == 2 and max(runs[1][1]) == 4  # steps 2-4 go on in run1


def test_wandb_offline_writes_a_run(data_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_ERROR_REPORTING", "false"),
                        ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path / "cache")),
                        ("WANDB_DATA_DIR", str(tmp_path / "data"))):
        monkeypatch.setenv(name, value)
    out = str(tmp_path / "run")
    try:
        assert main(tiny_args(data_dir, out, max_steps=2, wandb_project="gpt2-offline", wandb_run_name="tiny")) == 0
    finally:
        wandb.teardown()  # stops the wandb-core process the run started
    runs = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1
    with open(runs[0], "rb") as f:
        data = f.read()
    for name in ("gpt2-offline", "tiny", *STEP_KEYS, "val_loss", "mem_rss_peak_mib"):
        assert name.encode() in data, name


@pytest.mark.parametrize("key, value, package", [("tensorboard", "true", "tensorboard"),
                                                 ("wandb_project", "gpt2", "wandb")])
def test_missing_package_is_one_line(key, value, package, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, **{key: value})) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{key} needs the {package} package" in err and f"pip install {package}" in err
    assert not os.path.exists(out)  # refused at start-up, before anything was written

# -----------------------------------------------------------------------------
# the console


def test_eta_leaves_out_the_first_step_and_follows_recent_ones():
    timer = logger.StepTimer(window=3)
    assert timer.eta(60.0, 10) is None  # the first step (compilation) alone says nothing
    assert timer.eta(2.0, 9) == 18.0
    timer.eta(2.0, 8)
    timer.eta(2.0, 7)
    assert timer.eta(5.0, 6) == pytest.approx((2.0 + 2.0 + 5.0) / 3 * 6)  # the last 3 steps only


@pytest.mark.parametrize("seconds, text", [(None, "n/a"), (0.4, "0s"), (59.4, "59s"), (61, "1m01s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (7 * 3600 + 5 * 60, "7h05m"),
                                           (2 * 86400 + 3 * 3600 + 59, "2d03h")])
def test_fmt_duration(seconds, text):
    assert logger.fmt_duration(seconds) == text


@pytest.mark.parametrize("terminal, master, grad_accum, slow, shown", [
    (True, True, 4, True, True),
    (True, True, 4, False, False),  # a step faster than the delay prints nothing
    (False, True, 4, True, False),  # a log file or a pipe never sees it
    (True, False, 4, True, False),  # rank 0 only
    (True, True, 1, True, False),  # one micro-step: nothing to count
])
def test_micro_step_bar(terminal, master, grad_accum, slow, shown, monkeypatch):
    """On tqdm's clock, patched (a busy machine cannot stretch a fast step past the delay): a micro-step takes
    1.5 s when slow, none otherwise; the bar shows once a step has run PROGRESS_DELAY (5 s)."""
    now = 1000.0
    monkeypatch.setattr(tqdm.std, "time", lambda: now)  # read by each bar (its _time) from its start
    stream = Terminal() if terminal else io.StringIO()
    with logger.micro_step_bar(grad_accum, master, stream) as bar:
        for _ in range(grad_accum):
            now += 1.5 if slow else 0
            bar.update()
    assert ("micro-steps" in stream.getvalue()) == shown


def test_step_line_eta_and_bar_in_a_run(data_dir, tmp_path, monkeypatch):
    """The trainer's step lines end with the ETA (n/a until a step past the first is timed); on a
    terminal the bar runs inside each step (2 micro-steps here) on stderr, never on stdout or in the log."""
    monkeypatch.setattr(logger, "PROGRESS_DELAY", 0.0)
    stdout, stderr = io.StringIO(), Terminal()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    out = str(tmp_path / "run")
    assert main(tiny_args(data_dir, out, max_steps=3, eval_interval=0)) == 0
    lines = [line for line in stdout.getvalue().splitlines() if re.match(r"step +\d+/3 \|", line)]
    assert len(lines) == 3 and lines[0].endswith("| ETA n/a")
    assert all(re.search(r"\| ETA \d+s$", line) for line in lines[1:])
    assert stderr.getvalue().count("micro-steps") >= 3 and "micro-steps" not in stdout.getvalue()
    assert "micro-steps" not in open(os.path.join(out, "log.jsonl")).read()
