"""Start-up benchmark: the same trivial DDP job under mpddp and its peers, side by side.

The job: init the process group (gloo), a 512x512 matmul (a multi-threaded
op where a rank has more than one thread), one all_reduce, destroy, exit.
Every launcher is timed as a whole process, from start to exit:

  mpddp        `python -m mpddp run --nprocs N job.py`
  launch       a script: import torch, `mpddp.launch(fn, nprocs=N)`; it also
               times a second launch in the same interpreter (the forkserver
               warm: a notebook's next cell)
  spawn        the textbook `torch.multiprocessing.spawn(main, nprocs=N)`,
               MASTER_ADDR/MASTER_PORT hard-coded in `main`
  torchrunx    `torchrunx.Launcher(hostnames=["localhost"], workers_per_host=N,
               backend="gloo").run(fn)`
  accelerate   `accelerate.notebook_launcher(fn, num_processes=N)` (fork, via
               torch's elastic agent in the calling process)
  fabric       Lightning `Fabric(accelerator="cpu", devices=N,
               strategy="ddp_spawn").launch(fn)`; fabric_fork: strategy="ddp_fork"
  torchrun     `torchrun --standalone --nproc-per-node N job.py`: the reference, 1.00

"after threads": the function launchers again, in a script that first runs a
multi-threaded matmul in the parent (what a notebook has always done), under
a time limit (--hang-limit); a launcher whose ranks never finish shows
"hangs". Peers that are not installed are skipped with a line saying so
(pip install torchrunx accelerate lightning; none of them is a dependency
of mpddp). Repetitions are interleaved (rotating the order) and each ratio
is taken against the torchrun run of the same repetition. Hard-coded ports
(spawn, accelerate) differ in each run (--port-base, +1 per run): a port
reused at once can still be in TIME_WAIT.

    python scripts/bench_launch.py                      # ranks 2, 5 reps
    python scripts/bench_launch.py --ranks 1,2,4,8 --reps 3 --json launch.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import load, machine, summary, table, torch_version, wait_for_quiet, write_json  # noqa: E402

STEP = """\
def step():
    import torch
    import torch.distributed as dist

    x = torch.ones(512, 512)
    y = (x @ x)[0, 0] / 512  # multi-threaded where the rank has threads: what hangs in a bad fork
    t = torch.ones(1) * y
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return t.item()
"""

JOB = STEP + """
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as torchrun sets it up
step()
dist.destroy_process_group()
"""

SPAWN = STEP + """
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)  # hard-coded, as in the tutorials
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    step()
    dist.destroy_process_group()


if __name__ == "__main__":
    n, port = int(sys.argv[1]), int(sys.argv[2])
    print("RETURNED " + repr(mp.spawn(main, args=(n, port), nprocs=n)))
"""

# Function launchers: argv is N, port, "threads" or "plain"; each prints what the launch returned.
FUNCTION = STEP + """
import json
import sys
import time

import torch

if sys.argv[3] == "threads":
    torch.ones(1024, 1024) @ torch.ones(1024, 1024)  # multi-threaded: what a notebook has run already

{body}
"""

LAUNCH = FUNCTION.format(body="""\
import mpddp


def fn(ctx):
    return step()


if __name__ == "__main__":
    n = int(sys.argv[1])
    times = []
    for _ in range(2):
        start = time.perf_counter()
        out = mpddp.launch(fn, nprocs=n)
        times.append(time.perf_counter() - start)
    print("RETURNED " + repr(out))
    print("TIMES " + json.dumps(times))
""")

TORCHRUNX = FUNCTION.format(body="""\
import torchrunx


def fn():
    return step()


if __name__ == "__main__":
    n = int(sys.argv[1])
    out = torchrunx.Launcher(hostnames=["localhost"], workers_per_host=n, backend="gloo").run(fn)
    print("RETURNED " + repr(out))
""")

ACCELERATE = FUNCTION.format(body="""\
from accelerate import notebook_launcher


def fn():
    import os

    import torch.distributed as dist

    # one process: notebook_launcher calls fn in the calling process, with no environment set up
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", sys.argv[2])):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo")  # env://, set up by the launcher
    step()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = notebook_launcher(fn, num_processes=int(sys.argv[1]), use_port=sys.argv[2])
    print("RETURNED " + repr(out))
