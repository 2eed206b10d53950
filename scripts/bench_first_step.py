"""Time to the first trained step: whole processes, start to exit, as ratios to a bare ``import torch.distributed``.

Every row is one command timed from process start to exit; each repetition
runs every row once (interleaved, rotating the order) and a ratio is taken
against the reference run of the same repetition.

  ref         python -c "import torch.distributed"                      (1.00)
  floor       one process, no launcher, no DDP: import torch, a Linear and
              AdamW, one step (the optimizer imports torch._dynamo, which
              costs about as much as torch: any first step pays it once)
  chain       import torch.distributed and torch._dynamo with the collector
              paused, then os._exit: the forkserver's own imports, below
              which no launch that trains can go (a launch() script adds
              its interpreter's teardown, about 0.6 s with torch loaded;
              mpddp's command line skips it)
  train N     mpddp train --nprocs N --dataset synthetic --samples 256 --epochs 1
  launch ddp  a script: import mpddp; mpddp.launch(fn, nprocs=2,
              preload=TRAINING_PRELOAD); fn wraps a Linear in DDP, one backward
  launch ddp, default   the same without preload= (launch()'s default)
  launch ddp, torch first   the same with preload=, in a script that imports
              torch before mpddp: the launcher's import then comes before
              the forkserver's, in series (no goal: what such a script costs)
  launch all_reduce     fn builds no DDP (one all_reduce), with and without
              preload=: what the preload costs a launch that does not need it

Goals (issue 36): train 2 and launch ddp <= 1.50x ref; train 8 <= 1.50x
train 2 (8 ranks on 2 cores). ``--baseline-rev REV`` adds the train and
launch rows run with mpddp as of git revision REV (exported to a temporary
directory): before and after in the same interleaved run.

    python scripts/bench_first_step.py                       # train 2 and 8, 7 reps
    python scripts/bench_first_step.py --ranks 1,2,4,8 --reps 5 --json first_step.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import load, machine, summary, table, torch_version, wait_for_quiet, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

FLOOR = """\
import torch
model = torch.nn.Linear(16, 16)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 16)).sum().backward()
optimizer.step()
"""

CHAIN = "import gc, os; gc.disable(); import torch.distributed, torch._dynamo; os._exit(0)"

LAUNCH = """\
import inspect
import sys

if sys.argv[4:] == ["torch-first"]:
    import torch  # noqa: F401 - the common script: torch at the top, before the launch

import mpddp


def ddp_step(ctx):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(16, 16))
    model(torch.randn(8, 16)).sum().backward()
    return ctx.rank


def all_reduce(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


if __name__ == "__main__":
    fn = ddp_step if sys.argv[1] == "ddp" else all_reduce
    options = {}
    if sys.argv[3] == "preload" and "preload" in inspect.signature(mpddp.launch).parameters:
        from mpddp.core.launcher.startup import TRAINING_PRELOAD

        options["preload"] = TRAINING_PRELOAD
    assert len(mpddp.launch(fn, nprocs=int(sys.argv[2]), **options)) == int(sys.argv[2])
"""

GOALS = {"train2": 1.50, "launch_ddp": 1.50}  # issue 36 (was 1.60, issue 15)
GOAL_8_OVER_2 = 1.50


def rows(ranks: list[int], baseline: bool) -> dict[str, tuple[str, list[str] | None]]:
    """key -> (label, argv after the interpreter; None: a script, filled in by commands())."""
    out: dict[str, tuple[str, list[str] | None]] = {
        "ref": ('python -c "import torch.distributed" (reference)', ["-c", "import torch.distributed"]),
        "floor": ("floor: one process, Linear + AdamW, one step", ["-c", FLOOR]),
        "chain": ("floor: torch + torch._dynamo imports, GC paused", ["-c", CHAIN]),
    }
    for n in ranks:
        out[f"train{n}"] = (f"mpddp train --nprocs {n}", None)
    out["launch_ddp"] = ("launch(), DDP step, preload=TRAINING_PRELOAD", None)
    out["launch_ddp_default"] = ("launch(), DDP step, default", None)
    out["launch_ddp_torch"] = ("launch(), DDP step, preload=, script imports torch first", None)
    out["launch_ar"] = ("launch(), all_reduce only, default", None)
    out["launch_ar_preload"] = ("launch(), all_reduce only, preload=", None)
    if baseline:
        for key in [k for k in out if k.startswith("train") or k in ("launch_ddp", "launch_ddp_default")]:
            out[f"base_{key}"] = (f"{out[key][0]} [baseline]", None)
    return out


def command(key: str, files: dict[str, str], ranks_of_launch: int) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one row (a baseline row runs the exported old mpddp). Every row names its
    mpddp on PYTHONPATH: a launch() script's folder is not this checkout, so it would import whichever mpddp is
    installed (an editable install of another checkout, say) and time that instead."""
    env = {"PYTHONPATH": str(REPO)}
    if key.startswith("base_"):
        key = key.removeprefix("base_")
        env["PYTHONPATH"] = files["baseline"]
    py = sys.executable
    if key.startswith("train"):
        run_dir = tempfile.mkdtemp(prefix="run-", dir=files["tmp"])
        return [py, "-m", "mpddp", "train", "--nprocs", key.removeprefix("train"), "--dataset", "synthetic",
                "--samples", "256", "--epochs", "1", "--run-dir", run_dir], env
    kind, pre, *first = {"launch_ddp": ("ddp", "preload"), "launch_ddp_default": ("ddp", "default"),
                         "launch_ddp_torch": ("ddp", "preload", "torch-first"),
                         "launch_ar": ("ar", "default"), "launch_ar_preload": ("ar", "preload")}[key]
    return [py, files["launch"], kind, str(ranks_of_launch), pre, *first], env


def timed(argv: list[str], env: dict[str, str], timeout: float) -> float:
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
                         cwd=env.get("PYTHONPATH", REPO))
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"bench_first_step: {' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return seconds


