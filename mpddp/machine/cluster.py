"""Which cluster environment started this process, and its layout under the explicit flags.

Owns: telling which environments are present (Open MPI, MPICH/Intel MPI, SLURM, PBS, LSF, Kubeflow), the one
precedence rule between them (:data:`PRECEDENCE`), :func:`apply_cluster` (what ``make_config`` calls) and
:func:`describe` for ``mpddp ranks`` and ``mpddp info``. Each environment is read by its own module's
``read_layout``; the shared shape and the merge under the flags are machine/joblayout.py's.

The precedence, first present wins: the innermost launcher, the one that started *this* process. Under ``sbatch`` +
``mpirun`` (or PBS, LSF) the MPI variables describe this process while the allocation's describe the batch script
(on node 0, ``SLURM_JOB_ID`` without ``SLURM_STEP_ID``, which SLURM's check would refuse as "outside srun"): MPI
first. SLURM, PBS and LSF do not nest; SLURM first (its torque wrapper may set ``PBS_*``). Kubeflow last: its
variables have generic names (``MASTER_ADDR``, ``RANK``) others use too, and an MPIJob's pods run ``mpirun``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import joblayout, kubeflow, lsf, mpi, pbs, slurm

_PRESENT: dict[str, Callable[[Mapping[str, str]], bool]] = {
    mpi.OPEN_MPI: mpi.open_mpi_present,
    mpi.HYDRA: mpi.hydra_present,
    slurm.SLURM: slurm.present,
    pbs.PBS: pbs.present,
    lsf.LSF: lsf.present,
    kubeflow.KUBEFLOW: kubeflow.present,
}
PRECEDENCE = tuple(_PRESENT)  # first present wins: see the module's docstring

_READERS: dict[str, Callable[[Mapping[str, str], Sequence[str], str | None], joblayout.JobLayout | None]] = {
    mpi.OPEN_MPI: mpi.read_open_mpi,
    mpi.HYDRA: mpi.read_hydra,
    slurm.SLURM: slurm.read_layout,
    pbs.PBS: pbs.read_layout,
    lsf.LSF: lsf.read_layout,
    kubeflow.KUBEFLOW: kubeflow.read_layout,
}


@dataclass(frozen=True)
class Detected:
    """The environment that started this process, its layout, and the ones it outranks."""

    name: str
    layout: joblayout.JobLayout
    outranked: tuple[str, ...] = ()

    @property
    def nnodes(self) -> int:
        return self.layout.nnodes


def present(environ: Mapping[str, str]) -> list[str]:
    """Every cluster environment whose variables are in ``environ``, in :data:`PRECEDENCE` order."""
    return [name for name in PRECEDENCE if _PRESENT[name](environ)]


def detect(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
           hostname: str | None = None) -> Detected | None:
    """The environment that wins, read (only the winner is read: a loser's bad variables do not matter)."""
    environ = os.environ if environ is None else environ
    names = present(environ)
    if not names:
        return None
    name = names[0]
    layout = _READERS[name](environ, sys.argv if argv is None else argv, hostname)
    return None if layout is None else Detected(name, layout, tuple(names[1:]))


def note(found: Detected) -> str | None:
    """What a launch with no layout flags would be refused with here (for ``mpddp ranks``), or None."""
    why = found.layout.problem
    if why is None:
        try:
            joblayout.merge({}, found.layout)
        except ConfigError as e:
            why = str(e)
    return why


def apply_cluster(options: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                  argv: Sequence[str] | None = None, hostname: str | None = None) -> dict[str, Any]:
    """``options`` with the cluster's values filled in where the user passed none (unchanged outside one).

    The edge function: it reads ``os.environ`` and ``sys.argv`` unless given
    (and, under PBS or LSF, the job's host file). The layout is checked (one
    launcher per node, started by the job's launcher) when its node count is
    used; explicit flags win, except the two combinations that cannot work.
    ``options`` may hold ``nprocs``: a Kubeflow pod's ``PET_NPROC_PER_NODE``
    fills it when it is None.
    """
    argv = sys.argv if argv is None else argv
    found = detect(environ, argv, hostname)
    if found is None:
        return dict(options)
    if options.get("nnodes") is None and found.layout.problem:
        raise ConfigError(found.layout.problem)
    return {**options, **joblayout.merge(options, found.layout)}


def describe(found: Detected) -> str:
    """Where each value came from, and which other environments lost, for ``mpddp ranks`` and ``mpddp info``."""
    text = joblayout.describe(found.layout)
    if found.outranked:
        text += (f"\n  ({' and '.join(found.outranked)} variables are set too; {found.name} started this "
                 "process, so its layout wins)")
    return text
