#!/bin/bash
# One-shot GPU check of mpddp, for a machine with one CUDA GPU; about 4 to 5 minutes, never more than the
# sum of the steps' limits (8 min 20 s) and a few seconds.
#
#   bash scripts/gpu_check.sh            (from the repository root; results in $OUT, else a temp dir)
#
# 1. mpddp train on the GPU: NCCL, one rank, bf16 (synthetic set: no scikit-learn needed)
# 2. mpddp train, two ranks over the one GPU with gloo (NCCL refuses two ranks on one GPU)
# 3. after CUDA is initialized in the parent: start_method='fork' is refused with its reason,
#    and the default forkserver still launches an NCCL rank that uses the GPU
# 4. nccl_hang: one NCCL rank (timeout 5 s) queues an all_reduce behind a 20 s GPU kernel and waits
#    in .item(): a HangError within 30 s, with a line naming that all_reduce (from the flight recorder)
# 5. long_gpu_compute: two gloo ranks on the one GPU (timeout 5 s); rank 0 runs a 15 s GPU kernel and
#    torch.cuda.synchronize() while rank 1 waits in a barrier: not a hang, the launch succeeds
# 6. fr_dump: one NCCL rank's flight recorder, dumped after 3 all_reduces ($OUT/fr_nccl_dump.pkl) and
#    with a 4th queued behind a GPU kernel ($OUT/fr_nccl_open.pkl): recorded dumps for unit tests, from
#    _dump_fr_trace and (*_nccl_trace.pkl) _dump_nccl_trace, NCCL's own recorder in CUDA builds: mpddp reads both
# 7. scripts/bench_train.py --gpu: the Trainer against a plain loop (and DDP variants), and the
#    Trainer with the flight recorder on against off (its cost)
# 8. scripts/bench_launch.py with one rank: the four launchers side by side
# A short table comes last. Each step has its own time limit: 40+40+40+45+45+40+150+100 s = 8 min 20 s.
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
        nccl_hang|long_gpu_compute|fr_dump) grep -o "^$1: .*" "$OUT/$1.log" | tail -1 | cut -c1-170 ;;
        bench_train_gpu) { sed -nE 's|^flight recorder on / off: ([0-9.]+) \(cost ([-0-9.]+) %.*|flight recorder on/off \1 (cost \2 %)|p' \
                               "$OUT/$1.log" | tail -1
                           grep -E '^mpddp Trainer|^plain loop \+' "$OUT/$1.log" | tr -s ' '; } | tr '\n' ';' ;;
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

# The head of the next three checks: the GPU's clock for torch.cuda._sleep, which counts cycles, and a
# refusal at once, with the reason, where no GPU is visible (device_count creates no CUDA context here).
cat > "$WORK/gpu_head.py" <<'PYEOF'
import os
import pickle
import re
import sys
import time

import torch
import mpddp

TIMEOUT = 5.0  # mpddp's hang timeout for these launches


def cycles_per_second():
    """In a rank: the GPU clock as torch.cuda._sleep counts it, timed with CUDA events (about 0.1 s)."""
    torch.cuda._sleep(1_000_000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    end.synchronize()
    return 200_000_000 / (start.elapsed_time(end) / 1000)


def need_gpu(check):
    if torch.cuda.device_count() == 0:
        raise SystemExit(f"{check}: needs a CUDA GPU, but torch.cuda.device_count() is 0 here")
PYEOF

cat "$WORK/gpu_head.py" - > "$WORK/nccl_hang.py" <<'PYEOF'

KERNEL_S = 20.0  # the GPU kernel the last all_reduce waits behind: 4 x the timeout
LIMIT_S = 30.0  # from the rank's wait to the HangError, at most


def recorders():
    """Entries in each flight recorder of this rank (mpddp reads both)."""
    c10d = torch._C._distributed_c10d
    return {name: len(pickle.loads(getattr(c10d, name)(includeCollectives=True, includeStackTraces=False,
                                                         onlyActive=False)).get("entries", ()))
            for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)}


