"""``mpddp.spawn``'s call in a rank: ``fn(i, *args)``, as ``torch.multiprocessing.spawn`` makes it.

Owns: the one wrapper that turns mpddp's ``fn(ctx, *args)`` into the user's
``fn(i, *args)``, ``i`` the process's index. Shipped by value to every rank;
the launcher's side of ``spawn`` is core/launcher/mp_spawn.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...context import WorkerContext


class ByIndex:
    """``fn(i, *args)`` for the user, ``fn(ctx, *args)`` for mpddp: mp.spawn's first argument is the index."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, ctx: WorkerContext, *args: Any) -> Any:
        return self.fn(ctx.local_rank, *args)
