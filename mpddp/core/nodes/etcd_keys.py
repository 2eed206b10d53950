"""The ``etcd`` backend's membership keys and its beat of one round (core/nodes/etcd.py is the backend).

Owns: :class:`EtcdLink`, what they ask of the backend (a Protocol, not core/nodes/etcd.py's class: it imports this
one); :class:`EtcdKeys`, what etcd adds to core/nodes/membership.py's keys (liveness by leases; a newcomer's
admission, one transaction against the nodes' moves to WAITING and RETURNED), and :class:`EtcdRoundWatch`, a
round's beat, on the round's own TCPStore (core/stores/store_beat.py): nothing written to etcd a beat.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import RendezvousGone
from ..stores.clock import Clock
from ..stores.deadline import SILENT, answered, within
from ..stores.etcd_kv import absent, counted, found, number, put, read
from ..stores.kv import KV
from ..stores.store_beat import KeptRecord, StoreBeat, first_record, record_of
from ..wire.protocol import FailureRecord
from .api import INTERVAL, Lost, RoundWatch, ending
from .membership import RoundKeys
from .rules import Door, door

if TYPE_CHECKING:
    from ...config import LaunchConfig
    from .etcd_identity import Identity


def etcd_interval(nodes: int) -> float:
    """Seconds between two looks of a waiting launcher on etcd: 0.1 s up to 25 nodes, then longer, so that all
    of them together look about 250 times a second (4 s at 1,000 nodes). A fourth of c10d's: each request costs
    etcd about a millisecond of CPU (measured: 0.34 CPU-seconds a second for 316 requests a second, when the beats
    still took 4 a node a second); past that the leases' refreshes queue and run out."""
    return min(4.0, max(0.1, nodes / 250))


