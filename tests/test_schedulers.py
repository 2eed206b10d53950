"""Scheduler environments from recorded variables: which one is found, its layout, flags win, refusals word for word.

The environments are files in tests/data/scheduler_env/, each opening with where it comes from:
captured under Debian 12's Open MPI 4.1.4, MPICH 4.0.2 and slurm-wlm 22.05 on this project's machines,
or written from PBS's (Torque, OpenPBS), LSF's and Kubeflow's documentation and sources. Real
``mpirun`` launches are in tests/test_mpirun.py; SLURM's own tables in tests/test_slurm.py.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from mpddp.cli import main
from mpddp.cli.info import cluster_lines
from mpddp.core.launcher.api import make_config
from mpddp.errors import ConfigError
from mpddp.machine import cluster, joblayout, lsf, mpi, slurm

pytestmark = pytest.mark.timeout(30)

DATA = Path(__file__).parent / "data" / "scheduler_env"
GUIDE = Path(__file__).parent.parent / "docs" / "machines.rst"  # the manual's guide to several machines
MAIN = ["/site-packages/mpddp/__main__.py", "train", "--epochs", "1"]
UNSET = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None, "nprocs": None}


def recorded(name: str, changes: dict[str, str | None] | None = None) -> dict[str, str]:
    """The variables of ``tests/data/scheduler_env/NAME.env`` (``{DATA}`` is that folder), with ``changes``."""
    env = {}
    for line in (DATA / f"{name}.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value.replace("{DATA}", str(DATA))
    for key, value in (changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM node lists expand without asking a scontrol that may be installed here."""
    monkeypatch.setattr(slurm, "scontrol_hostnames", lambda spec: None)


def test_every_recording_says_where_it_comes_from() -> None:
    for path in DATA.glob("*.env"):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and (
            "Captured" in path.read_text() or "Written by hand" in path.read_text()), path.name


# ---- which environment -----------------------------------------------------------------------------

SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": "n2"}


@pytest.mark.parametrize(
    ("env", "name", "outranked"),
    [
        (recorded("openmpi_two_hosts_rank1"), "Open MPI", ()),
        (recorded("mpich_two_hosts_rank1"), "MPICH/Intel MPI", ()),
        (recorded("torque_pbsdsh_node1"), "PBS", ()),
        (recorded("pbspro_pbsdsh_node1"), "PBS", ()),
        (recorded("lsf_blaunch_host2"), "LSF", ()),
        (recorded("kubeflow_v1_worker0"), "Kubeflow", ()),
        (recorded("kubeflow_old_worker0"), "Kubeflow", ()),
        (recorded("kubeflow_trainer_v2_node1"), "Kubeflow", ()),
        (recorded("kubeflow_v1_elastic_worker"), "Kubeflow", ()),
        # srun's PMI-2 sets PMI_RANK / PMI_SIZE too, but srun started the task: SLURM's
        (recorded("slurm_srun_pmi2_rank1"), "SLURM", ()),
        # mpirun in an sbatch script: its processes inherit the job's variables; mpirun started them
        (recorded("slurm_batch_n1") | recorded("openmpi_two_hosts_rank0"), "Open MPI", ("SLURM",)),
        # Hydra inside SLURM starts its proxies with srun: a step's variables, and Hydra's
        (SLURM_STEP | recorded("mpich_two_hosts_rank1"), "MPICH/Intel MPI", ("SLURM",)),
        (recorded("torque_batch_script") | recorded("openmpi_two_hosts_rank0"), "Open MPI", ("PBS",)),
        (recorded("lsf_job_script") | recorded("openmpi_two_hosts_rank0"), "Open MPI", ("LSF",)),
        (recorded("slurm_batch_n1") | recorded("torque_batch_script"), "SLURM", ("PBS",)),
    ],
)
def test_detection_and_precedence(env: dict[str, str], name: str, outranked: tuple[str, ...]) -> None:
    assert cluster.present(env) == [name, *outranked]
    found = cluster.detect(env, MAIN, "n1")
    assert found is not None and (found.name, found.outranked) == (name, outranked)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"},
        # torchrun's variables outside Kubernetes, and a torchrun (or mpddp) worker inside a pod
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"},
        recorded("kubeflow_v1_worker0", {"LOCAL_RANK": "0"}),
        recorded("kubeflow_v1_worker0", {"TORCHELASTIC_RUN_ID": "abc"}),
        recorded("kubeflow_v1_worker0", {"KUBERNETES_SERVICE_HOST": None}),
        recorded("torque_pbsdsh_node1", {"PBS_NODEFILE": None}),
        recorded("lsf_blaunch_host2", {"LSB_DJOB_HOSTFILE": None, "LSB_MCPU_HOSTS": None, "LSB_HOSTS": None}),
        recorded("mpich_two_hosts_rank1", {"MPI_LOCALNRANKS": None}),  # PMI_RANK alone: no launcher known
    ],
)
def test_nothing_found(env: dict[str, str]) -> None:
    assert cluster.detect(env, MAIN, "n1") is None
    assert cluster.apply_cluster(UNSET, env, MAIN, "n1") == UNSET


