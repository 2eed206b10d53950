"""Start-up benchmark: the same trivial DDP job under four launchers, side by side.

The job: init the process group (gloo), one all_reduce, destroy, exit.

  (a) mpddp      `python -m mpddp run --nprocs N job.py` from the shell
  (b) launch     `mpddp.launch(fn, nprocs=N)` in an interpreter that has already
                 imported torch (and run a matmul, as a notebook would); the
                 first launch (b1) and a second one in the same interpreter
                 (b2, forkserver warm) are timed inside that interpreter
  (c) spawn      the textbook `torch.multiprocessing.spawn(main, nprocs=N)`
                 with MASTER_ADDR/MASTER_PORT hard-coded in `main`
  (d) torchrun   `torchrun --standalone --nproc-per-node N job.py`
                 (`python -m torch.distributed.run`): the reference, 1.00

(a), (c) and (d) are timed from process start to exit. Repetitions are
interleaved (a b c d, b c d a, ...) and each ratio is taken against the
torchrun run of the same repetition; the table shows the median ratio and
its range. (c) uses a different fixed port in each run (--port-base, +1 per
run): a hard-coded port reused at once can still be in TIME_WAIT.

    python scripts/bench_launch.py                      # ranks 1,2,4,8, 5 reps
    python scripts/bench_launch.py --ranks 2 --reps 11 --json launch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, summary, table, torch_version, write_json  # noqa: E402

JOB = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as torchrun sets it up
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

SPAWN = """\
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)  # hard-coded, as in the tutorials
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    n, port = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(main, args=(n, port), nprocs=n)
"""

LAUNCH = """\
import json
import sys
import time

import torch

torch.ones(256, 256) @ torch.ones(256, 256)  # a notebook has run torch ops already

import mpddp


def fn(ctx):
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


if __name__ == "__main__":
    n = int(sys.argv[1])
    times = []
    for _ in range(2):
        start = time.perf_counter()
        assert mpddp.launch(fn, nprocs=n) == [float(n)] * n
        times.append(time.perf_counter() - start)
    print("TIMES " + json.dumps(times))
"""

VARIANTS = ("mpddp", "launch", "spawn", "torchrun")
LABELS = {
    "mpddp": "(a) python -m mpddp run",
    "launch1": "(b) mpddp.launch, 1st in a torch interpreter",
    "launch2": "(b) mpddp.launch, 2nd (forkserver warm)",
    "spawn": "(c) torch.multiprocessing.spawn (textbook)",
    "torchrun": "(d) torchrun --standalone",
}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"bench_launch: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def _timed(cmd: list[str], timeout: float) -> float:
    start = time.perf_counter()
    _run(cmd, timeout)
    return time.perf_counter() - start


def one_rep(variant: str, n: int, files: dict[str, str], port: int, timeout: float) -> dict[str, float]:
    py = sys.executable
    if variant == "mpddp":
        return {"mpddp": _timed([py, "-m", "mpddp", "run", "--nprocs", str(n), files["job"]], timeout)}
    if variant == "torchrun":
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), files["job"]]
        return {"torchrun": _timed(cmd, timeout)}
    if variant == "spawn":
        return {"spawn": _timed([py, files["spawn"], str(n), str(port)], timeout)}
    out = _run([py, files["launch"], str(n)], timeout)
    first, second = json.loads(out.stdout.split("TIMES ", 1)[1])
    return {"launch1": first, "launch2": second}


def bench(ranks: list[int], reps: int, warmup: bool, port_base: int, timeout: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    port = port_base
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-") as tmp:
        files = {}
        for name, text in (("job", JOB), ("spawn", SPAWN), ("launch", LAUNCH)):
            files[name] = os.path.join(tmp, f"{name}.py")
            Path(files[name]).write_text(text)
        for n in ranks:
            times: dict[str, list[float]] = {k: [] for k in LABELS}
            for rep in range(-1 if warmup else 0, reps):
                order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
                for variant in order:
                    port += 1
                    for key, value in one_rep(variant, n, files, port, timeout).items():
                        if rep >= 0:  # rep -1 warms the page cache, not counted
                            times[key].append(value)
                if rep >= 0:
                    print(f"  ranks {n} rep {rep + 1}/{reps}: "
                          + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
            results[str(n)] = {k: summary(v, times["torchrun"]) for k, v in times.items()}
    return results


def report(results: dict[str, Any]) -> str:
    rows = []
    for n, by_variant in results.items():
        for key, label in LABELS.items():
            s = by_variant[key]
            rows.append([n, label, f"{s['median']:.2f}", f"{s['ratio']:.2f}",
                         f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}"])
    return table(["ranks", "launcher", "median s", "x torchrun", "range"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4,8", help="comma-separated rank counts [1,2,4,8]")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per rank count [5]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--port-base", type=int, default=29700, help="first hard-coded port of (c) [29700]")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take [300]")
    parser.add_argument("--tiny", action="store_true", help="test mode: one repetition, no warm-up, ranks 1")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")] if not args.tiny or args.ranks != "1,2,4,8" else [1]
    reps = 1 if args.tiny else args.reps
    print(f"bench_launch: {machine()}, torch {torch_version()}, ranks {ranks}, {reps} interleaved reps", flush=True)
    results = bench(ranks, reps, not args.tiny, args.port_base, args.timeout)
    print()
    print(report(results))
    write_json(args.json, {"benchmark": "launch", "torch": torch_version(), "reps": reps, "results": results})


if __name__ == "__main__":
    main()
