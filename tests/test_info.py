"""`mpddp info`: a real subprocess, the report's lines, and no CUDA initialized."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mpddp.cli import info, main
from mpddp.errors import ConfigError
from mpddp.machine import gpus

DATA = Path(__file__).parent / "data"


def recorded_8xh100() -> gpus.GpuQuery:
    found = gpus.parse_query_gpu((DATA / "smi_8xh100_query_gpu.csv").read_text())
    apps = gpus.parse_compute_apps((DATA / "smi_8xh100_compute_apps.csv").read_text())
    everything = gpus.with_processes(found, apps)
    return gpus.GpuQuery(everything, tuple(g.index for g in everything), "nvidia-smi")


@pytest.mark.timeout(60)
def test_info_runs_as_a_real_command() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "mpddp", "info"], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"torch         {torch.__version__}" in out
    assert "(cuda.device_count(); CUDA not initialized)" in out
    assert "gloo: yes" in out
    assert "CPU cores     " in out and " physical, " in out
    assert "A launch here would choose:" in out
    assert "  start method  forkserver" in out
    assert "  master        127.0.0.1" in out
    assert "[rank 0] node 0 · local rank 0 · rank 0×" in out
    if torch.cuda.device_count() == 0:  # no GPU here: the CPU choices, said with the reason
        assert "  backend       gloo (no GPU)" in out
        assert "  nprocs        1 (no GPU: one CPU worker" in out
        assert "GPUs          none (" in out


def test_info_never_initializes_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # is_available() poisons a later fork even though is_initialized() stays False (DESIGN.md):
    # make every such call fail the test, not only the ones is_initialized() would see.
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("mpddp info touched CUDA beyond device_count()")

    for name in ("is_available", "init", "_lazy_init", "get_device_properties", "get_device_name",
                 "mem_get_info", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert not torch.cuda.is_initialized()
    assert "A launch here would choose:" in result.output


def test_info_shows_gpus_processes_and_busy_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info, "query_gpus", recorded_8xh100)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    result = CliRunner().invoke(main, ["info", "--gpus", "1,3"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = result.output
    assert "GPUs          8 (from nvidia-smi)" in out
    assert "   id  name                     memory used / total  util  state  processes" in out
    assert "    0  NVIDIA H100 80GB HBM3          1 / 81559 MiB    0%  free   -" in out
    assert "    1  NVIDIA H100 80GB HBM3      71234 / 81559 MiB   97%  busy   pid 4242 (python3, 71222 MiB)" in out
    assert "    7  NVIDIA H100 80GB HBM3      45012 / 81559 MiB     -  busy   -" in out
    assert "  backend       nccl (one GPU per rank)" in out
    assert "  nprocs        2 (one per chosen GPU)" in out
    assert "  threads/rank  6 (OMP_NUM_THREADS=6)" in out
    assert "  children get  CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1,3" in out
    assert "  [rank 1] node 0 · local rank 1 · rank 0×2+1 = 1 of 2 · cuda:1 (physical GPU 3)" in out
    assert "mpddp: warning: GPU 1 (NVIDIA H100 80GB HBM3) is in use: 71234 of 81559 MiB taken" in out


def test_info_free_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info, "query_gpus", recorded_8xh100)
    result = CliRunner().invoke(main, ["info", "--gpus", "free:2"])
    assert result.exit_code == 0, result.output
    assert "CUDA_VISIBLE_DEVICES=0,3" in result.output
    assert "warning" not in result.output


def test_info_with_unusable_gpus_ends_with_the_error() -> None:
    query = gpus.GpuQuery(problem="nvidia-smi not found")
    with pytest.raises(ConfigError,
                       match=r"gpus=0,3 but this machine has no visible NVIDIA GPU \(nvidia-smi not found\)"):
        info.choice_lines(info.LaunchConfig(gpus=(0, 3)), query)
    done = subprocess.run([sys.executable, "-m", "mpddp", "info", "--gpus", "0,99"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("mpddp: error: gpus=0,99 ")
    assert "A launch here would choose:" not in done.stdout


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_fork_after_info_can_use_cuda() -> None:
    """The real check: after `mpddp info` in a parent, a forked child still gets CUDA."""
    if torch.cuda.device_count() == 0:
        pytest.skip("needs a CUDA GPU")
    script = textwrap.dedent("""
        import multiprocessing as mp, sys
        import torch
        from click.testing import CliRunner
        from mpddp.cli import main

        def child():
            print("child sum", torch.ones(4, device="cuda").sum().item(), flush=True)

        result = CliRunner().invoke(main, ["info"])
        assert result.exit_code == 0, result.output
        print(result.output, flush=True)
        p = mp.get_context("fork").Process(target=child)
        p.start(); p.join(90)
        sys.exit(p.exitcode)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child sum 4.0" in done.stdout
    assert "nccl (one GPU per rank)" in done.stdout
