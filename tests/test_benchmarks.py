"""The benchmark scripts keep working, and the first-step preload keeps the forkserver's guarantees.

The script tests (marked ``bench``: .ci/run runs them as a step of its own, README's ``pytest -q`` leaves
them out) are not benchmarks: each script runs once in --tiny mode
(one repetition, small sizes) and the test checks that it prints its table
of ratios and writes its JSON; no test asserts a timing. The figures
themselves come from full runs (docs/performance.rst).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpddp

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftovers")]
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def tiny(script: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, str(SCRIPTS / script), "--tiny", "--json", str(out_json), *args],
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout, json.loads(out_json.read_text())


@pytest.mark.bench
def test_bench_launch(tmp_path):
    # one peer (accelerate, when installed) keeps the run short; every peer's row has the same code path
    stdout, data = tiny("bench_launch.py", tmp_path, "--only", "mpddp,launch,spawn,accelerate", "--hang-limit", "30",
                        "--port-base", str(_free_port_base(16)))
    header = stdout.split("\n\n")[-1]
    for column in ("x torchrun", "after threads", "returns"):
        assert column in header
    by_key = data["results"]["1"]
    assert by_key["torchrun"]["ratio"] == 1.0 and by_key["torchrun"]["returns"] == "exit code"
    for key in ("mpddp", "launch", "launch2", "spawn"):
        assert by_key[key]["ratio"] > 0 and len(by_key[key]["values"]) == 1
    assert by_key["launch"]["returns"] == "[1.0]" and by_key["spawn"]["returns"] == "None"
    assert by_key["launch"]["after_threads"]["ratio"] > 0  # mpddp.launch after a threaded op: no hang
    assert by_key["mpddp"].get("after_threads") is None  # a command line has no parent that ran an op


def test_bench_launch_skips_missing_peers(monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_launch
    finally:
        sys.path.remove(str(SCRIPTS))
    import importlib.util

    # Every other peer counts as installed, so that the answer does not depend on this venv's extras.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchrunx" else object())
    present, skipped = bench_launch.available()
    assert [launcher.key for launcher in present] == [
        launcher.key for launcher in bench_launch.LAUNCHERS if launcher.needs != "torchrunx"]
    assert skipped == ["skipped torchrunx Launcher.run: torchrunx is not installed (pip install torchrunx)"]


@pytest.mark.bench
def test_bench_first_step(tmp_path):
    # the two rows with a goal and one launch() row of each kind (script, preload=): every row kind's code path,
    # in half the time of all nine (each row is a cold start of about three seconds)
    rows = ("train2", "launch_ddp", "launch_ar_preload")
    stdout, data = tiny("bench_first_step.py", tmp_path, "--only", ",".join(rows))
    header = stdout.split("\n\n")[-1]
    for column in ("x ref", "x train 2", "floor", "goal"):
        assert column in header
    results = data["results"]
    assert results["ref"]["ratio"] == 1.0
    assert set(results) == {"ref", "floor", *rows}
    for key in ("floor", *rows):
        assert results[key]["median"] > 0 and len(results[key]["values"]) == 1
    assert "<= 1.50: " in stdout  # the goal's verdict is printed, whatever it is (issue 36's goal)


@pytest.mark.bench
def test_bench_train(tmp_path):
    stdout, data = tiny("bench_train.py", tmp_path)
    assert "mpddp Trainer" in stdout and "x ref" in stdout
    assert data["results"]["loop"]["ratio"] == 1.0 and data["results"]["trainer"]["median"] > 0
    # the flight recorder's cost: the Trainer with it on (mpddp's default) against off, in the same run
    assert data["results"]["trainer_fr_off"]["median"] > 0
    fr = data["flight_recorder"]
    assert 0.2 < fr["ratio"] < 5 and len(fr["ratios"]) == 1  # a tiny run is noisy: sane, not small
    assert fr["ratio"] == data["results"]["trainer"]["median"] / data["results"]["trainer_fr_off"]["median"]
    assert abs(fr["cost_percent"] - (1 - fr["ratio"]) * 100) < 1e-9
    line = next(line for line in stdout.splitlines() if line.startswith("flight recorder on / off: "))
    assert f"{fr['ratio']:.3f} (cost {fr['cost_percent']:.1f} %" in line and "; on: " in line
    assert 0 < fr["reader_percent"] < 5  # measured by the reader itself, in the rank
    assert f"flight recorder reader: {fr['reader_percent']:.2f} % of a rank's time" in stdout


def test_bench_train_gpu_mode_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible: the GPU mode would run")
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_train.py"), "--gpu", "--tiny"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "bench_train: --gpu needs a CUDA GPU, but torch.cuda.device_count() is 0 here" in out.stderr


def _free_port_base(count: int = 8) -> int:
    """A first port whose next ``count`` are free now: the textbook spawn peer binds hard-coded ports,
    and another run on this machine (a second suite, a real job) may hold 29800."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 30000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError("no free run of ports")


