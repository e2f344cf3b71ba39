"""Issue 33's recipe on CPU: tuned AdamW, today's Muon, each lever on top of Muon, the adopted combination;
two byte-level models trained to >= 10 tokens per non-embedding parameter.

    python dev/recipe.py --calibrate               # seconds per run of each candidate size (pick SIZES)
    nice python dev/recipe.py --phase adamw_sweep  # then muon_sweep, ablate, combo, budget, scaling, transfer
    python dev/recipe.py --report                  # dev/recipe.md: tables, token ratios, the plot
    # 2 cores: one process a size, each with its own JSON, then one JSON of all:
    python dev/recipe.py --sizes large --phase all --results /tmp/large.json &
    python dev/recipe.py --sizes small --phase all --results /tmp/small.json; wait
    python dev/recipe.py --merge /tmp/small.json /tmp/large.json --report
    python dev/recipe.py --smoke                   # every phase at a tiny size, 3 steps, into a temp JSON

Each run is the trainer's own step (optim.build_optimizers with the run's keys, optim.accumulate_gradients,
optim.optimizer_step at optim.lr_multiplier(step, cfg) with Muon's optim.muon_momentum(step, cfg)) on the
quickstart's text as bytes (vocab 256: Python's help topics and stdlib sources; every 100th 64 KiB block is
val). The budget phase gives a run only a share of the tokens (its whole schedule fitted into them) and walks a
ladder of shares until the one that reaches the tuned AdamW's final val loss is bracketed. Every run is appended
to the JSON as it ends; a run already there is skipped, so a stopped phase continues where it was. A best lr at
the edge of its sweep extends the sweep (x2 or /2) until bracketed."""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt2train import data, optim, precision  # noqa: E402
from gpt2train.config import Config  # noqa: E402
from gpt2train.logger import redirect0  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "recipe_cpu.json")
REPORT = os.path.join(HERE, "recipe.md")
TOKENS_PER_PARAM = 10  # the floor, per non-embedding parameter
# candidate sizes for --calibrate; SIZES: the two picked from it (~2-3 and ~5-6 min a run on 2 cores)
CANDIDATES = {f"{L}x{C}": dict(n_layer=L, n_head=max(1, C // 32), n_embd=C) for L, C in
              ((3, 64), (4, 64), (3, 96), (4, 96), (4, 128))}
SIZES = {"small": CANDIDATES["4x64"], "large": CANDIDATES["4x96"]}  # --calibrate, 1 thread: ~1.6 and ~5.9 min a run
B, T = 16, 256  # rows x bytes a step: 4,096 tokens
BASE = dict(warmup_frac=0.04, min_ratio=0.1, weight_decay=0.1)  # build-nanogpt's shape: warmup, cosine to 0.1x
GRIDS = {"adamw": [1e-3, 2e-3, 4e-3, 8e-3], "muon": [4e-3, 8e-3, 1.6e-2], "original": [1.2e-2, 2.5e-2, 5e-2]}
ORIGINAL = dict(muon_scaling="original")  # --phase scaling: Muon's lr on torch's original scale
LEVERS = {  # each on top of today's Muon, alone (ablate), the adopted ones together (combo)
    "linear_d2z": dict(lr_schedule="linear", min_ratio=0.0),
    "wsd_d2z": dict(lr_schedule="wsd", cooldown_frac=0.2, min_ratio=0.0),
    "split_qkv": dict(muon_split_qkv=True),
    "momentum_warmup": dict(momentum_warmup_frac=0.1),
    "zero_init_proj": dict(zero_init_proj=True),
    "embed_lr_3x": dict(embed_lr_mult=3.0),
    "scalar_lr_3x": dict(scalar_lr_mult=3.0),
}
SEEDS = (0, 1)
LADDER = (0.125, 0.177, 0.25, 0.354, 0.5, 0.707, 1.0)  # budgets, a share of a size's tokens, sqrt(2) apart
SMOKE = dict(sizes={"small": dict(n_layer=1, n_head=1, n_embd=16), "large": dict(n_layer=2, n_head=1, n_embd=16)},
             B=2, T=32, steps=3, files=20, val_rows=2, max_extend=1)
STATE = dict(sizes=SIZES, B=B, T=T, steps=None, files=None, val_rows=64, max_extend=6, results=RESULTS)  # --smoke: its


class ByteText:
    """The quickstart's text (help topics, stdlib sources) as bytes, every 100th 64 KiB block val; train rows at
    seeded random offsets, val rows consecutive from its start. TokenLoader's next_batch(device)."""
    cache = {}

    def __init__(self, split, B, T, seed=0):
        if not ByteText.cache:
            from pydoc_data.topics import topics
            parts = [t.encode() for _, t in sorted(topics.items())]
            parts += [open(f, "rb").read() for f in data.python_sources()[:STATE["files"]]]
            raw = b"\n\n".join(parts)
            size = min(65536, len(raw) // 400)  # 64 KiB; a smoke run's small text: smaller, so that val holds some
            blocks = [raw[i:i + size] for i in range(0, len(raw), size)]
            for k in ("train", "val"):
                kept = b"".join(b for j, b in enumerate(blocks) if (j % 100 == 99) == (k == "val"))
                ByteText.cache[k] = torch.frombuffer(bytearray(kept), dtype=torch.uint8)
        self.data, self.B, self.T, self.split, self.pos = ByteText.cache[split], B, T, split, 0
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self, device="cpu"):
        if self.split == "train":
            starts = torch.randint(0, len(self.data) - self.T - 1, (self.B,), generator=self.gen).tolist()
        else:
            starts = [(self.pos + i * self.T) % (len(self.data) - self.T - 1) for i in range(self.B)]
            self.pos += self.B * self.T
        rows = torch.stack([self.data[i:i + self.T + 1] for i in starts]).long()  # (B, T+1)
        return rows[:, :-1].to(device), rows[:, 1:].to(device)


def non_embedding_params(model):
    embeddings = ("transformer.wte.", "transformer.wpe.")  # (wte is lm_head too: 256 x C, small)
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith(embeddings))


def make_model(size, seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=STATE["T"], vocab_size=256, **size))