def test_the_precedence_rule() -> None:
    assert cluster.PRECEDENCE == ("Open MPI", "MPICH/Intel MPI", "SLURM", "PBS", "LSF", "Kubeflow")


# ---- layouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "changes", "hostname", "layout"),
    [
        # mpirun on n1 (10.99.0.1): both ranks take its address; port 20000 + job id 81330177 % 10000
        ("openmpi_two_hosts_rank0", {}, "n1", (2, 0, "10.99.0.1", 20177, None)),
        ("openmpi_two_hosts_rank1", {}, "n2", (2, 1, "10.99.0.1", 20177, None)),
        ("openmpi_one_host_rank1", {}, "vm", (2, 1, "192.0.2.2", 22417, None)),
        # Open MPI 5 keeps only PMIX_NAMESPACE as the job's name: its CRC-32 makes the port
        ("openmpi_two_hosts_rank1", {"OMPI_MCA_ess_base_jobid": None, "PMIX_NAMESPACE": "prterun-n1-4242@1",
                                     "OMPI_MCA_orte_hnp_uri": None}, "n2", (2, 1, None, 24281, None)),
        ("mpich_two_hosts_rank1", {}, "n2", (2, 1, None, None, None)),
        ("torque_pbsdsh_node1", {}, "n2", (2, 1, "n1", 24242, None)),
        # without PBS_NODENUM, this host's place among the node file's hosts (short names match)
        ("pbspro_pbsdsh_node1", {}, "gpu02", (2, 1, "gpu01.cluster", 21234, None)),
        ("pbspro_pbsdsh_node1", {"PBS_NODENUM": None}, "gpu02", (2, 1, "gpu01.cluster", 21234, None)),
        ("torque_pbsdsh_node1", {"PBS_JOBID": "4242[7].torque01"}, "n2", (2, 1, "n1", 28241, None)),
        ("lsf_blaunch_host2", {}, "lsf-b", (2, 1, "lsf-a", 25678, None)),
        ("lsf_blaunch_host2", {"LSB_DJOB_HOSTFILE": None}, "lsf-b.cluster", (2, 1, "lsf-a", 25678, None)),
        ("lsf_blaunch_host2", {"LSB_DJOB_HOSTFILE": None, "LSB_MCPU_HOSTS": None}, "lsf-b",
         (2, 1, "lsf-a", 25678, None)),
        ("lsf_blaunch_host2", {"LSB_JOBINDEX": "3"}, "lsf-b", (2, 1, "lsf-a", 28491, None)),
        # WORLD_SIZE is pods x nprocPerNode = 4 there: the node count is PET_NNODES
        ("kubeflow_v1_worker0", {}, "x", (2, 1, "mnist-master-0", 23456, 2)),
        ("kubeflow_old_worker0", {}, "x", (2, 1, "mnist-master-0", 23456, None)),
        ("kubeflow_trainer_v2_node1", {}, "x", (2, 1, "mnist-node-0-0.mnist", 29500, None)),
    ],
)
def test_layout(name: str, changes: dict[str, str | None], hostname: str,
                layout: tuple[int, int, str | None, int | None, int | None]) -> None:
    found = cluster.detect(recorded(name, changes), MAIN, hostname)
    assert found is not None and isinstance(found.layout, joblayout.JobLayout)
    got = found.layout
    assert (got.nnodes, got.node_rank, got.master_addr, got.master_port, got.nprocs) == layout
    assert got.problem is None or name.startswith("openmpi_one_host")