""")

FABRIC = FUNCTION.format(body="""\
from lightning.fabric import Fabric


def fn(fabric):
    return step()


if __name__ == "__main__":
    strategy = sys.argv[4]
    out = Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy=strategy).launch(fn)
    print("RETURNED " + repr(out))
""")


@dataclass(frozen=True)
class Launcher:
    key: str
    label: str
    script: str  # a key of SCRIPTS
    needs: str | None = None  # the module a peer needs (skipped when missing)
    function: bool = True  # called from a script: also measured after a threaded op
    extra: tuple[str, ...] = ()


LAUNCHERS = (
    Launcher("mpddp", "python -m mpddp run", "job", function=False),
    Launcher("launch", "mpddp.launch", "launch"),
    Launcher("spawn", "torch.multiprocessing.spawn (textbook)", "spawn"),
    Launcher("torchrunx", "torchrunx Launcher.run", "torchrunx", needs="torchrunx"),
    Launcher("accelerate", "accelerate.notebook_launcher", "accelerate", needs="accelerate"),
    Launcher("fabric", "Lightning Fabric ddp_spawn", "fabric", needs="lightning", extra=("ddp_spawn",)),
    Launcher("fabric_fork", "Lightning Fabric ddp_fork", "fabric", needs="lightning", extra=("ddp_fork",)),
    Launcher("torchrun", "torchrun --standalone (reference)", "job", function=False),
)
SCRIPTS = {"job": JOB, "spawn": SPAWN, "launch": LAUNCH, "torchrunx": TORCHRUNX, "accelerate": ACCELERATE,
           "fabric": FABRIC}
RETURNS = {
    "mpddp": "exit code (the failing rank's)",
    "torchrun": "exit code",
}


class Hung(Exception):
    pass


class Failed(Exception):
    pass


def _run(cmd: list[str], timeout: float, limit: float | None, tolerate: bool) -> tuple[float, str]:
    """Seconds and stdout. Past ``limit`` (after threads) Hung, the whole process group killed; an
    error is Failed where ``tolerate`` (a peer's), else SystemExit (mpddp's or the reference's)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit or timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if limit:
            raise Hung from None
        raise SystemExit(f"bench_launch: {' '.join(cmd)} took over {timeout:.0f} s") from None
    seconds = time.perf_counter() - start
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the launcher left behind
    except ProcessLookupError:
        pass
    if proc.returncode != 0:
        if tolerate:
            signal_name = re.search(r"signal (SIG[A-Z]+)", err)
            raise Failed(f"fails ({signal_name.group(1) if signal_name else f'exit {proc.returncode}'})")
        raise SystemExit(f"bench_launch: {' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return seconds, out


def command(launcher: Launcher, n: int, files: dict[str, str], port: int, threads: bool) -> list[str]:
    py = sys.executable
    if launcher.key == "mpddp":
        return [py, "-m", "mpddp", "run", "--nprocs", str(n), files["job"]]
    if launcher.key == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), files["job"]]
    if launcher.key == "spawn":
        return [py, files["spawn"], str(n), str(port)]
    return [py, files[launcher.script], str(n), str(port), "threads" if threads else "plain", *launcher.extra]


