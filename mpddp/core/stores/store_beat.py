"""A round's beat on a TCPStore: what both backends' round watches do there (c10d: node 0's store, etcd: the
round's own, which its first node hosts).

Owns: :class:`StoreBeat`, one node's keys in a round's store and the operations on them: a beat (this node's
progress added, and every node's read back by the same add, :data:`~mpddp.core.wire.protocol.FAILED` on it once
the round's record is written; this node's ranks' collectives set when they moved), listing this node among
those that shared their collectives, and reading the other nodes' (once a hang is suspected). Two operations a
beat, however many nodes; a node watched (``mpddp top``, core/launcher/live.py) adds
:data:`~mpddp.core.wire.protocol.WATCHED` to the same counter, and takes it back once nobody asked for
:data:`WATCHED_FOR` s: every node hears it with no operation more. Also the round's record on a TCPStore, for both
backends (c10d's always, etcd's once it takes no write): :func:`first_record` (the first writer wins),
:func:`record_of`, and :class:`KeptRecord`, one node's reads of it (how many other nodes read it: :func:`reads`).
Leaves which store, its client's lock and what to do when it is gone to the watches (core/nodes/c10d_watch.py,
core/nodes/etcd_keys.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import RendezvousGone
from ..wire import protocol
from ..wire.protocol import FailureRecord, full_key
from .clock import MACHINE, Clock

ABSENT = "\x00absent"  # compare_set's answer for a key that is not there (it sets nothing then): a get in one


def peek(s: Any, key: str) -> bytes | None:
    """``key``'s value, or None when it is not there: one operation (a compare_set that sets nothing)."""
    found = bytes(s.compare_set(key, ABSENT, ABSENT))
    return None if found == ABSENT.encode() else found


def first_record(s: Any, attempt: int, record: bytes) -> bytes:
    """Round ``attempt``'s record: ``record`` unless another was written first; its writer adds FAILED to the
    progress counter, which every node's next beat reads. The record that stands."""
    standing = bytes(s.compare_set(full_key(attempt, protocol.FAILURE), "", record))
    if standing == record:
        s.add(full_key(attempt, protocol.PROGRESS), protocol.FAILED)
    return standing


def record_of(s: Any, attempt: int) -> bytes | None:
    """Round ``attempt``'s record, once written: one operation."""
    return peek(s, full_key(attempt, protocol.FAILURE)) or None


def reads(s: Any, attempt: int, mine: int = 0) -> int:
    """How many nodes other than its writer read round ``attempt``'s record, this node's read added (``mine``: 1):
    a store that goes with its host keeps it until they did."""
    return int(s.add(full_key(attempt, protocol.READ), mine))


