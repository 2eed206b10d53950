"""PBS (PBS Pro / OpenPBS, Torque): the job's layout from its node file and the task's variables.

Owns: reading ``PBS_JOBID``, ``$PBS_NODEFILE`` (one line per slot; its distinct hosts, in order, are the nodes and
the first is the mother superior, where the batch script runs), ``PBS_NODENUM`` and ``PBS_TASKNUM`` into a
:class:`~mpddp.machine.joblayout.JobLayout`, and the ``pbsdsh`` line that starts one launcher per node.

From the sources of both (Torque's and OpenPBS's ``src/resmom/start_exec.c`` and ``mom_comm.c``): the MOM gives the
batch script and every task it spawns ``PBS_NODENUM``, this host's index among the job's hosts (0 = mother
superior), and ``PBS_TASKNUM``, the TM task id: 1 for the batch script, 2, 3, ... for spawned tasks. Torque also
sets ``PBS_VNODENUM``, the slot, and ``pbsdsh -u`` spawns on the first slot of each host; OpenPBS's ``pbsdsh`` runs
once per node-file line, so ask for one line a host (``select=N:mpiprocs=1``).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .joblayout import (
    JobLayout,
    host_index,
    int_var,
    pick,
    port_for,
    port_source,
    read_hostfile,
    unique,
    user_command,
)

PBS = "PBS"


def present(environ: Mapping[str, str]) -> bool:
    """Inside a PBS job (its script, or a task the MOM spawned)."""
    return pick(environ, "PBS_JOBID") is not None and pick(environ, "PBS_NODEFILE") is not None


def is_torque(environ: Mapping[str, str]) -> bool:
    """Torque sets PBS_NUM_NODES / PBS_NUM_PPN / PBS_VNODENUM; PBS Pro and OpenPBS do not."""
    return any(name in environ for name in ("PBS_NUM_NODES", "PBS_NUM_PPN", "PBS_VNODENUM"))


def pbsdsh_line(environ: Mapping[str, str], argv: Sequence[str]) -> str:
    """The line that runs the command once per node of the job."""
    if is_torque(environ):
        return f"pbsdsh -u {user_command(argv)}"
    return f"pbsdsh -- {user_command(argv)} (with one node-file line a host: -l select=N:mpiprocs=1)"


def _problem(environ: Mapping[str, str], layout: JobLayout, slots: list[str], here: str) -> str | None:
    """Why this command cannot work as started: the batch script itself, or one launcher per slot."""
    task = pick(environ, "PBS_TASKNUM")
    if task is not None and task[1] == "1" and layout.nnodes > 1:
        return (f"{layout.job} runs this command in the batch script (PBS_TASKNUM=1), on the first of "
                f"{layout.nnodes} nodes: mpddp needs one launcher on every node of the job; start it with: "
                f"{layout.command}")
    vnode = int_var(environ, PBS, "PBS_VNODENUM")
    if vnode is not None and task is not None and 0 < vnode[0] < len(slots) and slots[vnode[0]] == here \
            and slots.index(here) != vnode[0]:
        return (f"pbsdsh started this command on slot {vnode[0]} of the node file (PBS_VNODENUM), one of "
                f"{slots.count(here)} slots of {here}: mpddp wants one launcher per node and starts one worker "
                f"per GPU itself; start it with: {layout.command}")
    return None


def read_layout(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None) -> JobLayout | None:
    """The PBS layout in ``environ``, or None outside a PBS job."""
    if not present(environ):
        return None
    job, nodefile = environ["PBS_JOBID"].strip(), environ["PBS_NODEFILE"].strip()
    slots = read_hostfile(nodefile, "PBS_NODEFILE", PBS)
    hosts = unique(slots)
    nodenum = int_var(environ, PBS, "PBS_NODENUM")
    found = host_index(hosts, hostname)
    here = hosts[nodenum[0]] if nodenum and nodenum[0] < len(hosts) else hosts[found] if found is not None else ""
    rank = nodenum or ((found, f"position of {here} among the hosts of PBS_NODEFILE") if found is not None else None)
    layout = JobLayout(
        scheduler=PBS,
        job=f"PBS job {job}",
        nnodes=len(hosts),
        node_rank=rank[0] if rank else 0,
        master_addr=hosts[0],
        master_port=port_for(job),
        launcher="pbsdsh",
        command=pbsdsh_line(environ, argv),
        sources=(
            ("nnodes", f"distinct hosts of PBS_NODEFILE={nodefile}"),
            ("node_rank", rank[1] if rank else "not found"),
            ("master_addr", "first host of PBS_NODEFILE (the mother superior)"),
            ("master_port", port_source("PBS_JOBID", job)),
        ),
    )
    if rank is None:
        problem: str | None = (f"this host ({hostname or socket.gethostname()}) is not among the hosts of "
                               f"PBS_NODEFILE ({' '.join(hosts)}) and PBS_NODENUM is not set: start it with: "
                               f"{layout.command}, or pass --nnodes and --node-rank")
    else:
        problem = _problem(environ, layout, slots, here)
    return replace(layout, problem=problem)
