"""What a worker knows about itself: the frozen ``ctx`` passed to ``fn``.

Owns: the :class:`WorkerContext` value type. No torch import here, so that
code which only reads a context stays light.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerContext:
    """The first argument of every ``fn`` started by :func:`mpddp.launch`.

    ``rank = node_rank * nprocs_per_node + local_rank``; ``device`` is
    ``"cuda:<local_rank>"`` on GPUs (already set as the current device) and
    ``"cpu"`` otherwise; ``gpu`` is the physical GPU id or None. ``restart``
    counts restarts of the group (0 on the first attempt).
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

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes checkpoints."""
        return self.rank == 0
