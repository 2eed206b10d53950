"""One shape for what a scheduler or an MPI launcher says about the job, and how it meets the flags.

Owns: :class:`JobLayout` (node count, node rank, master, the command line that starts one launcher per node, what
would not work, and where each value came from), the small readers the scheduler modules share, the one port formula
every node of a job derives alike (:func:`port_for`), merging a layout *under* explicit flags with the two conflicts
that cannot work, and :func:`describe` for ``mpddp ranks``. Each scheduler's module is one
``read_layout(environ, argv, hostname) -> JobLayout``; machine/cluster.py chooses among them.

Why one shape: every scheduler runs the *same* command on every node, so the same two mistakes are possible
everywhere (a ``--nnodes`` the job does not have, a ``--node-rank`` every node would claim), and the same fix is
printed: the launcher's own command line for one launcher per node.
"""

from __future__ import annotations

import os
import shlex
import socket
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

# Port = PORT_BASE + job id % PORT_SPAN, so 20000..29999: every node of a job
# derives the same port with no message passing; the range is above the
# well-known ports and below Linux's ephemeral range (32768-60999), so an
# outgoing connection never holds it. Two jobs collide only when their ids
# differ by a multiple of 10000 *and* they share node 0; pass --master-port then.
PORT_BASE = 20000
PORT_SPAN = 10000


@dataclass(frozen=True)
class JobLayout:
    """One node's view of its job, as a scheduler or MPI launcher describes it.

    ``master_addr`` / ``master_port`` are None where the environment does not
    say; ``missing`` then tells why, and a multi-node launch without the flag
    is refused with it (``{pass}`` in it becomes "pass --master-addr" or
    whichever flags are still missing). ``problem`` is why the layout cannot work as started
    (several launchers on one node, a batch script instead of the launcher),
    ending with ``command``, the line that starts one launcher per node; it is
    raised only when the node count comes from the scheduler. ``launcher``
    names what runs the same command on every node (``mpirun``, ``pbsdsh``).
    ``nprocs`` is the workers per node the job asked for, if it says.
    ``numbered`` is False where the node rank is not the job's to give (a
    SLURM batch script outside ``srun``), so a ``--node-rank`` there is no
    conflict; ``resize`` says how to ask for ``{n}`` nodes. ``gpus`` and
    ``gpu_ids`` are the GPUs the job gave this node, for ``mpddp ranks`` (the
    choice itself reaches machine/gpus.py through ``CUDA_VISIBLE_DEVICES``).
    """

    scheduler: str
    job: str
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str
    command: str
    nprocs: int | None = None
    problem: str | None = None
    missing: str = ""
    sources: tuple[tuple[str, str], ...] = ()
    numbered: bool = True
    resize: str = "start the job on {n} nodes"
    gpus: int = 0
    gpu_ids: tuple[int, ...] | None = None

    def source(self, name: str) -> str:
        """Where the value ``name`` came from (a variable, a file, a default)."""
        return dict(self.sources).get(name, "default")