@pytest.mark.parametrize(
    ("name", "flags", "expected"),
    [
        ("openmpi_two_hosts_rank1", {},
         {"nnodes": 2, "node_rank": 1, "master_addr": "10.99.0.1", "master_port": 20177}),
        # explicit flags win, one by one
        ("openmpi_two_hosts_rank1", {"master_port": 29500},
         {"nnodes": 2, "node_rank": 1, "master_addr": "10.99.0.1", "master_port": 29500}),
        ("openmpi_two_hosts_rank1", {"master_addr": "n1"},
         {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 20177}),
        ("openmpi_two_hosts_rank1", {"nnodes": 2, "node_rank": 1},
         {"nnodes": 2, "node_rank": 1, "master_addr": "10.99.0.1", "master_port": 20177}),
        # --nnodes 1 under a two-node mpirun: every node runs a one-node job of its own
        ("openmpi_two_hosts_rank1", {"nnodes": 1},
         {"nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": None}),
        # mpirun -np 1: one node keeps the loopback default and an OS-chosen port
        ("openmpi_two_hosts_rank0", {"OMPI_COMM_WORLD_SIZE": "1"},
         {"nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": None}),
        # rank 0 away from mpirun's host: the flag it asks for makes it work
        ("openmpi_mpirun_elsewhere_rank0", {"master_addr": "n1"},
         {"nnodes": 2, "node_rank": 0, "master_addr": "n1", "master_port": 28641}),
        ("mpich_two_hosts_rank1", {"master_addr": "n1", "master_port": 29500},
         {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 29500}),
        ("torque_pbsdsh_node1", {}, {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 24242}),
        ("torque_pbsdsh_node1", {"nprocs": 4},
         {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 24242, "nprocs": 4}),
        # by hand inside a Torque batch script: an explicit --nnodes keeps PBS out
        ("torque_batch_script", {"nnodes": 3, "node_rank": 2, "master_addr": "h0", "master_port": 29500},
         {"nnodes": 3, "node_rank": 2, "master_addr": "h0", "master_port": 29500}),
        ("lsf_blaunch_host2", {}, {"nnodes": 2, "node_rank": 1, "master_addr": "lsf-a", "master_port": 25678}),
        # a Kubeflow pod's PET_NPROC_PER_NODE fills --nprocs, which wins when given
        ("kubeflow_v1_worker0", {},
         {"nnodes": 2, "node_rank": 1, "master_addr": "mnist-master-0", "master_port": 23456, "nprocs": 2}),
        ("kubeflow_v1_worker0", {"nprocs": 1},
         {"nnodes": 2, "node_rank": 1, "master_addr": "mnist-master-0", "master_port": 23456, "nprocs": 1}),
        ("kubeflow_trainer_v2_node1", {},
         {"nnodes": 2, "node_rank": 1, "master_addr": "mnist-node-0-0.mnist", "master_port": 29500}),
    ],
)
def test_apply_cluster_flags_win(name: str, flags: dict[str, object], expected: dict[str, object]) -> None:
    env_changes = {k: v for k, v in flags.items() if k.isupper()}
    options = UNSET | {k: v for k, v in flags.items() if not k.isupper()}
    got = cluster.apply_cluster(options, recorded(name, env_changes), MAIN, {"lsf_blaunch_host2": "lsf-b"}.get(name))
    assert got == UNSET | expected


