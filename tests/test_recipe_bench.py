"""dev/recipe.py --smoke: every phase (AdamW and Muon sweeps, the ablation, the combination) and the report, at
tiny sizes and 3 steps, through the trainer's step; a second call finds every run in the JSON and runs none.

    python -m pytest -q tests/test_recipe_bench.py
"""
import json
import os
import subprocess
import sys

from conftest import ROOT


def smoke(results):
    res = subprocess.run([sys.executable, "dev/recipe.py", "--smoke", f"--results={results}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)  # (subprocess.run kills it at the timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_smoke_runs_every_phase_and_resumes(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    import recipe
    results = str(tmp_path / "recipe.json")
    out = smoke(results)
    runs = json.load(open(results))["runs"]
    assert all(r["steps"] == 3 and len(r["curve"]) == 4 for r in runs if r["budget"] == 1)
    for size in ("small", "large"):
        for opt in ("adamw", "muon"):
            swept = [r for r in runs if (r["size"], r["optimizer"], r["keys"], r["seed"]) == (size, opt, {}, 0)]
            assert len(swept) >= 3  # a bracketed sweep: the best has a neighbour on each side, or it was extended
        assert {r["seed"] for r in runs if r["size"] == size and r["optimizer"] == "adamw"} == {0, 1}  # combo's
    ablated = [r for r in runs if r["size"] == "small" and r["keys"] and r["budget"] == 1]
    for keys in recipe.LEVERS.values():
        assert sorted(r["seed"] for r in ablated if r["keys"] == keys) == [0, 1]
    md = open(tmp_path / "recipe.md").read()
    assert all(f"| {lever} |" in md for lever in recipe.LEVERS) and "## Tokens to reach tuned AdamW" in md
    assert os.path.getsize(tmp_path / "recipe.png") > 0 and "phase combo" in out and "phase budget" in out
    combo_keys = json.load(open(results))["adopted"]["keys"]
    for size in ("small", "large"):  # the budget phase: the combination at both seeds, at a share of the tokens
        short = [r for r in runs if r["size"] == size and r["keys"] == combo_keys and r["budget"] < 1]
        assert {r["seed"] for r in short} == {0, 1} and all(r["steps"] <= 3 for r in short)
    assert "### The budget runs" in md and "| original |" in md  # --phase scaling: torch's original lr scale
    large = [r for r in runs if r["size"] == "large" and r["budget"] == 1 and r["optimizer"] == "muon"]
    for keys in recipe.LEVERS.values():  # --phase transfer: each lever alone at the larger size
        assert any(r["keys"] == keys for r in large)
    assert "## The levers at the larger size" in md
    original = [r for r in runs if r["size"] == "small" and r["keys"] == recipe.ORIGINAL]
    assert len({r["muon_lr"] for r in original}) >= 3 and {r["seed"] for r in original} == {0, 1}
    again = smoke(results)
    assert len(json.load(open(results))["runs"]) == len(runs)  # nothing ran again
    assert not any(line.startswith(("  small ", "  large ")) for line in again.splitlines()), again


def test_budget_ratio_brackets_and_interpolates_in_log_tokens(monkeypatch):
    """A made-up JSON: AdamW's seeds end at 2.0 and 2.2 (target 2.1); Muon at 0.354 of the tokens ends at 2.3 and at
    0.5 at 1.9, so a run fitted into exp(log 0.354 + (log 0.5 - log 0.354) * (2.3 - 2.1) / (2.3 - 1.9)) reaches it."""
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    import math
    import recipe
    monkeypatch.setitem(recipe.STATE, "sizes", {"small": recipe.SIZES["small"]})

    def r(opt, lr, muon_lr, seed, budget, val):
        return dict(size="small", optimizer=opt, lr=lr, muon_lr=muon_lr, keys={}, seed=seed, budget=budget,
                    final_val=val)
    results = {"runs": [r("adamw", 1e-3, None, 0, 1.0, 2.0), r("adamw", 1e-3, None, 1, 1.0, 2.2),
                        r("adamw", 2e-3, None, 0, 1.0, 2.5), r("muon", 1e-3, 0.01, 0, 1.0, 1.5),
                        r("muon", 1e-3, 0.01, 0, 0.354, 2.3)]}
    assert recipe.budget_ratio(results, "small", 1e-3, 0.01, {}, 0) is None  # 0.354 misses, 0.5 not run: open
    results["runs"].append(r("muon", 1e-3, 0.01, 0, 0.5, 1.9))
    want = math.exp(math.log(0.354) + (math.log(0.5) - math.log(0.354)) * 0.5)
    assert math.isclose(recipe.budget_ratio(results, "small", 1e-3, 0.01, {}, 0), want)
    ran = []
    def fake_get(res, name, opt, lr, muon_lr, keys, seed, budget):  # noqa: E306
        ran.append(budget)
        return dict(final_val=2.0 if budget >= 0.25 else 2.2)  # reaches at 0.25 and above, misses below
    assert recipe.budget_walk(results, "small", 1e-3, 0.01, {}, 0, fake_get) == ((0.177, 2.2), (0.25, 2.0))
    assert ran == [0.354, 0.25, 0.177]  # down the ladder from 0.354 until it misses