@pytest.mark.bench
def test_bench_teardown(tmp_path):
    stdout, data = tiny("bench_teardown.py", tmp_path, "--port-base", str(_free_port_base()))
    assert "x spawn" in stdout and "python -m mpddp run" in stdout
    for mode in ("kill", "raise"):
        assert data["results"][mode]["spawn"]["ratio"] == 1.0
        assert 0 < data["results"][mode]["mpddp"]["median"] < 30


PROBE = """\
import gc, json, os, sys, threading
import psutil, torch
with open(os.environ["MPDDP_TEST_PROBE"], "w") as f:
    json.dump({"threads": threading.active_count(), "os_threads": psutil.Process().num_threads(),
               "cuda_initialized": torch.cuda.is_initialized(), "gc_enabled": gc.isenabled(),
               "dynamo": "torch._dynamo" in sys.modules}, f)
"""

LAUNCHER = """\
import json
import mpddp
from mpddp.core.launcher.startup import TRAINING_PRELOAD


def fn(ctx):
    import gc
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(2)
    x = torch.randn(1024, 1024)
    y = x @ x  # multi-threaded, in a process forked from the forkserver
    model = DDP(torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "threads": torch.get_num_threads(),
            "matmul_ok": bool(torch.allclose(y, x @ x))}


if __name__ == "__main__":
    print("RESULT " + json.dumps(mpddp.launch(fn, nprocs=2, preload=[*TRAINING_PRELOAD, "fs_probe"])))
"""


def test_training_preload_keeps_the_forkserver_clean(tmp_path):
    """torch._dynamo in the forkserver: no thread, no CUDA; workers collect garbage and run threaded ops."""
    (tmp_path / "fs_probe.py").write_text(PROBE)  # preloaded last: the forkserver's state after the preload
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "MPDDP_TEST_PROBE": str(tmp_path / "probe.json")}
    out = subprocess.run([sys.executable, str(tmp_path / "launcher.py")], capture_output=True, text=True, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    forkserver = json.loads((tmp_path / "probe.json").read_text())
    # the threads a process has once torch is imported (BLAS may start its own): the preload adds none
    torch_only = subprocess.run([sys.executable, "-c", "import psutil, mpddp.core.rank.worker; "
                                 "print(psutil.Process().num_threads())"], capture_output=True, text=True, timeout=120)
    assert forkserver == {"threads": 1, "os_threads": int(torch_only.stdout), "cuda_initialized": False,
                          "gc_enabled": False, "dynamo": True}
    for worker in json.loads(out.stdout.split("RESULT ", 1)[1]):
        assert worker["gc_enabled"] and worker["frozen"] > 0  # the forkserver's objects stay out of its collections
        assert worker["threads"] == 2 and worker["matmul_ok"]


def test_preload_must_be_module_names():
    with pytest.raises(mpddp.ConfigError, match=r"preload='torch._dynamo' is not a list of module names: "
                                                r"pass e.g. preload=\['torch._dynamo'\]"):
        mpddp.launch(lambda ctx: None, nprocs=1, preload="torch._dynamo")


@pytest.mark.bench
def test_bench_recovery(tmp_path):
    stdout, data = tiny("bench_recovery.py", tmp_path, "--no-torchrun", "--quiet", "100")
    assert "recovery / start-up" in stdout and "goal on one node" in stdout
    one = data["results"]["mpddp 1"]
    assert 0 < one["recovery_to_fn"][0] < one["recovery"][0]  # fn is called again before its first step
    assert one["ratio"][0] == one["recovery"][0] / one["startup"][0]


@pytest.mark.bench
def test_bench_interrupt(tmp_path):
    stdout, data = tiny("bench_interrupt.py", tmp_path)
    (delay,) = data["delays"].values()
    assert data["import_s"] > 0 and delay["codes"] == [130] and delay["left"] == []
    assert delay["median"] > 0 and "Ctrl-C during `mpddp train --nprocs 2` start-up" in stdout


@pytest.mark.bench
def test_bench_scale(tmp_path):
    stdout, data = tiny("bench_scale.py", tmp_path)
    (row,) = data["results"]
    assert (row["backend"], row["nodes"]) == ("c10d", 8) and "failure known s" in stdout
    assert json.loads(stdout.strip().splitlines()[-1])["results"] == data["results"]  # the last line, for a check
    assert row["ops_per_s"] > 0 and 0 < row["failure_known_s"] < 60 and row["next_round_s"] > 0
