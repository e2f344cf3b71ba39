"""bench.py and its rooms (gpt2train/ladder.py, ddp_bench.py, memory_report.py): the --quick ladder end to end,
the rung rules, DDP's two orders, and the memory report and fit table (its measurements checked by independent
counts). memory.py's estimate, search and probes are tests/test_memory.py's."""
import json
import subprocess
import sys
import warnings

import pytest
import torch

import bench
from gpt2train import ddp_bench
from gpt2train import ladder
from gpt2train import memory
from gpt2train import memory_report
from gpt2train import microbatch
from gpt2train import optim
from conftest import ROOT, adamw, cpu_plan, tiny_model
from gpt2train.fileio import UserError
from model import GPT, GPTConfig, flops_per_token
from gpt2train.precision import default_plan

NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)  # bf16/fp32: a disabled scaler, a no-op
RUNG_PREFIXES = ["fp32", "+TF32", "+autocast", "+torch.compile", "+SDPA", "+vocab 50304", "+fused AdamW",
                 "+loss head"]
OPTIONS_CPU = ["attention kernels", "chunked loss", "micro-batch 16", "micro-batch 32", "micro-batch 64"]
CHUNKED = {"chunked loss": {"loss": "chunked"}}


def job(plan, micro_batch, seq_len, build=bench.build):
    """A Ladder job at the tiny size, no warm-up and one timed step, with bench.py's GPT (or a wrapper of it)."""
    return ladder.Ladder(plan, "tiny", micro_batch, seq_len, 0, 1, build, flops_per_token, verbose=False)


# -----------------------------------------------------------------------------
# the ladder


