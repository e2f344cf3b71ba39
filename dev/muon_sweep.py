"""AdamW vs Muon on CPU: val loss against tokens, each at its best lr from a sweep, at two tiny scales.

    nice python dev/muon_sweep.py                 # the sweep; appends each run to dev/results/muon_cpu.json
    python dev/muon_sweep.py --report             # best runs, token ratio, ms/step, plot (muon_cpu.png)

Same step as the trainer: one (B, T) batch, then optim.optimizer_step (the trainer's: every group's
lr = base_lr x the warmup + cosine scale, clip 1.0 over all parameters, each optimizer steps), val loss
from the start of the val split. Runs already in the JSON are
skipped, so a stopped sweep continues where it was."""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt2train import data  # noqa: E402
from gpt2train import optim  # noqa: E402
from gpt2train import precision  # noqa: E402
from gpt2train.logger import redirect0  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "muon_cpu.json")
DATA_DIR = os.path.join(os.path.dirname(HERE), "data", "muon_bench_python")  # own copy: no race with other runs

# (a) the quickstart corpus in GPT-2 tokens (vocab 50304), the quickstart's 160 steps of 1,024 tokens, at 4 x 128;
# (b) 6 x 192 on the same text as bytes (vocab 256: the 50304-way head would be 80% of a step, and a shared
# 2-core CPU has no time for it), 4x the batch, 0.52M tokens seen
SCALES = {
    "a": dict(corpus="gpt2", vocab_size=50304, n_layer=4, n_head=4, n_embd=128, B=8, T=128, steps=160, warmup=16,
              eval_every=10, val_rows=72, adamw=[3e-3, 6e-3, 1.2e-2], muon=[6e-3, 1.2e-2, 2.4e-2]),
    "b": dict(corpus="bytes", vocab_size=256, n_layer=6, n_head=6, n_embd=192, B=16, T=256, steps=128, warmup=13,
              eval_every=8, val_rows=24, adamw=[2e-3, 4e-3, 8e-3], muon=[4e-3, 8e-3, 1.6e-2]),
}
SEED = 1337
STOP_AT = None  # "HH:MM": no run starts after it


class ByteCorpus:
    """The quickstart corpus's text (help topics, stdlib sources) as bytes: every 100th 64 KiB block is val.
    train: rows at random offsets (seeded); val: consecutive rows from its start. TokenLoader's two methods."""
    text = None

    def __init__(self, split, B, T, seed=SEED):
        if ByteCorpus.text is None:
            src = os.path.join(DATA_DIR, "source")
            files = [os.path.join(src, f) for f in sorted(os.listdir(src))] + data.python_sources()
            raw = b"\n\n".join(open(f, "rb").read() for f in files)
            blocks = [raw[i:i + 65536] for i in range(0, len(raw), 65536)]
            ByteCorpus.text = {k: torch.frombuffer(bytearray(b"".join(b for j, b in enumerate(blocks)
                                                                     if (j % 100 == 99) == (k == "val"))),
                                                   dtype=torch.uint8) for k in ("train", "val")}
        self.data, self.B, self.T, self.split = ByteCorpus.text[split], B, T, split
        self.gen = torch.Generator().manual_seed(seed)
        self.reset()

    def reset(self):
        self.pos = 0

    def next_batch(self):
        B, T = self.B, self.T
        if self.split == "train":
            starts = torch.randint(0, len(self.data) - T - 1, (B,), generator=self.gen)
        else:
            starts = torch.arange(B) * T + self.pos
            self.pos += B * T
        rows = torch.stack([self.data[i:i + T + 1] for i in starts.tolist()]).long()  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def lr_scale(step, steps, warmup, min_ratio=0.1):
    """optim.lr_multiplier with its own steps: linear warmup, cosine to min_lr = max_lr / 10 (the quickstart's)."""
    if step < warmup:
        return (step + 1) / warmup
    ratio = (step - warmup) / (steps - warmup)
    return min_ratio + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1 - min_ratio)


@torch.no_grad()
def val_loss(model, loader, rows):
    model.eval()
    loader.reset()
    total, n = 0.0, 0
    while n < rows:
        x, y = loader.next_batch()
        total += model(x, y)[1].item() * x.size(0)
        n += x.size(0)
    model.train()
    return total / n


