"""
Training curves from a run's out_dir: train loss (smoothed), val loss and HellaSwag acc_norm against
tokens seen, several runs overlaid, with the OpenAI checkpoints' scores as reference lines.

    python plot.py out/gpt2_124m                       # -> out/gpt2_124m/curves.png
    python plot.py out/run_a out/run_b --out ab.png    # two runs on the same axes

Reads each run's log.jsonl and config.json (written by train_gpt2.py). Needs matplotlib, an optional
dependency (`pip install matplotlib`, or `pip install -r requirements-dev.txt`). The trainer calls
refresh(out_dir) at each eval to keep out_dir/curves.png current; that call never raises.
"""
import json
import math
import os
import sys

from gpt2train.fileio import ArgumentParser, UserError, check_output_file, fail, replacing
from gpt2train.logger import print0

# -----------------------------------------------------------------------------
# reference scores: zero-shot HellaSwag acc_norm of OpenAI's checkpoints, completion style (as
# hellaswag.py) GPT-2 124M and 1558M: 0.2955 and 0.4893 over the 10,042 val rows,
# karpathy/build-nanogpt hellaswag.py docstring (also llm.c dev/data/hellaswag.py; our
# docs/hellaswag.md table). GPT-2 350M and 774M: 0.3752 and 0.4320, the `hella2_baseline` table of
# karpathy/build-nanogpt play.ipynb (llm.c's evaluation; it has 0.2945 for 124M, so these two may
# sit ~0.001 off this method). GPT-3: zero-shot HellaSwag of Brown et al. 2020 (arXiv:2005.14165,
# appendix H: every task at every size), as in the `hella3_baseline` table of the same play.ipynb;
# GPT-3's sizes are 125M, 350M, 760M and 1.3B, the nearest to GPT-2's four.
HELLASWAG_REFS = {  # GPT-2 size: [(label, acc_norm)]
    "124M": [("OpenAI GPT-2 124M", 0.2955), ("OpenAI GPT-3 125M", 0.337)],
    "350M": [("OpenAI GPT-2 350M", 0.3752), ("OpenAI GPT-3 350M", 0.436)],
    "774M": [("OpenAI GPT-2 774M", 0.4320), ("OpenAI GPT-3 760M", 0.510)],
    "1558M": [("OpenAI GPT-2 1558M", 0.4893), ("OpenAI GPT-3 1.3B", 0.547)],
}
# OpenAI GPT-2 124M's loss on the FineWeb-Edu val shard: 3.2924 (build-nanogpt play.ipynb,
# `loss_baseline`). No published FineWeb-Edu number for the larger sizes, so no line for them.
VAL_LOSS_REFS = {"124M": [("OpenAI GPT-2 124M on FineWeb-Edu val", 3.29)]}
# (n_layer, n_embd)
GPT2_SHAPES = {"124M": (12, 768), "350M": (24, 1024), "774M": (36, 1280), "1558M": (48, 1600)}


def reference_size(n_layer, n_embd):
    """The GPT-2 size whose references a run is compared with: the one nearest in 12 * n_layer *
    n_embd^2 (the non-embedding parameters), on a log scale; models smaller than 124M get 124M's."""
    n = 12 * n_layer * n_embd ** 2
    size_of = lambda s: 12 * GPT2_SHAPES[s][0] * GPT2_SHAPES[s][1] ** 2  # noqa: E731
    return min(GPT2_SHAPES, key=lambda s: abs(math.log(n / size_of(s))))

# -----------------------------------------------------------------------------
# reading a run


