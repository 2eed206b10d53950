"""The ``c10d`` backend's beat of one round, from a thread of its own (core/nodes/c10d.py is the backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..wire import protocol
from ..wire.protocol import full_key
from .api import INTERVAL, BeatThread, RendezvousGone
from .c10d_keys import C10dLink, read_all


class C10dRoundWatch(BeatThread):
    """One round's heartbeat, from a daemon thread: a beat, progress between nodes, another node's failure.

    The watchdog (core/launcher/watchdog.py) calls :meth:`progressed` when a local rank
    computed and reads :attr:`remote_progress`, which moves when a rank on
    another node did, so that no node declares a hang while another node's
    ranks compute. :attr:`remote_failure` is set when another node wrote the
    round's first failure: the attempt then stops this node's ranks.
    """

    def __init__(self, link: C10dLink, attempt: int,
                 share: Callable[[bool], bytes | None] | None = None) -> None:
        super().__init__(attempt, share)
        self.link = link
        self._listed = False  # this node's collectives are in the store, and it is among the SHARERS
        self._thread.start()

    def _run(self) -> None:
        node, attempt = self.link.config.node, self.attempt
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
            if snapshot is not None:
                self._list(s)
            return step, total

        try:
            while not self._stop.is_set():
                beats += 1
                step, total = self.link.client.call(turn)
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
        key = full_key(self.attempt, protocol.calls_key(self.link.config.node))

        def put(s: Any) -> None:
            s.set(key, snapshot)
            self._list(s)

        self.link.client.call(put)

    def _list(self, s: Any) -> None:
        """Once, after its first collectives are in: this node among the SHARERS (two operations)."""
        if not self._listed:
            self._listed = True
            number = s.add(full_key(self.attempt, protocol.SHARERS), 1)
            s.set(full_key(self.attempt, protocol.sharer_entry(number)), str(self.link.config.node_rank))

    def others_calls(self) -> list[bytes]:
        """The other nodes' last snapshots of their ranks' collectives (none when node 0's store is gone)."""
        node, attempt = self.link.config.node, self.attempt

        def read(s: Any) -> list[bytes]:  # once a hang is suspected: three operations, of those that shared
            count = s.add(full_key(attempt, protocol.SHARERS), 0)
            entries = [full_key(attempt, protocol.sharer_entry(n)) for n in range(1, count + 1)]
            if not s.check(entries):  # a node counted, its entry not yet written
                entries = [k for k in entries if s.check([k])]
            nodes = sorted({int(v) for v in read_all(s, entries)} - {node})
            return read_all(s, [full_key(attempt, protocol.calls_key(n)) for n in nodes])

        try:
            return self.link.client.call(read)
        except RendezvousGone:
            return []
