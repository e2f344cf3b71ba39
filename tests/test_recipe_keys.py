"""Issue 33's keys through the trainer (lr_schedule, cooldown_frac, muon_split_qkv, muon_momentum_warmup,
zero_init_proj, embed_lr_mult, scalar_lr_mult): each resumes bit-exact, mid-cooldown and mid-warmup too; all
of them on, 2-rank DDP and FSDP2 (gloo, CPU) equal one process (the suite's Muon-on-2-ranks check), fp16 +
GradScaler runs, the export opens in transformers' text-generation pipeline; zero_init_proj never touches
init_from's weights; every group's lr is its base_lr x optim.lr_multiplier(step), the one place an lr is
computed. Their pieces: tests/test_optim.py.

    python -m pytest -q tests/test_recipe_keys.py
"""
import math
import os
import shutil

import pytest
import torch

from conftest import (assert_export_generates_like_us, load_ckpt, read_log, run_ranks, save_ckpt, step_losses,
                      tiny_args, tiny_model)
from gpt2train import optim
from gpt2train.config import parse_args
from train_gpt2 import main

MUON = dict(optimizer="muon", muon_lr=2e-2)
ALL = dict(MUON, lr_schedule="wsd", cooldown_frac=0.5, muon_split_qkv="true", muon_momentum_warmup=3,
           zero_init_proj="true", embed_lr_mult=3.0, scalar_lr_mult=1.5)  # every lever on
BUILD = optim.build_optimizers  # the real one, whatever a test patches
RESUMED = {  # resumed from step 4 of 8
    "wsd_mid_cooldown": dict(lr_schedule="wsd", cooldown_frac=0.75),  # cools down over steps 2..8
    "linear_to_zero": dict(lr_schedule="linear", min_lr=0.0),
    "momentum_mid_warmup": dict(MUON, muon_momentum_warmup=6),  # 0.85 -> 0.95 over steps 0..6
    "split_qkv_off": dict(MUON, muon_split_qkv="false"),  # (on is the default: "all" and momentum_mid_warmup)
    "zero_init_proj": dict(zero_init_proj="true"),
    "embed_scalar_lrs": dict(embed_lr_mult=3.0, scalar_lr_mult=2.0),  # adamw: three groups
    "all": ALL,
}


def assert_bit_exact(a_dir, b_dir, steps):
    a, b = step_losses(a_dir), step_losses(b_dir)
    assert sorted(b) == steps and all(a[s] == b[s] for s in b), (a, b)
    ca, cb = load_ckpt(os.path.join(a_dir, "ckpt_000008.pt")), load_ckpt(os.path.join(b_dir, "ckpt_000008.pt"))
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert set(sa) == set(sb) and all(torch.equal(sa[p][k], sb[p][k]) for p in sa for k in sa[p])
    hyper = lambda ckpt: [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}  # noqa: E731
                          for g in ckpt["optimizer"]["param_groups"]]  # (a loaded state's betas are a list)
    assert hyper(ca) == hyper(cb)  # lrs, base_lrs, Muon's momentum


