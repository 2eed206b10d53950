"""A clock that a test injects into the waiting loops of core/nodes (core/stores/clock.py's ``Clock``): its time moves
only when the code under test sleeps, and what a test schedules :meth:`Steps.at` a moment happens there, in the
sleeping thread. A wait of --timeout runs in microseconds, and every bound is exact: told at 1.5 s means after the
first look at or past 1.5 s, whatever the machine's load."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from mpddp.core.stores.clock import Clock


class Steps:
    """Injected time: ``clock`` for a rendezvous's ``clock`` (or a ``clock=`` argument); ``now`` the seconds slept
    since it was made. A wait that never ends raises once ``limit`` seconds have gone (a hung loop, not a hung test)."""

    def __init__(self, limit: float = 3600.0) -> None:
        self.now = 0.0
        self.limit = limit
        self._due: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()
        self.clock = Clock(lambda: self.now, self.sleep)

    def at(self, when: float, do: Callable[[], object]) -> None:
        """``do()`` once the clock reaches ``when``."""
        heapq.heappush(self._due, (when, next(self._order), do))

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        if self.now > self.limit:
            raise TimeoutError(f"the code under test waited past {self.limit:g} s of injected time")
        while self._due and self._due[0][0] <= self.now:
            heapq.heappop(self._due)[2]()
