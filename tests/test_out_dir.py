"""A run's out_dir, as a new user meets it (issue 24): one live run per out_dir (a second one refused, a
killed one's lock taken over; the lock itself: tests/test_checkpoint.py), your own text in one command after the
quickstart, the --data cache's val split fixed by the text, out of memory in one line, files with the user's
umask, and no process left.

The trainer runs in subprocesses (the tiny CPU shapes of test_train), each ended by pid on every path.

    python -m pytest -q tests/test_out_dir.py
"""
import contextlib
import dataclasses
import io
import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gpt2train import optim
from gpt2train import checkpoint
import train_gpt2
from conftest import ROOT, LaunchedTree, alive, end_processes, one_line, read_log, tiny_args, wait_for

TRAINER = os.path.join(ROOT, "train_gpt2.py")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # one thread a run: the same sums in every run, light on a shared CPU
WORDS = ("the river ran past the mill and the miller counted his sacks of grain while the children sang "
         "about a fox that stole a hen from the farmer who lived beyond the hill near the old stone bridge").split()

# -----------------------------------------------------------------------------
# helpers: tiny runs, run or started in subprocesses that are always ended


def book(path, n_words=3000, seed=0):
    """A plain-text file of n_words English words (~1 GPT-2 token each): a small book of one's own."""
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
    lines = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, n_words, 12)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def trainer(argv, cwd=ROOT, timeout=300, umask=None, address_space=None):
    """train_gpt2.py argv in a subprocess (optionally under a umask, or an address-space limit), ended by pid
    whatever happens: (exit code, stdout, stderr)."""
    def limits():
        if umask is not None:
            os.umask(umask)
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    p = subprocess.Popen([sys.executable, TRAINER, *argv], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=limits)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_processes([p.pid])
        out, err = p.communicate()
        raise AssertionError(f"train_gpt2.py still running after {timeout} s:\n{out[-2000:]}\n{err[-2000:]}") from None
    finally:
        if p.poll() is None:  # an interrupt while waiting
            end_processes([p.pid])
            p.wait()
    return p.returncode, out, err