def stuck(ctx, mark):
    import torch.distributed as dist

    t = torch.ones(1024, device=ctx.device)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    rate = cycles_per_second()
    print(f"GPU clock {rate / 1e9:.2f} GHz; flight recorder entries {recorders()}; now a {KERNEL_S:g} s kernel, "
          "an all_reduce queued behind it, and t.item()", flush=True)
    torch.cuda._sleep(int(rate * KERNEL_S))
    dist.all_reduce(t)  # queued behind the kernel: it cannot complete before the timeout
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    return t.item()  # the CPU spins here, waiting for the all_reduce


if __name__ == "__main__":
    need_gpu("nccl_hang")
    mark = os.path.join(sys.argv[1], "nccl_hang.mark")
    start = time.time()
    try:
        value = mpddp.launch(stuck, nprocs=1, backend="nccl", timeout=TIMEOUT, args=(mark,))
    except mpddp.HangError as e:
        end = time.time()
        text = str(e)
        print("---- the HangError ----\n" + text + "\n-----------------------")
        waited = end - float(open(mark).read()) if os.path.exists(mark) else None
        named = re.search(r"entered all_reduce #(\d+).*has not completed", text)
        print("nccl_hang: " + (f"HangError {waited:.1f} s after the rank began to wait" if waited is not None
                               else "HangError before the rank began to wait")
              + f" (timeout {TIMEOUT:g} s; {end - start:.1f} s after the launch); "
              + (f"names all_reduce #{named.group(1)}, not completed" if named else "names NO all_reduce"))
        if waited is None or waited > LIMIT_S or not named:
            raise SystemExit(f"nccl_hang: FAILED: expected a HangError within {LIMIT_S:g} s of the wait, with a "
                             "line 'entered all_reduce #N ... has not completed' from the flight recorder")
    except Exception as e:
        raise SystemExit(f"nccl_hang: FAILED: {type(e).__name__} instead of HangError, "
                         f"{time.time() - start:.1f} s after the launch:\n{e}")
    else:
        raise SystemExit(f"nccl_hang: FAILED: NO HangError: the launch returned {value} after "
                         f"{time.time() - start:.1f} s (the rank waited {KERNEL_S:g} s for its GPU; timeout "
                         f"{TIMEOUT:g} s)")
PYEOF
step nccl_hang 45 $PY "$WORK/nccl_hang.py" "$WORK"

cat "$WORK/gpu_head.py" - > "$WORK/long_gpu.py" <<'PYEOF'

COMPUTE_S = 3 * TIMEOUT  # rank 0's GPU kernel


def work(ctx):
    import torch.distributed as dist

    t = torch.ones(1024, device=ctx.device)
    dist.all_reduce(t)
    seconds = 0.0
    if ctx.rank == 0:
        rate = cycles_per_second()
        start = time.perf_counter()
        torch.cuda._sleep(int(rate * COMPUTE_S))
        torch.cuda.synchronize()  # the CPU spins here while the GPU computes, no collective open: progress
        seconds = time.perf_counter() - start
    dist.barrier()  # rank 1 waits here all along
    return ctx.device, round(seconds, 1), t[0].item()


if __name__ == "__main__":
    need_gpu("long_gpu_compute")
    start = time.time()
    try:
        results = mpddp.launch(work, nprocs=2, backend="gloo", timeout=TIMEOUT)
    except Exception as e:
        raise SystemExit(f"long_gpu_compute: FAILED: {type(e).__name__} {time.time() - start:.1f} s after the "
                         f"launch (a long GPU computation on rank 0 is not a hang):\n{e}")
    print("each rank's (device, seconds of GPU kernel, all_reduce result):", results)
    print(f"long_gpu_compute: ok in {time.time() - start:.1f} s; rank 0 computed {results[0][1]:g} s on the GPU "
          f"(timeout {TIMEOUT:g} s); devices {', '.join(r[0] for r in results)}")
    if results[0][1] < 2 * TIMEOUT:
        raise SystemExit(f"long_gpu_compute: FAILED: rank 0 computed only {results[0][1]:g} s, under 2 x the "
                         "timeout: nothing was tested")
