"""SLURM: what an allocation says about the job's layout, read once at the edge.

Owns: expanding node lists (``gpu[01-03,7]``), the master host and the
master port of a SLURM job, the per-node task counts (``2(x3),1``), the
:class:`SlurmLayout` read from ``SLURM_*`` variables, the check that the
layout can work (one mpddp task per node, inside ``srun``) and merging it
*under* explicit flags. Leaves to others: validation of the final values
(config.py), merging under launch() options (core/api.py), GPU choice
(machine/gpus.py: SLURM's pick reaches it through ``CUDA_VISIBLE_DEVICES``),
and the rendezvous itself (core/rendezvous.py).

mpddp runs one launcher per node, each starting one worker per local GPU,
so under SLURM it wants exactly one task per node::

    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python -m mpddp train ...

Which variables, measured with slurm-wlm 22.05 (``srun -N1 -w n2`` inside
a two-node ``sbatch``): a step sees ``SLURM_NODELIST`` and
``SLURM_JOB_NODELIST`` of the *job* (``n[1-2]``) but ``SLURM_STEP_NODELIST=n2``,
``SLURM_NNODES=1`` and ``SLURM_NODEID=0`` of the *step*, and it inherits
``SLURM_NTASKS_PER_NODE`` from ``sbatch`` even when the step runs one task a
node. So the step's variables come first, the job's are the fallback. The
batch script itself has ``SLURM_JOB_ID`` but no ``SLURM_STEP_ID``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
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


def port_for_job(job_id: int) -> int:
    """The master port every node of job ``job_id`` derives alike (see PORT_BASE)."""
    return PORT_BASE + job_id % PORT_SPAN


def parse_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: SLURM's compressed per-node task counts."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={spec!r} is not like '1(x2)' or '2,1': check the allocation")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmLayout:
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
        """The port derived from the job id (see :func:`port_for_job`)."""
        return port_for_job(self.job_id)

    @property
    def tasks_here(self) -> int:
        """How many tasks of this step (or job) run on this node."""
        if 0 <= self.node_rank < len(self.tasks_per_node):
            return self.tasks_per_node[self.node_rank]
        return max(self.tasks_per_node, default=1)


def _pick(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set and not empty, as (name, value)."""
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None


def _int_var(environ: Mapping[str, str], default: int, *names: str) -> tuple[int, str]:
    found = _pick(environ, *names)
    if found is None:
        return default, f"default {default}"
    name, text = found
    if not text.isdigit():
        raise ConfigError(f"{name}={text!r} is not a number: SLURM sets it to an integer; unset it or fix the job")
    return int(text), name


