"""The benchmark scripts keep working: each runs once in --tiny mode (one repetition, small sizes).

These are not benchmarks: they check that each script runs from the command
line, prints its table of ratios and writes its JSON. The figures themselves
come from full runs (see docs_perf.rst).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftovers")]
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def tiny(script: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, str(SCRIPTS / script), "--tiny", "--json", str(out_json), *args],
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout, json.loads(out_json.read_text())


def test_bench_launch(tmp_path):
    stdout, data = tiny("bench_launch.py", tmp_path)
    assert "x torchrun" in stdout and "(a) python -m mpddp run" in stdout
    by_variant = data["results"]["1"]
    assert by_variant["torchrun"]["ratio"] == 1.0
    for key in ("mpddp", "launch1", "launch2", "spawn"):
        assert by_variant[key]["ratio"] > 0 and len(by_variant[key]["values"]) == 1


def test_bench_train(tmp_path):
    stdout, data = tiny("bench_train.py", tmp_path)
    assert "mpddp Trainer" in stdout and "x ref" in stdout
    assert data["results"]["loop"]["ratio"] == 1.0 and data["results"]["trainer"]["median"] > 0


def test_bench_train_gpu_mode_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible: the GPU mode would run")
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_train.py"), "--gpu", "--tiny"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "bench_train: --gpu needs a CUDA GPU, but torch.cuda.device_count() is 0 here" in out.stderr


def test_bench_teardown(tmp_path):
    stdout, data = tiny("bench_teardown.py", tmp_path)
    assert "x spawn" in stdout and "python -m mpddp run" in stdout
    for mode in ("kill", "raise"):
        assert data["results"][mode]["spawn"]["ratio"] == 1.0
        assert 0 < data["results"][mode]["mpddp"]["median"] < 30
