"""The smaller things a new user met (issue 24), each the way a nanoGPT user would expect: what contradicts
itself refused (one line, exit 2, nothing written), what is merely odd warned; the divergence advice fits the
config; nanoGPT's key names point to ours; --model takes a run folder; --help uses the terminal's width; a
text too small for the run leaves nothing behind.

(Elsewhere: `python model.py --help` in test_model.py::test_help_from_the_command_line, `sample.py
--temperature 0` in test_sample.py::test_greedy_equals_hf_generate, `fineweb.py --source FOLDER` in
test_fineweb.py::test_a_folder_source_reads_its_text_files.)

    python -m pytest -q tests/test_newcomer.py
"""
import dataclasses
import json
import os

import pytest

from gpt2train import config
from gpt2train import guard
import hellaswag
import sample
import train_gpt2
from conftest import one_line, tiny_args
from gpt2train.config import Config, parse_args
from gpt2train.fileio import UserError

ROW = {"ctx": "A man is sitting on a roof. He", "label": 0,
       "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                   "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}


# -----------------------------------------------------------------------------
# the learning-rate schedule: contradictory is refused, odd is warned


def test_min_lr_above_max_lr_is_refused_before_anything_is_written(data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert train_gpt2.main(tiny_args(data_dir, str(out), max_lr=1e-4, min_lr=1e-3)) == 2
    assert one_line(capsys.readouterr().err) == (
        "error: min_lr=0.001 is above max_lr=0.0001: the cosine decays from max_lr down to "
        "min_lr; swap them (min_lr = max_lr gives a constant learning rate)")
    assert not out.exists()
    parse_args(["--max_lr=1e-3", "--min_lr=1e-3"])  # equal: a constant learning rate, fine


def test_warmup_not_below_max_steps_is_warned_and_runs(data_dir, tmp_path, capsys):
    """configs/gpt2_124m.py --max_steps=100 (the README's try-out) warms up over 715 steps: odd, not wrong."""
    assert train_gpt2.main(tiny_args(data_dir, str(tmp_path / "out"), warmup_steps=8, max_steps=8)) == 0
    out = capsys.readouterr().out
    assert ("warning: warmup_steps=8 is not below max_steps=8: the learning rate never reaches max_lr and never "
            "decays") in out
    assert config.oddities(Config(warmup_steps=715, max_steps=100))
    assert not config.oddities(Config(warmup_steps=99, max_steps=100))

# -----------------------------------------------------------------------------
# divergence: the advice fits the config


def test_divergence_advice_never_says_set_grad_clip_when_it_is_set(data_dir, tmp_path, capsys):
    assert train_gpt2.main(tiny_args(data_dir, str(tmp_path / "out"), max_lr=1e20, min_lr=1e20, max_steps=20,
                                max_skipped=3, grad_clip=1.0, checkpoint_interval=0)) == 3
    err = one_line(capsys.readouterr().err)
    assert err.startswith("error: the run diverged") and "lower grad_clip (e.g. 0.5)" in err
    assert "set grad_clip" not in err
    assert guard.remedy(Config(grad_clip=0.0)) == "lower max_lr or set grad_clip=1.0 and start again"
    assert guard.remedy(Config(grad_clip=1.0, optimizer="muon")) == \
        "lower max_lr and muon_lr or lower grad_clip (e.g. 0.5) and start again"

# -----------------------------------------------------------------------------
# nanoGPT's names


@pytest.mark.parametrize("name, ours", [("learning_rate", "max_lr"), ("batch_size", "micro_batch_size"),
                                        ("max_iters", "max_steps"),
                                        ("gradient_accumulation_steps", "total_batch_size")])
def test_nanogpt_names_get_a_did_you_mean(name, ours, tmp_path, capsys):
    """On the command line and in a config file alike: one line naming our key, exit 2."""
    with pytest.raises(UserError, match=f"unknown config key '{name}': here it is {ours}\\b"):
        parse_args([f"--{name}=4"])
    path = tmp_path / "mine.py"
    path.write_text(f"{name} = 4\n")
    with pytest.raises(UserError, match=f"unknown config key '{name}': here it is {ours}\\b"):
        parse_args([str(path)])
    assert train_gpt2.main([f"--{name}=4", f"--out_dir={tmp_path / 'out'}"]) == 2
    assert f"here it is {ours}" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()

# -----------------------------------------------------------------------------
# --model RUN_DIR


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory):
    """A finished tiny run with GPT-2's vocabulary and two checkpoints, steps 2 and 3."""
    out = str(tmp_path_factory.mktemp("run") / "out")
    assert train_gpt2.main(tiny_args(data_dir, out, vocab_size=50304, max_steps=3, checkpoint_interval=2, keep_last=0,
                                eval_interval=0)) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".pt")) == ["ckpt_000002.pt", "ckpt_000003.pt"]
    return out