@pytest.mark.parametrize("keys", RESUMED.values(), ids=RESUMED.keys())
def test_each_key_resumes_bit_exact(keys, data_dir, tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert main(tiny_args(data_dir, straight, **keys)) == 0
    os.makedirs(resumed)
    shutil.copy(os.path.join(straight, "ckpt_000004.pt"), resumed)
    assert main(tiny_args(data_dir, resumed, resume="true", **keys)) == 0
    assert_bit_exact(straight, resumed, [4, 5, 6, 7])


def test_wsd_keeps_the_cooldowns_start_and_a_longer_run_continues_from_it_exactly(data_dir, tmp_path, capsys):
    """wsd's lr is flat until the cooldown, whatever max_steps is: the checkpoint at the cooldown's start is written
    and kept (keep_last=1 keeps it beside the newest), and resumed with a larger max_steps in a new out_dir it
    trains bit for bit as a run planned that long from the start (the config's fallback). checkpoint_interval=0
    (no checkpoints but the last) writes none there."""
    wsd = dict(lr_schedule="wsd", cooldown_frac=0.5, checkpoint_interval=100, checkpoint_minutes=0, keep_last=1)
    bet, longer, planned = str(tmp_path / "bet"), str(tmp_path / "longer"), str(tmp_path / "planned")
    assert main(tiny_args(data_dir, bet, **wsd)) == 0  # 8 steps, the cooldown from step 4
    assert sorted(f for f in os.listdir(bet) if f.startswith("ckpt_")) == ["ckpt_000004.pt", "ckpt_000008.pt"]
    assert "ckpt_000004.pt (the cooldown starts here; kept: to train longer" in capsys.readouterr().out
    assert main(tiny_args(data_dir, str(tmp_path / "none"), **dict(wsd, checkpoint_interval=0))) == 0
    assert [f for f in os.listdir(tmp_path / "none") if f.startswith("ckpt_")] == ["ckpt_000008.pt"]
    assert main(tiny_args(data_dir, planned, **dict(wsd, max_steps=12))) == 0  # the cooldown from step 6
    os.makedirs(longer)
    shutil.copy(os.path.join(bet, "ckpt_000004.pt"), longer)
    assert main(tiny_args(data_dir, longer, resume="true", **dict(wsd, max_steps=12))) == 0
    a, b = step_losses(planned), step_losses(longer)
    assert sorted(b) == list(range(4, 12)) and all(a[s] == b[s] for s in b), (a, b)
    ca, cb = load_ckpt(os.path.join(planned, "ckpt_000012.pt")), load_ckpt(os.path.join(longer, "ckpt_000012.pt"))
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])


def test_schedule_multiplier_is_the_only_lr(data_dir, tmp_path, monkeypatch, capsys):
    """Every group of every optimizer steps at its base_lr x optim.lr_multiplier(step) (here the real one x 0.5,
    so an lr computed anywhere else would show), for each schedule; Muon's momentum is optim.muon_momentum(step);
    log.jsonl shows each optimizer's lr."""
    real, seen = optim.lr_multiplier, []
    monkeypatch.setattr(optim, "lr_multiplier", lambda step, cfg: 0.5 * real(step, cfg))
    step_fn = optim.optimizer_step

    def recorded(stepping, *a, **k):
        stepped = step_fn(stepping, *a, **k)
        seen.append([(type(o).__name__, g["base_lr"], g["lr"], g.get("momentum")) for o in stepping.optimizers
                     for g in o.param_groups])
        return stepped
    monkeypatch.setattr(optim, "optimizer_step", recorded)
    for kind in optim.SCHEDULES:
        out, seen[:] = str(tmp_path / kind), []
        args = tiny_args(data_dir, out, **{**ALL, "lr_schedule": kind}, checkpoint_interval=0, eval_interval=0)
        assert main(args) == 0
        cfg = parse_args(args)[0]
        assert len(seen) == 8
        for step, groups in enumerate(seen):
            assert sorted({base for _, base, _, _ in groups}) == pytest.approx([1.5e-2, 2e-2, 3e-2])  # 1-D, muon, embed
            for name, base, lr, momentum in groups:
                assert lr == base * 0.5 * real(step, cfg), (kind, step, name)
                assert name == "AdamW" or momentum == optim.muon_momentum(step, cfg)
        logged = [e for e in read_log(out) if "loss" in e]
        # the base lrs (issue 39 item 11: "lr" was the embeddings' group's, embed_lr_mult x max_lr)
        assert [e["lr"] for e in logged] == pytest.approx([cfg.max_lr * 0.5 * real(s, cfg) for s in range(8)])
        assert [e["muon_lr"] for e in logged] == pytest.approx([cfg.muon_lr * 0.5 * real(s, cfg) for s in range(8)])
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "| loss" in line]
        assert [line.split(" | ")[2] for line in said] == [f"lr adamw {e['lr']:.2e} muon {e['muon_lr']:.2e}"
                                                           for e in logged]
    assert seen[0][-1][3] == 0.85 and seen[-1][-1][3] == pytest.approx(0.95)


def first_weights(monkeypatch):
    """{name: tensor} of the model the trainer hands build_optimizers (its weights before any step)."""
    got = {}

    def spy(model, *a, **k):
        got.update({n: p.detach().clone() for n, p in model.state_dict().items()})
        return BUILD(model, *a, **k)
    monkeypatch.setattr(optim, "build_optimizers", spy)
    return got