# ---- what cannot work, word for word ----------------------------------------------------------------

NODEFILE = DATA / "torque_nodefile"
HOSTFILE = DATA / "lsf_hostfile"
REFUSALS = [
    ("openmpi_one_host_rank1", {}, {}, None,
     "mpirun runs 2 MPI processes on this node (OMPI_COMM_WORLD_LOCAL_SIZE=2): mpddp wants one MPI process per node "
     "and starts one worker per GPU itself; start it with: mpirun -N 1 python -m mpddp train --epochs 1"),
    ("mpich_one_host_rank1", {}, {}, None,
     "mpiexec runs 2 MPI processes on this node (MPI_LOCALNRANKS=2): mpddp wants one MPI process per node and "
     "starts one worker per GPU itself; start it with: mpiexec -ppn 1 python -m mpddp train --epochs 1"),
    ("mpich_two_hosts_rank1", {}, {}, None,
     "MPICH/Intel MPI's mpiexec (Hydra) tells no process where MPI rank 0 runs, nor a port the whole job shares: "
     "pass --master-addr and --master-port on every node (node 0 is MPI rank 0, on the first host of mpiexec's "
     "-hosts)"),
    ("mpich_two_hosts_rank1", {}, {"master_addr": "n1"}, None,
     "MPICH/Intel MPI's mpiexec (Hydra) tells no process where MPI rank 0 runs, nor a port the whole job shares: "
     "pass --master-port on every node (node 0 is MPI rank 0, on the first host of mpiexec's -hosts)"),
    ("openmpi_mpirun_elsewhere_rank0", {}, {}, "n1",
     "MPI rank 0 runs on n1, not on mpirun's host (OMPI_MCA_orte_hnp_uri), whose address mpddp takes as node 0's: "
     "pass --master-addr on every node (e.g. --master-addr n1), or run mpirun on n1"),
    ("openmpi_two_hosts_rank1", {"OMPI_MCA_orte_hnp_uri": None}, {}, None,
     "Open MPI's mpirun set no OMPI_MCA_orte_hnp_uri, so nothing tells this process where MPI rank 0 runs: "
     "pass --master-addr on every node (MPI rank 0's host)"),
    ("openmpi_two_hosts_rank1", {}, {"nnodes": 3}, None,
     "--nnodes 3 but mpirun runs this job on 2 node(s) (OMPI_COMM_WORLD_SIZE, one MPI process a node): node ranks "
     "from OMPI_COMM_WORLD_RANK cannot number 3 nodes; drop --nnodes, or start the job on 3 nodes, or pass "
     "--node-rank on every node"),
    ("openmpi_two_hosts_rank1", {}, {"node_rank": 0}, None,
     "--node-rank 0 on Open MPI node 1 of 2 (OMPI_COMM_WORLD_RANK): mpirun runs the same command on every node, "
     "so every node would claim node rank 0; drop --node-rank"),
    ("torque_batch_script", {}, {}, "n1",
     "PBS job 4242.torque01 runs this command in the batch script (PBS_TASKNUM=1), on the first of 2 nodes: mpddp "
     "needs one launcher on every node of the job; start it with: pbsdsh -u python -m mpddp train --epochs 1"),
    ("pbspro_pbsdsh_node1", {"PBS_TASKNUM": "1", "PBS_NODENUM": "0"}, {}, "gpu01",
     "PBS job 1234.pbs01 runs this command in the batch script (PBS_TASKNUM=1), on the first of 2 nodes: mpddp "
     "needs one launcher on every node of the job; start it with: pbsdsh -- python -m mpddp train --epochs 1 "
     "(with one node-file line a host: -l select=N:mpiprocs=1)"),
    ("torque_pbsdsh_every_slot", {}, {}, "n1",
     "pbsdsh started this command on slot 2 of the node file (PBS_VNODENUM), one of 4 slots of n1: mpddp wants "
     "one launcher per node and starts one worker per GPU itself; start it with: pbsdsh -u python -m mpddp train "
     "--epochs 1"),
    ("torque_pbsdsh_node1", {"PBS_NODENUM": None}, {}, "login1",
     "this host (login1) is not among the hosts of PBS_NODEFILE (n1 n2) and PBS_NODENUM is not set: start it "
     "with: pbsdsh -u python -m mpddp train --epochs 1, or pass --nnodes and --node-rank"),
    ("torque_pbsdsh_node1", {"PBS_NODEFILE": "/nonexistent/nodefile"}, {}, "n2",
     "PBS_NODEFILE=/nonexistent/nodefile cannot be read (No such file or directory): PBS writes it for the job; "
     "run this inside the job, or pass --nnodes, --node-rank and --master-addr"),
    ("torque_pbsdsh_node1", {}, {"node_rank": 0}, "n2",
     "--node-rank 0 on PBS node 1 of 2 (PBS_NODENUM): pbsdsh runs the same command on every node, so every node "
     "would claim node rank 0; drop --node-rank"),
    ("lsf_job_script", {}, {}, "lsf-a",
     "LSF job 5678 runs this command outside blaunch, on the first of 2 hosts: mpddp needs one launcher on every "
     "host of the job; start it with: blaunch -z 'lsf-a lsf-b' python -m mpddp train --epochs 1"),
    ("lsf_blaunch_host2", {"LSF_PM_TASKID": "3"}, {}, "lsf-b",
     "blaunch started this command as task 3 (LSF_PM_TASKID) on lsf-b, host 2 of 2: mpddp wants one launcher per "
     "host, in the job's host order, and starts one worker per GPU itself; start it with: blaunch -z 'lsf-a lsf-b' "
     "python -m mpddp train --epochs 1"),
    ("lsf_blaunch_host2", {}, {}, "login",
     f"this host (login) is not among the hosts of LSB_DJOB_HOSTFILE={HOSTFILE} (lsf-a lsf-b): start it with: "
     "blaunch -z 'lsf-a lsf-b' python -m mpddp train --epochs 1, or pass --nnodes and --node-rank"),
    ("lsf_blaunch_host2", {"LSB_DJOB_HOSTFILE": None, "LSB_MCPU_HOSTS": "lsf-a 4 lsf-b"}, {}, "lsf-b",
     "LSB_MCPU_HOSTS='lsf-a 4 lsf-b' is not 'host slots host slots ...': check the job, or pass --nnodes, "
     "--node-rank and --master-addr"),
    ("kubeflow_v1_elastic_worker", {}, {}, None,
     "Kubeflow pod mnist-worker-1 belongs to an elastic job (PET_NNODES=1:4): torchrun numbers elastic nodes as "
     "they join, mpddp needs a fixed node count and each pod's number; drop the elasticPolicy and give the job a "
     "Master replica, or pass --nnodes and --node-rank"),
    ("kubeflow_v1_worker0", {"MASTER_ADDR": None, "PET_MASTER_ADDR": None, "MASTER_PORT": None,
                             "PET_MASTER_PORT": None}, {}, None,
     "the pod has no MASTER_ADDR / MASTER_PORT (a PyTorchJob without a Master replica?): pass --master-addr and "
     "--master-port in every pod's command, or give the job a Master replica"),
    ("kubeflow_v1_worker0", {}, {"nnodes": 4}, None,
     "--nnodes 4 but the PyTorchJob runs this job on 2 node(s) (PET_NNODES): node ranks from PET_NODE_RANK cannot "
     "number 4 nodes; drop --nnodes, or start the job on 4 nodes, or pass --node-rank on every node"),
    ("kubeflow_v1_worker0", {}, {"node_rank": 0}, None,
     "--node-rank 0 on Kubeflow node 1 of 2 (PET_NODE_RANK): the PyTorchJob runs the same command on every node, "
     "so every node would claim node rank 0; drop --node-rank"),
    ("kubeflow_v1_worker0", {"PET_NODE_RANK": "one"}, {}, None,
     "PET_NODE_RANK='one' is not a number: Kubeflow sets it to an integer; unset it or fix the job"),
    # SLURM found by the same rule keeps its own words (tests/test_slurm.py has the rest)
    ("slurm_srun_pmi2_rank1", {}, {}, None,
     "SLURM runs 2 mpddp tasks on one node (tasks per node: 2): mpddp wants one task per node and starts one worker "
     "per GPU itself; start it with: srun --nodes=1 --ntasks-per-node=1 python -m mpddp train --epochs 1"),
]