def test_sample_takes_a_run_folders_newest_checkpoint(run_dir, capsys):
    argv = ["--device", "cpu", "--prompt", "Hello", "--max_new_tokens", "5", "--temperature", "0"]
    assert sample.main(["--model", os.path.join(run_dir, "ckpt_000003.pt"), *argv]) == 0
    by_path = capsys.readouterr().out
    assert sample.main(["--model", run_dir, *argv]) == 0
    got = capsys.readouterr()
    assert got.out == by_path
    assert f"{run_dir} is a training run's folder: sampling from its newest checkpoint, " \
        f"{os.path.join(run_dir, 'ckpt_000003.pt')}" in got.err


def test_hellaswag_takes_a_run_folders_newest_checkpoint(run_dir, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ROW) + "\n")
    results = []
    for model in (os.path.join(run_dir, "ckpt_000003.pt"), run_dir):
        out = tmp_path / f"{len(results)}.json"
        assert hellaswag.main(["--model", model, "--data", str(rows), "--device", "cpu", "--json", str(out)]) == 0
        results.append(json.load(open(out)))
    assert results[0] == results[1]
    assert f"model: {os.path.join(run_dir, 'ckpt_000003.pt')} (the newest checkpoint in the run folder {run_dir})" \
        in capsys.readouterr().out

# -----------------------------------------------------------------------------
# --help at the terminal's width


@pytest.mark.parametrize("columns", [80, 132])
def test_help_wraps_at_the_terminals_width(columns, monkeypatch):
    """Every line (the introduction, the section titles, each key's meaning) fits the terminal's width, and the
    meanings fill it, not a ~26-character column."""
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    lines = config.help_text().splitlines()
    assert max(len(line) for line in lines) <= columns
    meaning = [line for line in lines if line.startswith("      ")]
    assert max(len(line) for line in meaning) > columns - 20

# -----------------------------------------------------------------------------
# a text too small for the run: exit 2, nothing written


def test_a_too_small_data_file_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """The trainer's own path for --data (out/<name>, its cache beside it in out/data_cache): a text whose val
    split cannot hold one batch is refused with one line and the folder is as it was: no cache, no out/."""
    (tmp_path / "short.txt").write_text("Once upon a time there was a short story. " * 40)
    monkeypatch.chdir(tmp_path)
    argv = ["--data=short.txt", "--vocab_size=50304", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128",
            "--seq_len=128", "--micro_batch_size=8", "--total_batch_size=1024", "--max_steps=2",
            "--hellaswag_interval=0", "--sample_interval=0"]
    assert train_gpt2.main(argv) == 2
    assert "val split is" in one_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == ["short.txt"]

# -----------------------------------------------------------------------------
# issue 31: nothing the user asked ignored


QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.py")


