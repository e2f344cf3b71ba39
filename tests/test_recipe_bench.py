"""bench/recipe.py --smoke: every phase (AdamW and Muon sweeps, the ablation, the combination) and the report, at
tiny sizes and 3 steps, through the trainer's step; a second call finds every run in the JSON and runs none.

    python -m pytest -q tests/test_recipe_bench.py
"""
import json
import os
import subprocess
import sys

from conftest import ROOT


def smoke(results):
    res = subprocess.run([sys.executable, "bench/recipe.py", "--smoke", f"--results={results}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)  # (subprocess.run kills it at the timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_smoke_runs_every_phase_and_resumes(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import recipe
    results = str(tmp_path / "recipe.json")
    out = smoke(results)
    runs = json.load(open(results))["runs"]
    assert all(r["steps"] == 3 and len(r["curve"]) == 4 for r in runs)
    for size in ("small", "large"):
        for opt in ("adamw", "muon"):
            swept = [r for r in runs if (r["size"], r["optimizer"], r["keys"], r["seed"]) == (size, opt, {}, 0)]
            assert len(swept) >= 3  # a bracketed sweep: the best has a neighbour on each side, or it was extended
        assert {r["seed"] for r in runs if r["size"] == size and r["optimizer"] == "adamw"} == {0, 1}  # combo's
    ablated = [r for r in runs if r["size"] == "small" and r["keys"]]
    for keys in recipe.LEVERS.values():
        assert sorted(r["seed"] for r in ablated if r["keys"] == keys) == [0, 1]
    md = open(tmp_path / "recipe.md").read()
    assert all(f"| {lever} |" in md for lever in recipe.LEVERS) and "## Tokens to reach tuned AdamW" in md
    assert os.path.getsize(tmp_path / "recipe.png") > 0 and "phase combo" in out
    again = smoke(results)
    assert len(json.load(open(results))["runs"]) == len(runs)  # nothing ran again
    assert not any(line.startswith(("  small ", "  large ")) for line in again.splitlines()), again