def run_steps(size):
    """Steps that give >= TOKENS_PER_PARAM tokens per non-embedding parameter (--smoke: its 3)."""
    if STATE["steps"]:
        return STATE["steps"]
    n = non_embedding_params(make_model(size, 0))
    return -(-TOKENS_PER_PARAM * n // (STATE["B"] * STATE["T"]))


def schedule_config(steps, lr, keys):
    """The trainer's Config for the run's schedule and Muon momentum: what lr_multiplier / muon_momentum read."""
    warm = keys.get("momentum_warmup_frac", 0.0)
    return dataclasses.replace(Config(), max_steps=steps, warmup_steps=max(1, round(BASE["warmup_frac"] * steps)),
                               max_lr=lr, min_lr=lr * keys.get("min_ratio", BASE["min_ratio"]),
                               lr_schedule=keys.get("lr_schedule", "cosine"),
                               cooldown_frac=keys.get("cooldown_frac", 0.2),
                               muon_momentum_warmup=round(warm * steps))


@torch.no_grad()
def val_loss(model, plan):
    model.eval()
    loader, total = ByteText("val", STATE["B"], STATE["T"]), 0.0
    n = max(1, STATE["val_rows"] // STATE["B"])  # the same rows from val's start every time
    for _ in range(n):
        total += model(*loader.next_batch())[1].item()
    model.train()
    return total / n


def run(name, optimizer, lr, muon_lr, keys, seed, budget=1.0):
    """One training run: its curve of (tokens, val loss) and its numbers, as a JSON-able dict. budget: the share
    of the size's tokens this run is given, its whole schedule (warmup, decay) fitted into them."""
    size = STATE["sizes"][name]
    steps = max(1, round(budget * run_steps(size)))
    model = make_model(size, seed)
    if keys.get("zero_init_proj"):
        model.zero_init_projections()
    with redirect0(None):
        opts = optim.build_optimizers(model, optimizer, lr=lr, weight_decay=BASE["weight_decay"],
                                      muon_lr=muon_lr or optim.MUON_LR,
                                      muon_split_qkv=keys.get("muon_split_qkv", False),
                                      embed_lr_mult=keys.get("embed_lr_mult", 1.0),
                                      scalar_lr_mult=keys.get("scalar_lr_mult", 1.0),
                                      muon_scaling=keys.get("muon_scaling", "match_rms_adamw"))
    cfg, plan = schedule_config(steps, lr, keys), precision.make_plan("cpu", "fp32")
    scaler, params = torch.amp.GradScaler("cpu", enabled=False), list(model.parameters())
    train, tok = ByteText("train", STATE["B"], STATE["T"], seed), STATE["B"] * STATE["T"]
    every = max(1, steps // 20)
    curve, t0 = [[0, val_loss(model, plan)]], time.perf_counter()
    stepping = optim.Stepping(plan, scaler, opts, params)
    for step in range(steps):
        loss = optim.accumulate_gradients(model, train, 1, stepping)
        optim.optimizer_step(stepping, optim.lr_multiplier(step, cfg), loss,
                             momentum=optim.muon_momentum(step, cfg))  # the trainer's step
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append([(step + 1) * tok, val_loss(model, plan)])
    seconds = time.perf_counter() - t0
    print(f"  {name} {optimizer} lr {lr:g} muon_lr {muon_lr} {sorted(keys)} seed {seed}: val {curve[-1][1]:.4f} "
          f"({seconds:.0f} s)", flush=True)
    return dict(size=name, optimizer=optimizer, lr=lr, muon_lr=muon_lr, keys=keys, seed=seed, budget=budget,
                steps=steps, tokens=steps * tok, params=non_embedding_params(model), curve=curve,
                final_val=curve[-1][1], seconds=seconds, model=size)

# -----------------------------------------------------------------------------
# the JSON: runs appended as they end, looked up by what they ran


def read(path):
    """A results JSON; a run from before the budget phase ran the whole budget (1.0)."""
    with open(path) as f:
        results = json.load(f)
    for r in results["runs"]:
        r.setdefault("budget", 1.0)
    return results


def load():
    if os.path.exists(STATE["results"]):
        return read(STATE["results"])
    return {"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(), "B": STATE["B"],
                     "T": STATE["T"], "tokens_per_param": TOKENS_PER_PARAM, "base": BASE}, "runs": []}


def save(results):
    os.makedirs(os.path.dirname(STATE["results"]) or ".", exist_ok=True)
    with open(STATE["results"] + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(STATE["results"] + ".tmp", STATE["results"])


def identity(r):
    """What a run ran: two runs with the same identity are the same run (runs are deterministic)."""
    return (r["size"], r["optimizer"], r["lr"], r["muon_lr"], json.dumps(r["keys"], sort_keys=True), r["seed"],
            r["budget"])


def find(results, name, optimizer, lr, muon_lr, keys, seed, budget=1.0):
    want = (name, optimizer, lr, muon_lr, json.dumps(keys, sort_keys=True), seed, budget)
    return next((r for r in results["runs"] if identity(r) == want), None)


def get(results, name, optimizer, lr, muon_lr=None, keys=None, seed=0, budget=1.0):
    """The run from the JSON, or run it now and append it."""
    keys = keys or {}
    r = find(results, name, optimizer, lr, muon_lr, keys, seed, budget)
    if r is None:
        r = run(name, optimizer, lr, muon_lr, keys, seed, budget)
        results["runs"].append(r)
        save(results)
    return r


def merge(results, paths):
    """--merge: the runs of other JSONs (one process a size on a 2-core CPU) not already in results."""
    have = {identity(r) for r in results["runs"]}
    for path in paths:
        other = read(path)
        if "adopted" in other:
            results.setdefault("adopted", other["adopted"])
        for r in other["runs"]:
            if identity(r) not in have:
                results["runs"].append(r)
                have.add(identity(r))
    save(results)


def best(results, name, optimizer, keys=None, seed=0):
    rs = [r for r in results["runs"] if r["size"] == name and r["optimizer"] == optimizer
          and r["keys"] == (keys or {}) and r["seed"] == seed and r["budget"] == 1.0]
    return min(rs, key=lambda r: r["final_val"]) if rs else None

# -----------------------------------------------------------------------------
# the phases


def sweep(results, name, optimizer, grid, adamw_lr=None, keys=None):
    """Each value of grid (lr for AdamW, muon_lr for Muon), then x2 / /2 while the best sits on the edge
    (at most max_extend times)."""
    grid, max_extend = sorted(grid), STATE["max_extend"]
    value = (lambda r: r["lr"]) if optimizer == "adamw" else (lambda r: r["muon_lr"])  # noqa: E731
    for _ in range(max_extend + 1):
        vals = {v: get(results, name, optimizer, *((v, None) if optimizer == "adamw" else (adamw_lr, v)), keys)
                for v in grid}
        b = min(vals, key=lambda v: vals[v]["final_val"])
        if grid[0] < b < grid[-1]:
            return value(vals[b])
        grid = grid + [b * 2] if b == grid[-1] else [b / 2] + grid
    return value(vals[b])  # not bracketed within max_extend: the report says so


def adamw_sweep(results):
    for name in STATE["sizes"]:
        sweep(results, name, "adamw", GRIDS["adamw"])


def muon_sweep(results):
    for name in STATE["sizes"]:
        sweep(results, name, "muon", GRIDS["muon"], adamw_lr=needed(results, name, "adamw")["lr"])


def needed(results, name, optimizer):
    r = best(results, name, optimizer)
    if r is None:
        sys.exit(f"error: no {optimizer} run at size {name} in {STATE['results']}: run --phase {optimizer}_sweep first")
    return r


def muon_base(results, name):
    """(AdamW's lr, Muon's lr) of today's Muon at its best: the base every lever goes on top of."""
    m = needed(results, name, "muon")
    return m["lr"], m["muon_lr"]


def ablate(results, name="small"):
    if name not in STATE["sizes"]:
        return
    lr, muon_lr = muon_base(results, name)
    for seed in SEEDS:
        get(results, name, "muon", lr, muon_lr, {}, seed)
        for keys in LEVERS.values():
            get(results, name, "muon", lr, muon_lr, keys, seed)


def ablation(results, name="small"):
    """{lever: (per-seed deltas vs the base, mean delta, the seed spread, adopted)}: a lever is adopted when both
    seeds improve and its mean gain beats the larger of the base's and the lever's own seed spread."""
    lr, muon_lr = muon_base(results, name)
    base = [find(results, name, "muon", lr, muon_lr, {}, s) for s in SEEDS]
    rows = {}
    for lever, keys in LEVERS.items():
        on = [find(results, name, "muon", lr, muon_lr, keys, s) for s in SEEDS]
        if None in base or None in on:
            continue
        deltas = [a["final_val"] - b["final_val"] for a, b in zip(on, base)]
        spread = max(abs(base[0]["final_val"] - base[1]["final_val"]), abs(on[0]["final_val"] - on[1]["final_val"]))
        mean = statistics.mean(deltas)
        rows[lever] = (deltas, mean, spread, all(d < 0 for d in deltas) and -mean > spread)
    return rows


def adopted_keys(results, adopt=None):
    """The adopted levers' keys merged (--adopt names them, else the ablation's verdict); of two schedules, the
    better one."""
    rows = ablation(results)
    names = adopt if adopt is not None else [k for k, row in rows.items() if row[3]]
    schedules = [n for n in names if "lr_schedule" in LEVERS[n]]
    if len(schedules) > 1:
        keep = min(schedules, key=lambda n: rows[n][1] if n in rows else 0.0)
        names = [n for n in names if n not in schedules or n == keep]
    merged = {}
    for n in names:
        merged.update(LEVERS[n])
    return names, merged


def combo(results, adopt=None):
    names, keys = adopted_keys(results, adopt)
    print(f"combo: {', '.join(names) or 'no lever adopted: today Muon'}", flush=True)
    for name in STATE["sizes"]:
        a = needed(results, name, "adamw")
        lr, muon_lr = muon_base(results, name)
        for seed in SEEDS:
            get(results, name, "adamw", a["lr"], None, {}, seed)  # the tuned baseline at both seeds
            get(results, name, "muon", lr, muon_lr, keys, seed)
    results["adopted"] = dict(levers=names, keys=keys)
    save(results)


def target(results, name):
    """The tuned AdamW's final val loss at this size, the mean of its seeds: what 'reaching AdamW' means."""
    a = best(results, name, "adamw")
    finals = [r["final_val"] for r in (find(results, name, "adamw", a["lr"], None, {}, s) for s in SEEDS) if r]
    return statistics.mean(finals)


def budget_walk(results, name, lr, muon_lr, keys, seed, lookup):
    """(the largest budget on LADDER that misses the target, the smallest that reaches it) as (budget, final val)
    pairs, walking the ladder from 0.354 (down while it reaches, up while it misses); a side is None where the
    ladder ends (or, with lookup=find, where a run is not in the JSON)."""
    goal, i = target(results, name), LADDER.index(0.354)
    r = lookup(results, name, "muon", lr, muon_lr, keys, seed, LADDER[i])
    if r is None:
        return None, None
    step = -1 if r["final_val"] <= goal else 1
    prev = (LADDER[i], r["final_val"])
    while 0 <= i + step < len(LADDER):
        i += step
        r = lookup(results, name, "muon", lr, muon_lr, keys, seed, LADDER[i])
        if r is None:
            break
        here = (LADDER[i], r["final_val"])
        if (r["final_val"] <= goal) == (step == 1):  # crossed the target: bracketed
            return (prev, here) if step == 1 else (here, prev)
        prev = here
    return (prev, None) if step == 1 else (None, prev)


def budget_ratio(results, name, lr, muon_lr, keys, seed):
    """The budget (a share of AdamW's tokens) at which a run given only that many tokens ends at the target,
    interpolated in log budget between the bracketing runs; None where not bracketed."""
    miss, reach = budget_walk(results, name, lr, muon_lr, keys, seed, find)
    if miss is None or reach is None:
        return None
    goal, (b0, v0), (b1, v1) = target(results, name), miss, reach
    return math.exp(math.log(b0) + (math.log(b1) - math.log(b0)) * (v0 - goal) / (v0 - v1))


def budgets(results):
    """Today's Muon (seed 0) and the combination (both seeds) at every size, each run with its whole schedule in a
    share of the tokens, until the share that reaches the tuned AdamW's final val loss is bracketed."""
    keys = results.get("adopted", {}).get("keys")
    if keys is None:
        sys.exit(f"error: no adopted combination in {STATE['results']}: run --phase combo first")
    for name in STATE["sizes"]:
        lr, muon_lr = muon_base(results, name)
        for k, seeds in (({}, SEEDS[:1]), (keys, SEEDS)):
            for seed in seeds:
                budget_walk(results, name, lr, muon_lr, k, seed, get)


def scaling(results, name="small"):
    """Muon's lr on torch's original scale (max(1, A/B)^0.5 a matrix: mlp.c_proj gets half match_rms_adamw's share)
    at its own best lr from a bracketed sweep, seed 0 then its best at seed 1, against today's (match_rms_adamw)."""
    if name not in STATE["sizes"]:
        return
    lr, muon_lr = muon_base(results, name)
    best_lr = sweep(results, name, "muon", GRIDS["original"], adamw_lr=lr, keys=ORIGINAL)
    get(results, name, "muon", lr, best_lr, ORIGINAL, 1)
    get(results, name, "muon", lr, muon_lr, {}, 1)


def transfer(results, small="small"):
    """Do the levers carry over? At every other size: each lever alone (seed 0), today's Muon at seed 1 (the spread
    there), the schedule lever's budget walk, and the combination at half AdamW's lr (a retune, both seeds, with its
    budget walks)."""
    keys = results.get("adopted", {}).get("keys")
    for name in [n for n in STATE["sizes"] if n != small]:
        lr, muon_lr = muon_base(results, name)
        get(results, name, "muon", lr, muon_lr, {}, 1)
        for lever in LEVERS.values():
            get(results, name, "muon", lr, muon_lr, lever, 0)
        budget_walk(results, name, lr, muon_lr, LEVERS["wsd_d2z"], 0, get)
        for seed in SEEDS if keys else ():
            get(results, name, "muon", lr / 2, muon_lr, keys, seed)
            budget_walk(results, name, lr / 2, muon_lr, keys, seed, get)


PHASES = {"adamw_sweep": adamw_sweep, "muon_sweep": muon_sweep, "ablate": ablate, "combo": combo, "budget": budgets,
          "scaling": scaling, "transfer": transfer}

# -----------------------------------------------------------------------------
# calibration and the report


def calibrate(steps=4):
    """Seconds per Muon step (the heavier) of each candidate size, and a run's projected time at
    TOKENS_PER_PARAM tokens per non-embedding parameter."""
    plan, scaler = precision.make_plan("cpu", "fp32"), torch.amp.GradScaler("cpu", enabled=False)
    rows = []
    for name, size in CANDIDATES.items():
        model = make_model(size, 0)
        with redirect0(None):
            opts = optim.build_optimizers(model, "muon", lr=1e-3)
        loader, times = ByteText("train", STATE["B"], STATE["T"]), []
        stepping = optim.Stepping(plan, scaler, opts, list(model.parameters()))
        for i in range(steps + 1):
            t0 = time.perf_counter()
            loss = optim.accumulate_gradients(model, loader, 1, stepping)
            optim.optimizer_step(stepping, 1.0, loss)
            if i:  # the first step warms up
                times.append(time.perf_counter() - t0)
        s, n = statistics.median(times), run_steps(size)
        rows.append(dict(size=name, params=non_embedding_params(model), steps=n, s_per_step=s, s_per_run=s * n * 1.05))
        print(f"{name}: {rows[-1]['params']:,} non-embedding params, {n} steps of {STATE['B'] * STATE['T']} tokens, "
              f"{1e3 * s:.0f} ms/step -> ~{s * n * 1.05 / 60:.1f} min a run (evals ~5%)", flush=True)
    return rows


def ratio(curve, target, total):
    sys.path.insert(0, HERE)
    from muon_sweep import tokens_to_reach
    reach = tokens_to_reach(curve, target)
    return reach / total if reach else None


def fmt(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


def times(x):
    return "n/a" if x is None else f"{x:.2f}x"


def sweep_lines(results):
    lines = ["| size | optimizer | lr -> final val (best in bold) | bracketed |", "|---|---|---|---|"]
    for name in STATE["sizes"]:
        for opt in ("adamw", "muon"):
            rs = sorted((r for r in results["runs"] if r["size"] == name and r["optimizer"] == opt and not r["keys"]
                         and r["seed"] == 0), key=lambda r: r["lr"] if opt == "adamw" else r["muon_lr"])
            if opt == "muon":
                rs = [r for r in rs if r["lr"] == (best(results, name, "adamw") or {}).get("lr")]
            if not rs:
                continue
            b = min(rs, key=lambda r: r["final_val"])
            key = "lr" if opt == "adamw" else "muon_lr"
            cells = ", ".join(("**{:g}: {:.4f}**" if r is b else "{:g}: {:.4f}").format(r[key], r["final_val"])
                              for r in rs)
            lines.append(f"| {name} | {opt} | {cells} | {'yes' if rs[0] is not b and rs[-1] is not b else 'NO'} |")
    return lines


def ablation_lines(results):
    lines = ["| lever (on top of Muon, small) | delta val, seed 0 / 1 | mean | seed spread | adopted |",
             "|---|---|---|---|---|"]
    for lever, (deltas, mean, spread, ok) in ablation(results).items():
        lines.append(f"| {lever} | {' / '.join(f'{d:+.4f}' for d in deltas)} | {mean:+.4f} | {spread:.4f} | "
                     f"{'yes' if ok else 'no'} |")
    return lines


def combo_lrs(results, name):
    """AdamW lrs the combination ran at, full length, at this size: muon_base's first (the protocol's), then any
    other (a retune at that size, reported as one)."""
    keys, base = results.get("adopted", {}).get("keys", {}), muon_base(results, name)[0]
    others = {r["lr"] for r in results["runs"] if r["size"] == name and r["optimizer"] == "muon" and r["keys"] == keys
              and keys and r["budget"] == 1.0 and r["lr"] != base}
    return [base, *sorted(others)]


def ratio_lines(results):
    """Two readings of 'tokens to reach the tuned AdamW': where the full run's val curve first crosses the target
    (mid-run the lr is still high, so this overstates a decaying schedule's need, WSD's most), and the share of the
    tokens a run needs when its whole schedule is fitted into that share (--phase budget; the issue's measure)."""
    keys = results.get("adopted", {}).get("keys", {})
    lines = ["| size | model | non-emb params | tokens (per param) | AdamW lr, final val (seeds) | "
             "today's Muon: curve / budget | combination, seeds 0 / 1: curve | combination, seeds 0 / 1: budget |",
             "|---|---|---|---|---|---|---|---|"]
    for name in STATE["sizes"]:
        a, m = best(results, name, "adamw"), best(results, name, "muon")
        if a is None or m is None:
            continue
        adamw = [find(results, name, "adamw", a["lr"], None, {}, s) for s in SEEDS]
        goal = target(results, name)
        today = (f"{times(ratio(m['curve'], goal, a['tokens']))} / "
                 f"{times(budget_ratio(results, name, m['lr'], m['muon_lr'], {}, 0))}")
        size = a["model"]
        for lr in combo_lrs(results, name):
            combos = [find(results, name, "muon", lr, m["muon_lr"], keys, s) for s in SEEDS]
            curve = " / ".join(times(c and ratio(c["curve"], goal, a["tokens"])) if c else "n/a" for c in combos)
            budget = " / ".join(times(budget_ratio(results, name, lr, m["muon_lr"], keys, s)) for s in SEEDS)
            at = "" if lr == m["lr"] else f" (combination at AdamW lr {lr:g})"
            lines.append(f"| {name}{at} | {size['n_layer']} x {size['n_embd']} | {a['params']:,} | {a['tokens']:,} "
                         f"({a['tokens'] / a['params']:.1f}) | {a['lr']:g}, "
                         f"{' / '.join(fmt(r and r['final_val']) for r in adamw)} | {today} | {curve} | {budget} |")
    return lines


def lever_name(keys, combo):
    """A run's keys as the lever that sets them, 'combination', or 'today's Muon'."""
    if not keys:
        return "today's Muon"
    if keys == combo:
        return "combination"
    return next((k for k, v in LEVERS.items() if v == keys), json.dumps(keys, sort_keys=True))


def transfer_lines(results, small="small", large="large"):
    """Each lever alone at the large size (where run), beside the small size's ablation: do they carry over?"""
    rows, m = ablation(results, small), best(results, large, "muon")
    if m is None or large not in STATE["sizes"]:
        return []
    base = [find(results, large, "muon", m["lr"], m["muon_lr"], {}, s) for s in SEEDS]
    lines = [f"| lever | {small}: mean delta (spread) | {large}: delta, seed 0 | adopted at {small} |",
             "|---|---|---|---|"]
    for lever, keys in LEVERS.items():
        on = find(results, large, "muon", m["lr"], m["muon_lr"], keys, 0)
        if on is None or base[0] is None or lever not in rows:
            continue
        _, mean, spread, ok = rows[lever]
        lines.append(f"| {lever} | {mean:+.4f} ({spread:.4f}) | {on['final_val'] - base[0]['final_val']:+.4f} | "
                     f"{'yes' if ok else 'no'} |")
    if all(base):
        lines += ["", f"Today's Muon at {large}, seeds 0 / 1: {base[0]['final_val']:.4f} / {base[1]['final_val']:.4f} "
                  f"(spread {abs(base[0]['final_val'] - base[1]['final_val']):.4f})."]
    return lines


def full_runs_lines(results, name="large"):
    """Every full-length Muon run at one size: lever or combination, AdamW's lr, seed, final val."""
    combo = results.get("adopted", {}).get("keys", {})
    rs = sorted((r for r in results["runs"] if r["size"] == name and r["optimizer"] == "muon"
                 and r["budget"] == 1.0), key=lambda r: (lever_name(r["keys"], combo), r["lr"],
                                                                  r["muon_lr"], r["seed"]))
    lines = ["| run | AdamW lr | muon_lr | seed | final val |", "|---|---|---|---|---|"]
    return lines + [f"| {lever_name(r['keys'], combo)} | {r['lr']:g} | {r['muon_lr']:g} | {r['seed']} | "
                    f"{r['final_val']:.4f} |" for r in rs]


def scaling_lines(results, name="small"):
    """Muon's lr scale: each sweep (seed 0) and each best at both seeds."""
    m = best(results, name, "muon")
    lines = ["| Muon's lr scale (small) | muon_lr -> final val, seed 0 | best: seeds 0 / 1 |", "|---|---|---|"]
    for label, keys in (("match_rms_adamw (today's)", {}), ("original", ORIGINAL)) if m else ():
        rs = sorted((r for r in results["runs"] if r["size"] == name and r["optimizer"] == "muon"
                     and r["keys"] == keys and r["seed"] == 0 and r["lr"] == m["lr"] and r["budget"] == 1),
                    key=lambda r: r["muon_lr"])
        if not rs:
            continue
        b = min(rs, key=lambda r: r["final_val"])
        seeds = [find(results, name, "muon", b["lr"], b["muon_lr"], keys, s) for s in SEEDS]
        cells = ", ".join(f"{r['muon_lr']:g}: {r['final_val']:.4f}" for r in rs)
        lines.append(f"| {label} | {cells} | "
                     f"{b['muon_lr']:g}: {' / '.join(fmt(r and r['final_val']) for r in seeds)} |")
    return lines


def budget_lines(results):
    """Every budget run: its share of the tokens and its final val loss, against the target."""
    lines = ["| size | run | seed | budget -> final val (target: the tuned AdamW's mean) |", "|---|---|---|---|"]
    keys = results.get("adopted", {}).get("keys", {})
    for name in STATE["sizes"]:
        m = best(results, name, "muon")
        if m is None or best(results, name, "adamw") is None:
            continue
        runs = [("today's Muon", {}, m["lr"])] + [(lever, k, m["lr"]) for lever, k in LEVERS.items()]
        runs += [("combination" + ("" if lr == m["lr"] else f" at AdamW lr {lr:g}"), keys, lr)
                 for lr in combo_lrs(results, name)]
        for label, k, lr in runs:
            for seed in SEEDS:
                rs = sorted((r for r in results["runs"] if r["size"] == name and r["optimizer"] == "muon"
                             and (r["lr"], r["muon_lr"], r["keys"], r["seed"]) == (lr, m["muon_lr"], k, seed)),
                            key=lambda r: r["budget"])
                if len(rs) > 1:
                    cells = ", ".join(f"{r['budget']:g}: {r['final_val']:.4f}" for r in rs)
                    lines.append(f"| {name} | {label} | {seed} | {cells} (target {target(results, name):.4f}) |")
    return lines


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(STATE["sizes"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    keys = results.get("adopted", {}).get("keys", {})
    for ax, name in zip(axes[0], names):
        a, m = best(results, name, "adamw"), best(results, name, "muon")
        shown = [(a, "AdamW (tuned)", "C0"), (m, "Muon (today)", "C3")]
        if m:
            shown += [(find(results, name, "muon", m["lr"], m["muon_lr"], keys, s), f"combination, seed {s}", "C2")
                      for s in SEEDS]
        for r, label, color in shown:
            if r:
                ax.plot(*zip(*r["curve"][1:]), label=label, color=color)
        if a:
            ax.axhline(a["final_val"], color="gray", ls=":", lw=1)
        ax.set(title=f"{name}: {STATE['sizes'][name]}", xlabel="tokens seen", ylabel="val loss (bytes)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results, md_path):
    png = os.path.splitext(STATE["results"])[0] + ".png"
    plot(results, png)
    adopted = results.get("adopted", {}).get("levers")
    text = ["# Issue 33's recipe on CPU: tuned AdamW, Muon, its levers, the combination", "",
            f"Written by `python dev/recipe.py --report` from `{os.path.relpath(STATE['results'], HERE)}` "
            f"(torch {results['meta']['torch']}, {results['meta']['threads']} threads, {STATE['B']} x {STATE['T']} "
            f"bytes a step).", "", f"![val loss against tokens]({os.path.relpath(png, os.path.dirname(md_path))})",
            "", "## Sweeps (seed 0)", "", *sweep_lines(results), "", "## Ablation", "", *ablation_lines(results), "",
            f"Adopted: {', '.join(adopted) if adopted else 'none yet'}.", "",
            "## The levers at the larger size", "", *transfer_lines(results), "",
            "Every full-length Muon run there:", "", *full_runs_lines(results), "",
            "## Muon's lr scale", "", *scaling_lines(results), "",
            "## Tokens to reach tuned AdamW's final val loss (mean of its seeds), as a share of AdamW's tokens", "",
            "*curve*: where the full-length run's val curve first crosses the target (mid-run its lr is still high, "
            "so this overstates what a decaying schedule needs, WSD's most). *budget*: the share of the tokens at "
            "which a run whose whole schedule (warmup, decay) is fitted into that share ends at the target, "
            "interpolated in log tokens between the two runs on the ladder that bracket it.", "",
            *ratio_lines(results), "", "### The budget runs", "", *budget_lines(results), ""]
    with open(md_path + ".tmp", "w") as f:
        f.write("\n".join(text))
    os.replace(md_path + ".tmp", md_path)
    print("\n".join(text))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=[*PHASES, "all"], help="run this phase (all: the seven in order)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="add these JSONs' runs (other processes') to --results")
    p.add_argument("--report", action="store_true", help="write the tables and the plot from the JSON")
    p.add_argument("--calibrate", action="store_true", help="time each candidate size; project a run's minutes")
    p.add_argument("--adopt", help="combo: these levers (comma-separated names of LEVERS), not the ablation's verdict")
    p.add_argument("--smoke", action="store_true", help="every phase, then the report, tiny sizes, 3 steps, temp files")
    p.add_argument("--results", help="the JSON (default dev/results/recipe_cpu.json; --smoke: a temp dir's)")
    p.add_argument("--md", help="the report (default dev/recipe.md; --smoke: beside its JSON)")
    p.add_argument("--sizes", help="only these sizes (comma-separated: small,large): one process a size, each with "
                   "its own --results, on a 2-core CPU")
    p.add_argument("--threads", type=int, default=1)  # on a shared 2-core CPU 1 beats 2 (3x64: 0.22 s vs 0.47 s)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        STATE.update(SMOKE)
        args.results = args.results or os.path.join(tempfile.mkdtemp(prefix="recipe_smoke_"), "recipe.json")
        args.phase, args.report = "all", True
        args.md = args.md or os.path.join(os.path.dirname(args.results), "recipe.md")
    STATE["results"], args.md = args.results or RESULTS, args.md or REPORT
    if args.sizes:
        STATE["sizes"] = {k: STATE["sizes"][k] for k in args.sizes.split(",")}
    if args.calibrate:
        return print(json.dumps(calibrate(), indent=1))
    results = load()
    if args.merge:
        merge(results, args.merge)
    adopt = args.adopt.split(",") if args.adopt else None
    for phase in (list(PHASES) if args.phase == "all" else [args.phase] if args.phase else []):
        print(f"phase {phase}", flush=True)
        PHASES[phase](results, adopt) if phase == "combo" else PHASES[phase](results)
    if args.report:
        report(results, args.md)


if __name__ == "__main__":
    main()