def run(scale, kind, lr, muon_lr):
    s = SCALES[scale]
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"], block_size=s["T"],
                          vocab_size=s["vocab_size"]))
    with redirect0(None):
        opts = optim.build_optimizers(model, kind, lr=lr, weight_decay=0.1, muon_lr=muon_lr or optim.MUON_LR)
    if s["corpus"] == "bytes":
        train, val = ByteCorpus("train", s["B"], s["T"]), ByteCorpus("val", 8, s["T"])
    else:
        train = data.TokenLoader(DATA_DIR, "train", s["B"], s["T"], data.Sampling(seed=SEED))
        val = data.TokenLoader(DATA_DIR, "val", 8, s["T"], data.Sampling(shuffle=False))
    tokens_per_step = s["B"] * s["T"]
    curve, train_losses, step_ms, opt_ms = [[0, val_loss(model, val, s["val_rows"])]], [], [], []
    scaler, params = torch.amp.GradScaler("cpu", enabled=False), list(model.parameters())
    stepping = optim.Stepping(precision.default_plan("cpu"), scaler, opts, params)  # fp32, eager
    for step in range(s["steps"]):
        t0 = time.perf_counter()
        x, y = train.next_batch()
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        stepped = optim.optimizer_step(stepping, lr_scale(step, s["steps"], s["warmup"]),
                                       loss.detach())  # the trainer's step: lrs, clip, update
        t2 = time.perf_counter()
        train_losses.append(stepped.loss)
        step_ms.append(1e3 * (t2 - t0))
        opt_ms.append(1e3 * (t2 - t1))
        if (step + 1) % s["eval_every"] == 0 or step + 1 == s["steps"]:
            curve.append([(step + 1) * tokens_per_step, val_loss(model, val, s["val_rows"])])
            print(f"  {scale} {kind} lr {lr:g} muon_lr {muon_lr} step {step + 1}: val {curve[-1][1]:.4f} "
                  f"({statistics.median(step_ms[1:] or step_ms):.0f} ms/step)", flush=True)
    return dict(scale=scale, optimizer=kind, lr=lr, muon_lr=muon_lr, curve=curve, final_val=curve[-1][1],
                train_loss=train_losses, ms_per_step=statistics.median(step_ms[1:]),
                opt_ms_per_step=statistics.median(opt_ms[1:]), tokens_per_step=tokens_per_step,
                config={k: v for k, v in s.items() if k not in ("adamw", "muon")})


def timing(scale, steps=24):
    """ms/step and ms of optimizer.step, adamw and muon alternating step by step (a shared CPU's load hits both)."""
    s = SCALES[scale]
    models, opts, ms = {}, {}, {k: ([], []) for k in ("adamw", "muon")}
    scaler, plan = torch.amp.GradScaler("cpu", enabled=False), precision.default_plan("cpu")
    for kind in ms:
        torch.manual_seed(SEED)
        models[kind] = GPT(GPTConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                                     block_size=s["T"], vocab_size=s["vocab_size"]))
        with redirect0(None):
            opts[kind] = optim.build_optimizers(models[kind], kind, lr=1e-3, muon_lr=1e-3)
    steppings = {kind: optim.Stepping(plan, scaler, opts[kind], list(models[kind].parameters())) for kind in ms}
    x = torch.randint(0, s["vocab_size"], (s["B"], s["T"] + 1), generator=torch.Generator().manual_seed(SEED))
    for step in range(steps + 2):
        for kind in ms:
            t0 = time.perf_counter()
            _, loss = models[kind](x[:, :-1], x[:, 1:])
            loss.backward()
            t1 = time.perf_counter()
            optim.optimizer_step(steppings[kind], 1.0, loss.detach())
            t2 = time.perf_counter()
            if step >= 2:  # warm-up
                ms[kind][0].append(1e3 * (t2 - t0))
                ms[kind][1].append(1e3 * (t2 - t1))
    return {k: dict(ms_per_step=statistics.median(a), opt_ms_per_step=statistics.median(b)) for k, (a, b) in ms.items()}


def load():
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            return json.load(f)
    return {"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(), "seed": SEED,
                     "muon": "optim.Muon (torch.optim.Muon, adjust_lr_fn=match_rms_adamw, Newton-Schulz in fp32), "
                             "momentum 0.95, weight decay 0.1; AdamW on the rest at the best AdamW lr",
                     "data": "the quickstart corpus (data.prepare_python_corpus): a in GPT-2 tokens, b as bytes"},
            "runs": []}


def save(results):
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(RESULTS + ".tmp", RESULTS)


def best(runs, scale, kind):
    rs = [r for r in runs if r["scale"] == scale and r["optimizer"] == kind]
    return min(rs, key=lambda r: r["final_val"]) if rs else None


