"""Rank math: the whole lesson of a multi-node launch, as pure functions.

Owns: world size, global rank, the inverse, the per-worker layout table
that ``mpddp ranks`` prints, and the one-line banner a worker prints with
``--verbose``. No torch, no environment variables, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


def world_size(nnodes: int, nprocs_per_node: int) -> int:
    """Total number of workers in the job."""
    return nnodes * nprocs_per_node


def global_rank(node_rank: int, local_rank: int, nprocs_per_node: int) -> int:
    """The rank a worker passes to ``init_process_group``.

    Passing ``local_rank`` instead is the classic bug: it is only right on a
    single node, and on two nodes both workers 0 claim rank 0.
    """
    return node_rank * nprocs_per_node + local_rank


def split_rank(rank: int, nprocs_per_node: int) -> tuple[int, int]:
    """The inverse: ``rank -> (node_rank, local_rank)``."""
    return divmod(rank, nprocs_per_node)


@dataclass(frozen=True)
class RankSlot:
    """Where one worker sits in the job, and which GPU it drives (if any)."""

    node_rank: int
    local_rank: int
    rank: int
    world_size: int
    nprocs_per_node: int
    gpu: int | None  # physical GPU id, None on CPU
    cuda_index: int | None = None  # index among the GPUs the worker sees

    @property
    def device(self) -> str:
        """The device name the worker uses (indices count visible GPUs only)."""
        return "cpu" if self.cuda_index is None else f"cuda:{self.cuda_index}"

    @property
    def formula(self) -> str:
        """``node_rank×nprocs_per_node+local_rank = rank``, filled in."""
        return f"{self.node_rank}×{self.nprocs_per_node}+{self.local_rank} = {self.rank}"


def layout(nnodes: int, nprocs_per_node: int, gpus: Sequence[int] | None = None) -> list[RankSlot]:
    """Every worker of the job in rank order; ``gpus[i]`` is local rank i's GPU.

    With more local ranks than GPUs (gloo only) ranks share GPUs round-robin.
    """
    size = world_size(nnodes, nprocs_per_node)
    return [
        RankSlot(
            node_rank=node,
            local_rank=local,
            rank=global_rank(node, local, nprocs_per_node),
            world_size=size,
            nprocs_per_node=nprocs_per_node,
            gpu=None if not gpus else gpus[local % len(gpus)],
            cuda_index=None if not gpus else local % len(gpus),
        )
        for node in range(nnodes)
        for local in range(nprocs_per_node)
    ]


class Placed(Protocol):
    """Where a worker sits: a :class:`RankSlot` or a :class:`~mpddp.context.WorkerContext`."""

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
