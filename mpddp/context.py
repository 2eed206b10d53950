"""What a worker knows about itself: the frozen ``ctx`` passed to ``fn``.

Owns: the :class:`WorkerContext` value type, made from a rank's
:class:`~mpddp.rank_math.RankSlot` plus what the job decided. No torch import
here, so that code which only reads a context stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .rank_math import RankSlot


@dataclass(frozen=True)
class WorkerContext:
    """The first argument of every ``fn`` started by :func:`mpddp.launch`.

    ``rank = node_rank * nprocs_per_node + local_rank``; ``device`` is
    ``"cuda:<local_rank>"`` on GPUs (already set as the current device) and
    ``"cpu"`` otherwise; ``gpu`` is the physical GPU id or None. ``restart``
    counts restarts of the group (0 on the first attempt), a node's
    admission to an elastic job included (the trainer resumes then too);
    ``TORCHELASTIC_RESTART_COUNT`` counts only those after a failure, as
    torchrun's agent does.
    """

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    nprocs_per_node: int
    nnodes: int
    device: str
    backend: str
    gpu: int | None = None
    restart: int = 0
    verbose: bool = False

    @classmethod
    def at(cls, slot: RankSlot, *, nnodes: int, backend: str, restart: int = 0, verbose: bool = False) -> WorkerContext:
        """The context of the worker in ``slot``: the slot's fields (device included) and the job's."""
        job: dict[str, Any] = {"nnodes": nnodes, "backend": backend, "restart": restart, "verbose": verbose}
        where = {f.name: getattr(slot, f.name) for f in fields(cls) if f.name not in job and hasattr(slot, f.name)}
        return cls(**where, **job)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes checkpoints."""
        return self.rank == 0