def files(folder):
    """{relative path: (size, mtime_ns, bytes' hash)} of every file under folder: what a run wrote."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            st = os.stat(path)
            found[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns, hash(open(path, "rb").read()))
    return found


# -----------------------------------------------------------------------------
# one live run per out_dir


def test_a_second_live_trainer_is_refused_and_the_first_finishes_intact(data_dir, tmp_path):
    """The issue's case: the same command started twice on one out_dir (a notebook cell run again). The second
    stops at once with one line naming the holder, exit 2, writing nothing; the first run is untouched: its log,
    config.json and checkpoint are those of the same run made alone."""
    out, alone = str(tmp_path / "out"), str(tmp_path / "alone")
    shape = dict(max_steps=200, eval_interval=100, val_steps=1, checkpoint_interval=100)
    first = tiny_args(data_dir, out, **shape)
    assert trainer(tiny_args(data_dir, alone, **shape))[0] == 0
    lock = os.path.join(out, "run.lock")
    with LaunchedTree([[sys.executable, TRAINER, *first]], tmp_path, env=ENV) as run:
        holder = run.procs[0]
        wait_for(lambda: os.path.exists(lock) and os.path.getsize(lock) > 0 or holder.poll() is not None, 120,
                 "the first run's lock")
        os.kill(holder.pid, signal.SIGSTOP)  # alive and holding out_dir while the second one tries
        assert holder.poll() is None, run.logs()
        held, before = json.load(open(lock)), files(out)
        code, _, err = trainer(tiny_args(data_dir, out, max_steps=200, seed=1, max_lr=2e-2), timeout=120)
        line = one_line(err)
        assert code == 2 and f"out_dir {out!r} is in use by a live run: pid {holder.pid} on {socket.gethostname()}, " \
            f"since {held['since']}" in line and "choose another --out_dir" in line, line
        assert files(out) == before  # nothing written, nothing removed (the lock is still the first run's)
        os.kill(holder.pid, signal.SIGCONT)
        assert run.wait(300) == [0], run.logs()
    assert not os.path.exists(lock)  # released at the end
    log, reference = read_log(out), read_log(alone)
    assert [r["step"] for r in log if "loss" in r] == list(range(200))  # one run's rows, once each
    losses = lambda rows: [(r["step"], r["loss"]) for r in rows if "loss" in r]  # noqa: E731
    assert losses(log) == losses(reference)  # bit-identical to the same run made alone
    assert [r for r in log if "val_loss" in r] == [r for r in reference if "val_loss" in r]  # {step, val_loss}
    asked = json.load(open(os.path.join(out, "config.json")))["asked"]
    assert asked["seed"] == 0 and asked["max_lr"] == 1e-2  # the first run's, not the second's
    a, b = (torch.load(os.path.join(d, "ckpt_000200.pt"), weights_only=True) for d in (out, alone))
    assert a["step"] == 200 and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def test_a_lock_left_by_a_killed_run_is_taken_over_and_resume_auto_continues(data_dir, tmp_path):
    """SIGKILL (a crash, the OOM killer, a preempted VM) leaves run.lock behind: the next run sees its holder gone,
    takes the lock over and resume=auto continues from the newest checkpoint."""
    out = str(tmp_path / "out")
    lock = os.path.join(out, "run.lock")
    args = dict(max_steps=100000, eval_interval=0, checkpoint_interval=4, resume="auto")
    with LaunchedTree([[sys.executable, TRAINER, *tiny_args(data_dir, out, **args)]], tmp_path, env=ENV) as run:
        killed = run.procs[0]
        wait_for(lambda: os.path.exists(checkpoint.checkpoint_path(out, 8)) or killed.poll() is not None, 120,
                 "the run's second checkpoint")
        os.kill(killed.pid, signal.SIGKILL)
        assert run.wait(30) == [-signal.SIGKILL], run.logs()
    assert json.load(open(lock))["pid"] == killed.pid  # left behind by the killed run
    step = checkpoint.checkpoint_files(out)[0][0]  # the newest complete checkpoint
    code, stdout, err = trainer(tiny_args(data_dir, out, **dict(args, max_steps=step + 4)))
    assert code == 0, err
    assert f"resuming from {checkpoint.checkpoint_path(out, step)} at step {step}" in stdout and "in use" not in err
    assert [r["step"] for r in read_log(out) if "loss" in r][-4:] == [step, step + 1, step + 2, step + 3]
    assert torch.load(checkpoint.checkpoint_path(out, step + 4), weights_only=True)["step"] == step + 4
    assert not os.path.exists(lock)


# -----------------------------------------------------------------------------
# your own text, one command, after the quickstart


def readme_own_text_command():
    """The README's own-text command, as written in its code block."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    command = "python train_gpt2.py configs/quickstart.py --data=my_book.txt"
    assert f"\n{command}  " in text or f"\n{command}\n" in text, "the README no longer shows the own-text command"
    return command.split()[2:]


SMALL = ["--max_steps=4", "--warmup_steps=1", "--micro_batch_size=2", "--seq_len=16", "--total_batch_size=64",
         "--eval_interval=2", "--val_steps=1", "--sample_interval=0"]  # the quickstart's model, a few small steps