PYEOF
step long_gpu_compute 45 $PY "$WORK/long_gpu.py"

cat "$WORK/gpu_head.py" - > "$WORK/fr_dump.py" <<'PYEOF'

DUMPS = (("_dump_fr_trace", ""), ("_dump_nccl_trace", "_nccl_trace"))  # the other backends'; NCCL's own


def save(out, name):
    """Each recorder's dump as torch returns it (pickled bytes) to out/name[suffix].pkl; -> what each holds."""
    c10d = torch._C._distributed_c10d
    told = {}
    for dump_name, suffix in DUMPS:
        dump = getattr(c10d, dump_name, None)
        if dump is None:
            continue
        data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        with open(os.path.join(out, f"{name}{suffix}.pkl"), "wb") as f:
            f.write(data)
        loaded = pickle.loads(data)
        told[dump_name] = {"entries": [(e.get("collective_seq_id"), e.get("profiling_name"), e.get("state"))
                                       for e in loaded.get("entries", ())],
                           "pg_status": loaded.get("pg_status")}
    return told


def dumps(ctx, out):
    import torch.distributed as dist

    t = torch.ones(1024, device=ctx.device)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    time.sleep(1.0)  # NCCL's watchdog thread marks the entries completed (it looks every 100 ms or so)
    done = save(out, "fr_nccl_dump")
    rate = cycles_per_second()
    torch.cuda._sleep(int(rate * 3))  # 3 s on the GPU: the next all_reduce waits behind it
    dist.all_reduce(t)
    queued = save(out, "fr_nccl_open")  # at once: the all_reduce is queued, not completed
    torch.cuda.synchronize()
    return done, queued


def all_reduces(told):
    return [e for e in (told or {}).get("entries", ()) if str(e[1]).endswith("all_reduce")]


if __name__ == "__main__":
    need_gpu("fr_dump")
    out = sys.argv[1]
    done, queued = mpddp.launch(dumps, nprocs=1, backend="nccl", args=(out,))[0]
    for when, told in (("after 3 all_reduces", done), ("a 4th queued", queued)):
        for dump_name, what in told.items():
            print(f"{when}, {dump_name}: entries (seq, name, state) {what['entries']}; pg_status {what['pg_status']}")
    print("wrote", ", ".join(sorted(f for f in os.listdir(out) if f.startswith("fr_nccl_"))), "in", out)
    verdicts = {}  # recorder -> (all_reduces after 3, how many completed, the queued 4th's state)
    for dump_name in done:
        after, later = all_reduces(done[dump_name]), all_reduces(queued.get(dump_name))
        fourth = later[-1][2] if len(later) > len(after) else "MISSING"
        verdicts[dump_name] = (len(after), sum(e[2] == "completed" for e in after), fourth)
    print("fr_dump: " + "; ".join(f"{name} holds {n} all_reduces after 3 ({c} completed), then the queued 4th: {f}"
                                  for name, (n, c, f) in verdicts.items()))
    # mpddp reads both recorders (NCCL's own, where a CUDA build has it, and the other backends')
    if not any(n >= 3 and f not in ("MISSING", "completed") for n, _, f in verdicts.values()):
        raise SystemExit("fr_dump: FAILED: no recorder holds the 3 all_reduces and then a 4th not completed")
PYEOF
step fr_dump 40 $PY "$WORK/fr_dump.py" "$OUT"

step bench_train_gpu 150 $PY scripts/bench_train.py --gpu --reps 3 --json "$OUT/bench_train_gpu.json"
step bench_launch_1rank 100 $PY scripts/bench_launch.py --ranks 1 --reps 2 --only mpddp,launch,spawn --hang-limit 20 --json "$OUT/bench_launch_1rank.json"

echo
echo "== gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)); logs in $OUT"
printf '%s\n' "${ROWS[@]}"
grep -h -A9 '^GPU, 1 rank' "$OUT/bench_train_gpu.log" 2>/dev/null
grep -h -A8 '^ranks  launcher' "$OUT/bench_launch_1rank.log" 2>/dev/null
