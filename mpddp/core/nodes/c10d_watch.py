"""The ``c10d`` backend's beat of one round, from a thread of its own (core/nodes/c10d.py is the backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..stores.store_beat import StoreBeat
from ..wire.protocol import FailureRecord
from .api import Lost, RoundWatch
from .c10d_keys import C10dLink, close_door
from .rules import NodeState, lost_nodes

LIVE_BEATS = 12  # a node whose beat stood still while another's moved this many times (3 s of beats) is lost


class Beats:
    """Each node's beat as one looker (node ``me``) saw it, for core/nodes/rules.py's :func:`lost_nodes`: when it
    last moved, on a clock of beats (the most any node's beat moved since the looker first saw it beat). A looker or
    a store starved of CPU sees no beat move, and finds nobody lost; a node that never beat is not lost by that alone
    (its launcher may still import torch to connect): --timeout's, by the same rule."""

    def __init__(self, me: int) -> None:
        self.me = me
        self._first: dict[int, int] = {}  # each node's beat count when first seen to beat
        self._count: dict[int, int] = {}  # ... as last seen
        self._heard: dict[int, float] = {}  # the clock when each node's beat was last seen to move

    def still(self, beats: dict[int, int]) -> list[int]:
        """The other nodes whose beat stood still for :data:`LIVE_BEATS` of the clock, after this look at ``beats``."""
        for node, count in beats.items():
            if count > 0:
                self._first.setdefault(node, count)
        clock = max((beats[n] - first for n, first in self._first.items()), default=0)
        for node, count in beats.items():
            if count > 0 and self._count.get(node) != count:
                self._count[node], self._heard[node] = count, clock
        return [n for n in lost_nodes(self._heard, clock, grace=LIVE_BEATS) if n != self.me]


class C10dRoundWatch(RoundWatch):
    """One round's beat on node 0's store (api.RoundWatch), from a daemon thread; node 0 also looks at the others'
    beats while the ranks run (the store is its own, and its loss is the job's end: every node's beat finds it)."""

    link: C10dLink

    def __init__(self, link: C10dLink, attempt: int, share: Callable[[bool], bytes | None] | None,
                 tell: Callable[[Lost], FailureRecord] | None = None) -> None:
        super().__init__(attempt, share, tell)
        self.link = link
        self.beat = StoreBeat(attempt, link.config.node)
        self.admits = link.elastic
        self.looks = link.config.node == 0 and link.config.nnodes > 1
        self._beats = Beats(link.config.node)
        self._begin()

    def _lost(self) -> Lost | None:
        """Two operations (a counter and a batch read of every beat), twice a second, on node 0 only, whatever the
        job's size. None until every node has beaten: one that never beats is --timeout's (a first connection imports
        torch; a node never started is named as never arrived)."""
        if (beats := self.link.heartbeats(self.attempt, every=True)) is None:
            return None
        lost = self.link.found_lost(self.attempt, self._beats.still(beats))
        return Lost(lost) if lost else None

    def _on_store(self, op: Callable[[Any], Any]) -> Any:
        """On node 0's store; the beat's count too, which the other nodes read for liveness. Node 0 gone raises."""
        return self.link.client.call(op)

    def _shut(self) -> None:
        self.link.client.call(lambda s: close_door(s, self.attempt, NodeState.WAITING))