def test_the_readmes_own_text_line_trains_right_after_the_quickstart(data_dir, tmp_path):
    """The issue's case: after a finished quickstart in its default out_dir, `python train_gpt2.py
    configs/quickstart.py --data=my_book.txt` trains (into out/quickstart-my_book), where it said 'nothing to do'. A
    finished run is found before any tokenizing; a checkpoint trained on other data gets one line with the ways on."""
    config, data = readme_own_text_command()
    assert config == "configs/quickstart.py" and data == "--data=my_book.txt"
    book(tmp_path / "my_book.txt")
    quickstart = os.path.join("out", "quickstart")
    code, _, err = trainer([QUICKSTART, f"--data_dir={data_dir}", "--data_source=fineweb", *SMALL], cwd=tmp_path)
    assert code == 0 and os.path.exists(tmp_path / quickstart / "ckpt_000004.pt"), err
    finished = files(tmp_path / quickstart)

    code, out, err = trainer([QUICKSTART, data, *SMALL], cwd=tmp_path)  # the README's line (smaller steps)
    assert code == 0, err
    mine = tmp_path / "out" / "quickstart-my_book"
    assert "tokenizing" in out and f"saved {os.path.join('out', 'quickstart-my_book', 'ckpt_000004.pt')}" in out, out
    assert json.load(open(mine / "config.json"))["resolved"]["out_dir"] == os.path.join("out", "quickstart-my_book")
    assert [r["step"] for r in read_log(mine) if "loss" in r] == [0, 1, 2, 3]
    assert files(tmp_path / quickstart) == finished  # the quickstart's run as it was
    cache = [d for d in os.listdir(tmp_path / "out" / "data_cache") if d.startswith("my_book.txt-")]
    assert len(cache) == 1

    shutil.rmtree(tmp_path / "out" / "data_cache")  # the same line again: finished, said before tokenizing
    code, out, err = trainer([QUICKSTART, data, *SMALL], cwd=tmp_path)
    assert code == 0 and "holds a finished run (step 4, max_steps=4): nothing to do" in out, out + err
    assert "tokenizing" not in out and not os.path.exists(tmp_path / "out" / "data_cache")

    # the quickstart's out_dir continued on other data: one line offering a new out_dir or its weights
    more = [a if not a.startswith("--max_steps") else "--max_steps=8" for a in SMALL]
    code, out, err = trainer([QUICKSTART, data, f"--out_dir={quickstart}", *more], cwd=tmp_path)
    line = one_line(err)
    ckpt = os.path.join(quickstart, "ckpt_000004.pt")
    assert code == 2 and "the checkpoint's data order differs from this run's" in line and "--out_dir=" in line \
        and f"--init_from={ckpt} --out_dir=" in line, line
    assert files(tmp_path / quickstart) == finished
    code, out, err = trainer([QUICKSTART, data, f"--init_from={ckpt}", "--out_dir=out/from_quickstart", *SMALL],
                             cwd=tmp_path)  # what the line offers works
    assert code == 0 and os.path.exists(tmp_path / "out" / "from_quickstart" / "ckpt_000004.pt"), err


def test_another_configs_run_on_the_same_text_goes_to_its_own_out_dir(data_dir, hf_dir, tmp_path):
    """Issue 31: every config's --data run went to out/<text name>, so `configs/finetune_gpt2.py
    --data=my_book.txt` after the quickstart's was refused, told to "drop init_from", which the user never typed
    (the config file sets it). Now each config's run on a text has its own out_dir (<its out_dir>-<text name>),
    and a refusal over a key a config file set names the file."""
    text = book(tmp_path / "my_book.txt")
    finetune = tmp_path / "finetune.py"  # configs/finetune_gpt2.py's shape of config, offline: a save_pretrained dir
    finetune.write_text(f"init_from = {hf_dir!r}\nout_dir = 'out/finetune'\nresume = 'auto'\n")
    common = ["--max_steps=2", "--micro_batch_size=2", "--seq_len=16", "--total_batch_size=32", "--eval_interval=0",
              "--sample_interval=0", "--hellaswag_interval=0", f"--data={text}"]
    code, out, err = trainer([QUICKSTART, *common], cwd=tmp_path)
    assert code == 0 and os.path.exists(tmp_path / "out" / "quickstart-my_book" / "ckpt_000002.pt"), err
    code, out, err = trainer([str(finetune), *common], cwd=tmp_path)
    assert code == 0 and os.path.exists(tmp_path / "out" / "finetune-my_book" / "ckpt_000002.pt"), err
    assert sorted(os.listdir(tmp_path / "out")) == ["data_cache", "finetune-my_book", "quickstart-my_book"]
    code, out, err = trainer([str(finetune), *common, "--out_dir=out/quickstart-my_book"], cwd=tmp_path)
    line = one_line(err)
    assert code == 2 and f"holds a run with init_from='scratch', not {hf_dir!r} as asked: choose another --out_dir " \
        f"for a new run ({finetune} sets it)" in line, line


OWN_TEXT = ["--vocab_size=50304", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32",
            "--total_batch_size=64", "--max_steps=1", "--eval_interval=1", "--val_steps=1", "--hellaswag_interval=0",
            "--sample_interval=0"]  # micro_batch_size left at its default (64)


@pytest.fixture(scope="module")
def own_text_run(tmp_path_factory):
    """One trainer run on a small text of one's own at seq_len 16 (tests/test_data.py checks the cache's split
    without a trainer): (its folder, holding notes.txt and out/, with out/data_cache; out_dir; what it printed)."""
    tmp = tmp_path_factory.mktemp("own_text")
    text, out, printed = book(tmp / "notes.txt"), tmp / "out" / "small", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train_gpt2.main([*OWN_TEXT, "--seq_len=16", f"--data={text}", f"--out_dir={out}"]) == 0
    return tmp, out, printed.getvalue()


