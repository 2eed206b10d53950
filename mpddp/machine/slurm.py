"""SLURM: what an allocation says about the job's layout, read once at the edge.

Owns: expanding node lists (``gpu[01-03,7]``) and per-node task counts (``2(x3),1``), the :class:`SlurmJob` read
from ``SLURM_*`` variables, the check that it can work (one mpddp task per node, inside ``srun``) with the ``srun``
line that fixes it, and :func:`read_layout`, which turns it into a :class:`~mpddp.machine.joblayout.JobLayout`.
mpddp runs one launcher per node, each starting one worker per local GPU, so it wants one task per node::

    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python -m mpddp train ...

Why the step's variables come first and the job's are the fallback (measured with slurm-wlm 22.05, ``srun -N1 -w
n2`` in a two-node ``sbatch``): a step sees the *job's* ``SLURM_NODELIST`` (``n[1-2]``) but the *step's*
``SLURM_STEP_NODELIST=n2``, ``SLURM_NNODES=1`` and ``SLURM_NODEID=0``, and inherits ``SLURM_NTASKS_PER_NODE`` from
``sbatch``. The batch script has ``SLURM_JOB_ID`` but no ``SLURM_STEP_ID``. GPUs are not chosen here: SLURM's pick
reaches machine/gpus.py through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .joblayout import JobLayout, int_var, pick, port_for, port_source, user_command

SLURM = "SLURM"
SCONTROL_TIMEOUT = 5.0  # seconds; scontrol answers locally, never wait on a sick controller

_NODELIST_ITEM = re.compile(r"([^\[\],]*)\[([^\]]*)\]")
_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _expand_range(part: str, spec: str) -> list[str]:
    """``01-03`` -> ``01, 02, 03`` (zero padding kept), ``7`` -> ``7``."""
    lo, sep, hi = part.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ConfigError(
            f"SLURM node list {spec!r} holds the range {part!r}: ranges look like 1-3 or 01-03; "
            "check SLURM_JOB_NODELIST or pass --master-addr"
        )
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise ConfigError(f"SLURM node list {spec!r} holds the backwards range {part!r}: write it low-high")
    width = len(lo) if lo.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_item(item: str, spec: str) -> list[str]:
    """One comma-free item, possibly with several bracket groups: ``r1-[2-3]n[1,5]``."""
    names = [""]
    pos = 0
    for match in _NODELIST_ITEM.finditer(item):
        if match.start() != pos:
            break
        prefix, ranges = match.groups()
        choices = [n for part in ranges.split(",") for n in _expand_range(part.strip(), spec)]
        names = [f"{name}{prefix}{choice}" for name in names for choice in choices]
        pos = match.end()
    rest = item[pos:]
    if "[" in rest or "]" in rest:
        raise ConfigError(f"SLURM node list {spec!r} has an unmatched bracket in {item!r}")
    return [name + rest for name in names]


def _split_top(spec: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"SLURM node list {spec!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    items.append(spec[start:])
    return [item.strip() for item in items if item.strip()]


def expand_nodelist(spec: str) -> list[str]:
    """``gpu[01-03,7]`` -> ``gpu01 gpu02 gpu03 gpu7``; ``a[1-2],b3`` -> ``a1 a2 b3``."""
    hosts = [host for item in _split_top(spec.strip()) for host in _expand_item(item, spec)]
    if not hosts:
        raise ConfigError(f"SLURM node list {spec!r} names no host: check SLURM_JOB_NODELIST or pass --master-addr")
    return hosts


def scontrol_hostnames(spec: str) -> list[str] | None:
    """``scontrol show hostnames SPEC`` when scontrol is here and answers, else None."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        out = subprocess.run([scontrol, "show", "hostnames", spec], capture_output=True, text=True,
                             timeout=SCONTROL_TIMEOUT, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split() or None


def hostnames(spec: str, scontrol: Callable[[str], list[str] | None] = scontrol_hostnames) -> list[str]:
    """Every host of a node list: SLURM's own answer when it has one, else ours."""
    return scontrol(spec) or expand_nodelist(spec)


def parse_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: SLURM's compressed per-node task counts."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={spec!r} is not like '1(x2)' or '2,1': check the allocation")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def present(environ: Mapping[str, str]) -> bool:
    """Inside a SLURM job (its batch script, an salloc shell, or a step)."""
    return pick(environ, "SLURM_JOB_ID", "SLURM_JOBID") is not None