def _returned(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.startswith("RETURNED "):
            value = line.removeprefix("RETURNED ")
            return value if len(value) <= 48 else value[:45] + "..."
    return "?"


def available() -> tuple[list[Launcher], list[str]]:
    present, skipped = [], []
    for launcher in LAUNCHERS:
        if launcher.needs and importlib.util.find_spec(launcher.needs) is None:
            skipped.append(f"skipped {launcher.label}: {launcher.needs} is not installed "
                           f"(pip install {launcher.needs})")
        else:
            present.append(launcher)
    return present, skipped


@dataclass
class Measured:
    """One rank count's runs: seconds by key and repetition, and what did not finish."""

    times: dict[str, dict[int, float]] = field(default_factory=dict)
    returned: dict[str, str] = field(default_factory=dict)
    stopped: dict[str, str] = field(default_factory=dict)  # after threads: "hangs (...)", not run again
    failures: dict[str, list[str]] = field(default_factory=dict)  # a peer's runs that failed, by key
    attempts: dict[str, int] = field(default_factory=dict)
    busy: list[float] = field(default_factory=list)  # the CPUs' busy share just before each run: others' load


def _one(m: Measured, rep: int, launcher: Launcher, threads: bool, cmd: list[str], timeout: float,
         hang_limit: float) -> None:
    key = launcher.key + ("@threads" if threads else "")
    m.attempts[key] = m.attempts.get(key, 0) + 1
    try:
        seconds, out = _run(cmd, timeout, hang_limit if threads else None, tolerate=threads or bool(launcher.needs))
    except Hung:
        m.stopped[key] = f"hangs (> {hang_limit:.0f} s)"
        return
    except Failed as failure:  # counted, and tried again next repetition: one failure is not a verdict
        m.failures.setdefault(key, []).append(str(failure))
        return
    if rep < 0:
        return  # rep -1 warms the page cache, not counted
    m.times.setdefault(key, {})[rep] = seconds
    m.returned.setdefault(launcher.key, _returned(out))
    if key == "launch":
        m.times.setdefault("launch2", {})[rep] = json.loads(out.split("TIMES ", 1)[1])[1]


def measure(n: int, reps: int, warmup: bool, launchers: list[Launcher], files: dict[str, str], ports: Iterator[int],
            timeout: float, hang_limit: float, quiet: tuple[float, float]) -> Measured:
    m = Measured()
    runs = [(lau, False) for lau in launchers] + [(lau, True) for lau in launchers if lau.function]
    for rep in range(-1 if warmup else 0, reps):
        shift = rep % len(runs)
        for launcher, threads in runs[shift:] + runs[:shift]:
            if launcher.key + ("@threads" if threads else "") in m.stopped:
                continue  # a hang is not timed twice
            m.busy.append(wait_for_quiet(*quiet))
            _one(m, rep, launcher, threads, command(launcher, n, files, next(ports), threads), timeout, hang_limit)
        if rep >= 0:
            print(f"  ranks {n} rep {rep + 1}/{reps} (load {load():.1f}, busy before runs at most "
                  f"{max(m.busy[-len(runs):]):.0f}%): "
                  + "  ".join(f"{k} {v[rep]:.2f}s" for k, v in m.times.items() if rep in v)
                  + "".join(f"  {k} {v}" for k, v in sorted(m.stopped.items())), flush=True)
    return m


def _paired(values: dict[int, float], reference: dict[int, float]) -> dict[str, Any]:
    """summary() over the repetitions where both ran."""
    reps = sorted(values.keys() & reference.keys())
    return summary([values[r] for r in reps], [reference[r] for r in reps])


def rows_of(m: Measured, launchers: list[Launcher]) -> dict[str, Any]:
    reference = m.times["torchrun"]
    by_key: dict[str, Any] = {}
    for launcher in launchers:
        failed = m.failures.get(launcher.key, [])
        returns = RETURNS.get(launcher.key, m.returned.get(launcher.key, "?"))
        if failed:
            returns += f"; {failed[0]} in {len(failed)} of {m.attempts[launcher.key]} runs"
        if launcher.key not in m.times:
            by_key[launcher.key] = {"label": launcher.label, "returns": returns, "failed": True}
            continue
        row = {"label": launcher.label, **_paired(m.times[launcher.key], reference), "returns": returns}
        threaded = f"{launcher.key}@threads"
        failed_threaded = m.failures.get(threaded, [])
        if threaded in m.stopped:
            row["after_threads"] = m.stopped[threaded]
        elif threaded in m.times:
            row["after_threads"] = _paired(m.times[threaded], reference)
            if failed_threaded:
                row["after_threads_failed"] = (
                    f"{failed_threaded[0]} in {len(failed_threaded)} of {m.attempts[threaded]}")
        elif failed_threaded:
            row["after_threads"] = f"{failed_threaded[0]}, {len(failed_threaded)} of {m.attempts[threaded]}"
        by_key[launcher.key] = row
    if "launch2" in m.times:
        by_key["launch2"] = {"label": "mpddp.launch, 2nd in the same interpreter (timed inside)",
                             **_paired(m.times["launch2"], reference), "returns": by_key["launch"]["returns"]}
    return by_key


def bench(ranks: list[int], reps: int, warmup: bool, port_base: int, timeout: float, hang_limit: float,
          launchers: list[Launcher], quiet: tuple[float, float]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    ports = itertools.count(port_base + 1)
    # every launcher's TMPDIR is the benchmark's: what one leaves there (torchrun's torchelastic_*) goes with it
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-") as tmp, mock.patch.dict(os.environ, TMPDIR=tmp):
        files = {}
        for name, text in SCRIPTS.items():
            files[name] = os.path.join(tmp, f"bench_{name}.py")  # not torchrunx.py: it would shadow the package
            Path(files[name]).write_text(text)
        for n in ranks:
            m = measure(n, reps, warmup, launchers, files, ports, timeout, hang_limit, quiet)
            results[str(n)] = rows_of(m, launchers)
            results[f"busy_before_runs_{n}"] = summary(m.busy)
    return results


def report(results: dict[str, Any]) -> str:
    rows = []
    for n, by_key in results.items():
        for key, r in by_key.items():
            after = r.get("after_threads")
            if isinstance(after, str):
                after_cell = after
            elif isinstance(after, dict):
                after_cell = f"{after['ratio']:.2f}" + (f"; {r['after_threads_failed']}" if "after_threads_failed" in r
                                                        else "")
            else:
                after_cell = "n/a" if key != "launch2" else ""
            if r.get("failed"):
                rows.append([n, r["label"], "-", "-", "-", after_cell, r["returns"]])
                continue
            rows.append([n, r["label"], f"{r['median']:.2f}", f"{r['ratio']:.2f}",
                         f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", after_cell, r["returns"]])
    return table(["ranks", "launcher", "median s", "x torchrun", "range", "after threads", "returns"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2", help="comma-separated rank counts [2]")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per rank count [5]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--port-base", type=int, default=29700,
                        help="first hard-coded port (spawn, accelerate) [29700]")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take [300]")
    parser.add_argument("--hang-limit", type=float, default=60,
                        help="after threads: seconds before a launch counts as hung [60]")
    parser.add_argument("--quiet-below", type=float, default=30, metavar="PERCENT",
                        help="before each run, wait until the CPUs are at most this busy [30; 100: never wait]")
    parser.add_argument("--patience", type=float, default=60, help="seconds to wait for that at most [60]")
    parser.add_argument("--only", default=None, help="comma-separated launcher keys to run (torchrun always runs)")
    parser.add_argument("--tiny", action="store_true", help="test mode: one repetition, no warm-up, ranks 1")
    args = parser.parse_args()
    ranks = [1] if args.tiny and args.ranks == "2" else [int(r) for r in args.ranks.split(",")]
    reps = 1 if args.tiny else args.reps
    launchers, skipped = available()
    if args.only:
        wanted = set(args.only.split(",")) | {"torchrun"}
        launchers = [lau for lau in launchers if lau.key in wanted]
    print(f"bench_launch: {machine()}, torch {torch_version()}, ranks {ranks}, {reps} interleaved reps, "
          f"load {load():.1f}", flush=True)
    for line in skipped:
        print(line, flush=True)
    quiet = (100.0, 0.0) if args.tiny else (args.quiet_below, args.patience)
    results = bench(ranks, reps, not args.tiny, args.port_base, args.timeout, args.hang_limit, launchers, quiet)
    busy = {n: results.pop(f"busy_before_runs_{n}") for n in ranks}
    print()
    print(report(results))
    for n, b in busy.items():
        print(f"ranks {n}: CPUs busy just before a run (others' load): median {b['median']:.0f}%, "
              f"at most {b['max']:.0f}%")
    print(f"load average at the end: {load():.1f} ({os.cpu_count()} logical CPUs)")
    write_json(args.json, {"benchmark": "launch", "torch": torch_version(), "reps": reps, "skipped": skipped,
                           "hang_limit": args.hang_limit, "busy_before_runs": busy, "results": results})


if __name__ == "__main__":
    main()
