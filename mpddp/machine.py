"""What a launch on this machine would choose, as small pure rules.

Owns: the threads-per-rank rule, counting cores, and the one-line banner a
worker prints with ``--verbose``. Leaves GPUs to gpus.py and the rank
formula to ranks.py; no torch here.
"""

from __future__ import annotations

import os
from typing import Protocol

import psutil


def threads_per_rank(local_ranks: int, physical_cores: int | None, omp_env: str | None) -> int:
    """Intra-op threads each rank gets: ``OMP_NUM_THREADS`` if set, else cores // ranks, at least 1.

    torchrun's blanket 1 thread leaves cores idle; more threads than
    physical cores, summed over the ranks, makes them fight (DESIGN.md).
    ``omp_env`` may be a nested list such as ``"4,2"``: the first level counts.
    """
    if omp_env:
        first = omp_env.split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            return int(first)
    return max(1, (physical_cores or 1) // max(1, local_ranks))


def physical_cores() -> int:
    """Physical cores (psutil), or logical ones where psutil cannot tell."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


class Placed(Protocol):
    """Where a worker sits: a :class:`~mpddp.ranks.RankSlot` or a ``WorkerContext``."""

    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def nprocs_per_node(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def gpu(self) -> int | None: ...


def banner(where: Placed) -> str:
    """``node 1 · local rank 1 · rank 1×4+1 = 5 of 8 · cuda:1 (physical GPU 3)``.

    The relay adds the ``[rank 5] `` prefix. On the CPU the device is ``cpu``.
    """
    device = where.device if where.gpu is None else f"{where.device} (physical GPU {where.gpu})"
    return (
        f"node {where.node_rank} · local rank {where.local_rank} · "
        f"rank {where.node_rank}×{where.nprocs_per_node}+{where.local_rank} = {where.rank} of {where.world_size} · "
        f"{device}"
    )
