"""plot.py: the series it extracts from log.jsonl, the smoothing, the PNG, and what happens without matplotlib."""
import builtins
import json
import math
import os

import pytest

import plot


def make_run(path, rows, total_batch_size=1000, **config):
    os.makedirs(path, exist_ok=True)
    with open(path / "config.json", "w") as f:
        json.dump({"total_batch_size": total_batch_size, "n_layer": 2, "n_embd": 64, **config}, f)
    with open(path / "log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def synthetic_rows(steps=60, every=20):
    rows = []
    for s in range(steps + 1):
        if s % every == 0:
            rows.append({"step": s, "val_loss": 5.0 - s / 30})
            rows.append({"step": s, "hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.25 + s / 1000})
        if s < steps:
            rows.append({"step": s, "loss": 5.0 - s / 30 + 0.1 * (-1) ** s, "lr": 1e-3, "norm": 1.0})
    return rows


def test_read_run_tokens_seen_last_row_wins_and_skips_a_partial_line(tmp_path):
    rows = [{"step": 0, "val_loss": 11.0}, {"step": 0, "loss": 10.9}, {"step": 1, "loss": 9.0},
            {"step": 2, "loss": 8.0},
            {"step": 2, "loss": 7.5}, {"step": 3, "loss": float("nan")},  # resumed from step 2: logged again
            {"step": 3, "hellaswag_acc": 0.3, "hellaswag_acc_norm": 0.31}]
    run_dir = make_run(tmp_path / "run", rows, total_batch_size=524288)
    with open(os.path.join(run_dir, "log.jsonl"), "a") as f:
        f.write('{"step": 4, "lo')  # the trainer is mid-write
    run = plot.read_run(run_dir)
    assert run["name"] == "run"
    assert run["train"][0] == [0, 524288, 2 * 524288, 3 * 524288]
    assert run["train"][1][:3] == [10.9, 9.0, 7.5] and math.isnan(run["train"][1][3])
    assert run["val"] == ([0], [11.0]) and run["hellaswag"] == ([3 * 524288], [0.31])


def test_smooth_against_the_formula():
    assert plot.smooth([2.0] * 5, span=3) == [2.0] * 5  # bias-corrected: a constant stays itself
    a = 2 / (3 + 1)  # span 3
    x = [4.0, 0.0, 2.0]
    num = [a * 4.0, (1 - a) * a * 4.0 + a * 0.0, (1 - a) ** 2 * a * 4.0 + (1 - a) * a * 0.0 + a * 2.0]
    den = [a, (1 - a) * a + a, (1 - a) ** 2 * a + (1 - a) * a + a]
    assert plot.smooth(x, span=3) == pytest.approx([n / d for n, d in zip(num, den)])
    assert plot.smooth([1.0, 5.0], span=1) == [1.0, 5.0]  # span 1: no smoothing
    out = plot.smooth([1.0, float("nan"), float("inf"), 1.0], span=4)  # a diverged step is skipped
    assert out == [1.0, 1.0, 1.0, 1.0]
    assert plot.smoothing_span(50) == 1 and plot.smoothing_span(19073) == 190


def test_reference_size():
    assert plot.reference_size(12, 768) == "124M" and plot.reference_size(2, 64) == "124M"
    assert plot.reference_size(24, 1024) == "350M" and plot.reference_size(36, 1280) == "774M"
    assert plot.reference_size(48, 1600) == "1558M" and plot.reference_size(64, 2048) == "1558M"


def test_format_tokens():
    assert [plot.format_tokens(x) for x in (0, 500, 2.5e6, 1e9, 10e9)] == ["0", "500", "2.5M", "1B", "10B"]


def test_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = make_run(tmp_path / "a", synthetic_rows())
    b = make_run(tmp_path / "b", synthetic_rows(40), n_layer=12, n_embd=768)
    assert plot.main([a]) == 0  # one run: its own curves.png
    assert plot.main([a, b, "--out", str(tmp_path / "ab.png")]) == 0
    for path in (tmp_path / "a" / "curves.png", tmp_path / "ab.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert not [n for n in os.listdir(tmp_path) + os.listdir(tmp_path / "a") if ".tmp" in n]
    out = capsys.readouterr().out
    assert "a: 60 steps logged | min val loss 3.0000 | max HellaSwag acc_norm 0.3100" in out


def test_plot_bad_input_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = make_run(tmp_path / "a", synthetic_rows())
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert plot.main([a, "--out", str(tmp_path / "x.doc")]) == 2
    assert plot.main([a, "--out", str(tmp_path / "no" / "x.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "config.json not found" in err[0] and ".doc" in err[1] and "does not exist" in err[2]


@pytest.fixture
def no_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(plot, "_noted", False)


def test_without_matplotlib_the_cli_says_how_to_install(tmp_path, capsys, no_matplotlib):
    a = make_run(tmp_path / "a", synthetic_rows())
    assert plot.main([a]) == 2  # a package the command needs: bad set-up, as bench.py --plot
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install matplotlib" in err
    assert not os.path.exists(os.path.join(a, "curves.png"))


def test_refresh_is_silent_without_matplotlib(tmp_path, no_matplotlib, capsys):
    """Issue 31: the trainer's "matplotlib not installed" note showed in the README's first run (matplotlib is
    optional: requirements-dev.txt); without it the trainer writes no curves.png and says nothing."""
    a = make_run(tmp_path / "a", synthetic_rows())
    assert plot.refresh(a) is False
    notes = capsys.readouterr().out.splitlines()
    assert notes == [] and not os.path.exists(os.path.join(a, "curves.png"))


def test_the_train_curve_is_labelled_smoothed_only_when_it_is():
    """Issue 31: under 200 steps the curve was drawn raw (a span of 1) and labelled "(smoothed)"."""
    short, long = [float(i % 7) for i in range(150)], [float(i % 7) for i in range(1000)]
    assert plot.train_lines(short) == [(short, {}, "train")]
    (raw, faint, none), (smoothed, solid, label) = plot.train_lines(long)
    assert raw == long and none is None and faint["alpha"] < 1 and solid == {}
    assert smoothed == plot.smooth(long, 10) and smoothed != long and label == "train (smoothed, 10 steps)"
    assert plot.train_lines([]) == []


def test_refresh_survives_a_broken_run_dir(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(plot, "_noted", False)
    a = make_run(tmp_path / "a", synthetic_rows())
    assert plot.refresh(a) is True and os.path.isfile(os.path.join(a, "curves.png"))
    with open(os.path.join(a, "config.json"), "w") as f:
        f.write("{broken")
    capsys.readouterr()
    assert plot.refresh(a) is False
    notes = capsys.readouterr().out.splitlines()
    assert len(notes) == 1 and "config.json" in notes[0]
    assert os.path.getsize(os.path.join(a, "curves.png")) > 0  # the previous picture is kept