@pytest.mark.parametrize(("name", "changes", "flags", "hostname", "message"), REFUSALS)
def test_refusals_word_for_word(name: str, changes: dict[str, str | None], flags: dict[str, object],
                                hostname: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        cluster.apply_cluster(UNSET | flags, recorded(name, changes), MAIN, hostname)
    assert str(info.value) == message


def test_problems_wait_for_the_node_count_to_be_the_jobs() -> None:
    """A layout that cannot work as started is no obstacle to flags that describe the job by hand."""
    env = recorded("openmpi_one_host_rank1")
    hand = {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29500}
    assert cluster.apply_cluster(UNSET | hand, env, MAIN) == UNSET | hand


# ---- the small readers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "addresses"),
    [
        ("622198784.0;tcp://192.0.2.2:54553;tcp6://[fd00::2]:53359", ["192.0.2.2", "fd00::2"]),
        ("957808640.0;tcp://192.0.2.2,10.99.0.254:47603;tcp6://[fd00::2]:45323",
         ["192.0.2.2", "10.99.0.254", "fd00::2"]),
        ("81330176.0;tcp://10.99.0.1:49127", ["10.99.0.1"]),
        ("81330176.0;tcp6://[fd00::2],[fd00::3]:1;tcp://10.0.0.1:2", ["10.0.0.1", "fd00::2", "fd00::3"]),
        ("81330176.0", []),
        ("81330176.0;usock://x", []),
    ],
)
def test_hnp_addresses(uri: str, addresses: list[str]) -> None:
    assert mpi.hnp_addresses(uri) == addresses