def test_a_bigger_seq_len_run_leaves_the_val_split_as_the_text_made_it(own_text_run, tmp_path):
    """The issue's case: one run at a larger seq_len re-split the cached text (34% val) and later runs reused it.
    After own_text_run's at seq_len 16 (its cache copied here, beside a new out_dir), a trainer run on the same
    --data at seq_len 32: the cache (its val split) is byte-identical after it, and the split is the text's own
    (10% of a small text)."""
    tmp, _, _ = own_text_run
    shutil.copytree(tmp / "out" / "data_cache", tmp_path / "out" / "data_cache")
    caches = os.listdir(tmp_path / "out" / "data_cache")
    assert len(caches) == 1
    cache = tmp_path / "out" / "data_cache" / caches[0]
    made = files(cache)
    manifest = json.load(open(cache / "manifest.json"))
    tokens = {s: sum(x["tokens"] for x in manifest["shards"] if x["split"] == s) for s in ("train", "val")}
    assert tokens["val"] == pytest.approx(0.1 * (tokens["train"] + tokens["val"]), rel=0.02)  # the text's own
    out = tmp_path / "out" / "b"
    assert train_gpt2.main([*OWN_TEXT, "--seq_len=32", f"--data={tmp / 'notes.txt'}", f"--out_dir={out}"]) == 0
    assert files(cache) == made  # not re-split, not rewritten
    assert json.load(open(out / "config.json"))["resolved"]["data_dir"] == str(cache)


def test_the_data_is_checked_for_the_micro_batch_the_run_chose(own_text_run):
    """micro_batch_size left at its default (64) becomes 4, the largest that divides total_batch_size=64 tokens of
    seq_len 16: a small text whose val split holds ~19 rows trains, checked for 4 rows, not refused for 64."""
    _, out, printed = own_text_run
    assert "micro_batch_size=4: the largest up to 64" in printed
    resolved = json.load(open(out / "config.json"))["resolved"]
    manifest = json.load(open(os.path.join(resolved["data_dir"], "manifest.json")))
    val_tokens = sum(s["tokens"] for s in manifest["shards"] if s["split"] == "val")
    assert resolved["micro_batch_size"] == 4 and 4 * 17 <= val_tokens < 64 * 17  # rows of 16 + 1 tokens

# -----------------------------------------------------------------------------
# out of memory: one line, exit 1


def test_an_injected_cuda_out_of_memory_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    """CUDA's OutOfMemoryError in training (a run resumed on the CPU, its plan then given a CUDA device, the
    training step raising what the CUDA allocator raises): one line, exit 1, naming GPU memory, the micro-batch
    and what to try; the checkpoints written before are intact."""
    out = str(tmp_path / "out")
    assert train_gpt2.main(tiny_args(data_dir, out, max_steps=4)) == 0
    real_setup, steps = train_gpt2.setup, []

    def on_cuda(*a, **k):
        run = real_setup(*a, **k)
        return dataclasses.replace(run, plan=dataclasses.replace(run.plan, device="cuda:0"))

    def step(model, loader, grad_accum, stepping, *a, **k):
        steps.append(stepping.plan.device)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.07 GiB. GPU 0 has a total capacity "
                                     "of 14.74 GiB of which 1.21 GiB is free.")
    monkeypatch.setattr(train_gpt2, "setup", on_cuda)
    monkeypatch.setattr(optim, "accumulate_gradients", step)
    before = files(out)
    capsys.readouterr()
    assert train_gpt2.main(tiny_args(data_dir, out, max_steps=12, eval_interval=0, checkpoint_interval=100,
                                resume="auto")) == 1
    line = one_line(capsys.readouterr().err)
    assert line == ("error: out of GPU memory at micro-batch 2 x 16 (grad_accum 2): try --micro_batch_size=auto, "
                    "a smaller --micro_batch_size (e.g. 1; total_batch_size stays, by more accumulation steps) or "
                    "--activation_checkpointing=blocks"), line
    assert steps == ["cuda:0"]  # raised by the first training step, on the CUDA plan
    assert {k: v for k, v in files(out).items() if k.startswith("ckpt_")} == \
        {k: v for k, v in before.items() if k.startswith("ckpt_")}


