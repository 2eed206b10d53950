"""MPI launchers: the layout ``mpirun`` (Open MPI) or ``mpiexec`` (MPICH, Intel MPI) hands each process.

Owns: reading Open MPI's ``OMPI_COMM_WORLD_*`` and Hydra's ``PMI_*`` / ``MPI_LOCAL*`` variables into a
:class:`~mpddp.machine.joblayout.JobLayout` (one MPI process per node: nnodes = the MPI world size, node rank = the
MPI rank), the master from Open MPI's own contact address, and the ``mpirun -N 1`` / ``mpiexec -ppn 1`` line for a
job started with several processes a node. No mpi4py, no MPI library: only what the launcher put in the environment.

Measured (tests/data/scheduler_env/ holds the recordings): Open MPI 4.1.4 gives a job id shared by the whole job
(``OMPI_MCA_ess_base_jobid``, also ``PMIX_NAMESPACE``) and ``OMPI_MCA_orte_hnp_uri``, mpirun's contact with every
address of its host; a process on mpirun's host has ``OMPI_MCA_orte_local_daemon_uri`` equal to it, one elsewhere
its host's orted. No variable names the host of MPI rank 0. MPICH 4.0 (Hydra, as is Intel MPI) gives ``PMI_RANK``,
``PMI_SIZE``, ``MPI_LOCALNRANKS``, ``MPI_LOCALRANKID`` and nothing shared by the job: no job id, no host of rank 0.
``srun --mpi=pmi2`` also sets ``PMI_RANK``/``PMI_SIZE``, but no ``MPI_LOCALNRANKS``: that job is SLURM's.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence

from .joblayout import JobLayout, int_var, pick, port_for, port_source, user_command

OPEN_MPI = "Open MPI"
HYDRA = "MPICH/Intel MPI"


def open_mpi_present(environ: Mapping[str, str]) -> bool:
    """Open MPI's mpirun (or mpiexec) started this process."""
    return pick(environ, "OMPI_COMM_WORLD_SIZE") is not None


def hydra_present(environ: Mapping[str, str]) -> bool:
    """MPICH's or Intel MPI's Hydra mpiexec started this process (srun's PMI has no MPI_LOCALNRANKS)."""
    return all(pick(environ, name) for name in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"))


def hnp_addresses(uri: str) -> list[str]:
    """The addresses in an Open MPI contact URI, IPv4 first.

    ``622198784.0;tcp://192.0.2.2,10.99.0.254:54553;tcp6://[fd00::2]:53359``
    -> ``['192.0.2.2', '10.99.0.254', 'fd00::2']``.
    """
    found: list[str] = []
    for part in uri.split(";")[1:]:
        scheme, sep, rest = part.partition("://")
        if not sep or not scheme.startswith("tcp"):
            continue
        hosts, _, _port = rest.rpartition(":")
        found += [host.strip("[]") for host in hosts.split(",") if host.strip("[]")]
    return sorted(found, key=lambda addr: ":" in addr)  # stable: IPv4 before IPv6


def _one_per_node(local: tuple[int, str] | None, launcher: str, command: str) -> str | None:
    if local is None or local[0] <= 1:
        return None
    count, name = local
    return (f"{launcher} runs {count} MPI processes on this node ({name}={count}): mpddp wants one MPI process "
            f"per node and starts one worker per GPU itself; start it with: {command}")


def _layout(scheduler: str, job: str, launcher: str, command: str, size: tuple[int, str], rank: tuple[int, str],
            local: tuple[int, str] | None, master: str | None, port: int | None, missing: str,
            master_from: str, port_from: str) -> JobLayout:
    """The layout of an MPI job with one MPI process a node: node rank = MPI rank."""
    return JobLayout(
        scheduler=scheduler, job=job, nnodes=size[0], node_rank=rank[0], master_addr=master, master_port=port,
        launcher=launcher, command=command, problem=_one_per_node(local, launcher, command), missing=missing,
        sources=(("nnodes", f"{size[1]}, one MPI process a node"), ("node_rank", rank[1]),
                 ("master_addr", master_from), ("master_port", port_from)),
    )


def read_open_mpi(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None) -> JobLayout | None:
    """The layout Open MPI's mpirun gave this process, or None outside Open MPI.

    The master is mpirun's host (the first address of its contact URI): a
    batch script's or an interactive ``mpirun`` runs there, and maps MPI
    rank 0 there. MPI rank 0 itself checks: on another host, the master is
    unknown and ``--master-addr`` is asked for, naming rank 0's host.
    """
    size = int_var(environ, OPEN_MPI, "OMPI_COMM_WORLD_SIZE")
    if size is None:
        return None
    rank = int_var(environ, OPEN_MPI, "OMPI_COMM_WORLD_RANK") or (0, "default 0")
    job = pick(environ, "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
    command = f"mpirun -N 1 {user_command(argv)}"
    hnp = pick(environ, "OMPI_MCA_orte_hnp_uri")
    addrs = hnp_addresses(hnp[1]) if hnp else []
    on_hnp = hnp is not None and environ.get("OMPI_MCA_orte_local_daemon_uri", hnp[1]).strip() == hnp[1]
    here = hostname or socket.gethostname()
    master, missing = None, (f"{OPEN_MPI}'s mpirun set no OMPI_MCA_orte_hnp_uri, so nothing tells this process "
                             "where MPI rank 0 runs: {pass} on every node (MPI rank 0's host)")
    if addrs and rank[0] == 0 and not on_hnp:
        missing = (f"MPI rank 0 runs on {here}, not on mpirun's host (OMPI_MCA_orte_hnp_uri), whose address mpddp "
                   f"takes as node 0's: {{pass}} on every node (e.g. --master-addr {here}), or run mpirun on {here}")
    elif addrs:
        master = addrs[0]
    if job is None:
        missing = (f"{OPEN_MPI}'s mpirun set no job id (OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE) to derive "
                   "a port from: {pass} on every node")
    return _layout(OPEN_MPI, f"{OPEN_MPI} job {job[1] if job else '(no id)'} (mpirun)", "mpirun", command, size, rank,
                   int_var(environ, OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE"), master,
                   port_for(job[1]) if job else None, missing,
                   f"mpirun's host, first address of {hnp[0]}" if master and hnp else "not in the environment",
                   port_source(*job) if job else "not in the environment")


def read_hydra(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None) -> JobLayout | None:
    """The layout MPICH's or Intel MPI's mpiexec (Hydra) gave this process, or None outside Hydra.

    Hydra shares nothing job-wide in the environment: the master address and
    port must be passed (``--master-addr``: MPI rank 0's host, the first of
    mpiexec's ``-hosts``).
    """
    if not hydra_present(environ):
        return None
    size = int_var(environ, HYDRA, "PMI_SIZE") or (1, "default 1")
    rank = int_var(environ, HYDRA, "PMI_RANK") or (0, "default 0")
    command = f"mpiexec -ppn 1 {user_command(argv)}"
    missing = (f"{HYDRA}'s mpiexec (Hydra) tells no process where MPI rank 0 runs, nor a port the whole job "
               "shares: {pass} on every node (node 0 is MPI rank 0, on the first host of mpiexec's -hosts)")
    return _layout(HYDRA, f"{HYDRA} job (mpiexec, Hydra)", "mpiexec", command, size, rank,
                   int_var(environ, HYDRA, "MPI_LOCALNRANKS"), None, None, missing, "not in the environment",
                   "not in the environment")
