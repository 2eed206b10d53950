"""Real Open MPI (Debian's openmpi-bin, scripts/ci_mpi.sh): mpirun on one machine and across two namespace hosts.

- ``mpirun -np 2 python -m mpddp ranks`` on one machine: the two MPI processes are nodes 0 and 1 (fine
  for ``ranks``), each with the note that names the ``mpirun -N 1`` line;
- ``mpirun -np 2 python -m mpddp train`` there is refused at once with that line;
- mpirun started on n1 with ``--host n1,n2 -N 1`` runs ``mpddp train --nprocs 2`` (a world of 4), n2
  reached through scripts/netns_agent.sh, an ssh stand-in;
- mpirun started on the bridge host, which is no node of the job: MPI rank 0 (on n1) refuses at once,
  naming ``--master-addr n1``.

Every process the test starts carries the Cluster's tag (mpirun, its orted on n2, the launchers and
their workers): nothing may be left running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode import NETNS, REPO, Cluster, namespace_hosts

AGENT = REPO / "scripts" / "netns_agent.sh"
TRAIN = [sys.executable, "-m", "mpddp", "train", "--nprocs", "2", "--dataset", "synthetic", "--samples", "256",
         "--epochs", "1", "--backend", "gloo", "--verbose"]
SCHEDULERS = ("SLURM", "PBS_", "LSB_", "LSF_", "OMPI_", "PMIX_", "PMI_", "PET_", "KUBERNETES_")


def open_mpi() -> str | None:
    """Open MPI's mpirun (Debian: mpirun.openmpi; plain mpirun may be MPICH's), or None."""
    for name in ("mpirun.openmpi", "mpirun"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if "Open MPI" in version:
            return path
    return None


@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    path = open_mpi()
    if path is None:
        pytest.skip("Open MPI's mpirun is not installed (scripts/ci_mpi.sh install)")
    return [path, *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    for name in [n for n in os.environ if n.startswith(SCHEDULERS)]:
        monkeypatch.delenv(name)  # mpirun would read a surrounding job's allocation; mpddp its layout
    c = Cluster(tmp_path)
    yield c
    c.kill_all()


@pytest.fixture(scope="module")
def netns_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Hosts n1 (10.99.0.1) and n2 (10.99.0.2) in network namespaces; deleted at the end."""
    with namespace_hosts(tmp_path_factory.mktemp("netns")) as work:
        yield work


def output(cluster: Cluster) -> str:
    node = cluster.nodes[-1]
    return node.stdout + node.stderr


@pytest.mark.timeout(60)
def test_ranks_under_mpirun_on_one_machine(cluster: Cluster, mpirun: list[str]) -> None:
    node = cluster.start([], command=[*mpirun, "--oversubscribe", "-np", "2", sys.executable, "-m", "mpddp", "ranks"])
    assert node.wait(45) == 0, output(cluster)
    out = node.stdout
    assert len(re.findall(r"^From Open MPI job \d+ \(mpirun\):$", out, re.M)) == 2, out
    assert {m for m in re.findall(r"^  node_rank   = (\d) +\(OMPI_COMM_WORLD_RANK\)$", out, re.M)} == {"0", "1"}
    assert re.search(r"^  master_port = 2\d{4} +\(20000 \+ OMPI_MCA_ess_base_jobid % 10000\)$", out, re.M), out
    note = ("note: mpirun runs 2 MPI processes on this node (OMPI_COMM_WORLD_LOCAL_SIZE=2): mpddp wants one MPI "
            "process per node and starts one worker per GPU itself; start it with: mpirun -N 1 python -m mpddp ranks")
    assert out.count(note + "\n") == 2, out
    assert out.count("world_size = nnodes × nprocs_per_node = 2 × 1 = 2") == 2
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(60)
def test_train_with_two_mpi_processes_on_one_machine_is_refused(cluster: Cluster, mpirun: list[str]) -> None:
    node = cluster.start([], command=[*mpirun, "--oversubscribe", "-np", "2", *TRAIN])
    assert node.wait(45) != 0
    assert ("mpddp: error: mpirun runs 2 MPI processes on this node (OMPI_COMM_WORLD_LOCAL_SIZE=2): mpddp wants "
            "one MPI process per node and starts one worker per GPU itself; start it with: mpirun -N 1 python -m "
            "mpddp train --nprocs 2 --dataset synthetic --samples 256 --epochs 1 --backend gloo --verbose") \
        in output(cluster)
    assert "epoch" not in node.stdout
    assert cluster.leftovers(wait=5) == []


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_mpirun_trains_across_two_namespace_hosts(cluster: Cluster, mpirun: list[str], netns_hosts: Path) -> None:
    """mpirun on n1 (10.99.0.1) starts one launcher there and one on n2: ranks 0, 1 on n1 and 2, 3 on n2."""
    on_n1 = [str(NETNS), "run", "1", str(netns_hosts)]
    command = [*mpirun, "--mca", "plm_rsh_agent", str(AGENT), "--host", "n1,n2", "-N", "1", *TRAIN,
               "--run-dir", "runs/mpi"]
    node = cluster.start([], prefix=on_n1, command=command, env={"NETNS_DIR": str(netns_hosts)})
    assert node.wait(100) == 0, output(cluster)
    out = output(cluster)
    formulas = set(re.findall(r"rank (\d+×\d+\+\d+ = \d+ of \d+)", out))
    assert formulas == {"0×2+0 = 0 of 4", "0×2+1 = 1 of 4", "1×2+0 = 2 of 4", "1×2+1 = 3 of 4"}, out
    assert "epoch   1/1" in out
    assert (cluster.tmp / "runs" / "mpi" / "metrics.jsonl").exists()
    assert cluster.leftovers(wait=5) == []


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_mpirun_off_the_job_asks_for_the_master(cluster: Cluster, mpirun: list[str], netns_hosts: Path) -> None:
    """mpirun on the bridge host runs no rank; MPI rank 0, on n1, refuses at once and names the flag."""
    command = [*mpirun, "--mca", "plm_rsh_agent", str(AGENT), "--host", "10.99.0.1,10.99.0.2", "-N", "1", *TRAIN]
    node = cluster.start([], command=command, env={"NETNS_DIR": str(netns_hosts)})
    assert node.wait(100) != 0
    assert ("mpddp: error: MPI rank 0 runs on n1, not on mpirun's host (OMPI_MCA_orte_hnp_uri), whose address "
            "mpddp takes as node 0's: pass --master-addr on every node (e.g. --master-addr n1), or run mpirun on n1") \
        in output(cluster)
    assert "epoch" not in node.stdout
    assert cluster.leftovers(wait=5) == []
