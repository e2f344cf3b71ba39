"""optimizer=muon through the trainer: it learns; resume is bit-exact; a checkpoint of one optimizer does not
resume as the other (init_from still starts a new run from its weights); a Muon-trained checkpoint exports to a
Hugging Face directory that transformers' text-generation pipeline opens. The optimizer's own step is tested in
test_optim.py; Muon on 2 ranks (DDP and FSDP2) equals one process in test_recipe_keys.py, with every recipe key
on (one 2-rank run for each, not one more for Muon alone)."""
import json
import os
import shutil

import pytest
import torch

from gpt2train import optim
from conftest import assert_export_generates_like_us, load_ckpt, read_log, step_losses, tiny_args
from train_gpt2 import main

MUON = dict(optimizer="muon", muon_lr=2e-2)


@pytest.fixture(scope="module")
def muon_run(data_dir, tmp_path_factory):
    """8 steps of optimizer=muon, checkpoints at 4 and 8."""
    out = str(tmp_path_factory.mktemp("muon"))
    assert main(tiny_args(data_dir, out, **MUON)) == 0
    return out


def muon_state(ckpt):
    """{parameter name: momentum buffer} of a checkpoint's Muon state."""
    return {k: v["momentum_buffer"] for k, v in ckpt["optimizer"]["state"].items() if "momentum_buffer" in v}


def test_muon_learns_and_checkpoints_both_states_by_name(muon_run):
    vals = [e["val_loss"] for e in read_log(muon_run) if "val_loss" in e]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.25
    ckpt = load_ckpt(os.path.join(muon_run, "ckpt_000008.pt"))
    state = ckpt["optimizer"]["state"]
    matrices = {k for k in state if k.startswith("transformer.h.") and k.endswith(("c_attn.weight", "c_proj.weight",
                                                                                   "c_fc.weight"))}
    assert len(matrices) == 4 and set(muon_state(ckpt)) == matrices  # Muon: the block's four matrices
    assert all(set(state[k]) >= {"exp_avg", "exp_avg_sq"} for k in set(state) - matrices)  # AdamW: the rest
    assert "transformer.wte.weight" in state and ckpt["config"]["optimizer"] == "muon"
    resolved = json.load(open(os.path.join(muon_run, "config.json")))["resolved"]
    assert resolved["optimizer"] == "muon" and resolved["muon_lr"] == 2e-2


def test_muon_resume_is_bit_exact(muon_run, data_dir, tmp_path):
    out = str(tmp_path / "resumed")
    os.makedirs(out)
    shutil.copy(os.path.join(muon_run, "ckpt_000004.pt"), out)
    assert main(tiny_args(data_dir, out, resume="true", **MUON)) == 0
    resumed, straight = step_losses(out), step_losses(muon_run)
    assert sorted(resumed) == [4, 5, 6, 7] and all(resumed[s] == straight[s] for s in resumed)
    a, b = load_ckpt(os.path.join(muon_run, "ckpt_000008.pt")), load_ckpt(os.path.join(out, "ckpt_000008.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert set(sa) == set(sb) and all(torch.equal(sa[p][k], sb[p][k]) for p in sa for k in sa[p])


def test_other_optimizer_is_refused_but_init_from_starts_from_the_weights(muon_run, data_dir, tmp_path, capsys):
    out = str(tmp_path / "other")
    os.makedirs(out)
    shutil.copy(os.path.join(muon_run, "ckpt_000004.pt"), out)
    capsys.readouterr()
    assert main(tiny_args(data_dir, out, resume="true", optimizer="adamw")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer=muon" in err and "init_from" in err, err
    assert sorted(os.listdir(out)) == ["ckpt_000004.pt"]  # nothing written
    new = str(tmp_path / "new")
    ckpt = os.path.join(muon_run, "ckpt_000008.pt")
    assert main(tiny_args(data_dir, new, init_from=ckpt, optimizer="adamw", max_steps=2, eval_interval=0)) == 0
    first = next(e for e in read_log(new) if "loss" in e)
    assert first["step"] == 0 and first["loss"] < step_losses(muon_run)[0] - 0.25  # the trained weights


def test_muon_checkpoint_exports_to_a_text_generation_pipeline(data_dir, tmp_path):
    assert_export_generates_like_us(data_dir, tmp_path, **MUON)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_memory_estimate_and_report_count_muons_one_buffer(optimizer):
    """bench.py --memory/--fit and micro_batch_size=auto use training_bytes_estimate: its optimizer state
    is what the trainer's optimizers hold after a step (AdamW two fp32 buffers a parameter, Muon one a matrix)."""
    import bench
    from gpt2train import ladder
    from gpt2train import memory
    from gpt2train import memory_report
    from gpt2train import microbatch
    from gpt2train import precision
    from model import flops_per_token
    plan = precision.make_plan("cpu", "fp32")
    settings = dict(ladder.BASELINE, attn="sdpa", vocab=50304, fused=False, loss="chunked", ckpt="none")
    raw, model, optimizers = bench.build(settings, "tiny", 2, 32, plan, optimizer)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optim.train_step(model, optim.Stepping(plan, scaler, optimizers), *microbatch.random_batch(2, 32, "cpu"))
    held = memory.tensor_bytes(memory.optimizer_state_tensors(optimizers))
    estimate = memory.training_bytes_estimate(memory.Step(raw.config, 32, optimizer=optimizer), 2)["optimizer state"]
    n = sum(p.numel() for p in raw.parameters())
    steps = 4 * sum(1 for s in optimizers[0].state.values() if "step" in s)  # AdamW's step counts, not estimated
    assert held - steps == estimate == (8 * n if optimizer == "adamw" else 8 * n - 4 * sum(
        p.numel() for o in optimizers[1:] for g in o.param_groups for p in g["params"]))
    job = ladder.Ladder(plan, "tiny", 2, 32, 0, 1, bench.build, flops_per_token)
    report = memory_report.memory_report(job, memory_report.Modes(optimizer=optimizer))
    line = next(x for x in report if "optimizer state" in x)
    assert memory.fmt_bytes(held) in line and ("Muon" in line) == (optimizer == "muon")
