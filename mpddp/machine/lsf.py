"""IBM Spectrum LSF: the job's layout from its host list and blaunch's task id.

Owns: reading ``LSB_JOBID`` and the job's hosts (``$LSB_DJOB_HOSTFILE``, one line per slot; else
``LSB_MCPU_HOSTS``, ``host slots`` pairs; else ``LSB_HOSTS``, one name per slot) into a
:class:`~mpddp.machine.joblayout.JobLayout`: the distinct hosts in order are the nodes, the first (where the job
script runs) is node 0, this host's place among them is the node rank. And the ``blaunch -z "HOSTS"`` line that
starts one launcher per host.

From IBM's reference and the task RES source: a task started by ``blaunch`` also has ``LSF_PM_TASKID``, numbered
from 1 in the order of the hosts it was started on (Open MPI's LSF support takes ``LSF_PM_TASKID - 1`` as the task's
offset). ``blaunch CMD`` runs one task per *slot*; ``blaunch -z "h1 h2" CMD`` one per listed host. jsrun (CSM) jobs
are not read here: pass the flags.
"""

from __future__ import annotations

import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..errors import ConfigError
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

LSF = "LSF"


def present(environ: Mapping[str, str]) -> bool:
    """Inside an LSF job (its script, or a task blaunch started)."""
    return pick(environ, "LSB_JOBID") is not None and \
        pick(environ, "LSB_DJOB_HOSTFILE", "LSB_MCPU_HOSTS", "LSB_HOSTS") is not None


def job_hosts(environ: Mapping[str, str]) -> tuple[list[str], str]:
    """Every slot's host, and where the list came from."""
    hostfile = pick(environ, "LSB_DJOB_HOSTFILE")
    if hostfile is not None:
        return read_hostfile(hostfile[1], "LSB_DJOB_HOSTFILE", LSF), f"LSB_DJOB_HOSTFILE={hostfile[1]}"
    mcpu = pick(environ, "LSB_MCPU_HOSTS")
    if mcpu is not None:
        words = mcpu[1].split()
        pairs = list(zip(words[::2], words[1::2]))
        if len(words) % 2 or not all(count.isdigit() for _, count in pairs):
            raise ConfigError(f"LSB_MCPU_HOSTS={mcpu[1]!r} is not 'host slots host slots ...': check the job, "
                              "or pass --nnodes, --node-rank and --master-addr")
        return [host for host, count in pairs for _ in range(int(count))], "LSB_MCPU_HOSTS"
    return environ["LSB_HOSTS"].split(), "LSB_HOSTS"


def read_layout(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None) -> JobLayout | None:
    """The LSF layout in ``environ``, or None outside an LSF job."""
    if not present(environ):
        return None
    job = environ["LSB_JOBID"].strip()
    index = pick(environ, "LSB_JOBINDEX")
    if index is not None and index[1] != "0":  # array elements share LSB_JOBID and run at once
        job = f"{job}[{index[1]}]"
    slots, where = job_hosts(environ)
    hosts = unique(slots)
    here = hostname or socket.gethostname()
    found = host_index(hosts, here)
    task = int_var(environ, LSF, "LSF_PM_TASKID")
    command = f"blaunch -z {shlex.quote(' '.join(hosts))} {user_command(argv)}"
    layout = JobLayout(
        scheduler=LSF,
        job=f"LSF job {job}" + (" (blaunch)" if task else ""),
        nnodes=len(hosts),
        node_rank=found or 0,
        master_addr=hosts[0],
        master_port=port_for(job),
        launcher="blaunch",
        command=command,
        sources=(
            ("nnodes", f"distinct hosts of {where}"),
            ("node_rank", f"position of {here} among them" if found is not None else "not found"),
            ("master_addr", f"first host of {where} (the first execution host)"),
            ("master_port", port_source("LSB_JOBID", job)),
        ),
    )
    if found is None:
        problem: str | None = (f"this host ({here}) is not among the hosts of {where} ({' '.join(hosts)}): "
                               f"start it with: {command}, or pass --nnodes and --node-rank")
    elif task is None and len(hosts) > 1:
        problem = (f"LSF job {job} runs this command outside blaunch, on the first of {len(hosts)} hosts: mpddp "
                   f"needs one launcher on every host of the job; start it with: {command}")
    elif task is not None and task[0] != found + 1:
        problem = (f"blaunch started this command as task {task[0]} (LSF_PM_TASKID) on {here}, host {found + 1} of "
                   f"{len(hosts)}: mpddp wants one launcher per host, in the job's host order, and starts one "
                   f"worker per GPU itself; start it with: {command}")
    else:
        problem = None
    return replace(layout, problem=problem)
