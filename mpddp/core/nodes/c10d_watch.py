"""The ``c10d`` backend's beat of one round, from a thread of its own (core/nodes/c10d.py is the backend)."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import RendezvousGone
from ..stores.store_beat import StoreBeat
from .api import RoundWatch
from .c10d_keys import C10dLink, close_door
from .rules import NodeState


class C10dRoundWatch(RoundWatch):
    """One round's beat on node 0's store (api.RoundWatch), from a daemon thread."""

    link: C10dLink

    def __init__(self, link: C10dLink, attempt: int, share: Callable[[bool], bytes | None] | None) -> None:
        super().__init__(attempt, share)
        self.link = link
        self.beat = StoreBeat(attempt, link.config.node)
        self.admits = link.elastic
        self._thread.start()

    def _turn(self, step: int, snapshot: bytes | None, beats: int) -> int:
        """On node 0's store; its beat count too, which the other nodes read for liveness. Node 0 gone raises."""
        return int(self.link.client.call(lambda s: self.beat.turn(s, step, snapshot, beats)))

    def _put_calls(self, snapshot: bytes) -> None:
        self.link.client.call(lambda s: self.beat.put_calls(s, snapshot))

    def _shut(self) -> None:
        self.link.client.call(lambda s: close_door(s, self.attempt, NodeState.WAITING))

    def others_calls(self) -> list[bytes]:
        """The other nodes' last snapshots of their ranks' collectives (none when node 0's store is gone)."""
        try:
            return self.link.client.call(self.beat.others_calls)
        except RendezvousGone:
            return []
