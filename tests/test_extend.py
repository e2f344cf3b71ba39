"""Extending a finished run with a larger --max_steps (issue 39 item 7): how the lr schedule goes on is said.

    python -m pytest -q tests/test_extend.py
"""
import json
import os
import shutil

import train_gpt2

ARGS = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--seq_len=32", "--micro_batch_size=2",
        "--total_batch_size=64", "--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0",
        "--resume=auto", "--warmup_steps=2", "--max_lr=1e-3", "--min_lr=0", "--embed_lr_mult=1",
        "--scalar_lr_mult=1"]


def lrs(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}


def test_a_finished_wsd_run_extended_says_the_jump_and_the_ways_around_it(data_dir, tmp_path, capsys):
    """The issue's case: `--max_steps=200` after 160 on wsd jumped the lr 32x in one step with no note. Now the resume
    says it (the last step's lr, the next one's, the factor) with the ways around it: wsd's kept cooldown-start
    checkpoint, which resumed with the larger max_steps goes on with no jump, or a new run from the weights."""
    out = str(tmp_path / "run")
    common = [*ARGS, f"--data_dir={data_dir}", "--lr_schedule=wsd", "--checkpoint_interval=4", "--keep_last=1"]
    assert train_gpt2.main([*common, f"--out_dir={out}", "--max_steps=10"]) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".pt")) == ["ckpt_000008.pt", "ckpt_000010.pt"]
    capsys.readouterr()
    assert train_gpt2.main([*common, f"--out_dir={out}", "--max_steps=20"]) == 0
    said = capsys.readouterr().out
    logged = lrs(out)
    assert logged[9] == 1e-3 * 1 / 2 and logged[10] == 1e-3  # the cooldown's last step, then the flat lr again
    branch, ckpt = os.path.join(out, "ckpt_000008.pt"), os.path.join(out, "ckpt_000010.pt")
    note = next(line for line in said.splitlines() if line.startswith("note: max_steps"))
    assert note == ("note: max_steps 10 -> 20: the wsd schedule is re-planned for 20 steps (flat until the cooldown "
                    "at step 16, then down to min_lr=0.00e+00 at step 20): AdamW's lr jumps from 5.00e-04 (step 9) "
                    "to 1.00e-03 at step 10, 2.0x in one step; to avoid the jump, resume its cooldown-start "
                    f"checkpoint {branch} instead (copy it into a new folder and resume there with --max_steps=20 "
                    "--out_dir=<that folder>: exactly a 20-step run), or train on from its weights with a fresh "
                    f"warmup: --init_from={ckpt} --out_dir=<a new folder> --max_steps=<the steps to add> "
                    "(docs/training.md, 'Extending a run')"), note

    branched = str(tmp_path / "branched")  # the way offered: no jump, the 20-step run's own lrs
    os.makedirs(branched)
    shutil.copy(branch, branched)
    assert train_gpt2.main([*common, f"--out_dir={branched}", "--max_steps=20"]) == 0
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note: max_steps"))
    assert note.endswith("AdamW's lr goes on from 1.00e-03 to 1.00e-03 at step 8, no jump"), note
    assert all(lr == 1e-3 for step, lr in lrs(branched).items() if 8 <= step < 16)


def test_a_cosine_run_extended_says_how_far_the_lr_moves(data_dir, tmp_path, capsys):
    """cosine stretches to the new end: the step after the resume has a higher lr than the last, said with its factor;
    a resume with the same max_steps says nothing."""
    out = str(tmp_path / "run")
    common = [*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}", "--lr_schedule=cosine", "--min_lr=1e-4"]
    assert train_gpt2.main([*common, "--max_steps=6"]) == 0
    capsys.readouterr()
    assert train_gpt2.main([*common, "--max_steps=12"]) == 0
    said = capsys.readouterr().out
    note = next(line for line in said.splitlines() if line.startswith("note: max_steps"))
    logged = lrs(out)
    assert note.startswith("note: max_steps 6 -> 12: the cosine schedule is re-planned for 12 steps (cosine down to "
                           f"min_lr=1.00e-04 at step 12): AdamW's lr jumps from {logged[5]:.2e} (step 5) to "
                           f"{logged[6]:.2e} at step 6, {logged[6] / logged[5]:.1f}x in one step; to avoid the jump, "
                           "train on from its weights"), note
    assert "cooldown-start" not in note


def test_a_muon_run_extended_names_muons_lr_jump_too(data_dir, tmp_path, capsys):
    """Issue 44 item 8: under optimizer=muon the note named AdamW's lr jump only, while Muon's lr (the blocks'
    matrices, most of the model) jumps by the same factor on the same schedule: both are said, as logged."""
    out = str(tmp_path / "run")
    common = [*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}", "--lr_schedule=wsd", "--optimizer=muon",
              "--muon_lr=2e-2"]
    assert train_gpt2.main([*common, "--max_steps=10"]) == 0
    capsys.readouterr()
    assert train_gpt2.main([*common, "--max_steps=20"]) == 0
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note: max_steps"))
    with open(os.path.join(out, "log.jsonl")) as f:
        muon = {r["step"]: r["muon_lr"] for r in map(json.loads, f) if "muon_lr" in r}
    logged = lrs(out)
    assert muon[9] == 2e-2 / 2 and muon[10] == 2e-2  # the cooldown's last step, then the flat lr again
    assert (f"AdamW's lr jumps from {logged[9]:.2e} (step 9) to {logged[10]:.2e} and Muon's from {muon[9]:.2e} to "
            f"{muon[10]:.2e} at step 10, 2.0x in one step; to avoid the jump") in note, note
