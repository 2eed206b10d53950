"""Teardown benchmark: from one rank's failure to the moment no process of the run remains.

Two failures of rank 1 in a 2-rank gloo job whose rank 0 waits in a barrier:

  kill   the harness sends SIGKILL to rank 1 (its pid printed by the job);
         the clock starts just before the kill
  raise  rank 1 raises an exception; the clock starts in rank 1, at
         time.monotonic() just before the raise (CLOCK_MONOTONIC is
         machine-wide on Linux, so the harness can compare)

The clock stops when every process of the run has gone: the launcher, all
of its descendants listed once every rank was up (mpddp's forkserver,
torch's resource tracker, ...) and the ranks themselves (psutil, polled
every 2 ms; a zombie counts as gone). Launchers compared in the same run:

  mpddp      python -m mpddp run --nprocs 2 job.py
  spawn      torch.multiprocessing.spawn(main, nprocs=2) (the textbook form)
  torchrun   torchrun --standalone --nproc-per-node 2 job.py (the reference)

    python scripts/bench_teardown.py                  # 5 interleaved reps
    python scripts/bench_teardown.py --reps 9 --json teardown.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, summary, table, torch_version, write_json  # noqa: E402

from mpddp.core.procs.teardown import tree

BODY = """\
def body(rank, mode, go, stamp):
    import os, time
    import torch.distributed as dist
    print(f"READY {rank} {os.getpid()}", flush=True)
    if rank != 1:
        dist.barrier()  # waits for rank 1, which never arrives
        return
    while mode == "raise" and not os.path.exists(go):
        time.sleep(0.002)
    if mode == "raise":
        with open(stamp + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(stamp + ".tmp", stamp)
        raise RuntimeError("injected failure in rank 1")
    time.sleep(3600)  # until the harness kills it
"""

JOB = BODY + """
import sys
import torch.distributed as dist

dist.init_process_group("gloo")
body(dist.get_rank(), *sys.argv[1:4])
dist.destroy_process_group()
"""

SPAWN = BODY + """
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, port, mode, go, stamp):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    body(rank, mode, go, stamp)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(int(sys.argv[1]), *sys.argv[2:5]), nprocs=2)
"""

LABELS = {"mpddp": "python -m mpddp run", "spawn": "torch.multiprocessing.spawn", "torchrun": "torchrun --standalone"}
READY = re.compile(r"READY (\d+) (\d+)")


class Run:
    """One launcher process, its output read on a thread, its ranks' pids."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.output = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output += line

    def ranks(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = {int(r): int(p) for r, p in READY.findall(self.output)}
            if len(found) == 2:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        raise SystemExit(f"bench_teardown: the ranks did not come up:\n{self.output[-3000:]}")

    def everything(self, rank_pids: dict[int, int]) -> list[psutil.Process]:
        return tree([self.proc.pid, *rank_pids.values()])

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _gone(procs: list[psutil.Process], launcher: subprocess.Popen) -> bool:
    launcher.poll()  # reap our own child
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def one(launcher: str, mode: str, tmp: str, port: int, timeout: float) -> float:
    go, stamp = os.path.join(tmp, f"go-{port}"), os.path.join(tmp, f"stamp-{port}")
    py, job = sys.executable, os.path.join(tmp, "job.py")
    cmd = {"mpddp": [py, "-m", "mpddp", "run", "--nprocs", "2", job, mode, go, stamp],
           "torchrun": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", job, mode, go,
                        stamp],
           "spawn": [py, os.path.join(tmp, "spawn.py"), str(port), mode, go, stamp]}[launcher]
    run = Run(cmd)
    try:
        rank_pids = run.ranks(timeout)
        time.sleep(0.2)  # let rank 0 enter its barrier
        procs = run.everything(rank_pids)
        if mode == "kill":
            start = time.monotonic()
            os.kill(rank_pids[1], signal.SIGKILL)
        else:
            Path(go).touch()
        deadline = time.monotonic() + timeout
        while not _gone(procs, run.proc):
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_teardown: {launcher} left processes after {timeout:.0f} s: "
                                 f"{[p.pid for p in procs if p.is_running()]}")
            time.sleep(0.002)
        end = time.monotonic()
        if mode == "raise":
            start = float(Path(stamp).read_text())
        return end - start
    finally:
        run.kill()


def bench(launchers: list[str], modes: list[str], reps: int, port_base: int, timeout: float) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {m: {name: [] for name in launchers} for m in modes}
    port = port_base
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-teardown-") as tmp:
        Path(tmp, "job.py").write_text(JOB)
        Path(tmp, "spawn.py").write_text(SPAWN)
        for rep in range(reps):
            order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
            for mode in modes:
                for name in order:
                    port += 1
                    times[mode][name].append(one(name, mode, tmp, port, timeout))
            print(f"  rep {rep + 1}/{reps}: " + "  ".join(
                f"{m}/{n} {times[m][n][-1]:.3f}s" for m in modes for n in launchers), flush=True)
    reference = "torchrun" if "torchrun" in launchers else launchers[-1]
    return {m: {n: summary(v, by[reference]) for n, v in by.items()} for m, by in times.items()} | {
        "reference": reference}


def report(results: dict[str, Any]) -> str:
    rows = []
    for mode in ("kill", "raise"):
        for name, s in results.get(mode, {}).items():
            rows.append([mode, LABELS[name], f"{s['median']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}",
                         f"{s['ratio']:.2f}"])
    return table(["failure", "launcher", "median s", "range s", f"x {results['reference']}"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions [5]")
    parser.add_argument("--launchers", default="mpddp,spawn,torchrun", help="which launchers [mpddp,spawn,torchrun]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--port-base", type=int, default=29800, help="first hard-coded port of spawn [29800]")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for start-up or teardown [120]")
    parser.add_argument("--tiny", action="store_true", help="test mode: one repetition, mpddp and spawn")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    if args.tiny and args.launchers == parser.get_default("launchers"):
        launchers = ["mpddp", "spawn"]
    reps = 1 if args.tiny else args.reps
    print(f"bench_teardown: {machine()}, torch {torch_version()}, {reps} interleaved reps", flush=True)
    results = bench(launchers, ["kill", "raise"], reps, args.port_base, args.timeout)
    print()
    print(report(results))
    write_json(args.json, {"benchmark": "teardown", "torch": torch_version(), "reps": reps, "results": results})


if __name__ == "__main__":
    main()