def test_a_real_cpu_allocation_failure_is_one_line(data_dir, tmp_path):
    """A training step the CPU cannot hold: a 16.7M-token vocabulary, 2 wide (134 MB of weights), whose loss
    head asks for 1024 x 16.7M fp32 logits (64 GiB) at once, in a process whose address space is capped at
    8 GiB (so nothing is ever touched): DefaultCPUAllocator fails; one line, exit 1."""
    rows = os.path.join(str(tmp_path), "rows")
    os.makedirs(rows)
    rng = np.random.default_rng(0)
    np.save(os.path.join(rows, "toy_val_000000.npy"), rng.integers(0, 64, 2000).astype(np.uint16))
    np.save(os.path.join(rows, "toy_train_000001.npy"), rng.integers(0, 64, 3000).astype(np.uint16))
    args = tiny_args(rows, str(tmp_path / "out"), vocab_size=2**24, n_head=1, n_embd=2, block_size=128, seq_len=128,
                micro_batch_size=8, total_batch_size=1024, max_steps=2, eval_interval=0, checkpoint_interval=0)
    code, out, err = trainer(args, address_space=8 * 2**30)
    line = one_line(err)
    assert code == 1 and line == ("error: out of CPU RAM at micro-batch 8 x 128 (grad_accum 1): try a smaller "
                                  "--micro_batch_size (e.g. 4; total_batch_size stays, by more accumulation steps) "
                                  "or --activation_checkpointing=blocks"), err  # (not auto: on CPU it is the same)
    assert "parameters | 1,024 tokens per step" in out, out  # it was set up, the failure came in training

# -----------------------------------------------------------------------------
# files follow the user's umask


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoints_json_shards_and_the_export_follow_the_umask(tmp_path, mask):
    """A run on --data (its cache: shards, manifest, sources.json), its checkpoint, config.json and log.jsonl, then
    the export: every file 0666 & ~umask (0644 under 022, 0640 under 027), every folder 0777 & ~umask."""
    text = book(tmp_path / "book.txt")
    out = tmp_path / "runs" / "book"
    args = ["--vocab_size=50304", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--seq_len=16",
            "--max_steps=2", "--micro_batch_size=2", "--total_batch_size=64", "--eval_interval=2", "--val_steps=1",
            "--hellaswag_interval=0", "--sample_interval=0", "--checkpoint_interval=1", f"--data={text}",
            f"--out_dir={out}"]
    code, _, err = trainer(args, umask=mask)
    assert code == 0, err
    export = tmp_path / "runs" / "hf"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), str(out / "ckpt_000002.pt"),
                        str(export)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: os.umask(mask))
    assert p.returncode == 0, p.stderr
    seen = {}
    for root, dirs, names in os.walk(tmp_path / "runs"):
        for name in dirs:
            seen[os.path.join(root, name)] = 0o777 & ~mask
        for name in names:
            seen[os.path.join(root, name)] = 0o666 & ~mask
    modes = {os.path.relpath(p, tmp_path): (oct(stat.S_IMODE(os.stat(p).st_mode)), oct(want))
             for p, want in seen.items()}
    assert all(got == want for got, want in modes.values()), {p: m for p, m in modes.items() if m[0] != m[1]}
    kinds = {os.path.basename(p) for p in modes}
    assert {"ckpt_000002.pt", "config.json", "log.jsonl", "manifest.json", "sources.json",
            "model.safetensors", "vocab.json"} <= kinds and any(k.endswith(".npy") for k in kinds), sorted(kinds)

# -----------------------------------------------------------------------------
# nothing left running


def test_the_session_guard_ends_and_reports_a_process_a_test_leaves(tmp_path):
    """conftest.py's guard, in a pytest of its own: a test whose launcher leaves a worker in a session of its own
    (as torchrun's are, out of killpg's reach), stopped, orphaned: the session fails naming it, and it is gone."""
    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:  # the real one, with the repository importable
        (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + f.read())
    pidfile = tmp_path / "worker.pid"
    (tmp_path / "test_leaves_one.py").write_text(textwrap.dedent(f"""
        import os, signal, subprocess, sys

        def test_leaves_a_stopped_orphan():
            worker = "import os, time; os.setsid(); time.sleep(600)"
            launcher = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', " + repr(worker) +
                        "], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
            pid = int(subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                                     timeout=60).stdout)
            os.kill(pid, signal.SIGSTOP)
            open({str(pidfile)!r}, "w").write(str(pid))

        def test_another():
            pass
    """))
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path)], cwd=tmp_path,  # rootdir: a stray setup.py in /tmp would be pytest's
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            end_processes([p.pid])
            p.wait()
    pid = int(pidfile.read_text())
    try:
        assert p.returncode == 1 and "2 passed" in out, out
        assert "error: 1 process(es) left running by the tests, ended by conftest.py's guard:" in out, out
        assert f"pid {pid} after test_leaves_one.py::test_leaves_a_stopped_orphan" in out, out
        assert not alive(pid)
    finally:
        if alive(pid):
            end_processes([pid])