def sweep(results, scale, kind, grid, adamw_lr=None):
    """Each lr of grid, then one more beyond the grid's edge when the best sits on it."""
    key = "lr" if kind == "adamw" else "muon_lr"
    done = lambda v: any(r["scale"] == scale and r["optimizer"] == kind and r[key] == v  # noqa: E731
                         for r in results["runs"])
    grid = list(grid)
    for i in range(len(grid) + 1):
        if i == len(grid):
            b = best(results["runs"], scale, kind)[key]
            edge = b * 2 if b == max(grid) else b / 2 if b == min(grid) else None
            if edge is None or done(edge):
                return
            grid.append(edge)
        v = grid[i]
        if done(v):
            continue
        if STOP_AT and time.strftime("%H:%M") >= STOP_AT:
            print(f"skipped: scale {scale}, {kind}, {key} {v:g} (past --stop_at {STOP_AT})", flush=True)
            return
        print(f"run: scale {scale}, {kind}, {key} {v:g}", flush=True)
        lr, muon_lr = (v, None) if kind == "adamw" else (adamw_lr, v)
        results["runs"].append(run(scale, kind, lr, muon_lr))
        save(results)


def tokens_to_reach(curve, target):
    """The first tokens at which the (linearly interpolated) val curve reaches target, else None."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1) if v0 > target else t0
    return None


def report(results, plot_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scales = [s for s in SCALES if best(results["runs"], s, "adamw") and best(results["runs"], s, "muon")]
    fig, axes = plt.subplots(1, max(1, len(scales)), figsize=(6 * max(1, len(scales)), 4.5), squeeze=False)
    lines = []
    for ax, s in zip(axes[0], scales):
        a, m = best(results["runs"], s, "adamw"), best(results["runs"], s, "muon")
        reach = tokens_to_reach(m["curve"], a["final_val"])
        total = a["curve"][-1][0]
        c = SCALES[s]
        lines.append(dict(scale=s, model=f"{c['n_layer']} x {c['n_embd']}", tokens=total,
                          adamw_lr=a["lr"], adamw_val=a["final_val"], muon_lr=m["muon_lr"], muon_val=m["final_val"],
                          muon_tokens_to_adamw_final=reach, ratio=reach / total if reach else None,
                          adamw_ms=a["ms_per_step"], muon_ms=m["ms_per_step"],
                          adamw_opt_ms=a["opt_ms_per_step"], muon_opt_ms=m["opt_ms_per_step"],
                          sweep={k: {r["lr" if k == "adamw" else "muon_lr"]: round(r["final_val"], 4)
                                     for r in results["runs"] if r["scale"] == s and r["optimizer"] == k}
                                 for k in ("adamw", "muon")}))
        for r in results["runs"]:
            if r["scale"] != s:
                continue
            on_best = r is a or r is m
            label = f"{r['optimizer']} lr {r['lr' if r['optimizer'] == 'adamw' else 'muon_lr']:g}"
            ax.plot(*zip(*r["curve"][1:]), color="C0" if r["optimizer"] == "adamw" else "C3",
                    alpha=1.0 if on_best else 0.25, lw=2 if on_best else 1,
                    label=label + (" (best)" if on_best else ""))
        ax.axhline(a["final_val"], color="gray", ls=":", lw=1)
        ax.set_title(f"{s}: {c['n_layer']} x {c['n_embd']}, vocab {c['vocab_size']}, {c['B']} x {c['T']} tokens/step",
                     fontsize=9)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("val loss")
        ax.set_ylim(top=min(7.0, max(r["curve"][1][1] for r in results["runs"] if r["scale"] == s)))
        ax.legend(fontsize=7)
    fig.suptitle("AdamW vs Muon (hidden matrices) on CPU, quickstart corpus (a: GPT-2 tokens, b: bytes): "
                 "val loss vs tokens")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    results["summary"] = lines
    save(results)
    print(json.dumps(lines, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="ab")
    p.add_argument("--report", action="store_true", help="summarize and plot the runs in the JSON")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timing", action="store_true", help="alternating adamw/muon steps: the step-time overhead")
    p.add_argument("--stop_at", help="HH:MM local time after which no further run starts (the report still runs)")
    args = p.parse_args()
    global STOP_AT
    STOP_AT = args.stop_at
    results = load()
    if args.report:
        return report(results, RESULTS.replace(".json", ".png"))
    torch.set_num_threads(args.threads)
    if args.timing:
        results["timing"] = {s: timing(s) for s in args.scales}
        results["timing"]["threads"] = args.threads
        print(json.dumps(results["timing"], indent=1))
        return save(load() | {"timing": results["timing"]})  # the sweep may have written runs meanwhile
    data.prepare_python_corpus(DATA_DIR)
    for s in args.scales:
        sweep(results, s, "adamw", SCALES[s]["adamw"])
        sweep(results, s, "muon", SCALES[s]["muon"], adamw_lr=best(results["runs"], s, "adamw")["lr"])
    report(results, RESULTS.replace(".json", ".png"))


if __name__ == "__main__":
    main()