@dataclass(frozen=True)
class SlurmJob:
    """One node's view of its SLURM job: what mpddp takes from ``SLURM_*``.

    ``in_step`` is True inside ``srun`` (``SLURM_STEP_ID`` set), False in the
    batch script or an ``salloc`` shell; ``on_node`` is False in an
    ``salloc`` shell, which runs on the submit host, not on an allocated node.
    ``gpu_ids`` are the GPUs SLURM gave this node: ``SLURM_STEP_GPUS`` /
    ``SLURM_JOB_GPUS`` (physical ids), else ``CUDA_VISIBLE_DEVICES``; None
    when unset or not numbers. mpddp leaves the choice in
    ``CUDA_VISIBLE_DEVICES``, which machine/gpus.py honours; these are for display.
    ``sources`` names the variable each value came from, for ``mpddp ranks``.
    """

    job_id: int
    in_step: bool
    on_node: bool
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    gpus_on_node: int
    gpu_ids: tuple[int, ...] | None
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def master_addr(self) -> str:
        """Node 0 of the step hosts the rendezvous: the first host of its node list."""
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        """The port derived from the job id (see :func:`~mpddp.machine.joblayout.port_for`)."""
        return port_for(str(self.job_id))

    @property
    def tasks_here(self) -> int:
        """How many tasks of this step (or job) run on this node."""
        if 0 <= self.node_rank < len(self.tasks_per_node):
            return self.tasks_per_node[self.node_rank]
        return max(self.tasks_per_node, default=1)


def _int_var(environ: Mapping[str, str], default: int, *names: str) -> tuple[int, str]:
    return int_var(environ, SLURM, *names) or (default, f"default {default}")


def _gpu_ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def read_job(environ: Mapping[str, str], scontrol: Callable[[str], list[str] | None] | None = None) -> SlurmJob | None:
    """The SLURM job in ``environ``, or None outside a SLURM job (``scontrol``: see :func:`hostnames`)."""
    job = pick(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None:
        return None
    job_id, _ = _int_var(environ, 0, job[0])
    nnodes, nnodes_src = _int_var(environ, 1, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_rank, rank_src = _int_var(environ, 0, "SLURM_NODEID")
    nodelist = pick(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    hosts = tuple(hostnames(nodelist[1], scontrol or scontrol_hostnames)) if nodelist else ("127.0.0.1",)
    tasks = pick(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    gpus = pick(environ, "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    gpus_on_node, gpus_src = _int_var(environ, len(_gpu_ids(gpus[1]) or ()) if gpus else 0, "SLURM_GPUS_ON_NODE")
    return SlurmJob(
        job_id=job_id,
        in_step=pick(environ, "SLURM_STEP_ID", "SLURM_STEPID") is not None,
        on_node=pick(environ, "SLURMD_NODENAME") is not None,
        nnodes=nnodes,
        node_rank=node_rank,
        hosts=hosts,
        tasks_per_node=tuple(parse_tasks_per_node(tasks[1])) if tasks else (1,),
        gpus_on_node=gpus_on_node,
        gpu_ids=_gpu_ids(gpus[1] if gpus else environ.get("CUDA_VISIBLE_DEVICES")),
        sources=(
            ("nnodes", nnodes_src),
            ("node_rank", rank_src),
            ("master_addr", f"first host of {nodelist[0]}={nodelist[1]}" if nodelist else "default"),
            ("master_port", port_source(job[0], str(job_id))),
            ("gpus", gpus_src if gpus_src.startswith("SLURM") else (gpus[0] if gpus else "none asked for")),
        ),
    )


def srun_line(layout: SlurmJob, argv: Sequence[str]) -> str:
    """The ``srun`` line that runs this command as mpddp wants: one task per node."""
    gpus = f" --gpus-per-node={layout.gpus_on_node}" if layout.gpus_on_node else ""
    return f"srun --nodes={layout.nnodes} --ntasks-per-node=1{gpus} {user_command(argv)}"


def problem(job: SlurmJob, argv: Sequence[str]) -> str | None:
    """Why the job cannot work as started, ending with the right ``srun`` line; None when it can."""
    if not job.in_step and (job.nnodes > 1 or not job.on_node):
        where = f"{job.nnodes} nodes" if job.nnodes > 1 else "the submit host (an salloc shell)"
        return (f"SLURM job {job.job_id} runs this command outside srun, on {where}: mpddp needs one launcher "
                f"on every node of the job; start it with: {srun_line(job, argv)}")
    if job.tasks_here > 1 or any(count > 1 for count in job.tasks_per_node):
        return (f"SLURM runs {max(job.tasks_per_node)} mpddp tasks on one node (tasks per node: "
                f"{','.join(map(str, job.tasks_per_node))}): mpddp wants one task per node and starts one "
                f"worker per GPU itself; start it with: {srun_line(job, argv)}")
    return None


def read_layout(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None,
                scontrol: Callable[[str], list[str] | None] | None = None) -> JobLayout | None:
    """The SLURM job in ``environ`` as every scheduler's :class:`JobLayout`, or None outside a SLURM job.

    ``hostname`` is not needed: SLURM numbers the nodes itself (``SLURM_NODEID``).
    """
    job = read_job(environ, scontrol)
    if job is None:
        return None
    return JobLayout(
        scheduler=SLURM,
        job=f"SLURM job {job.job_id} ({'inside' if job.in_step else 'outside'} srun)",
        nnodes=job.nnodes,
        node_rank=job.node_rank,
        master_addr=job.master_addr,
        master_port=job.master_port,
        launcher="srun",
        command=srun_line(job, argv),
        problem=problem(job, argv),
        sources=job.sources,
        numbered=job.in_step,  # a batch script's node rank is no one's to claim
        resize="ask srun for --nodes={n}",
        gpus=job.gpus_on_node,
        gpu_ids=job.gpu_ids,
    )