def pick(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set and not empty, as (name, value)."""
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None


def int_var(environ: Mapping[str, str], scheduler: str, *names: str) -> tuple[int, str] | None:
    """The first of ``names`` that is set, as a number, with its name; None when none is set."""
    found = pick(environ, *names)
    if found is None:
        return None
    name, text = found
    if not text.isdigit():
        raise ConfigError(f"{name}={text!r} is not a number: {scheduler} sets it to an integer; "
                          "unset it or fix the job")
    return int(text), name


def port_for(job_id: str) -> int:
    """The master port every node of job ``job_id`` derives alike, 20000-29999: the one formula for every scheduler.

    The job's number: a numeric id (SLURM's ``1234``, PBS's ``1234.server``)
    is that number, so that consecutive jobs get distinct ports; any other id
    (an array job's ``1234[5].server``, Open MPI 5's namespace) is numbered
    by its CRC-32, which is the same on every node (Python's ``hash`` is
    not: it changes with each interpreter). Port = PORT_BASE + number % PORT_SPAN.
    """
    head = job_id.split(".", 1)[0]
    number = int(head) if head.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def port_source(name: str, job_id: str) -> str:
    """How :func:`port_for` derived the port from variable ``name``, for ``mpddp ranks``."""
    number = job_id.split(".", 1)[0]
    what = name if job_id.isdigit() else f"the number of {name}" if number.isdigit() else f"crc32({name})"
    return f"{PORT_BASE} + {what} % {PORT_SPAN}"


def unique(hosts: Iterable[str]) -> tuple[str, ...]:
    """The hosts in order of first appearance (host files list a host once per slot)."""
    return tuple(dict.fromkeys(hosts))


def host_index(hosts: tuple[str, ...], hostname: str | None = None) -> int | None:
    """Where this host is among ``hosts``: its exact name first, else the short names (``n1.cluster`` = ``n1``)."""
    name = hostname or socket.gethostname()
    if name in hosts:
        return hosts.index(name)
    short = [host.split(".", 1)[0] for host in hosts]
    return short.index(name.split(".", 1)[0]) if name.split(".", 1)[0] in short else None


def read_hostfile(path: str, variable: str, scheduler: str) -> list[str]:
    """The host names of a host file, one a line (the first word; ``#`` comments and blank lines skipped)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{variable}={path} cannot be read ({e.strerror}): {scheduler} writes it for the job; "
                          "run this inside the job, or pass --nnodes, --node-rank and --master-addr") from e
    hosts = [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not hosts:
        raise ConfigError(f"{variable}={path} names no host: check the job, or pass --nnodes, --node-rank "
                          "and --master-addr")
    return hosts


def user_command(argv: Sequence[str]) -> str:
    """How the user started this process, for the line that starts one launcher per node in messages."""
    if not argv or argv[0] in ("", "-c"):
        return "python your_script.py"
    first = argv[0].replace(os.sep, "/")
    if first.endswith("mpddp/__main__.py") or os.path.basename(first) == "mpddp":
        return shlex.join(["python", "-m", "mpddp", *argv[1:]])
    return shlex.join(["python", *argv])


def check_conflicts(explicit: Mapping[str, Any], layout: JobLayout) -> None:
    """Explicit flags win, except where one command line on every node cannot work.

    ``--nnodes`` other than the job's with no ``--node-rank``: the job's node
    ranks cannot number them. ``--node-rank`` on a job that runs the same
    command on every node: every node would claim it.
    """
    want_nodes, want_rank = explicit.get("nnodes"), explicit.get("node_rank")
    nnodes, node_rank = layout.nnodes, layout.node_rank
    if want_nodes is not None and want_nodes not in (1, nnodes) and want_rank is None:
        raise ConfigError(
            f"--nnodes {want_nodes} but {layout.launcher} runs this job on {nnodes} node(s) "
            f"({layout.source('nnodes')}): node ranks from {layout.source('node_rank')} cannot number {want_nodes} "
            f"nodes; drop --nnodes, or {layout.resize.format(n=want_nodes)}, or pass --node-rank on every node")
    if (want_rank is not None and want_rank != node_rank and want_nodes in (None, nnodes) and layout.numbered
            and nnodes > 1):
        raise ConfigError(
            f"--node-rank {want_rank} on {layout.scheduler} node {node_rank} of {nnodes} "
            f"({layout.source('node_rank')}): {layout.launcher} runs the same command on every node, so every "
            f"node would claim node rank {want_rank}; drop --node-rank")


def under_flags(explicit: Mapping[str, Any], layout: JobLayout) -> dict[str, Any]:
    """The job's layout with the explicit values (not None) over it.

    A node count of the user's other than the job's means the job is
    described by hand: the job's node rank and master stay out of it. One
    node keeps the loopback default and an OS-chosen port.
    """
    if explicit.get("nnodes") not in (None, layout.nnodes):
        job: dict[str, Any] = {"nnodes": explicit["nnodes"], "node_rank": 0}
    else:
        job = {"nnodes": layout.nnodes, "node_rank": layout.node_rank}
        if layout.nnodes > 1:
            job |= {"master_addr": layout.master_addr, "master_port": layout.master_port}
    return {name: explicit[name] if explicit.get(name) is not None else value for name, value in job.items()}


def merge(explicit: Mapping[str, Any], layout: JobLayout) -> dict[str, Any]:
    """nnodes, node_rank, master_addr, master_port (and nprocs): explicit values (not None) win over the job's.

    An explicit ``--nnodes`` other than the job's means the user describes the
    job by hand, so the job's node rank and master stay out of it. A
    multi-node job whose master the environment does not give needs the
    flags: refused with ``layout.missing``, naming what to pass.
    """
    check_conflicts(explicit, layout)
    merged = under_flags(explicit, layout)
    if layout.nprocs is not None:
        merged["nprocs"] = explicit["nprocs"] if explicit.get("nprocs") is not None else layout.nprocs
    if "master_addr" in merged:
        need = [f"--{name.replace('_', '-')}" for name in ("master_addr", "master_port") if merged[name] is None]
        if need:
            remedy = f"pass {' and '.join(need)}"
            text = layout.missing or f"{layout.job} does not say where node 0 is: {{pass}} on every node"
            raise ConfigError(text.replace("{pass}", remedy))
    return merged


def describe(layout: JobLayout) -> str:
    """Where each value came from, for ``mpddp ranks`` and ``mpddp info`` inside a job."""
    values = {
        "nnodes": str(layout.nnodes),
        "node_rank": str(layout.node_rank),
        "master_addr": layout.master_addr or "(not given)",
        "master_port": "(not given)" if layout.master_port is None else str(layout.master_port),
        "nprocs": "(default)" if layout.nprocs is None else str(layout.nprocs),
        "gpus": str(layout.gpus),
    }
    lines = [f"From {layout.job}:"]
    lines += [f"  {name:<11} = {values[name]:<14} ({source})" for name, source in layout.sources]
    return "\n".join(lines)
