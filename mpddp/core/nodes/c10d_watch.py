"""The ``c10d`` backend's beat of one round, from a thread of its own (core/nodes/c10d.py is the backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..wire import protocol
from ..wire.protocol import full_key
from .api import INTERVAL, BeatThread, RendezvousGone

if TYPE_CHECKING:
    from .c10d import C10dRendezvous


class C10dRoundWatch(BeatThread):
    """One round's heartbeat, from a daemon thread: a beat, progress between nodes, another node's failure.

    The watchdog (core/launcher/watchdog.py) calls :meth:`progressed` when a local rank
    computed and reads :attr:`remote_progress`, which moves when a rank on
    another node did, so that no node declares a hang while another node's
    ranks compute. :attr:`remote_failure` is set when another node wrote the
    round's first failure: the attempt then stops this node's ranks.
    """

    def __init__(self, link: C10dRendezvous, attempt: int,
                 share: Callable[[bool], bytes | None] | None = None) -> None:
        super().__init__(attempt, share)
        self.link = link
        self._thread.start()

    def _run(self) -> None:
        node, attempt = self.link.config.node_rank, self.attempt
        beat, progress, calls = (full_key(attempt, k) for k in (protocol.heartbeat_key(node), protocol.PROGRESS,
                                                                 protocol.calls_key(node)))
        mine = beats = 0

        def turn(s: Any) -> tuple[int, int]:  # two store operations a turn, however many nodes: flat
            step = 1 if self._progress.is_set() else 0
            total = s.add(progress, step)  # every node's progress, ours subtracted; FAILED once a record is written
            snapshot = self.share(False) if self.share is not None else None  # this node's collectives, when they moved
            if snapshot is None:
                s.set(beat, str(beats))
            elif hasattr(s, "multi_set"):
                s.multi_set([beat, calls], [str(beats), snapshot])
            else:  # torch 2.1, 2.2
                s.set(beat, str(beats)), s.set(calls, snapshot)
            return step, total

        try:
            while not self._stop.is_set():
                beats += 1
                step, total = self.link.call(turn)
                if step:
                    self._progress.clear()
                mine += step
                self.remote_progress = total % protocol.FAILED - mine
                if total >= protocol.FAILED and self.remote_failure is None:  # one more operation, once
                    if (record := self.link.record(attempt)) is not None and record.node_rank != node:
                        self.remote_failure = record
                self._stop.wait(INTERVAL)
        except RendezvousGone:  # node 0 gone: what that means is settled after the local ranks stop
            return

    def _put_calls(self, snapshot: bytes) -> None:
        key = full_key(self.attempt, protocol.calls_key(self.link.config.node_rank))
        self.link.call(lambda s: s.set(key, snapshot))

    def others_calls(self) -> list[bytes]:
        """The other nodes' last snapshots of their ranks' collectives (none when node 0's store is gone)."""
        node, nnodes = self.link.config.node_rank, self.link.config.nnodes
        keys = [full_key(self.attempt, protocol.calls_key(n)) for n in range(nnodes) if n != node]

        def read(s: Any) -> list[bytes]:  # once a hang is suspected: one operation while every node beat
            if keys and hasattr(s, "multi_get") and s.check(keys):
                return list(s.multi_get(keys))
            return [s.get(k) for k in keys if s.check([k])]

        try:
            return self.link.call(read)
        except RendezvousGone:
            return []