def export(rev: str, into: str) -> str:
    """mpddp as of git revision ``rev``, in a directory of its own."""
    target = os.path.join(into, "baseline")
    os.makedirs(target)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "mpddp"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", target], input=archive.stdout, check=True)
    return target


def bench(ranks: list[int], reps: int, warmup: bool, timeout: float, baseline_rev: str | None,
          quiet: tuple[float, float], only: set[str] | None = None) -> dict[str, Any]:
    table_of = rows(ranks, baseline_rev is not None)
    if only:  # a row's baseline comes with it: before and after, paired
        table_of = {k: v for k, v in table_of.items() if k.removeprefix("base_") in only | {"ref", "floor"}}
    keys = list(table_of)
    times: dict[str, list[float]] = {k: [] for k in keys}
    busy: list[float] = []  # the machine's busy share just before each run: someone else's load
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-first-") as tmp:
        files = {"tmp": tmp, "launch": os.path.join(tmp, "launch.py")}
        Path(files["launch"]).write_text(LAUNCH)
        if baseline_rev:
            files["baseline"] = export(baseline_rev, tmp)
        for rep in range(-1 if warmup else 0, reps):
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                fixed = table_of[key][1]
                argv, env = command(key, files, 2) if fixed is None else ([sys.executable, *fixed], {})
                busy.append(wait_for_quiet(*quiet))
                seconds = timed(argv, env, timeout)
                if rep >= 0:  # rep -1 warms the page cache, not counted
                    times[key].append(seconds)
            if rep >= 0:
                print(f"  rep {rep + 1}/{reps} (load {load():.1f}, busy before runs {max(busy[-len(keys):]):.0f}% "
                      f"at most): "
                      + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    results: dict[str, Any] = {k: {"label": table_of[k][0], **summary(v, times["ref"])} for k, v in times.items()}
    results["busy_before_runs"] = summary(busy)
    for prefix in ("", "base_"):
        if f"{prefix}train2" in times:
            for n in [n for n in ranks if f"{prefix}train{n}" in times]:
                results[f"{prefix}train{n}"]["over_train2"] = summary(times[f"{prefix}train{n}"],
                                                                      times[f"{prefix}train2"])
    return results


def _goal(key: str, ratio: float, over2: float | None, n: int | None) -> str:
    if key in GOALS:
        return f"<= {GOALS[key]:.2f}: {'met' if ratio <= GOALS[key] else 'NOT met'}"
    if n == 8 and over2 is not None:
        return f"/train2 <= {GOAL_8_OVER_2:.2f}: {'met' if over2 <= GOAL_8_OVER_2 else 'NOT met'}"
    return ""


def report(results: dict[str, Any]) -> str:
    out = []
    floor = results["floor"]["ratio"]
    for key, r in results.items():
        n = int(key.removeprefix("train")) if key.startswith("train") else None
        over = r.get("over_train2")
        cells = [r["label"], f"{r['median']:.2f}", f"{r['ratio']:.2f}", f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                 f"{over['ratio']:.2f}" if over else "",
                 f"{floor:.2f}" if key in GOALS else ("1.00" if n == 8 else ""),
                 _goal(key, r["ratio"], over["ratio"] if over else None, n)]
        out.append(cells)
    return table(["command", "median s", "x ref", "range", "x train 2", "floor", "goal"], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,8", help="comma-separated rank counts of mpddp train [2,8]")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions [7]")
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="also run the train and launch rows with mpddp as of this git revision")
    parser.add_argument("--quiet-below", type=float, default=30, metavar="PERCENT",
                        help="before each run, wait until the CPUs are at most this busy [30; 100: never wait]")
    parser.add_argument("--patience", type=float, default=60, help="seconds to wait for that at most [60]")
    parser.add_argument("--only", default=None, metavar="ROWS",
                        help="comma-separated row keys (train2, launch_ddp, ...; ref and floor always run, and "
                             "with --baseline-rev each row's baseline)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take [300]")
    parser.add_argument("--tiny", action="store_true", help="test mode: one repetition, no warm-up, train 2 only")
    args = parser.parse_args()
    ranks = sorted({int(r) for r in args.ranks.split(",")} | {2})
    if args.tiny:
        ranks = [2]
    reps = 1 if args.tiny else args.reps
    print(f"bench_first_step: {machine()}, torch {torch_version()}, train ranks {ranks}, {reps} interleaved reps, "
          f"load {load():.1f}", flush=True)
    quiet = (100.0, 0.0) if args.tiny else (args.quiet_below, args.patience)
    only = set(args.only.split(",")) if args.only else None
    results = bench(ranks, reps, not args.tiny, args.timeout, args.baseline_rev, quiet, only)
    busy = results.pop("busy_before_runs")
    print()
    print(report(results))
    print(f"CPUs busy just before a run (others' load): median {busy['median']:.0f}%, at most {busy['max']:.0f}%; "
          f"load average at the end: {load():.1f} ({os.cpu_count()} logical CPUs)")
    write_json(args.json, {"benchmark": "first_step", "torch": torch_version(), "reps": reps, "ranks": ranks,
                           "baseline_rev": args.baseline_rev, "busy_before_runs": busy, "results": results})


if __name__ == "__main__":
    main()