def test_quick_ladder_runs_every_rung_or_says_why(tmp_path):
    out = tmp_path / "ladder.json"
    r = subprocess.run([sys.executable, "bench.py", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == len(RUNG_PREFIXES) + len(OPTIONS_CPU)
    progress = [line for line in r.stderr.splitlines() if line.startswith(("timing", "then", "  "))]
    assert progress[0].startswith("timing the core rungs from the trainer's stack down to fp32")
    assert progress[1].startswith("  +loss head: ") and progress[8].startswith("  fp32: ")  # as the first line says
    assert progress[9].startswith("then the options") and progress[10].startswith("  attention kernels: ")
    assert [row["name"] for row in rows[len(RUNG_PREFIXES):]] == OPTIONS_CPU  # --quick is micro-batch 4
    for row, prefix in zip(rows, RUNG_PREFIXES + OPTIONS_CPU):
        assert row["name"].startswith(prefix)
        assert row["name"] in r.stdout  # the printed table has every rung, skipped or not
        assert {"name", "ms_per_step", "tokens_per_s", "mfu", "peak_allocated", "peak_reserved", "skipped"} <= set(row)
    skipped = {row["name"]: row["skipped"] for row in rows if row["skipped"]}
    assert set(skipped) == {"+TF32", "+autocast", "+torch.compile", *OPTIONS_CPU}  # CPU: fp32, no TF32, no compile
    assert "precision plan for cpu is fp32" in skipped["+autocast"]
    assert all(skipped[name] == "a GPU option: not run on cpu" for name in OPTIONS_CPU)
    measured = [row for row in rows if not row["skipped"]]
    first = measured[0]
    for prev, row in zip([None] + measured, measured):
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(4 * 32 / (row["ms_per_step"] / 1000))  # --quick is 4 x 32
        assert row["speedup_first"] == pytest.approx(row["tokens_per_s"] / first["tokens_per_s"])
        if prev:
            assert row["speedup_prev"] == pytest.approx(row["tokens_per_s"] / prev["tokens_per_s"])
        assert row["mfu"] is None and row["peak_allocated"] is None  # no peak FLOPs or allocator on a CPU
        assert row["syncs_per_step"] is None  # sync debug mode is CUDA's
    assert "syncs/step" in r.stdout


def test_count_syncs_counts_sync_warnings_only_and_restores_the_mode():
    modes = []

    def step():  # what torch.cuda's TORCH_WARN looks like from Python, twice from the same line
        for _ in range(2):
            warnings.warn(ladder.SYNC_WARNING, stacklevel=1)
        warnings.warn("some other warning", stacklevel=1)

    assert ladder.count_syncs(step, set_mode=modes.append) == 2
    assert modes == ["warn", "default"]
    assert ladder.count_syncs(step, set_mode=modes.append) == 2  # Python's once-per-line filter does not hide repeats
    assert ladder.count_syncs(lambda: None, set_mode=modes.append) == 0
    with pytest.raises(ZeroDivisionError):
        ladder.count_syncs(lambda: 1 / 0, set_mode=modes.append)
    assert modes[-2:] == ["warn", "default"]  # restored on the way out of a failing step too


@pytest.mark.parametrize("cap,skipped,autocast,sdpa", [
    ((9, 0), set(), "+autocast bf16", "+SDPA cudnn/flash/efficient/math"),
    ((8, 6), set(), "+autocast bf16", "+SDPA flash/efficient/math"),
    ((7, 5), {"+TF32"}, "+autocast fp16+GradScaler", "+SDPA efficient/math"),
    ((6, 1), {"+TF32", "+autocast", "+torch.compile"}, "+autocast", "+SDPA (torch's choice)"),
])
def test_cuda_rungs_follow_the_precision_plan(cap, skipped, autocast, sdpa):
    rungs = ladder.ladder_rungs(default_plan("cuda:0", cap), "cuda", cap)[:8]
    names = [r[0] for r in rungs]
    assert names[2] == autocast and names[4] == sdpa
    assert {name for name, _, reason, *_ in rungs if reason} == skipped
    assert not any(optional for *_, optional in rungs)
    for _, _, reason, *_ in rungs:
        if reason:
            assert f"sm{cap[0]}{cap[1]}" in reason
    if cap[0] == 7:
        assert "no flash kernel" in rungs[4][3]
        assert rungs[2][1] == {"dtype": torch.float16, "scaler": True}


@pytest.mark.parametrize("device,cap,micro_batch,expected", [
    ("cuda:0", (9, 0), 16, {"attention flash/efficient/math": {"sdpa_backends": ("flash", "efficient", "math")},
                            "attention efficient/math": {"sdpa_backends": ("efficient", "math")}, **CHUNKED,
                            "micro-batch 32": {"micro_batch": 32}, "micro-batch 64": {"micro_batch": 64}}),
    ("cuda:0", (8, 0), 64, {"attention efficient/math": {"sdpa_backends": ("efficient", "math")}, **CHUNKED,
                            "micro-batch 16": {"micro_batch": 16}, "micro-batch 32": {"micro_batch": 32}}),
    ("cuda:0", (7, 5), 16, {**CHUNKED, "micro-batch 32": {"micro_batch": 32}, "micro-batch 64": {"micro_batch": 64}}),
])
def test_option_rungs_come_from_the_plan(device, cap, micro_batch, expected):
    """After the eight cumulative rungs: the plan's other kernel orders (never math first), the chunked loss head
    (the memory fallback), the other micro-batches of 16/32/64; all optional, none skipped on these GPUs except
    sm7x's single kernel. No compile-mode rung: max-autotune's autotuning took a whole process down on an H200
    (CUDA illegal memory access), so the modes are the trainer's compile_mode, each timed in a process of its own."""
    plan = default_plan(device, cap)
    rungs = ladder.ladder_rungs(plan, "cuda", cap, micro_batch=micro_batch)
    options = rungs[8:]
    assert all(optional for *_, optional in options) and not any("autotune" in name for name, *_ in rungs)
    assert {name: change for name, change, reason, _, _ in options if reason is None} == expected
    skipped = {name: reason for name, _, reason, _, _ in options if reason}
    assert skipped == ({"attention kernels": "the precision plan for cuda sm75 has one kernel (efficient/math)"}
                       if cap == (7, 5) else {})


def test_option_rungs_skip_on_cpu():
    rungs = ladder.ladder_rungs(default_plan("cpu"), "cpu", micro_batch=16)
    assert [(name, reason) for name, _, reason, _, _ in rungs[8:]] == [
        ("attention kernels", "a GPU option: not run on cpu"), ("chunked loss", "a GPU option: not run on cpu"),
        ("micro-batch 32", "a GPU option: not run on cpu"),
        ("micro-batch 64", "a GPU option: not run on cpu")]


def test_options_are_kept_only_when_faster(monkeypatch):
    """A slower option is reported and dropped (the next rung builds on the best row), a faster one kept."""
    rungs = [("base", {}, None, "", False), ("slow", {"vocab": 1}, None, "", True),
             ("fast", {"micro_batch": 8}, None, "", True), ("after", {"fused": True}, None, "", True)]
    seen = []

    def fake_time_rung(settings, job):
        seen.append(dict(settings))
        ms = {0: 100.0, 1: 120.0, 2: 150.0, 3: 400.0}[len(seen) - 1]  # "fast" does 2x the tokens in 1.5x the time
        return ms, 1.0, (None, None), None, "full"

    monkeypatch.setattr(ladder, "ladder_rungs", lambda *a, **k: rungs)
    monkeypatch.setattr(ladder, "time_rung", fake_time_rung)
    rows = ladder.run_ladder(job(default_plan("cpu"), 4, 32))
    assert [r["kept"] for r in rows] == [None, False, True, False]
    assert "not kept (slower)" in rows[1]["note"] and rows[2]["note"].endswith("kept")
    assert seen[2]["vocab"] == 50257 and seen[2]["micro_batch"] == 8  # "slow" dropped before "fast" ran
    assert seen[3]["micro_batch"] == 8 and seen[3]["fused"]  # "fast" kept under "after"
    assert rows[2]["tokens_per_s"] == pytest.approx(8 * 32 / 0.150)
    assert rows[2]["speedup_prev"] == pytest.approx((8 * 32 / 0.150) / (4 * 32 / 0.100))  # vs the best, not "slow"


def test_core_ladder_times_the_trainers_stack_first_and_reports_every_rung_as_it_goes(monkeypatch):
    """--core: the core rungs only, timed last to first (a cut-off keeps the trainer's stack), each with the
    baseline plus every applicable change up to it; on_row sees the rows after each rung, the rest 'not run'."""
    seen, snapshots = [], []

    def fake_time_rung(settings, job):
        seen.append(dict(settings))
        return 100.0 * len(seen), 1.0, (None, None), None, "full"

    monkeypatch.setattr(ladder, "time_rung", fake_time_rung)
    rows = ladder.run_ladder(job(default_plan("cpu"), 4, 32), core=True,
                             on_row=lambda rows: snapshots.append([dict(r) for r in rows]))
    assert [r["name"][:len(p)] for r, p in zip(rows, RUNG_PREFIXES)] == RUNG_PREFIXES and len(rows) == 8
    timed = [r for r in rows if r["skipped"] is None]  # CPU: fp32, SDPA, vocab, fused, the trainer's loss head
    assert seen[0]["loss"] == "auto" and seen[0]["fused"] and seen[0]["vocab"] == 50304  # the whole stack first
    assert seen[1]["loss"] == "full" and seen[1]["fused"]  # then +fused AdamW: the same with plain full logits
    assert seen[-1] == dict(ladder.BASELINE, micro_batch=4)  # fp32 last
    assert len(snapshots) == 8 and snapshots[0][-1]["ms_per_step"] == 100.0  # +loss head, written at once
    assert all(r["skipped"] == "not run (yet)" for r in snapshots[0][:-1] if r["name"] not in ("+TF32",))
    assert [r["ms_per_step"] for r in timed] == [500.0, 400.0, 300.0, 200.0, 100.0]  # ladder order in the table
    for prev, row in zip(timed, timed[1:]):
        assert row["speedup_prev"] == pytest.approx(row["tokens_per_s"] / prev["tokens_per_s"])
        assert row["speedup_first"] == pytest.approx(row["tokens_per_s"] / timed[0]["tokens_per_s"])


def test_loss_head_rung_runs_the_trainers_head(monkeypatch):
    """The rung's model takes the trainer's loss head for its plan and micro-batch (memory.use_loss_head:
    choose_loss_impl and memory.loss_chunk's rows, the trainer's functions; on this CPU plan, compile off: chunked),
    and the row says which."""
    asked, built = [], []
    monkeypatch.setattr(memory, "loss_chunk", lambda plan, rows, vocab: asked.append((rows, vocab)) or 37)
    rungs = [r for r in ladder.ladder_rungs(default_plan("cpu"), "cpu") if r[0] in ("fp32", "+loss head")]
    monkeypatch.setattr(ladder, "ladder_rungs", lambda *a, **k: rungs)
    # the job's build: bench.py's, each rung's model kept
    rows = ladder.run_ladder(job(default_plan("cpu"), 2, 16,
                                 build=lambda *a, **k: built.append(bench.build(*a, **k)) or built[-1]))
    assert [(raw.loss_impl, raw.ce_chunk_rows) for raw, _, _ in built] == [("chunked", 37), ("full", 37)]
    assert (2 * 16, 50257) in asked  # loss head first (the trainer's stack), then fp32: vocab 50257 both
    assert rows[-1]["note"].endswith(": chunked, 37 rows a chunk") and rows[-1]["skipped"] is None
    assert bench.use_loss_head is memory.use_loss_head


def test_compile_can_be_forced_on_cpu():
    plan = default_plan("cpu")
    assert ladder.ladder_rungs(plan, "cpu")[3][2] is not None
    assert ladder.ladder_rungs(plan, "cpu", force_compile=True)[3][2] is None


def test_ddp_orders_wrap_and_train_alike(tmp_path):
    """Both DDP orders in a 1-process gloo group (the eager backend: seconds, not minutes): the wrappers
    nest as named, one step gives the same gradients, and run_ddp times both or says why not."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plan = default_plan("cpu")
        grads = []
        for order in ddp_bench.DDP_ORDERS:
            model = tiny_model(vocab_size=50257)
            opt = adamw(model)
            wrapped = ddp_bench.wrap_ddp(model, order, None, backend="eager")
            if order == "DDP(compile(model))":
                assert isinstance(wrapped, DDP) and wrapped.module._orig_mod is model
            else:
                assert isinstance(wrapped._orig_mod, DDP) and wrapped._orig_mod.module is model
            optim.train_step(wrapped, optim.Stepping(plan, NO_SCALER, [opt]), *microbatch.random_batch(2, 16, "cpu"))
            grads.append([p.detach().clone() for p in model.parameters()])  # the weights one step on: same gradients
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
        rows = ddp_bench.run_ddp(job(plan, 2, 16), force_compile=True, backend="eager")
        assert [r["name"] for r in rows] == list(ddp_bench.DDP_ORDERS)
        assert all(r["skipped"] is None and r["ms_per_step"] > 0 for r in rows)
        assert rows[0]["tokens_per_s"] == pytest.approx(2 * 16 / (rows[0]["ms_per_step"] / 1000))
        off = ddp_bench.run_ddp(job(plan, 2, 16))
        assert all("compile off" in r["skipped"] for r in off) and "skipped" in ddp_bench.ddp_table(off)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_bad_options_exit_with_one_line(capsys):
    cases = [(["--quick", "--steps", "0"], "--steps must be at least 1"),
             (["--quick", "--ddp"], "run it under torchrun"),
             (["--quick", "--headroom", "1.5"], "--headroom must be in [0, 1)"),
             (["--quick", "--device", "tpu"], "device 'tpu' is not one of")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA GPU"))
    for argv, message in cases:
        assert bench.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(UserError, match="pip install matplotlib"):
        ladder.require_matplotlib()


# -----------------------------------------------------------------------------
# memory accounting


def live_after_forward(model, x, y):
    """Bytes of the storages the forward created that are still alive once it returned (its loss
    left out): an independent count of what it keeps, by weak reference instead of autograd's hooks."""
    counter = memory_report.LiveTensors(exclude=memory_report.storage_ptrs(model.parameters()))
    with counter:
        _, loss = model(x, y)
    return counter.live() - loss.untyped_storage().nbytes()


def test_checkpointing_keeps_only_block_inputs():
    """What autograd's hooks see is all the forward keeps, checkpointed or not; a checkpointed block
    keeps its input only, B x T x C fp32."""
    B, T, C, L = 3, 24, 32, 4
    kept = {}
    for mode in ("none", "blocks", "every_other"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, vocab_size=300, n_layer=L, n_head=4, n_embd=C),
                    activation_checkpointing=mode)
        x, y = torch.randint(0, 300, (B, T)), torch.randint(0, 300, (B, T))
        kept[mode] = memory_report.saved_activation_bytes(model, x, y, cpu_plan(torch.float32))[0]
        assert kept[mode] == live_after_forward(model, x, y)
    plain_layer = 14 * B * T * C * 4 + 2 * B * T * C * 4 + 2 * 2 * B * T * 4 + B * 4 * T * 4  # see the estimate
    assert kept["none"] - kept["blocks"] == L * (plain_layer - B * T * C * 4)
    assert kept["none"] - kept["every_other"] == (L // 2) * (plain_layer - B * T * C * 4)


def test_chunked_loss_lowers_the_step_peak():
    """A vocabulary-heavy model: the full loss holds (B*T, V) fp32 tensors at its peak (logits,
    log-softmax, their gradient); the chunked one holds chunks of them."""
    B, T, V = 4, 32, 4000
    peaks = {}
    for impl in ("full", "chunked"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, vocab_size=V, n_layer=1, n_head=2, n_embd=16), loss_impl=impl)
        x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
        peaks[impl] = memory_report.step_peak_bytes(model, x, y, cpu_plan(torch.float32))
        assert all(p.grad is None for p in model.parameters())
    assert peaks["full"] > 3 * B * T * V * 4
    assert peaks["full"] - peaks["chunked"] > 2 * B * T * V * 4


def test_memory_report_on_cpu_separates_every_part():
    modes = memory_report.Modes(loss="full", ckpt="every_other", world_size=4, fsdp=True)
    lines = memory_report.memory_report(job(default_plan("cpu"), 2, 16), modes)
    text = "\n".join(lines)
    for part in ("parameters", "gradients", "optimizer state", "activations", "logits", "step peak", "allocator",
                 "TF32 off vs on", "full loss, activation checkpointing every_other", "per rank, FSDP over 4"):
        assert part in text
    act = next(line for line in lines if line.strip().startswith("activations")).split()
    assert act[1:3] == act[-2:]  # measured == estimate, e.g. "1.2 MiB ... estimate 1.2 MiB"
    logits = next(line for line in lines if line.strip().startswith("logits")).split()
    assert logits[1:3] == ["6.1", "MiB"] == logits[-2:]  # 2 x 16 x 50304 x 4 bytes


def test_tf32_workspace_takes_the_peaks_of_time_rung(monkeypatch):
    """--memory's TF32 line (CUDA only) reads the peaks out of time_rung's five results (it unpacked four: a
    ValueError on every GPU)."""
    seen = []

    def fake_time_rung(settings, job):
        seen.append(settings["tf32"])
        assert (job.size, job.micro_batch, job.seq_len, job.warmup, job.steps) == ("tiny", 2, 16, 1, 3)
        return 1.0, 2.0, (10 + len(seen), 20 + len(seen)), 0, "full"

    monkeypatch.setattr(memory_report, "time_rung", fake_time_rung)
    assert memory_report.tf32_workspace(job(default_plan("cpu"), 2, 16)) == {False: (11, 21), True: (12, 22)}
    assert seen == [False, True]


# -----------------------------------------------------------------------------
# what fits where: the table behind --fit


def test_fit_table_orders_the_modes():
    lines = memory_report.fit_table(bench.fit_configs(("gpt2", "gpt2-xl")))
    rows = [line.split(" | ")[2:] for line in lines[2:]]
    assert len(rows) == 2 * len(memory_report.GPUS)
    cells = [[0 if c.strip(" |") == "-" else int(c.strip(" |")) for c in row] for row in rows]
    for c in cells:  # full loss <= chunked <= +every_other <= +blocks; DDP <= 1 GPU; FSDP >= DDP
        assert c[0] <= c[1] <= c[2] <= c[3] and c[4] <= c[1] and c[6] >= c[4] and c[7] >= c[6]
    xl_t4 = cells[len(memory_report.GPUS)]
    assert xl_t4[:6] == [0] * 6 and xl_t4[6] > 0  # 1558M: 25 GB of fp32 state; on 16 GB only sharded over 8