def test_an_out_dir_that_cannot_be_a_folder_is_bad_input(data_dir, tmp_path, capsys):
    """Issue 39 item 11: --out_dir=my_book.txt/run and --out_dir=/proc/x exited 1 (the machine's failure) with
    NotADirectoryError / FileNotFoundError; they are bad input: one line naming the reason, exit 2, nothing made."""
    book = tmp_path / "my_book.txt"
    book.write_text("a book")
    out = str(book / "run")
    assert train_gpt2.main(tiny_args(data_dir, out)) == 2
    assert one_line(capsys.readouterr().err) == (f"error: out_dir {out!r} cannot be made: {book} is a file, not a "
                                                 "folder: choose another --out_dir")
    if os.path.isdir("/proc/self"):  # Linux: a virtual filesystem that makes no folders
        assert train_gpt2.main(tiny_args(data_dir, "/proc/x")) == 2
        assert one_line(capsys.readouterr().err) == ("error: out_dir '/proc/x' cannot be made: /proc allows no new "
                                                     "folders (No such file or directory): choose another --out_dir")
    assert sorted(os.listdir(tmp_path)) == ["my_book.txt"]

# -----------------------------------------------------------------------------
# an out_dir holding files the trainer did not write: refused, untouched


def test_an_export_folder_is_refused_as_out_dir_and_left_byte_identical(data_dir, hf_dir, tmp_path, capsys):
    """Issue 44 item 1 (data loss): the trainer pointed at a folder export.py made trained into it, rc 0, replacing
    its config.json with the run's (from_pretrained then failed) and adding checkpoints that sample.py then took.
    Now it is one line naming the folder and the fix, exit 2, every file of the export as it was."""
    import export
    hf = str(tmp_path / "hf")
    export.export(hf_dir, hf)  # what `python export.py SRC out/quickstart/hf` writes
    assert {"config.json", "model.safetensors", "generation_config.json", "vocab.json"} <= set(os.listdir(hf))
    before = files(hf)
    for resume in ("false", "auto"):
        assert train_gpt2.main(tiny_args(data_dir, hf, max_steps=2, resume=resume)) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"error: out_dir {hf!r} is a Hugging Face model folder") and "--out_dir" in line, line
        assert files(hf) == before  # the same names, bytes and mtimes: nothing written, nothing removed
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(hf)  # still loads


@pytest.mark.parametrize("name", ["config.json", "log.jsonl", "curves.png", "wandb_run.json"])
def test_a_folder_holding_a_file_the_trainer_would_overwrite_is_refused(data_dir, tmp_path, capsys, name):
    """Issue 44 item 1: a folder holding a file of the name the trainer writes (config.json, log.jsonl, ...) that
    no run of it wrote is refused before anything is written; a file the trainer never writes (notes.txt) is no
    obstacle, and a run's own folder resumes as before."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text('{"my": "settings"}\n')
    (out / "notes.txt").write_text("my notes\n")
    before = files(str(out))
    assert train_gpt2.main(tiny_args(data_dir, str(out), max_steps=2)) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (f"error: out_dir {str(out)!r} holds {name}, which train_gpt2.py did not write and would "
                    f"overwrite: choose another --out_dir, or move {name} out of it"), line
    assert files(str(out)) == before
    (out / name).unlink()  # the notes alone: the run trains, then resumes in its own folder
    assert train_gpt2.main(tiny_args(data_dir, str(out), max_steps=2, checkpoint_interval=1)) == 0
    assert train_gpt2.main(tiny_args(data_dir, str(out), max_steps=3, checkpoint_interval=1, resume="auto")) == 0
    assert (out / "notes.txt").read_text() == "my notes\n" and os.path.exists(out / "ckpt_000003.pt")