class EtcdLink(KV, Protocol):
    """What :class:`EtcdKeys` and :class:`EtcdRoundWatch` ask of the backend: its keys (core/stores/kv.py's), and
    more."""

    config: LaunchConfig  # this round's
    launched: LaunchConfig  # as started: nnodes is MAX, min_nnodes MIN
    prefix: str  # every key of the job lies under it
    ttl: int  # the lease's seconds: how long a frozen launcher may hold a round's store
    identity: Identity | None  # which launch of the job this launcher is part of (once it reached etcd)
    clock: Clock  # what its waits sleep on

    def key(self, attempt: int, *parts: object) -> str: ...
    def commit(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
               failure: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...
    def lease(self) -> int: ...
    def record(self, attempt: int) -> FailureRecord | None: ...
    def tell_failed(self, attempt: int) -> None: ...
    def store(self, attempt: int) -> tuple[str, int]: ...
    def lost(self, attempt: int, since: float) -> Lost | None: ...


class EtcdKeys(RoundKeys):
    """core/nodes/membership.py's keys in etcd (:class:`~mpddp.core.nodes.membership.RoundKeys`: arrivals put with the
    launcher's lease, counted without being read; only the launcher that decides reads them), and what only this
    backend does: liveness by the leases, a ``--node-rank`` held by the launcher for its incarnation, a newcomer's
    admission in one transaction against the nodes' moves."""

    link: EtcdLink

    def __init__(self, link: EtcdLink) -> None:
        super().__init__(link, link.key, lambda name: link.prefix + name, link.clock)
        self.link = link
        self._early: dict[int, str] = {}  # a round's member list, when it was decided before this launcher came
        self._counted: dict[int, int] = {}  # a round's arrivals, as counted by the last look

    # A request less an arrival and a look than RoundKeys' (etcd's join at 64 nodes took 5.1x its join at 8 with
    # them, 3.3x to 4.3x without: docs/performance.rst), each read along in the same transaction.

    def arrive(self, attempt: int, me: str, arrival: str) -> int:
        """This launcher's arrival put, every arrival counted and the member list read: one request."""
        link, prefix = self.link, self.link.key(attempt, "join/")
        answer = link.commit([], [put(prefix + me, arrival, link.lease()), counted(prefix),
                                  read(link.key(attempt, "members"))])["responses"]
        if (members := found(answer[2])) is not None:  # decided before this one came
            self._early[attempt] = members.decode()
        return number(answer[1])

    def count(self, attempt: int) -> int:
        """The count the last look read along, once; else one request."""
        if (counted := self._counted.pop(attempt, None)) is not None:
            return counted
        return super().count(attempt)

    def await_decided(self, attempt: int, timeout: float) -> str | None:
        """The member list after a look of ``timeout`` (RoundKeys'), the arrivals counted in the same request."""
        if attempt in self._early:
            return self._early[attempt]
        self.clock.sleep(timeout)
        link = self.link
        answer = link.commit([], [read(link.key(attempt, "members")), counted(link.key(attempt, "join/"))])["responses"]
        self._counted[attempt] = number(answer[1])
        return members.decode() if (members := found(answer[0])) is not None else None

    def lived(self, attempt: int) -> int:
        """One request: a lost launcher's arrival went with its lease."""
        return super().count(attempt)  # now, not as a look read it

    def claim(self, attempt: int, node_rank: int, me: str) -> str | None:
        """None: this launcher holds ``--node-rank`` for as long as it lives in its incarnation, whatever the round
        (core/nodes/etcd_identity.py raises the line itself for a live launcher that holds it)."""
        if self.link.identity is not None:
            self.link.identity.claim(node_rank)
        return None

    def look(self, nodes: int) -> float:
        return etcd_interval(nodes)

    def admit(self, attempt: int, record: FailureRecord) -> None:
        """The round's record, created only while it has none, no node's rank failed (``failing/``: its record is on
        its way), none waits for a failure's and none's ranks returned (core/nodes/rules.py's :func:`door`): one
        transaction, which etcd orders with each of those writes (also one), so a node that writes after it reads the
        record as it waits (core/nodes/settle.py) and restarts with the others. Refused, this launcher comes to the
        next round (a failure's record on its way ends this one anyway), or is not needed once a node returned."""
        link = self.link
        key = link.key(attempt, "failure")
        shut = [link.key(attempt, "failing/"), link.key(attempt, "waiting/"), link.key(attempt, "returned/")]
        answer = link.commit([absent(key), *(absent(k, under=True) for k in shut)], [put(key, record.encode())],
                             [read(key), *map(counted, shut)])
        if answer["succeeded"]:
            link.tell_failed(attempt)  # the running nodes read it off their round's store, not etcd
            return
        written, (failing, waiting, came_back) = found(answer["responses"][0]), map(number, answer["responses"][1:])
        if door(record=written is not None, waiting=bool(failing or waiting), returned=bool(came_back)) is Door.CLOSED:
            raise ending(f"the job --rdzv-id {link.config.rdzv_id}", attempt)

    def over(self, attempt: int, members: list[str]) -> bool:
        left = set(self.link.under(self.link.prefix + "left/"))
        return set(members) <= left or self.decided(attempt) is None  # or the last launcher removed every key

    def alive(self, attempt: int, members: list[str]) -> bool:
        return bool(set(members) & set(self.arrivals(attempt)))


LOOKERS = 3  # the nodes of a round that look at its leases while the ranks run


class EtcdRoundWatch(RoundWatch):
    """One round's beat on the round's own TCPStore (its first node hosts it): no request to etcd a beat, so a job
    that trains for a week writes nothing to etcd's Raft log (a put a beat was two Raft writes and 4 KB of etcd's
    database a node a second, measured with scripts/bench_etcd_writes.py). The round's first failure is still
    created in etcd; its writer adds FAILED to the store's progress counter, which every node's next beat reads.
    Where the store cannot be reached (its node lost), each beat reads etcd's failure key instead: a read."""

    link: EtcdLink

    def __init__(self, link: EtcdLink, attempt: int, share: Callable[[bool], bytes | None] | None = None,
                 tell: Callable[[Lost], FailureRecord] | None = None) -> None:
        super().__init__(attempt, share, tell)
        self.link = link
        self.beat = StoreBeat(attempt, link.config.node)
        self.admits = link.launched.min_nnodes < link.launched.nnodes
        # the round's first LOOKERS nodes: any of them that finds a node lost writes the record every node reads, so
        # that etcd serves a few reads a second, not two a node (64 nodes in one process of bench_scale.py, each
        # looking, starved their beats); the loss of all of them at once is told as before, by the collectives
        self.looks = 1 < link.config.nnodes and link.config.node < LOOKERS
        self._store: Any = None  # the round's store, once connected; None again once an operation failed
        self._store_lock = threading.Lock()  # the beat's thread and share_now's caller
        self._address: tuple[str, int] | None = None  # where it listens, read from etcd once
        self._reached = threading.Event()  # the store answered once; a publish waits for it (only the beat connects
        # at first: the caller's thread may be the round's first node itself, which publishes the store after this)
        self._kept = KeptRecord(attempt, link.config.node)  # the round's record on the store, once read
        self._next_try = 0.0  # when the beat may try to connect to the round's store again
        self.host_lost = False  # the round's first node, its store's host, was found lost: its store is not called
        self._untold = False  # this node wrote the round's record before its beat reached the store: the beat tells
        from ..wire.store import load_torch

        load_torch()  # here, not in the beat's thread: a first import of torch there took 2-9 s (no store to tell
        self._begin()  # a record on meanwhile), and once raced the caller's own import of it

    def _lost(self) -> Lost | None:
        """The nodes whose lease ran out before they ended the round: one request to etcd (a count, no write), twice
        a second. etcd that does not answer finds nobody lost: the next look asks again."""
        from etcd3gw import exceptions

        with contextlib.suppress(RendezvousGone, exceptions.Etcd3Exception):
            lost = self.link.lost(self.attempt, 0.0)
            self.host_lost = lost is not None and 0 in lost.nodes  # the round's first node hosts its store
            return lost
        return None

    def _connect(self) -> None:
        """A client of the round's store, its operations' timeout a lease's TTL (torch 2.13 does not apply it to a
        frozen host's answers, measured: an add still waited after 20 s; etcd's lease then tells the other nodes, and
        --timeout this one). Again after an operation failed: a failed one (a reset connection) left this node blind
        to the round's record for good. A gone host refuses at once; a lost machine costs a second (its lease tells)."""
        from datetime import timedelta

        from ..wire.store import connect

        self._next_try = time.monotonic() + 1.0  # a store not reached costs one try a second, at most
        with contextlib.suppress(Exception):  # RendezvousError, OSError, torch's own types: etcd's key is read then
            if self._address is None:
                self._address = self.link.store(self.attempt)
            else:
                socket.create_connection(self._address, timeout=1.0).close()  # torch would retry till timeout
            address, wait = self._address, self.link.ttl if self._reached.is_set() else self.link.config.timeout
            store: Any = within(SILENT + wait, lambda: connect(*address, wait))  # a frozen host accepts, then is mute
            store.set_timeout(timedelta(seconds=self.link.ttl))  # 64 nodes at once took more than 3 s to connect
            with self._store_lock:
                self._store = store
                self._reached.set()

    def _on_store(self, op: Callable[[Any], Any], again: bool = False) -> Any:
        """``op(store)`` under the lock; None (and the client dropped) when the round's store does not answer.
        ``again``: a store that stopped answering is connected to once more first (a record to read or write)."""
        if self.host_lost:  # its machine: a call to it would wait for its deadline, for nothing
            return None
        if again and self._store is None and self._reached.is_set():
            self._connect()
        with self._store_lock:
            if self._store is None:
                return None
            try:  # within a deadline: torch's client ignores its timeout against a host cut off or frozen
                return answered(SILENT, op, self._store)
            except Exception:  # noqa: BLE001 - torch raises several types for a store that is gone or slow; Silent
                self._store = None  # never used again (a silent call's thread may still be blocked in it)
                return None

    def _turn(self, step: int, snapshot: bytes | None, beats: int | None) -> int | None:
        """On the round's store, once connected (its host publishes it late), again a second after an operation
        failed; no beat count: the lease tells liveness."""
        if self._store is None and time.monotonic() >= self._next_try:
            self._connect()
        if self._untold:
            self._untold = self._on_store(self.beat.tell_failed) is None
        return super()._turn(step, snapshot, None)

    def _shut(self) -> None:
        """A ``failing/`` key, put with the lease: a newcomer's admission compares that none is there (one write,
        at a failure only). An etcd that refuses it is the report's business, after."""
        from etcd3gw import exceptions

        with contextlib.suppress(exceptions.Etcd3Exception):
            self.link.put(self.link.key(self.attempt, "failing", self.link.config.node_rank), "1", leased=True)

    def tell_failed(self) -> None:
        """This node wrote the round's record: every node's next beat reads it off the store's counter. A beat not yet
        connected to the store tells it once it is: 64 clients connecting at once, a few took 5 s (measured), and a
        record written meanwhile was told to no node (they read etcd's key only once their own store fails)."""
        self._untold = self._on_store(self.beat.tell_failed) is None

    def publish(self, record: bytes) -> bytes | None:
        """The round's record on its store (etcd is full); the standing one, or None where the store is gone.
        A rank that fails as the round starts: the beat's first connection is waited for, a lease's TTL at most."""
        self._reached.wait(self.link.ttl)
        return self._on_store(lambda s: first_record(s, self.attempt, record), again=True)

    def record(self) -> FailureRecord | None:
        """The round's record on its store (etcd is full), counted once as read when another node wrote it, and
        kept from then on (core/stores/store_beat.py's ``KeptRecord``)."""
        return self._kept.read(functools.partial(self._on_store, again=True))

    def last_record(self, wait: float) -> FailureRecord | None:
        """The round's record on its store, waited for ``wait`` seconds at most while the store answers."""
        deadline = time.monotonic() + wait
        while (record := self.record()) is None and self._store is not None and time.monotonic() < deadline:
            time.sleep(INTERVAL)
        return record

    def until_read(self, others: int, wait: float) -> None:
        """The round's store host, leaving with the record on its store: stay until ``others`` nodes read it, or
        ``wait`` seconds (etcd full: the store is the only place the others can learn the truth)."""
        if self._on_store(lambda s: record_of(s, self.attempt)) is not None:
            KeptRecord.until_read(self._on_store, self.attempt, others, wait, INTERVAL / 5)