def test_a_shape_flag_under_init_from_must_match_the_weights(data_dir, hf_dir, tmp_path, capsys):
    """--init_from=<save_pretrained dir> --n_layer=8 trained the directory's 2-layer model, exit 0, no word."""
    base = tiny_args(data_dir, str(tmp_path / "run"), n_layer=None, n_head=None, n_embd=None, block_size=None,
                     vocab_size=None, max_steps=1, eval_interval=0, checkpoint_interval=0)
    assert train_gpt2.main([*base, f"--init_from={hf_dir}", "--n_layer=8"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "n_layer=8 (the weights: 2)" in line and "drop --n_layer" in line
    assert not os.path.exists(tmp_path / "run")
    assert train_gpt2.main([*base, f"--init_from={hf_dir}", "--n_layer=2", "--vocab_size=50257"]) == 0  # as they are


def test_a_config_files_shape_keys_under_init_from_must_match_the_weights(data_dir, hf_dir, tmp_path, capsys):
    """The quickstart's n_layer and vocab_size were dropped under --init_from without a word; --help
    says what a config file's shape keys mean there."""
    argv = [QUICKSTART, f"--init_from={hf_dir}", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}"]
    assert train_gpt2.main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {QUICKSTART} sets n_layer=4 (the weights: 2), vocab_size=50304 (the weights: "
                           "50257), but init_from=")  # (n_head, n_embd and block_size match this small GPT-2)
    assert "a config for init_from leaves n_layer, vocab_size out" in line
    assert "init_from not scratch: its weights set the shape" in config.help_text()


def test_the_quickstart_on_two_ranks_is_told_the_micro_batch_that_keeps_its_recipe():
    """configs/quickstart.py sets micro_batch_size=8 (1 x 8 x 128 = 1,024 tokens a step): on 2 ranks the line
    names --micro_batch_size=4, which keeps the recipe, before --total_batch_size=2048, which doubles it."""
    from conftest import adamw, tiny_model
    from gpt2train.memory import Step
    from gpt2train.microbatch import choose_micro_batch
    from gpt2train.precision import make_plan
    model = tiny_model(vocab_size=256)
    optimizer = adamw(model)
    shape = lambda total, **asked: Step(model.config, 128, total, 2, device_type="cpu", **asked)  # noqa: E731
    with pytest.raises(UserError) as e:  # set on the command line: kept or refused
        choose_micro_batch(model, [optimizer], make_plan("cpu"), shape(1024, fit=False, divide=False), 8)
    assert str(e.value).endswith(": --micro_batch_size=4 keeps 1,024 tokens per step (or --total_batch_size=2048 "
                                 "makes it 2,048)")
    B, T, why, _ = choose_micro_batch(model, [optimizer], make_plan("cpu"), shape(1024), 8)
    assert (B, T) == (4, 128) and why.startswith("micro_batch_size=4: the largest up to 8")
    with pytest.raises(UserError, match=r"= 2048: e\.g\. --total_batch_size=2048$"):  # no micro-batch keeps 1,000
        choose_micro_batch(model, [optimizer], make_plan("cpu"), shape(1000), 8)


def test_a_cpu_step_beyond_the_free_ram_is_fitted_or_warned_before_it_starts(monkeypatch, capsys):
    """Issue 31: on a 23 GB machine the 124M config's 64 x 1024 step (~60 GB by our own estimate) was never
    warned about (the OOM killer came first), and the OOM line's --micro_batch_size=auto does nothing on CPU.
    Left at its default, the micro-batch is fitted to the free RAM (total_batch_size kept); set, it is warned
    about with the micro-batch that fits; the OOM line on CPU names a smaller micro-batch, not auto."""
    from gpt2train import memory, microbatch, precision
    from model import GPT, GPTConfig
    from gpt2train.precision import make_plan
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=1024, vocab_size=50304))
    plan = make_plan("cpu")
    step = memory.Step(model.config, 1024, 524288, device_type="cpu")
    need = lambda b: memory.training_bytes_estimate(step, b)  # noqa: E731
    ram = sum(need(8).values()) + 1  # 8 x 1024 fits, 16 x 1024 does not
    monkeypatch.setattr(microbatch, "available_ram", lambda: ram)
    capsys.readouterr()
    B, T, why, _ = microbatch.choose_micro_batch(model, [], plan, step, 64)
    said = capsys.readouterr().out.splitlines()
    assert (B, T) == (8, 1024) and why.startswith("micro-batch fitted to the free RAM: 64 x 1024 needs ~") and not said
    assert "8 x 1024 (~" in why and "grad_accum 64 keeps total_batch_size 524288" in why
    flag = dataclasses.replace(step, fit=False, divide=False)  # set on the command line
    B, _, why, _ = microbatch.choose_micro_batch(model, [], plan, flag, 64)
    said = capsys.readouterr().out.splitlines()
    assert B == 64 and why == "" and len(said) == 1
    assert said[0].startswith("warning: micro-batch 64 x 1024 needs ~") and "--micro_batch_size=8 fits" in said[0]
    monkeypatch.setattr(microbatch, "available_ram", lambda: 10 * ram)
    assert microbatch.choose_micro_batch(model, [], plan, step, 64)[0] == 64
    assert capsys.readouterr().out.splitlines() == []
    line = precision.out_of_memory_message(RuntimeError("DefaultCPUAllocator: not enough memory"), "cpu", 64, 1024, 8)
    assert "auto" not in line and "--micro_batch_size (e.g. 32;" in line


