"""How fast a Ctrl-C during ``mpddp train``'s start-up is answered, against the torch import it used to wait for.

Each repetition starts ``python -m mpddp train --nprocs 2`` in a session of
its own (SIGINT at its default action, as from a terminal), sends SIGINT
after each delay in ``--delays`` (during start-up: the forkserver and the
launcher import torch), and measures the time from the signal to the
launcher's exit; it then checks that no process of the run is left. The
baseline, measured in the same run, is ``python -c "import torch"``: what
waiting for the forkserver's import costs at most. The ratio is the
latency against it (well under 1: the import is not waited for).

    python scripts/bench_interrupt.py                  # 5 reps, delays 0.2, 0.6, 1.2 s
    python scripts/bench_interrupt.py --tiny            # one rep, one delay (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, table, torch_version, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def import_time() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def interrupted(delay: float, run_dir: str) -> tuple[float, int, list[int]]:
    """(seconds from SIGINT to exit, exit code, pids of the run still running after it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "mpddp", "train", "--nprocs", "2", "--epochs", "1",
                             "--run-dir", run_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, restore_signals=True)
    time.sleep(delay)
    try:
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        tree = [proc.pid]
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)
    took = time.perf_counter() - sent
    time.sleep(0.3)
    left = [p for p in tree[1:] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return took, code, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--delays", default="0.2,0.6,1.2", help="seconds after the start at which SIGINT is sent")
    parser.add_argument("--tiny", action="store_true", help="one repetition of one delay (a smoke run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reps, delays = (1, [0.3]) if args.tiny else (args.reps, [float(d) for d in args.delays.split(",")])
    print(f"bench_interrupt: {machine()}, torch {torch_version()}, {reps} rep(s)", flush=True)
    baseline = statistics.median(import_time() for _ in range(reps))
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-interrupt-") as tmp:
        for delay in delays:
            runs = [interrupted(delay, os.path.join(tmp, f"run-{delay}-{i}")) for i in range(reps)]
            latencies = [t for t, _, _ in runs]
            left = sorted({p for _, _, pids in runs for p in pids})
            codes = sorted({c for _, c, _ in runs})
            median = statistics.median(latencies)
            results[str(delay)] = {"latencies": latencies, "median": median, "ratio": median / baseline,
                                   "codes": codes, "left": left}
            rows.append([f"{delay:.1f} s", f"{median:.2f} s", f"{max(latencies):.2f} s", f"{median / baseline:.2f}",
                         ",".join(map(str, codes)), "none" if not left else f"{len(left)} LEFT"])
    print()
    print(f"Ctrl-C during `mpddp train --nprocs 2` start-up; baseline `import torch`: {baseline:.2f} s")
    print(table(["SIGINT after", "answered in", "worst", "x import", "exit", "left"], rows))
    write_json(args.json, {"benchmark": "interrupt", "torch": torch_version(), "reps": reps, "import_s": baseline,
                           "delays": results})


if __name__ == "__main__":
    main()