def read_all(s: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, which all exist: one operation (torch 2.1, 2.2: one a key)."""
    if not keys:
        return []
    return list(s.multi_get(keys)) if hasattr(s, "multi_get") else [s.get(k) for k in keys]


class KeptRecord:
    """Round ``attempt``'s record on a store that goes with its host, as node ``node`` reads it: kept once read (a
    record never changes, and a read the beat's thread counted must not be looked for again in a store that may be
    gone by then: measured under etcd's round store, 2 of 25 runs), its read counted once where another node wrote
    it, so that the host waits for the others' reads before it goes (:meth:`until_read`). ``call(op)`` runs
    ``op(store)``, and raises :class:`~mpddp.errors.RendezvousGone` (c10d) or returns None (etcd) when it is gone."""

    def __init__(self, attempt: int, node: int | None) -> None:
        self.attempt, self.node = attempt, node
        self.record: FailureRecord | None = None
        self._counted = False
        self._lock = threading.Lock()  # the beat's thread and the settlement's looks: one read counted

    def read(self, call: Callable[[Callable[[Any], Any]], Any]) -> FailureRecord | None:
        with self._lock:
            if self.record is None and (data := call(lambda s: record_of(s, self.attempt))) is not None:
                self.record = self._count(call, FailureRecord.decode(data))
            return self.record

    def standing(self, call: Callable[[Callable[[Any], Any]], Any], record: FailureRecord) -> FailureRecord:
        """``record``, the one that stood as this node wrote its own: counted as read where another's."""
        with self._lock:
            return self._count(call, record)

    def _count(self, call: Callable[[Callable[[Any], Any]], Any], record: FailureRecord) -> FailureRecord:
        """A store gone before the count waits for none, and the record read stands (a count that raised lost it)."""
        if record.writer != self.node and not self._counted:
            self._counted = True
            with contextlib.suppress(RendezvousGone):
                call(lambda s: reads(s, self.attempt, mine=1))
        return record

    @staticmethod
    def until_read(call: Callable[[Callable[[Any], Any]], Any], attempt: int, readers: int, wait: float,
                   look: float, clock: Clock = MACHINE) -> None:
        """Until ``readers`` nodes other than its writer read round ``attempt``'s record, or ``wait`` seconds with the
        store up (no answer: it is gone), looking every ``look``: a store that outlives the wait keeps it for a node
        that reads it later."""
        deadline = clock.now() + wait
        while (count := call(lambda s: reads(s, attempt))) is not None and count < readers:
            if clock.now() > deadline:
                return
            clock.sleep(look)


WATCHED_FOR = 5.0  # seconds a node shares its live rows after a watcher last asked (mpddp top)


class StoreBeat:
    """Node ``node``'s beat in round ``attempt``'s store."""

    def __init__(self, attempt: int, node: int) -> None:
        self.attempt, self.node = attempt, node
        self.progress = full_key(attempt, protocol.PROGRESS)
        self.calls = full_key(attempt, protocol.calls_key(node))
        self.beat = full_key(attempt, protocol.heartbeat_key(node))
        self._listed = False  # this node's collectives are in the store, and it is among the SHARERS
        self.asked = False  # a watcher asked this node (mpddp top): its next beat says so
        self.watched_at = float("-inf")  # time.monotonic() when a beat last read that some node is watched
        self._asked_at = float("-inf")  # ... when a watcher last asked this node
        self._adds_watched = False  # this node's WATCHED is in the progress counter

    def turn(self, s: Any, step: int, snapshot: bytes | None, beats: int | None) -> int:
        """This node's ``step`` (0 or 1) added; every node's total back (with FAILED once a record is written).
        ``snapshot``: this node's collectives, when they moved; ``beats``: its beat count (c10d reads beats for
        liveness, and the round's first beat counts the node among the BEATING; etcd has leases, and sets none)."""
        watched, total = divmod(int(s.add(self.progress, step + self._watched())), protocol.WATCHED)
        if watched:
            self.watched_at = time.monotonic()
        keys: list[str] = [self.beat] if beats is not None else []
        values: list[str | bytes] = [str(beats)] if beats is not None else []
        if snapshot is not None:
            keys, values = [*keys, self.calls], [*values, snapshot]
        if len(keys) > 1 and hasattr(s, "multi_set"):
            s.multi_set(keys, values)
        else:  # one key, or torch 2.1, 2.2
            for key, value in zip(keys, values):
                s.set(key, value)
        if snapshot is not None:
            self._list(s)
        if beats == 1:  # once a round, after its beat key is there: node 0 reads every beat once every node beat
            s.add(full_key(self.attempt, protocol.BEATING), 1)
        return total

    def _watched(self) -> int:
        """What this beat adds to say this node is watched: WATCHED when a watcher first asks, its negative once
        none asked for WATCHED_FOR s, else 0. The counter's part above WATCHED counts the nodes watched now."""
        now = time.monotonic()
        if self.asked:
            self.asked, self._asked_at = False, now
            if not self._adds_watched:
                self._adds_watched = True
                return protocol.WATCHED
        elif self._adds_watched and now - self._asked_at > WATCHED_FOR:
            self._adds_watched = False
            return -protocol.WATCHED
        return 0

    def put_calls(self, s: Any, snapshot: bytes) -> None:
        s.set(self.calls, snapshot)
        self._list(s)

    def tell_failed(self, s: Any) -> int:
        """The writer of the round's record: every node's next beat reads FAILED off its one add (the counter back)."""
        return int(s.add(self.progress, protocol.FAILED))

    def _list(self, s: Any) -> None:
        """Once, after its first collectives are in: this node among the SHARERS (two operations)."""
        if not self._listed:
            self._listed = True
            number = s.add(full_key(self.attempt, protocol.SHARERS), 1)
            s.set(full_key(self.attempt, protocol.sharer_entry(number)), str(self.node))

    def others_calls(self, s: Any) -> list[bytes]:
        """The other nodes' last snapshots of their ranks' collectives: three operations, of those that shared."""
        count = s.add(full_key(self.attempt, protocol.SHARERS), 0)
        entries = [full_key(self.attempt, protocol.sharer_entry(n)) for n in range(1, count + 1)]
        if not s.check(entries):  # a node counted, its entry not yet written
            entries = [k for k in entries if s.check([k])]
        nodes = sorted({int(v) for v in read_all(s, entries)} - {self.node})
        return read_all(s, [full_key(self.attempt, protocol.calls_key(n)) for n in nodes])
