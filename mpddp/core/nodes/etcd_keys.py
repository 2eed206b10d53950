"""The ``etcd`` backend's membership keys and its beat of one round (core/nodes/etcd.py is the backend).

Owns: :class:`EtcdKeys`, core/nodes/membership.py's keys in etcd (arrivals put with the launcher's lease,
counted without being read; only the launcher that decides reads them), and :class:`EtcdRoundWatch`, a
round's beat in one request: this node's progress and collectives put, the round's progress and first
failure read, in one transaction, whatever the number of nodes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..wire.protocol import FailureRecord
from .api import INTERVAL, BeatThread, RendezvousGone

if TYPE_CHECKING:
    from .etcd_link import EtcdLink


def _create(client: Any, key: str, value: str | bytes, lease: Any = None) -> bool:
    return bool(client.create(key, value, lease=lease))


def _transaction(client: Any, txn: dict[str, Any]) -> Any:
    return client.transaction(txn)


def _count_of(prefix: str) -> dict[str, Any]:
    """A transaction's request that counts the keys under ``prefix`` without reading them (count_only)."""
    from etcd3gw.utils import _encode, _increment_last_byte

    return {"request_range": {"key": _encode(prefix), "range_end": _encode(_increment_last_byte(prefix)),
                              "count_only": True}}


def _value_of(response: dict[str, Any]) -> str | None:
    """The value a transaction's read of one key found, or None."""
    from etcd3gw.utils import _decode

    found = response.get("response_range", {}).get("kvs")
    return _decode(found[0]["value"]).decode() if found else None


def etcd_interval(nodes: int) -> float:
    """Seconds between two looks of a waiting launcher on etcd: 0.1 s up to 25 nodes, then longer, so that all
    of them together look about 250 times a second (4 s at 1,000 nodes). A fourth of c10d's: each request costs
    etcd about a millisecond of CPU (measured: 0.34 CPU-seconds a second for 316 requests a second), and the
    beats already take 4 a node a second; past that the leases' refreshes queue and run out."""
    return min(4.0, max(0.1, nodes / 250))


class EtcdKeys:
    """core/nodes/membership.py's keys, in etcd: arrivals put with the launcher's lease."""

    def __init__(self, link: EtcdLink) -> None:
        self.link = link
        self._early: dict[int, str] = {}  # a round's member list, when it was decided before this launcher came
        self._counted: dict[int, int] = {}  # a round's arrivals, as counted by the last look

    def arrive(self, attempt: int, me: str, arrival: str) -> int:
        """Put this launcher's arrival and count them all, in one request (a transaction)."""
        from etcd3gw.utils import _encode

        link, prefix = self.link, self.link._key(attempt, "join/")
        lease = link._lease_object().id
        txn = {"compare": [], "failure": [], "success": [
            {"request_put": {"key": _encode(prefix + me), "value": _encode(arrival), "lease": lease}},
            _count_of(prefix), {"request_range": {"key": _encode(link._key(attempt, "members"))}}]}
        answer = link.client.call(functools.partial(_transaction, txn=txn))
        if (members := _value_of(answer["responses"][2])) is not None:  # decided before this one came
            self._early[attempt] = members
        return int(answer["responses"][1]["response_range"].get("count", 0))

    def count(self, attempt: int) -> int:
        """The count the last look read along, once; else one request."""
        if (counted := self._counted.pop(attempt, None)) is not None:
            return counted
        return self.link._count(self.link._key(attempt, "join/"))

    def arrivals(self, attempt: int) -> dict[str, str]:
        return {m: v.decode() for m, v in self.link._prefix(self.link._key(attempt, "join/")).items()}

    def claim(self, attempt: int, node_rank: int, me: str) -> str | None:
        link, key = self.link, self.link._key(attempt, "claim", node_rank)
        if link.client.call(functools.partial(_create, key=key, value=me, lease=link._lease_object())):
            return None
        standing = link._get(key)
        return standing.decode() if standing is not None else None  # its launcher left meanwhile: free again

    def decided(self, attempt: int) -> str | None:
        found = self.link._get(self.link._key(attempt, "members"))
        return found.decode() if found is not None else None

    def look(self, nodes: int) -> float:
        return etcd_interval(nodes)

    def await_decided(self, attempt: int, timeout: float) -> str | None:
        """The member list, once written: a look after ``timeout``. Not a watch: etcd's HTTP gateway serves
        a few hundred streams at once, and with a watch a waiting launcher the leases' refreshes queued behind
        them (measured: 256 simulated nodes joined in 10 s, and three leases ran out)."""
        from etcd3gw.utils import _encode

        if attempt in self._early:
            return self._early[attempt]
        time.sleep(timeout)
        txn = {"compare": [], "failure": [], "success": [  # the arrivals counted in the same request, for count()
            {"request_range": {"key": _encode(self.link._key(attempt, "members"))}},
            _count_of(self.link._key(attempt, "join/"))]}
        answer = self.link.client.call(functools.partial(_transaction, txn=txn))["responses"]
        self._counted[attempt] = int(answer[1]["response_range"].get("count", 0))
        return _value_of(answer[0])

    def decide(self, attempt: int, members: str) -> bool:
        link = self.link
        if won := link.client.call(functools.partial(_create, key=link._key(attempt, "members"), value=members)):
            link._put(link.prefix + "round", str(attempt))
        return bool(won)

    def latest(self) -> int:
        found = self.link._get(self.link.prefix + "round")
        return int(found) if found else 0

    def admit(self, attempt: int, record: FailureRecord) -> None:
        key = self.link._key(attempt, "failure")
        self.link.client.call(functools.partial(_create, key=key, value=record.encode()))

    def record(self, attempt: int) -> FailureRecord | None:
        return self.link.record(attempt)

    def over(self, attempt: int, members: list[str]) -> bool:
        left = set(self.link._prefix(self.link.prefix + "left/"))
        return set(members) <= left or self.decided(attempt) is None  # or the last launcher removed every key

    def alive(self, attempt: int, members: list[str]) -> bool:
        return bool(set(members) & set(self.arrivals(attempt)))

    def pause(self, attempt: int) -> None:
        self.link.pause(attempt)