def test_zero_init_proj_on_scratch_only(data_dir, tmp_path, monkeypatch):
    """Scratch: the c_proj weights start at 0, every other tensor as without the key (same RNG draws);
    init_from (a checkpoint) with zero_init_proj: its weights, every one untouched."""
    runs = {}
    for name, keys in (("plain", {}), ("zero", dict(zero_init_proj="true"))):
        runs[name] = first_weights(monkeypatch)
        assert main(tiny_args(data_dir, str(tmp_path / name), max_steps=1, eval_interval=0, **keys)) == 0
    proj = [k for k in runs["plain"] if k.endswith("c_proj.weight")]
    assert len(proj) == 2 and all(runs["zero"][k].eq(0).all() and runs["plain"][k].ne(0).any() for k in proj)
    assert all(torch.equal(runs["zero"][k], runs["plain"][k]) for k in runs["plain"] if k not in proj)
    trained = tiny_model(seed=5)
    ckpt = save_ckpt(trained, tmp_path / "trained.pt")
    loaded = first_weights(monkeypatch)
    assert main(tiny_args(data_dir, str(tmp_path / "from"), init_from=ckpt, zero_init_proj="true", max_steps=1,
                          eval_interval=0)) == 0
    want = trained.state_dict()
    assert set(loaded) == set(want) and all(torch.equal(loaded[k], want[k]) for k in want)


COMMON = dict(ALL, n_layer=2, max_steps=4, total_batch_size=128, eval_interval=4, checkpoint_interval=2, max_lr=1e-3,
              min_lr=1e-4)  # 2 ranks x 2 micro-steps of 2 x 16 = 1 rank x 4 micro-steps


@pytest.fixture(scope="module")
def all_one(data_dir, tmp_path_factory):
    """COMMON (every key on) in one process: the reference of its 2-rank and fp16 runs."""
    out = str(tmp_path_factory.mktemp("all_one"))
    assert main(tiny_args(data_dir, out, **COMMON, val_steps=4)) == 0
    return out


@pytest.mark.parametrize("fsdp", ["false", "true"])
def test_all_keys_on_two_ranks_equal_one_process(fsdp, all_one, data_dir, tmp_path):
    """The suite's check that Muon on 2 ranks (DDP, FSDP2) equals one process, with every recipe key on."""
    out = str(tmp_path / "two")
    run_ranks(tiny_args(data_dir, out, **COMMON, val_steps=2, fsdp=fsdp), out)
    a, b = step_losses(all_one), step_losses(out)
    assert sorted(b) == [0, 1, 2, 3] and all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)
    wa, wb = (load_ckpt(os.path.join(d, "ckpt_000004.pt")) for d in (all_one, out))
    w2 = load_ckpt(os.path.join(all_one, "ckpt_000002.pt"))["model"]
    moved = max((wa["model"][k] - w2[k]).abs().max().item() for k in w2)  # steps 2 and 3's update
    assert max((wa["model"][k] - wb["model"][k]).abs().max().item() for k in wa["model"]) <= 1e-3 * moved
    sa, sb = wa["optimizer"]["state"], wb["optimizer"]["state"]
    assert set(sa) == set(sb) and max((sa[p][k] - sb[p][k]).abs().max().item() for p in sa for k in sa[p]
                                      if k != "step") <= 1e-5
    matrices = [p for p in sa if "momentum_buffer" in sa[p]]  # Muon's: the blocks' 2 x 4 matrices
    assert len(matrices) == 8 and all(wa["model"][p].ne(w2[p]).any() for p in matrices)  # moved in steps 2-3


def test_all_keys_fp16_with_grad_scaler(all_one, data_dir, tmp_path):
    out = str(tmp_path / "fp16")
    assert main(tiny_args(data_dir, out, **COMMON, val_steps=4, precision="fp16")) == 0
    a, b = step_losses(all_one), step_losses(out)
    assert all(math.isfinite(v) for v in b.values()) and all(abs(a[s] - b[s]) < 0.05 for s in a), (a, b)
    ckpt = load_ckpt(os.path.join(out, "ckpt_000004.pt"))
    assert ckpt["scaler"]["scale"] > 0 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_all_keys_export_to_a_text_generation_pipeline(data_dir, tmp_path):
    assert_export_generates_like_us(data_dir, tmp_path, **ALL)