def read_run(run_dir):
    """{'name', 'config', 'train', 'val', 'hellaswag'}: each series a (tokens_seen, values) pair of
    lists, sorted by step. Tokens seen at a row of step s are s * total_batch_size: the losses and
    evals logged at step s are those of the model before its s-th update. A resumed run may log a
    step twice: the last row wins. Lines that do not parse (one being written) are skipped."""
    config_path, log_path = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "log.jsonl")
    for path in (config_path, log_path):
        if not os.path.isfile(path):
            raise UserError(f"{path} not found: RUN_DIR must be a train_gpt2.py out_dir")
    try:
        with open(config_path) as f:
            config = json.load(f)
        # {"asked", "resolved", "changed"}; older runs: the config itself
        config = config.get("resolved", config)
        tokens_per_step = int(config["total_batch_size"])
        config["n_layer"] = int(config.get("n_layer", 12))
        config["n_embd"] = int(config.get("n_embd", 768))
        if min(tokens_per_step, config["n_layer"], config["n_embd"]) < 1:
            raise ValueError("total_batch_size, n_layer and n_embd must be positive")
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise UserError(f"{config_path} is not a train_gpt2.py config "
                        f"({type(e).__name__}: {e})") from None
    series = {"train": {}, "val": {}, "hellaswag": {}}
    keys = {"train": "loss", "val": "val_loss", "hellaswag": "hellaswag_acc_norm"}
    # (a line of bytes that are not UTF-8 does not parse: skipped)
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError, OverflowError):
                continue
            for name, key in keys.items():
                if isinstance(row.get(key), (int, float)):
                    series[name][step] = float(row[key])
    run = {"name": os.path.basename(os.path.normpath(run_dir)), "config": config}
    for name, points in series.items():
        steps = sorted(points)
        run[name] = ([s * tokens_per_step for s in steps], [points[s] for s in steps])
    return run


def smooth(values, span):
    """Exponential moving average over a span of about `span` points, bias-corrected at the start
    (so the first output is the first value, not a fraction of it). Non-finite values (a diverged
    step) are skipped: they leave the average where it was and get it as their output."""
    alpha = 2.0 / (span + 1)
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            avg = (1 - alpha) * avg + alpha * v
            weight = (1 - alpha) * weight + alpha
        out.append(avg / weight if weight > 0 else float("nan"))
    return out


def smoothing_span(n):
    """Points averaged for a train-loss curve of n points: ~1% of the run, at least 1."""
    return max(1, n // 100)


def train_lines(ys):
    """[(values, line style, legend label or None)] of a train-loss curve: raw and faint under its
    smoothed line, or (a run under 200 steps, span 1: nothing to smooth) raw alone, labelled as what
    it is."""
    span = smoothing_span(len(ys))
    if not ys:
        return []
    if span == 1:
        return [(ys, {}, "train")]
    return [(ys, {"alpha": 0.2, "linewidth": 0.8}, None),
            (smooth(ys, span), {}, f"train (smoothed, {span} steps)")]

# -----------------------------------------------------------------------------
# drawing


def format_tokens(x, _pos=None):
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:g}{unit}"
    return f"{x:g}"


