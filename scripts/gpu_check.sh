#!/bin/bash
# One-shot GPU check of mpddp, for a machine with one CUDA GPU; under 5 minutes.
#
#   bash scripts/gpu_check.sh            (from the repository root; results in $OUT, else a temp dir)
#
# 1. mpddp train on the GPU: NCCL, one rank, bf16 (synthetic set: no scikit-learn needed)
# 2. mpddp train, two ranks over the one GPU with gloo (NCCL refuses two ranks on one GPU)
# 3. after CUDA is initialized in the parent: start_method='fork' is refused with its reason,
#    and the default forkserver still launches an NCCL rank that uses the GPU
# 4. scripts/bench_train.py --gpu: the Trainer against a plain loop (and DDP variants)
# 5. scripts/bench_launch.py with one rank: the four launchers side by side
# A short table comes last. Each step has its own time limit, so the whole stays under 5 minutes.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/mpddp-gpu-check-XXXX)}
WORK=$(mktemp -d /tmp/mpddp-gpu-work-XXXX)
trap 'rm -rf "$WORK"' EXIT
ROWS=()

step() {  # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, remember rc and seconds
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$(date +%s%N)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    tail -n 25 "$OUT/$name.log"
    local result=ok; [ $rc -eq 0 ] || result="FAIL rc=$rc"; [ $rc -eq 124 ] && result="TIMEOUT"
    ROWS+=("$(printf '%-20s %-12s %4d.%ds  %s' "$name" "$result" $((ms / 1000)) $((ms % 1000 / 100)) "$(summary_of "$name")")")
}

summary_of() {  # the one figure worth a glance, from a step's log
    case $1 in
        train_nccl_1rank|train_gloo_2ranks) grep -o 'test loss [0-9.]*.*samples/s' "$OUT/$1.log" | tail -1 ;;
        fork_refused) grep -o 'fork: refused.*\|forkserver: .*' "$OUT/$1.log" | tr '\n' ' ' | cut -c1-90 ;;
        bench_train_gpu) grep -E '^mpddp Trainer|^plain loop \+' "$OUT/$1.log" | awk '{print $0}' | tr -s ' ' | tr '\n' ';' ;;
        bench_launch_1rank) grep -E '^1 ' "$OUT/$1.log" | sed -E 's/  +/ /g' | cut -d' ' -f3- | tr '\n' ';' ;;
    esac
}

echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -1)"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

step train_nccl_1rank 40 $PY -m mpddp train --dataset synthetic --nprocs 1 --backend nccl --precision bf16 \
    --epochs 2 --batch-size 256 --samples 32768 --run-dir "$WORK/nccl" --verbose
step train_gloo_2ranks 40 $PY -m mpddp train --dataset synthetic --nprocs 2 --backend gloo --precision bf16 \
    --epochs 2 --batch-size 256 --samples 32768 --run-dir "$WORK/gloo" --verbose

cat > "$WORK/fork_check.py" <<'PYEOF'
import torch
import mpddp


def on_gpu(ctx):
    import torch.distributed as dist
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return (ctx.backend, ctx.device, t.item())


if __name__ == "__main__":
    torch.ones(1, device="cuda")  # CUDA is initialized in this (the launching) process
    try:
        mpddp.launch(on_gpu, nprocs=1, start_method="fork")
        raise SystemExit("fork: NOT refused after CUDA was initialized")
    except mpddp.ConfigError as e:
        assert "start_method='fork' is unsafe" in str(e), e
        print("fork: refused:", str(e)[:160])
    print("forkserver:", mpddp.launch(on_gpu, nprocs=1))
PYEOF
step fork_refused 40 $PY "$WORK/fork_check.py"
step bench_train_gpu 100 $PY scripts/bench_train.py --gpu --reps 3 --json "$OUT/bench_train_gpu.json"
step bench_launch_1rank 100 $PY scripts/bench_launch.py --ranks 1 --reps 2 --only mpddp,launch,spawn --hang-limit 20 --json "$OUT/bench_launch_1rank.json"

echo
echo "== gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)); logs in $OUT"
printf '%s\n' "${ROWS[@]}"
grep -h -A8 '^GPU, 1 rank' "$OUT/bench_train_gpu.log" 2>/dev/null
grep -h -A8 '^ranks  launcher' "$OUT/bench_launch_1rank.log" 2>/dev/null