class EtcdRoundWatch(BeatThread):
    """One round's beat on etcd, one request a beat: a transaction that puts this node's progress (one shared
    key: its version counts every node's steps) and collectives when they moved, and reads the progress key
    and the round's first failure (core/nodes/c10d_watch.py's has the rules)."""

    def __init__(self, link: EtcdLink, attempt: int,
                 share: Callable[[bool], bytes | None] | None = None) -> None:
        super().__init__(attempt, share)
        self.link = link
        self._thread.start()

    def _run(self) -> None:
        from etcd3gw.utils import _decode, _encode

        link, node = self.link, self.link.config.node_rank
        progress, failure = (_encode(link._key(self.attempt, k)) for k in ("progress", "failure"))
        mine = 0
        try:
            while not self._stop.is_set():
                puts = []
                if self._progress.is_set():
                    self._progress.clear()
                    mine += 1
                    puts.append({"request_put": {"key": progress, "value": _encode(str(node))}})
                if self.share is not None and (snapshot := self.share(False)) is not None:
                    puts.append({"request_put": {"key": _encode(link._key(self.attempt, "calls", node)),
                                                 "value": _encode(snapshot)}})
                reads = [{"request_range": {"key": progress}}, {"request_range": {"key": failure}}]
                answers = link.client.call(functools.partial(_transaction, txn={
                    "compare": [], "success": puts + reads, "failure": []}))["responses"][len(puts):]
                found = [a.get("response_range", {}).get("kvs", []) for a in answers]
                self.remote_progress = (int(found[0][0].get("version", 0)) if found[0] else 0) - mine
                if found[1] and self.remote_failure is None and (
                        record := FailureRecord.decode(_decode(found[1][0]["value"]))).node_rank != node:
                    self.remote_failure = record
                self._stop.wait(INTERVAL)
        except RendezvousGone:
            return

    def _put_calls(self, snapshot: bytes) -> None:
        self.link._put(self.link._key(self.attempt, "calls", self.link.config.node_rank), snapshot)

    def others_calls(self) -> list[bytes]:
        """The other nodes' last collectives, read once a hang is suspected (one request)."""
        node = self.link.config.node_rank
        try:
            calls = self.link._prefix(self.link._key(self.attempt, "calls/"))
        except RendezvousGone:
            return []
        return [v for k, v in calls.items() if k != str(node)]