def draw(runs, out):
    """Write the figure to out (format from its extension, default png) through a temp file."""
    from matplotlib.figure import Figure  # no pyplot: no display backend, no global state
    from matplotlib.ticker import FuncFormatter
    fig = Figure(figsize=(14, 5.5), layout="constrained")
    ax_loss, ax_hs = fig.subplots(1, 2)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        c = run["config"]
        label = f"{run['name']} ({c.get('n_layer', '?')}L {c.get('n_embd', '?')}d)"
        xs, ys = run["train"]
        for values, style, what in train_lines(ys):
            ax_loss.plot(xs, values, color=color, **style,
                         **({"label": f"{label} {what}"} if what else {}))
        xs, ys = run["val"]
        if xs:
            ax_loss.plot(xs, ys, color=color, linestyle="--", marker=".", label=f"{label} val")
        xs, ys = run["hellaswag"]
        if xs:
            ax_hs.plot(xs, ys, color=color, marker=".", label=label)
    sizes = sorted({reference_size(r["config"].get("n_layer", 12),
                                   r["config"].get("n_embd", 768)) for r in runs},
                   key=list(GPT2_SHAPES).index)
    fineweb = any(r["config"].get("data_source", "fineweb") == "fineweb"
                  and not r["config"].get("data") for r in runs)
    for i, size in enumerate(sizes):
        for (label, y), style in zip(VAL_LOSS_REFS.get(size, []) if fineweb else [], [":"]):
            ax_loss.axhline(y, color="red", linestyle=style, linewidth=1,
                            label=f"{label} ({y:.2f})")
        for (label, y), color in zip(HELLASWAG_REFS[size], ["red", "green"]):
            ax_hs.axhline(y, color=color, linestyle=(0, (4, 2 + 2 * i)), linewidth=1,
                          label=f"{label} ({y:.4g})")
    ax_loss.set(title="loss", xlabel="tokens seen", ylabel="loss", yscale="log")
    ax_hs.set(title="HellaSwag acc_norm (zero-shot)", xlabel="tokens seen", ylabel="acc_norm")
    if not any(r["hellaswag"][0] for r in runs):
        ax_hs.text(0.5, 0.5, "no HellaSwag evals in log.jsonl", transform=ax_hs.transAxes,
                   ha="center")
    plain = FuncFormatter(lambda y, _pos: f"{y:g}")  # 3.5, not 3.5 x 10^0, on the log axis
    ax_loss.yaxis.set_major_formatter(plain)
    ax_loss.yaxis.set_minor_formatter(plain)
    for ax in (ax_loss, ax_hs):
        ax.xaxis.set_major_formatter(FuncFormatter(format_tokens))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    ext = os.path.splitext(out)[1].lstrip(".").lower() or "png"
    if ext not in fig.canvas.get_supported_filetypes():
        raise UserError(f"--out {out}: matplotlib cannot write .{ext} files; "
                        "use .png, .pdf or .svg")
    with replacing(out, suffix=".tmp." + ext) as tmp:
        fig.savefig(tmp, format=ext, dpi=110)


def missing_matplotlib():
    """None when matplotlib imports, else the one line that says how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("plotting needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install -r requirements-dev.txt)")
    return None

# -----------------------------------------------------------------------------
# for the trainer: redraw out_dir/curves.png at each eval, never fail the run

_noted = False


def refresh(out_dir):
    """Redraw out_dir/curves.png when matplotlib (optional) is installed; without it, nothing and no
    word (plot.py says how to get it). Never raises: the first problem (an unreadable log...) is
    said once, as a note, and later ones stay silent. Returns True when the file was written."""
    global _noted
    try:
        if missing_matplotlib() is not None:
            return False
        draw([read_run(out_dir)], os.path.join(out_dir, "curves.png"))
        return True
    except Exception as e:  # a plot is never worth a crashed run
        note = f"could not draw curves.png ({type(e).__name__}: {e})"
    if not _noted:
        _noted = True
        print0(f"note: {note}; training goes on without curves.png")
    return False

# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    p = ArgumentParser(prog="plot.py",
                       description="Plot train/val loss and HellaSwag of train_gpt2.py runs.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="out_dir of a run (holds log.jsonl and config.json)")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="image to write (.png, .pdf, .svg); default RUN_DIR/curves.png for one "
                        "run, curves.png for several")
    try:
        args = p.parse_args(argv)
        note = missing_matplotlib()
        # a package the command needs, as bench.py --plot and the trainer's --tensorboard: exit 2
        if note:
            raise UserError(note)
        out = args.out
        if not out:
            out = os.path.join(args.runs[0], "curves.png") if len(args.runs) == 1 else "curves.png"
        runs = [read_run(d) for d in args.runs]
        check_output_file(out, "--out")
        draw(runs, out)
    except (UserError, OSError) as e:
        return fail(e)
    for run in runs:
        (_, tr), (_, va), (_, hs) = run["train"], run["val"], run["hellaswag"]
        best = lambda v, f: f"{f(v):.4f}" if v else "-"  # noqa: E731
        print(f"{run['name']}: {len(tr)} steps logged | min val loss {best(va, min)} | "
              f"max HellaSwag acc_norm {best(hs, max)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