@pytest.mark.parametrize(
    ("job", "port"),
    [("1234", 21234), ("4242.torque01", 24242), ("81330177", 20177), ("123456.pbs", 23456),
     ("4242[7].torque01", 28241), ("5678[3]", 28491), ("prterun-n1-4242@1", 24281)],
)
def test_port_for(job: str, port: int) -> None:
    assert joblayout.port_for(job) == port
    assert 20000 <= port < 30000  # below Linux's ephemeral ports, as under SLURM


def test_port_source() -> None:
    assert joblayout.port_source("LSB_JOBID", "5678") == "20000 + LSB_JOBID % 10000"
    assert joblayout.port_source("PBS_JOBID", "1234.pbs01") == "20000 + the number of PBS_JOBID % 10000"
    assert joblayout.port_source("PMIX_NAMESPACE", "prterun-n1-4242@1") == "20000 + crc32(PMIX_NAMESPACE) % 10000"


@pytest.mark.parametrize(
    ("hosts", "hostname", "index"),
    [(("n1", "n2"), "n2", 1), (("n1.cluster", "n2.cluster"), "n2", 1), (("n1", "n2"), "n2.cluster", 1),
     (("n1", "n2"), "n3", None), (("a", "a.x"), "a.x", 1)],
)
def test_host_index(hosts: tuple[str, ...], hostname: str, index: int | None) -> None:
    assert joblayout.host_index(hosts, hostname) == index