def test_sample_and_hellaswag_skip_a_run_folders_unreadable_newest_checkpoint(run_dir, tmp_path, capsys):
    """Issue 31: on a run folder whose newest checkpoint is cut short they took it and stopped, where the trainer
    skips it: now they take the newest readable one (ckpt_000003), with the trainer's warning naming the other."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    data = open(run / "ckpt_000003.pt", "rb").read()
    open(run / "ckpt_000009.pt", "wb").write(data[:len(data) // 2])
    argv = ["--device", "cpu", "--prompt", "Hello", "--max_new_tokens", "5", "--temperature", "0"]
    assert sample.main(["--model", os.path.join(run_dir, "ckpt_000003.pt"), *argv]) == 0
    expect = capsys.readouterr().out
    assert sample.main(["--model", str(run), *argv]) == 0
    got = capsys.readouterr()
    assert got.out == expect and f"warning: skipping {run / 'ckpt_000009.pt'}: not a readable checkpoint" in got.err
    assert f"sampling from its newest checkpoint, {run / 'ckpt_000003.pt'}" in got.err
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ROW) + "\n")
    assert hellaswag.main(["--model", str(run), "--data", str(rows), "--device", "cpu"]) == 0
    assert f"model: {run / 'ckpt_000003.pt'} (the newest checkpoint in the run folder" in capsys.readouterr().out


def test_silent_choices_are_said(data_dir, tmp_path, monkeypatch, capsys):
    """Issue 31: --data=<folder> skipped .csv, .png and extensionless files without naming them; --precision=fp16
    on CPU was taken without a note (and runs far slower there)."""
    from gpt2train import data
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha")
    (folder / "table.csv").write_text("x,y\n")
    (folder / "sub" / "plot.png").write_bytes(b"\x89PNG")
    (folder / "NOTES").write_text("no extension")
    (folder / ".hidden.csv").write_text("hidden: not named")
    assert data.source_files(str(folder)) == [str(folder / "a.txt")]
    said = capsys.readouterr().out
    assert said.strip() == (f"data: skipping 3 file(s) in {folder} that are not .txt, .md, .py, .jsonl, .json or "
                            f".parquet: NOTES, table.csv, {os.path.join('sub', 'plot.png')}")
    run = lambda prec: train_gpt2.main(tiny_args(data_dir, str(tmp_path / prec), max_steps=1, eval_interval=0,  # noqa
                                                 checkpoint_interval=0, device="cpu", precision=prec))
    assert run("fp16") == 0
    assert "note: precision=fp16 on CPU runs far slower than fp32" in capsys.readouterr().out
    assert run("fp32") == 0
    assert "note: precision" not in capsys.readouterr().out


def test_the_trainer_lets_waiting_cpu_threads_sleep():
    """Issue 31: with the default thread count, quickstart steps took ~6 s on a shared 2-core machine, ~0.5 s with
    one thread: OpenMP's threads spin while they wait for a peer the OS has descheduled. The trainer sets
    OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (measured in the commit and the README), unless the user
    set it."""
    import subprocess
    import sys
    code = "import os, train_gpt2, torch; print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads() > 0)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["PASSIVE", "True"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(env, OMP_WAIT_POLICY="ACTIVE"),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["ACTIVE", "True"], out.stderr


def test_cosmetics_of_a_first_hour(data_dir, tmp_path, monkeypatch, capsys):
    """Issue 31's cosmetic items: a skip warning cut mid-word ("This is an interna"); the --data cache's temp
    folder printed; "data_source": "python" in a --data run's config; val rows read twice without a word; a
    read-only out_dir exiting 1 (the machine's failure) rather than 2 (the user's to fix)."""
    from gpt2train import checkpoint
    bad = tmp_path / "ckpts"
    bad.mkdir()
    (bad / "ckpt_000004.pt").write_bytes(b"PK\x03\x04" + b"x" * 300)  # a zip's magic, then nothing a zip holds
    capsys.readouterr()
    checkpoint.latest_checkpoint(str(bad))
    warnings = capsys.readouterr().out.splitlines()
    why = warnings[0].split("not a readable checkpoint (RuntimeError: ", 1)[1]
    assert why.startswith("PytorchStreamReader failed reading zip archive") and why.endswith(" ...)"), why
    words = why[:-len(" ...)")].split()  # torch's words up to a whole one: never "This is an interna"
    assert " ".join(words) in "PytorchStreamReader failed reading zip archive: failed finding central directory. " \
        "This is an internal miniz error. If you are seeing this error, there is a high likelihood" and \
        words[-1] in ("internal", "miniz", "error.", "If", "you", "are", "seeing", "this", "error,", "there", "is"), why

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_book.txt").write_text("Once upon a time there was a long story that went on. " * 2000)
    argv = [QUICKSTART, "--data=my_book.txt", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32",
            "--seq_len=32", "--micro_batch_size=2", "--total_batch_size=64", "--max_steps=1", "--eval_interval=1",
            "--val_steps=500", "--sample_interval=0"]
    assert train_gpt2.main(argv) == 0
    out = capsys.readouterr().out
    cache = json.load(open(os.path.join("out", "quickstart-my_book", "config.json")))["resolved"]["data_dir"]
    wrote = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and wrote[0].endswith(f"tokens) to {cache}"), out  # the cache's name, not its temp's
    resolved = json.load(open(os.path.join("out", "quickstart-my_book", "config.json")))["resolved"]
    # issue 39 item 11: a val_steps beyond the val split is capped to it (was a note, and every row read ~14 times)
    notes = [line for line in out.splitlines() if line.startswith("note: val_steps=500 asks for 1,000 rows")]
    assert len(notes) == 1 and notes[0].endswith(f"evaluating val_steps={resolved['val_steps']} instead "
                                                 f"({2 * resolved['val_steps']} rows, each at most once)"), out
    assert 1 <= resolved["val_steps"] < 500
    assert resolved["data_source"] == "fineweb" and "data_cache" in resolved["data_dir"]

    import errno
    real_makedirs = os.makedirs

    def read_only(path, *a, **k):  # a read-only file system (root writes into a chmod 555 folder anyway)
        if "readonly" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_makedirs(path, *a, **k)
    monkeypatch.setattr(os, "makedirs", read_only)
    assert train_gpt2.main(tiny_args(data_dir, str(tmp_path / "readonly" / "run"), max_steps=1)) == 2
    line = one_line(capsys.readouterr().err)
    assert "Read-only file system; choose a folder you can write to, or change its permissions" in line

# -----------------------------------------------------------------------------
# issue 44 item 6: start-up silences and noise


def test_the_start_says_what_differs_from_the_defaults_in_a_few_lines(data_dir, tmp_path, capsys):
    """Every start printed the whole config as ~60 lines of JSON: now a block of the keys set that differ from the
    defaults and what the run decided, each named with its value, and where the whole config is."""
    out = str(tmp_path / "out")
    assert train_gpt2.main(tiny_args(data_dir, out, max_steps=1, eval_interval=0, checkpoint_interval=0)) == 0
    printed = capsys.readouterr().out.splitlines()
    assert not [line for line in printed if line.lstrip().startswith(("{", "}", '"'))], printed  # no JSON
    first = printed.index(f"config: what differs from the defaults (every key: {os.path.join(out, 'config.json')})")
    block = []
    for line in printed[first + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    assert 2 <= len(block) <= 6, printed  # 20 keys set (two long paths: a line each), 4 decided; was 63 lines of JSON
    said = " " + " ".join(block) + " "
    saved = json.load(open(os.path.join(out, "config.json")))
    changed = {k: v for k, v in saved["asked"].items() if v != config.FIELDS[k].default}
    assert len(changed) == 20 and saved["decided"] == ["compile", "device", "loss_impl", "precision"]
    for key, value in [*changed.items(), *((k, saved["resolved"][k]) for k in saved["decided"])]:
        assert f" {key}={config.shown(value)} " in said, (key, said)
    assert " seed=0 " in said and " shuffle=" not in said and " warmup_steps=" in said  # set, not a default: said
    assert printed[first + 1 + len(block)].startswith("15,840 parameters | 64 tokens per step")
    again = tiny_args(data_dir, out, max_steps=1, eval_interval=0, checkpoint_interval=0, resume="auto")
    assert train_gpt2.main(again) == 0
    printed = capsys.readouterr().out
    assert "nothing to do" in printed and "config:" not in printed and "{" not in printed  # a finished run: no config


def test_the_first_compile_is_said_once_right_before_it(data_dir, tmp_path, monkeypatch, capsys):
    """On a GPU the model compiled for ~50 s between the start-up lines and step 0 without a word: one line, on
    rank 0, right before the first compile, says so and names the cache a later start reuses. (The compile itself
    is left out: the probe 'fails' and the run goes on eagerly.)"""
    from gpt2train import precision
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "restored"))  # use_compile_cache sets it: undone
    printed_before = []

    def no_compile(step_model, micro_batch, seq_len, plan):
        printed_before.append(capsys.readouterr().out)
        return False

    monkeypatch.setattr(precision, "compiles", no_compile)
    out = tmp_path / "runs" / "a"
    args = tiny_args(data_dir, str(out), max_steps=1, eval_interval=0, checkpoint_interval=0)
    assert train_gpt2.main(args + ["--compile=true"]) == 0
    after = capsys.readouterr().out
    note = precision.compile_note(str(tmp_path / "runs" / ".compile_cache"))
    assert len(printed_before) == 1 and printed_before[0].splitlines()[-1] == note, printed_before
    assert note.startswith("compiling the model (torch.compile; ") and note.endswith(
        f"later starts reuse {tmp_path / 'runs' / '.compile_cache'}")
    assert (printed_before[0] + after).count("compiling the model") == 1
    assert train_gpt2.main(tiny_args(data_dir, str(tmp_path / "eager"), max_steps=1, eval_interval=0)) == 0
    assert "compiling the model" not in capsys.readouterr().out  # no compile, no line
    assert "torch's default cache in /tmp" in precision.compile_note(None)  # compile_cache_dir="": torch's folder
