"""Kubeflow (PyTorchJob, Trainer's TrainJob): one pod is one node; its layout from the operator's variables.

Owns: :func:`read_layout`, which reads what the operator gives each pod into a
:class:`~mpddp.machine.joblayout.JobLayout` and refuses what mpddp cannot run (an elastic job, a pod without a node
rank). An ``mpirun`` inside a pod (an MPIJob) wins over it: see machine/cluster.py.

What the operators set, from their sources: training-operator v1 >= 1.7 sets ``PET_NNODES`` (the pods),
``RANK`` = ``PET_NODE_RANK`` (the pod's index), ``MASTER_ADDR`` / ``PET_MASTER_ADDR`` and the ports, but
``WORLD_SIZE`` = pods x nprocPerNode, so mpddp reads ``PET_NNODES``; with an ``elasticPolicy``, ``PET_NNODES`` may
be a range (``1:4``) and ``PET_RDZV_ENDPOINT`` is set. Older operators set only ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE`` = the pods and ``RANK``. Trainer v2 sets only the ``PET_*`` ones. Every pod has
``KUBERNETES_SERVICE_HOST``; a process that also has ``LOCAL_RANK`` or ``TORCHELASTIC_RUN_ID`` is a worker of
torchrun or mpddp, whose ``RANK`` and ``WORLD_SIZE`` describe itself, not the pod.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .joblayout import JobLayout, int_var, pick, user_command

KUBEFLOW = "Kubeflow"


def present(environ: Mapping[str, str]) -> bool:
    """A pod of a PyTorchJob or TrainJob, and not a worker a torch launcher started inside it."""
    if pick(environ, "KUBERNETES_SERVICE_HOST") is None or pick(environ, "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        return False
    operator = pick(environ, "PET_NNODES") is not None
    older = all(pick(environ, name) for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))
    return operator or older


def _nprocs(environ: Mapping[str, str]) -> tuple[int | None, str]:
    found = pick(environ, "PET_NPROC_PER_NODE")
    if found is None:
        return None, "not set: one worker per GPU"
    if found[1].isdigit():
        return int(found[1]), found[0]
    return None, f"{found[0]}={found[1]}: mpddp's default, one worker per GPU"  # auto, gpu, cpu


def read_layout(environ: Mapping[str, str], argv: Sequence[str], hostname: str | None = None) -> JobLayout | None:
    """The pod's layout in ``environ``, or None outside a PyTorchJob / TrainJob pod."""
    if not present(environ):
        return None
    pod = pick(environ, "HOSTNAME")
    nnodes_text = pick(environ, "PET_NNODES")
    elastic = ((nnodes_text is not None and not nnodes_text[1].isdigit())
               or pick(environ, "PET_RDZV_ENDPOINT") is not None)
    nnodes = None if elastic else int_var(environ, KUBEFLOW, "PET_NNODES", "WORLD_SIZE")
    rank = int_var(environ, KUBEFLOW, "PET_NODE_RANK", "RANK")
    addr = pick(environ, "PET_MASTER_ADDR", "MASTER_ADDR")
    port = int_var(environ, KUBEFLOW, "PET_MASTER_PORT", "MASTER_PORT")
    nprocs, nprocs_src = _nprocs(environ)
    layout = JobLayout(
        scheduler=KUBEFLOW,
        job=f"{KUBEFLOW} pod {pod[1] if pod else hostname or socket.gethostname()}",
        nnodes=nnodes[0] if nnodes else 1,
        node_rank=rank[0] if rank else 0,
        master_addr=addr[1] if addr else None,
        master_port=port[0] if port else None,
        launcher="the PyTorchJob",
        command=f"{user_command(argv)} as every pod's command (no torchrun)",
        nprocs=nprocs,
        missing="the pod has no MASTER_ADDR / MASTER_PORT (a PyTorchJob without a Master replica?): {pass} "
                "in every pod's command, or give the job a Master replica",
        sources=(
            ("nnodes", nnodes[1] + (", the number of pods" if nnodes[1] == "WORLD_SIZE" else "") if nnodes
             else "not set"),
            ("node_rank", rank[1] if rank else "not set"),
            ("master_addr", addr[0] if addr else "not set"),
            ("master_port", port[1] if port else "not set"),
            ("nprocs", nprocs_src),
        ),
    )
    if elastic:
        what = f"PET_NNODES={nnodes_text[1]}" if nnodes_text and not nnodes_text[1].isdigit() \
            else "PET_RDZV_ENDPOINT is set"
        problem: str | None = (f"{layout.job} belongs to an elastic job ({what}): torchrun numbers elastic nodes "
                               "as they join, mpddp needs a fixed node count and each pod's number; drop the "
                               "elasticPolicy and give the job a Master replica, or pass --nnodes and --node-rank")
    elif rank is None:
        problem = (f"{layout.job} has no node rank (PET_NODE_RANK, RANK): give the PyTorchJob a Master replica, "
                   "or pass --nnodes and --node-rank")
    else:
        problem = None
    return replace(layout, problem=problem)