def _gpu_ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def read_layout(environ: Mapping[str, str],
                scontrol: Callable[[str], list[str] | None] | None = None) -> SlurmLayout | None:
    """The SLURM layout in ``environ``, or None outside a SLURM job (``scontrol``: see :func:`hostnames`)."""
    job = _pick(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None:
        return None
    job_id, _ = _int_var(environ, 0, job[0])
    nnodes, nnodes_src = _int_var(environ, 1, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_rank, rank_src = _int_var(environ, 0, "SLURM_NODEID")
    nodelist = _pick(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    hosts = tuple(hostnames(nodelist[1], scontrol or scontrol_hostnames)) if nodelist else ("127.0.0.1",)
    tasks = _pick(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    gpus = _pick(environ, "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    gpus_on_node, gpus_src = _int_var(environ, len(_gpu_ids(gpus[1]) or ()) if gpus else 0, "SLURM_GPUS_ON_NODE")
    return SlurmLayout(
        job_id=job_id,
        in_step=_pick(environ, "SLURM_STEP_ID", "SLURM_STEPID") is not None,
        on_node=_pick(environ, "SLURMD_NODENAME") is not None,
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
            ("master_port", f"{PORT_BASE} + {job[0]} % {PORT_SPAN}"),
            ("gpus", gpus_src if gpus_src.startswith("SLURM") else (gpus[0] if gpus else "none asked for")),
        ),
    )


def user_command(argv: Sequence[str]) -> str:
    """How the user started this process, for the ``srun`` line in messages."""
    if not argv or argv[0] in ("", "-c"):
        return "python your_script.py"
    first = argv[0].replace(os.sep, "/")
    if first.endswith("mpddp/__main__.py") or os.path.basename(first) == "mpddp":
        return shlex.join(["python", "-m", "mpddp", *argv[1:]])
    return shlex.join(["python", *argv])


def srun_line(layout: SlurmLayout, argv: Sequence[str]) -> str:
    """The ``srun`` line that runs this command as mpddp wants: one task per node."""
    gpus = f" --gpus-per-node={layout.gpus_on_node}" if layout.gpus_on_node else ""
    return f"srun --nodes={layout.nnodes} --ntasks-per-node=1{gpus} {user_command(argv)}"


def check_layout(layout: SlurmLayout, argv: Sequence[str]) -> None:
    """Raise :class:`ConfigError` with the right ``srun`` line when the layout cannot work."""
    if not layout.in_step and (layout.nnodes > 1 or not layout.on_node):
        where = f"{layout.nnodes} nodes" if layout.nnodes > 1 else "the submit host (an salloc shell)"
        raise ConfigError(
            f"SLURM job {layout.job_id} runs this command outside srun, on {where}: mpddp needs one launcher "
            f"on every node of the job; start it with: {srun_line(layout, argv)}"
        )
    if layout.tasks_here > 1 or any(count > 1 for count in layout.tasks_per_node):
        raise ConfigError(
            f"SLURM runs {max(layout.tasks_per_node)} mpddp tasks on one node (tasks per node: "
            f"{','.join(map(str, layout.tasks_per_node))}): mpddp wants one task per node and starts one "
            f"worker per GPU itself; start it with: {srun_line(layout, argv)}"
        )


def refuse_conflicts(explicit: Mapping[str, Any], nnodes: int, node_rank: int, numbered: bool,
                     too_many: Callable[[int], str], claimed: Callable[[int], str]) -> None:
    """Explicit flags win, except where one command line on every node cannot work (every scheduler's: machine/joblayout.py).

    ``--nnodes`` other than the job's with no ``--node-rank``: the job's node
    ranks cannot number them (``too_many``). ``--node-rank`` on a job that
    runs the same command on every node (``numbered``): every node would
    claim it (``claimed``).
    """
    want_nodes, want_rank = explicit.get("nnodes"), explicit.get("node_rank")
    if want_nodes is not None and want_nodes not in (1, nnodes) and want_rank is None:
        raise ConfigError(too_many(want_nodes))
    if want_rank is not None and want_rank != node_rank and want_nodes in (None, nnodes) and numbered and nnodes > 1:
        raise ConfigError(claimed(want_rank))


def _check_conflicts(explicit: Mapping[str, Any], layout: SlurmLayout) -> None:
    """Explicit flags win, except where srun's one command line on every node cannot work."""
    refuse_conflicts(
        explicit, layout.nnodes, layout.node_rank, layout.in_step,
        lambda n: (f"--nnodes {n} but SLURM runs this step on {layout.nnodes} node(s) (SLURM_NNODES): node ranks "
                   f"from SLURM_NODEID cannot number {n} nodes; drop --nnodes, or ask srun for --nodes={n}, or pass "
                   "--node-rank on every node"),
        lambda r: (f"--node-rank {r} on SLURM node {layout.node_rank} of {layout.nnodes}: srun runs the same command "
                   f"on every node, so every node would claim node rank {r}; drop --node-rank (SLURM_NODEID numbers "
                   "the nodes)"),
    )


def merge(explicit: Mapping[str, Any], layout: SlurmLayout) -> dict[str, Any]:
    """nnodes, node_rank, master_addr and master_port: explicit values (not None) win over SLURM's.

    An explicit ``--nnodes`` other than SLURM's means the user describes the
    job by hand, so SLURM's node rank and master stay out of it.
    """
    _check_conflicts(explicit, layout)
    return under_flags(explicit, layout.nnodes, layout.node_rank, layout.master_addr, layout.master_port)


def under_flags(explicit: Mapping[str, Any], nnodes: int, node_rank: int, master_addr: str | None,
                master_port: int | None) -> dict[str, Any]:
    """A job's layout with the explicit values (not None) over it (every scheduler's: machine/joblayout.py).

    A node count of the user's other than the job's means the job is
    described by hand: the job's node rank and master stay out of it. One
    node keeps the loopback default and an OS-chosen port.
    """
    if explicit.get("nnodes") not in (None, nnodes):
        job: dict[str, Any] = {"nnodes": explicit["nnodes"], "node_rank": 0}
    else:
        job = {"nnodes": nnodes, "node_rank": node_rank}
        if nnodes > 1:
            job |= {"master_addr": master_addr, "master_port": master_port}
    return {name: explicit[name] if explicit.get(name) is not None else value for name, value in job.items()}


def apply_slurm(options: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``options`` with SLURM's values filled in where the user passed none (unchanged outside SLURM).

    The edge function: it reads ``os.environ`` and ``sys.argv`` unless given,
    checks the layout (one task per node, inside srun) when SLURM's node
    count is used, and may run ``scontrol show hostnames``.
    """
    layout = read_layout(os.environ if environ is None else environ)
    if layout is None:
        return dict(options)
    if options.get("nnodes") is None:
        check_layout(layout, sys.argv if argv is None else argv)
    return {**options, **merge(options, layout)}


def describe(layout: SlurmLayout) -> str:
    """Where each value came from, for ``mpddp ranks`` inside an allocation."""
    lines = [f"From SLURM job {layout.job_id} ({'inside srun' if layout.in_step else 'outside srun'}):"]
    values = {
        "nnodes": str(layout.nnodes),
        "node_rank": str(layout.node_rank),
        "master_addr": layout.master_addr,
        "master_port": str(layout.master_port),
        "gpus": str(layout.gpus_on_node),
    }
    lines += [f"  {name:<11} = {values[name]:<14} ({source})" for name, source in layout.sources]
    return "\n".join(lines)
