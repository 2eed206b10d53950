"""A real SLURM cluster started by the test run (scripts/ci_slurm.sh): one node, then two namespace nodes.

The cluster runs Debian's slurmctld, slurmd and munge on ports of its own,
with two fake GPUs a node (GRES over char devices: SLURM sets
CUDA_VISIBLE_DEVICES, torch sees no CUDA, so the jobs pass --nprocs and gloo).
Every srun has --immediate and a time limit; every call a timeout (sbatch
has no --immediate in slurm 22.05: the partition's MaxTime bounds it).
The daemons are stopped by pid at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode import JOB, REPO, machine_lock

pytestmark = pytest.mark.slurm
CI_SLURM = REPO / "scripts" / "ci_slurm.sh"
SRUN = ["srun", "--immediate=20", "--kill-on-bad-exit=1", "--time=2"]
TRAIN = ["python", "-m", "mpddp", "train", "--nprocs", "2", "--backend", "gloo", "--epochs", "1",
         "--dataset", "synthetic", "--samples", "512", "--verbose"]


def _free_port_pair() -> int:
    """A port p with p and p+1 free on this machine (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no two free ports in a row")


class SlurmCI:
    """The cluster of this module: brought up in one mode at a time, always brought down."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.mode: str | None = None
        self.env = {**os.environ, "CI_SLURM_DIR": str(work / "slurm"), "CI_SLURM_PORT": str(_free_port_pair()),
                    "FAKE_GPUS": "2", "SLURM_CONF": str(work / "slurm" / "slurm.conf"), "PYTHONPATH": str(REPO),
                    # the jobs' "python", as in a user's batch script, is this run's (a venv not activated too)
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        for name in [n for n in self.env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
            del self.env[name]  # a test run inside a SLURM job must not pass its own job's layout on

    def script(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(CI_SLURM), *args], env=self.env, capture_output=True, text=True, timeout=300)

    def ensure(self, mode: str) -> None:
        if self.mode == mode:
            return
        self.down()
        up = self.script("up", mode)
        if up.returncode == 3:
            pytest.skip(f"no SLURM cluster here: {up.stderr.strip().splitlines()[-1]}")
        assert up.returncode == 0, f"ci_slurm.sh up {mode} failed:\n{up.stdout}\n{up.stderr}"
        self.mode = mode

    def down(self) -> None:
        if self.mode is not None:
            self.mode = None
            self.script("down")

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, cwd=self.work, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm_ci(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCI]:
    if os.geteuid() != 0:
        pytest.skip("the SLURM cluster needs root (daemons, namespaces)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("no slurmctld and no apt-get to install it")
    with machine_lock():  # its namespace nodes and daemons are the machine's: one test run at a time
        ci = SlurmCI(tmp_path_factory.mktemp("slurmci"))
        try:
            yield ci
        finally:
            ci.down()


def banners(output: str) -> set[str]:
    """The ``rank N×P+L = R of W`` formulas of the workers' banners."""
    return set(re.findall(r"rank (\d+×\d+\+\d+ = \d+ of \d+)", output))


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_srun_one_node_train(slurm_ci: SlurmCI) -> None:
    slurm_ci.ensure("single")
    out = check(slurm_ci.run([*SRUN, "-N1", "-n1", "--gpus-per-node=2", *TRAIN, "--run-dir", "runs/one"]))
    assert banners(out) == {"0×2+0 = 0 of 2", "0×2+1 = 1 of 2"}
    assert "epoch   1/1" in out
    assert (slurm_ci.work / "runs" / "one" / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_ranks_inside_an_allocation(slurm_ci: SlurmCI) -> None:
    slurm_ci.ensure("single")
    out = check(slurm_ci.run([*SRUN, "-N1", "-n1", "--gpus-per-node=2", "python", "-m", "mpddp", "ranks"]))
    assert re.search(r"From SLURM job \d+ \(inside srun\):", out)
    assert re.search(r"master_port = 2\d{4} +\(20000 \+ SLURM_JOB_ID % 10000\)", out)
    assert "world_size = nnodes × nprocs_per_node = 1 × 2 = 2" in out


@pytest.mark.timeout(60)
def test_two_tasks_on_one_node_prints_the_srun_line(slurm_ci: SlurmCI) -> None:
    slurm_ci.ensure("single")
    result = slurm_ci.run([*SRUN, "-N1", "--ntasks-per-node=2", "--gpus-per-node=2", *TRAIN])
    assert result.returncode != 0
    assert "srun --nodes=1 --ntasks-per-node=1 --gpus-per-node=2 python -m mpddp train --nprocs 2" in result.stderr


@pytest.mark.timeout(120)
def test_srun_two_namespace_nodes_launch_api(slurm_ci: SlurmCI) -> None:
    slurm_ci.ensure("netns")
    out = check(slurm_ci.run([*SRUN, "-N2", "--ntasks-per-node=1", "python", str(JOB), "slurm", "0"]))
    results = [r for line in out.splitlines() if line.startswith("RESULT ") for r in json.loads(line[7:])]
    assert sorted((r["node_rank"], r["local_rank"], r["rank"]) for r in results) == [
        (0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]  # rank = node_rank × 2 + local_rank
    assert {(r["world_size"], r["sum"]) for r in results} == {(4, 6.0)}


@pytest.mark.timeout(120)
def test_sbatch_example_two_namespace_nodes(slurm_ci: SlurmCI) -> None:
    slurm_ci.ensure("netns")
    log = slurm_ci.work / "sbatch-two.out"
    check(slurm_ci.run(["timeout", "90", "sbatch", "--wait", "--gpus-per-node=2", f"--output={log}",
                        str(REPO / "scripts" / "sbatch_example.sh"), *TRAIN[4:], "--run-dir", "runs/sbatch-two"]))
    out = log.read_text()
    assert banners(out) == {"0×2+0 = 0 of 4", "0×2+1 = 1 of 4", "1×2+0 = 2 of 4", "1×2+1 = 3 of 4"}, out


@pytest.mark.timeout(180)
def test_srun_two_namespace_nodes_train_and_recover_from_a_killed_rank(slurm_ci: SlurmCI) -> None:
    """srun's two launchers, one on each namespace node, train a world of 4 (ranks 0, 1 on node 0; 2, 3 on node 1).
    Rank 3 (node 1) is SIGKILLed once; they name it alike and restart the group together."""
    slurm_ci.ensure("netns")
    result = slurm_ci.run([*SRUN, "-N2", "--ntasks-per-node=1", "--gpus-per-node=2", *TRAIN, "--batch-size", "16",
                           "--checkpoint-every", "4", "--max-restarts", "1", "--inject-fault", "kill:3:6",
                           "--run-dir", "runs/two-restart"], timeout=150)
    out = check(result)
    assert banners(out) == {"0×2+0 = 0 of 4", "0×2+1 = 1 of 4", "1×2+0 = 2 of 4", "1×2+1 = 3 of 4"}, out
    said = [line for line in out.splitlines() if line.startswith("mpddp: ")]
    killed = "mpddp: rank 3 (node 1, local rank 1) failed first: it was killed by SIGKILL"
    assert len([line for line in said if line.startswith(killed)]) == 2, out  # once on each node
    assert said.count("mpddp: restarting the group (1 of 1)") == 2, out
    assert "resumed from" in out and "epoch   1/1" in out