def test_host_files(tmp_path: Path) -> None:
    assert joblayout.read_hostfile(str(NODEFILE), "PBS_NODEFILE", "PBS") == ["n1"] * 4 + ["n2"] * 4
    assert joblayout.unique(["n1", "n1", "n2", "n1"]) == ("n1", "n2")
    commented = tmp_path / "hosts"
    commented.write_text("# a comment\n\nh1 4\nh2 4\n")
    assert joblayout.read_hostfile(str(commented), "LSB_DJOB_HOSTFILE", "LSF") == ["h1", "h2"]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=rf"^LSB_DJOB_HOSTFILE={empty} names no host: check the job"):
        joblayout.read_hostfile(str(empty), "LSB_DJOB_HOSTFILE", "LSF")
    assert lsf.job_hosts({"LSB_MCPU_HOSTS": "a 2 b 1"}) == (["a", "a", "b"], "LSB_MCPU_HOSTS")


# ---- one rule for the CLI and the API ---------------------------------------------------------------

CLEARED = ("SLURM", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "HYDI_", "MPIR_", "PBS_", "LSB_", "LSF_", "PET_",
           "KUBERNETES_")
CLEARED_NAMES = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                 "HOSTNAME", "CUDA_VISIBLE_DEVICES"}


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Replace every scheduler variable of this process with ``env``."""
    for name in list(os.environ):
        if name.startswith(CLEARED) or name in CLEARED_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["/site-packages/mpddp/__main__.py", "ranks"])

    def set_env(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_make_config_takes_the_jobs_layout(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("openmpi_two_hosts_rank1"))
    config = make_config({"nprocs": 2})
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (2, 1, "10.99.0.1", 20177)
    config = make_config({"nprocs": 2, "master_port": 29555})
    assert config.master_port == 29555
    given = make_config({"nprocs": 1})  # a config object already describes the job: the cluster stays out
    assert make_config({}, given) == given


def test_make_config_takes_a_pods_nprocs(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("kubeflow_v1_worker0"))
    assert (make_config({}).nprocs, make_config({"nprocs": 3}).nprocs) == (2, 3)


def test_make_config_refuses_with_the_command_line(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("mpich_one_host_rank1"))
    with pytest.raises(ConfigError, match=r"start it with: mpiexec -ppn 1 python -m mpddp ranks$"):
        make_config({})


def test_ranks_shows_the_environment_and_sources(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("torque_pbsdsh_node1"))
    result = CliRunner().invoke(main, ["ranks", "--nprocs", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        "From PBS job 4242.torque01:\n"
        f"  nnodes      = 2              (distinct hosts of PBS_NODEFILE={NODEFILE})\n"
        "  node_rank   = 1              (PBS_NODENUM)\n"
        "  master_addr = n1             (first host of PBS_NODEFILE (the mother superior))\n"
        "  master_port = 24242          (20000 + the number of PBS_JOBID % 10000)\n\n"
        "world_size = nnodes × nprocs_per_node = 2 × 2 = 4\n")
    assert "   1           1  1×2+1 = 3         cpu      -" in result.output
    assert "note:" not in result.output


def test_ranks_under_mpirun_on_one_host_notes_the_fix(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("openmpi_one_host_rank1"))
    result = CliRunner().invoke(main, ["ranks"])
    assert result.exit_code == 0, result.output
    assert "From Open MPI job 1905852417 (mpirun):\n" in result.output
    assert "  master_addr = 192.0.2.2      (mpirun's host, first address of OMPI_MCA_orte_hnp_uri)\n" in result.output
    assert "note: mpirun runs 2 MPI processes on this node (OMPI_COMM_WORLD_LOCAL_SIZE=2)" in result.output
    assert result.output.count("start it with: mpirun -N 1 python -m mpddp ranks\n") == 1


def test_ranks_names_the_environments_that_lose(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("slurm_batch_n1") | recorded("openmpi_two_hosts_rank0"))
    result = CliRunner().invoke(main, ["ranks"])
    assert result.exit_code == 0, result.output
    assert "  (SLURM variables are set too; Open MPI started this process, so its layout wins)\n" in result.output
    assert "world_size = nnodes × nprocs_per_node = 2 × 1 = 2" in result.output


def test_ranks_notes_a_missing_master(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("mpich_two_hosts_rank1"))
    result = CliRunner().invoke(main, ["ranks"])
    assert result.exit_code == 0, result.output
    assert "  master_addr = (not given)    (not in the environment)\n" in result.output
    assert "note: MPICH/Intel MPI's mpiexec (Hydra) tells no process where MPI rank 0 runs" in result.output


def test_ranks_flags_win_over_the_job(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("lsf_blaunch_host2"))
    result = CliRunner().invoke(main, ["ranks", "--nnodes", "3"])
    assert result.exit_code == 0, result.output
    assert "From LSF" not in result.output
    assert "world_size = nnodes × nprocs_per_node = 3 × 1 = 3" in result.output


def test_info_names_the_environment(job_env: Callable[[dict[str, str]], None]) -> None:
    assert cluster_lines() == ["cluster       none found (looked for Open MPI, MPICH/Intel MPI, SLURM, PBS, LSF, "
                               "Kubeflow)"]
    job_env(recorded("kubeflow_trainer_v2_node1"))
    assert cluster_lines() == [
        "cluster       Kubeflow: a launch here takes this layout (explicit flags win)",
        "  From Kubeflow pod mnist-node-0-1-x7k2p:",
        "    nnodes      = 2              (PET_NNODES)",
        "    node_rank   = 1              (PET_NODE_RANK)",
        "    master_addr = mnist-node-0-0.mnist (PET_MASTER_ADDR)",
        "    master_port = 29500          (PET_MASTER_PORT)",
        "    nprocs      = (default)      (PET_NPROC_PER_NODE=auto: mpddp's default, one worker per GPU)",
    ]


def test_info_reports_an_unreadable_job(job_env: Callable[[dict[str, str]], None]) -> None:
    job_env(recorded("torque_pbsdsh_node1", {"PBS_NODEFILE": "/nonexistent/nodefile"}))
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "cluster       unreadable: PBS_NODEFILE=/nonexistent/nodefile cannot be read" in result.output
    assert "A launch here would choose:" in result.output


# ---- the manual: each scheduler row is one of the lines tested here -------------------------------


def test_manual_scheduler_table_and_precedence() -> None:
    text = re.sub(r"\s+", " ", GUIDE.read_text(encoding="utf-8"))
    assert f"first present wins: {', '.join(cluster.PRECEDENCE)}" in text
    commands = {
        "srun --nodes=2 --ntasks-per-node=1": slurm.srun_line(
            slurm.SlurmJob(1, True, True, 2, 0, ("n1", "n2"), (1, 1), 0, None), MAIN),
        "mpirun -N 1": mpi.read_open_mpi(recorded("openmpi_two_hosts_rank1"), MAIN),
        "mpiexec -ppn 1": mpi.read_hydra(recorded("mpich_two_hosts_rank1"), MAIN),
        "pbsdsh -u": cluster.detect(recorded("torque_pbsdsh_node1"), MAIN, "n2"),
        "blaunch -z": cluster.detect(recorded("lsf_blaunch_host2"), MAIN, "lsf-b"),
    }
    for command, source in commands.items():
        line = source if isinstance(source, str) else getattr(source, "layout", source).command
        assert line.startswith(command), (command, line)
        assert f"``{command}" in text, f"docs/machines.rst's scheduler table lacks {command}"
