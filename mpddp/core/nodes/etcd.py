"""The ``etcd`` rendezvous backend: what the nodes of a job agree on, kept by an etcd cluster, so that no node
is special.

Owns: :class:`EtcdRendezvous`, core/nodes/api.py's interface on etcd's own means, and :class:`EtcdRoundWatch`,
a round's progress and first failure read in one request a beat. Every key lies under ``/mpddp/<rdzv-id>/``;
a round's keys under ``r/<round>/``. Membership is decided per round: each launcher puts ``join/<its id>``;
once ``MAX`` have joined, or ``MIN`` and no newcomer came for ``last_call_timeout``, the first launcher to
see it writes ``members`` (a create-if-absent transaction: the first writer wins) and the order of that list
is the round's node ranks: the last round's nodes first, in their old order, then ``--node-rank``, then
arrival. So the ranks are compacted when a node is gone. The round's first node hosts its process-group
store and publishes ``store``. Liveness is the launcher's lease: its ``join`` keys are put with it, and a
node whose key vanished without ``ended/<node>`` was lost (its launcher, or its machine). The first failure
is ``failure``, created only if absent, as under c10d.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...config import LaunchConfig
from ...errors import AddressError, RendezvousError, WorkerFailed
from ...log import logger
from ..wire.protocol import FailureRecord
from . import membership
from .api import INTERVAL, BeatThread, RendezvousGone, Round, stopped_record
from .etcd_client import EtcdClient, KeptLease

_FIRST_CONTACT = 5.0  # seconds the first contact with etcd may take, at most
_NOT_FOUND = 5  # the gRPC status of a put with a lease that is gone
_PAUSE = 0.5  # seconds a wait for the round's keys watches them before it looks again (a change it missed)


class EtcdRendezvous:
    """The ``etcd`` backend of :class:`~mpddp.core.nodes.api.Rendezvous`, for the whole job; thread-safe.

    ``config`` is this round's: its ``nnodes`` and ``node_rank`` are the round's, set by :meth:`join`.
    """

    hosts_round_store = True  # each round's first node hosts that round's store (api.Rendezvous)

    def __init__(self, config: LaunchConfig, port: int, nprocs: int) -> None:
        settings = config.rdzv_settings()
        self.config, self.nprocs = config, nprocs
        self.launched = config  # as the user started it: nnodes is MAX, min_nnodes MIN
        self.client = EtcdClient(config.rdzv_endpoint or "", settings.tls, timeout=config.timeout)
        self.ttl, self.last_call = settings.ttl, settings.last_call_timeout
        self.me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.prefix = f"/mpddp/{config.rdzv_id}/"
        self.gone: set[int] = set()
        self.reached = False
        self.rounds: dict[int, Round] = {}
        self._members_of: dict[int, list[str]] = {}  # each round's launchers, by node rank
        self._lease: KeptLease | None = None

    # ---- keys ---------------------------------------------------------------------------------------------

    def _key(self, attempt: int, *parts: object) -> str:
        return self.prefix + f"r/{attempt}/" + "/".join(map(str, parts))

    def _put(self, key: str, value: str | bytes, leased: bool = False) -> None:
        from etcd3gw import exceptions

        lease = self._lease_object() if leased else None
        try:
            self.client.call(lambda c: c.put(key, value, lease=lease))
        except exceptions.Etcd3Exception as e:
            if not (leased and _grpc_code(e) == _NOT_FOUND):
                raise
            assert self._lease is not None  # the lease ran out before its thread saw it (a starved machine)
            self._lease.lost = True
            lease = self._lease_object()
            self.client.call(lambda c: c.put(key, value, lease=lease))

    def _get(self, key: str) -> bytes | None:
        found = self.client.call(lambda c: c.get(key))
        return found[0] if found else None

    def _prefix(self, prefix: str) -> dict[str, bytes]:
        items = self.client.call(lambda c: c.get_prefix(prefix))
        return {meta["key"].decode()[len(prefix):]: value for value, meta in items}

    def _lease_object(self) -> Any:
        from etcd3gw.lease import Lease

        if self._lease is None or self._lease.lost:  # lost: etcd took this launcher for gone (a starved machine)
            self._lease = KeptLease(self.client, self.ttl)
        return Lease(self._lease.id, client=None)  # type: ignore[arg-type]  # put() reads only its id

    # ---- a round ------------------------------------------------------------------------------------------

    def join(self, attempt: int) -> Round:
        """This launcher's place in the job's next round from ``attempt`` on, once its membership is decided
        (core/nodes/membership.py: a launcher that comes to a running job is admitted, or waits as a spare)."""
        if attempt == 0:
            self._first_contact()
        keys = _EtcdKeys(self)
        try:
            if attempt == 0:
                self._clear_stale()
                attempt = keys.latest()
            here, members = membership.join_round(
                keys, attempt, self.me, low=self.launched.min_nnodes, high=self.launched.nnodes,
                node_rank=self.launched.node_rank, last_call=self.last_call, timeout=self.config.timeout,
                previous=max(self.rounds.values(), key=lambda r: r.number, default=None),
                start_them=f"start the missing launchers with --rdzv-backend etcd --rdzv-endpoint "
                           f"{self.client.endpoints} --rdzv-id {self.launched.rdzv_id}")
        except RendezvousGone as e:
            raise RendezvousError(f"{e}: round {attempt} cannot start; start etcd there, or pass the members "
                                  "that run with --rdzv-endpoint host:port,host:port") from None
        self.rounds[here.number], self._members_of[here.number] = here, members
        self.config = replace(self.launched, nnodes=here.nnodes, node_rank=here.node_rank)
        self.gone = set()  # node ranks are the new round's: those lost before are not among them
        return here

    def _first_contact(self) -> None:
        """Bad input, before any rank starts, when no member of --rdzv-endpoint answers within a few seconds."""
        wait = min(self.config.timeout, _FIRST_CONTACT)
        try:
            self.client.check(wait)
        except RendezvousGone:
            raise AddressError(f"no etcd member answers at --rdzv-endpoint {self.client.endpoints} (tried for "
                               f"{wait:g} s): start etcd there, or pass the members that run (host:port,...)") from None
        self.reached = True

    def _clear_stale(self) -> None:
        """Keys an earlier job with this --rdzv-id left, all of whose launchers are gone: not this job's."""
        latest = _EtcdKeys(self).latest()
        if self._get(self._key(latest, "members")) is not None and not self._prefix(self._key(latest, "join/")):
            logger.info("mpddp: etcd holds an ended job's keys under %s: removed", self.prefix)
            self.client.call(lambda c: c.delete_prefix(self.prefix))

    def set_store(self, attempt: int, host: str, port: int) -> None:
        """The round's first node: where its process-group store listens, for the others."""
        self._put(self._key(attempt, "store"), f"{host}:{port}")

    def store(self, attempt: int) -> tuple[str, int]:
        """Where the round's process-group store listens, once its first node has published it."""
        deadline = time.monotonic() + self.config.timeout
        while (found := self._get(self._key(attempt, "store"))) is None:
            if time.monotonic() > deadline or 0 in self.stalled(attempt, {}):
                raise RendezvousError(f"round {attempt}'s first node did not publish its store within --timeout "
                                      f"{self.config.timeout:g} s: its launcher is gone or stopped")
            self.pause(attempt)
        host, _, port = found.decode().rpartition(":")
        return host, int(port)

    def set_script_port(self, attempt: int, port: int) -> None:
        self._put(self._key(attempt, "script_port"), str(port))

    def script_port(self, attempt: int) -> int:
        return self.store(attempt)[1]

    def watch(self, attempt: int, share: Callable[[], bytes | None] | None = None) -> EtcdRoundWatch:
        return EtcdRoundWatch(self, attempt, share)

    def end_round(self, attempt: int) -> None:
        with contextlib.suppress(RendezvousGone):
            self.client.call(lambda c: c.put(self._key(attempt, "ended", self.config.node_rank), "1"), timeout=2.0)

    def finish(self, attempt: int) -> FailureRecord | None:
        """This node's ranks all returned: wait for the others' (or their end, or their loss); the round's
        record if one is written meanwhile (as core/nodes/c10d.py's, whose docstring says why)."""
        me = self.config.node_rank
        try:
            self._put(self._key(attempt, "returned", me), repr(time.time()))
            while True:
                pending = self._others_without(attempt, ("ended", "returned"))
                if (record := self.record(attempt)) is not None:
                    return record
                if not set(pending) - set(self.stalled(attempt, {})):
                    return None
                self.pause(attempt)
        except RendezvousGone:
            logger.warning("mpddp: etcd went away before every node ended round %d; node %d's ranks had all "
                           "returned", attempt, me)
            return None

    # ---- the round's first failure --------------------------------------------------------------------------

    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord:
        key = self._key(attempt, "failure")
        mine = replace(record, writer=self.config.node_rank).encode()
        self.client.call(lambda c: c.create(key, mine))
        standing = self._get(key)
        return FailureRecord.decode(standing) if standing else FailureRecord.decode(mine)

    def record(self, attempt: int) -> FailureRecord | None:
        data = self._get(self._key(attempt, "failure"))
        return FailureRecord.decode(data) if data else None

    def stopped(self, attempt: int, cause: BaseException) -> None:
        with contextlib.suppress(RendezvousGone):
            self.publish(attempt, stopped_record(self.config, self.nprocs, cause))

    # ---- liveness ---------------------------------------------------------------------------------------------

    def heartbeats(self, attempt: int) -> dict[int, int]:
        """No beats here: a lease says who is alive (kept for the interface's callers)."""
        return {}

    def stalled(self, attempt: int, before: dict[int, int]) -> list[int]:
        """The other nodes of the round whose lease ran out (their ``join`` key, put with it, is gone) and that
        did not end it: lost, never a guess from timing."""
        alive = self._prefix(self._key(attempt, "join/"))
        ended = self._prefix(self._key(attempt, "ended/"))
        me, members = self.config.node_rank, self._members_of.get(attempt, [])
        lost = [n for n, m in enumerate(members) if n != me and m not in alive and str(n) not in ended]
        self.gone.update(lost)
        return lost

    def silent(self, attempt: int) -> list[int]:
        return self.stalled(attempt, {})

    def busy(self, attempt: int) -> list[int]:
        return [n for n in self._others_without(attempt, ("ended", "waiting", "returned")) if n not in self.gone]

    def _others_without(self, attempt: int, marks: tuple[str, ...]) -> list[int]:
        marked = set()
        for mark in marks:
            marked |= {int(n) for n in self._prefix(self._key(attempt, mark + "/"))}
        me = self.config.node_rank
        return [n for n in range(self.config.nnodes) if n != me and n not in marked]

    def mark_waiting(self, attempt: int) -> None:
        self._put(self._key(attempt, "waiting", self.config.node_rank), "1")

    def waiting(self, attempt: int, nodes: set[int]) -> bool:
        marked = {int(n) for n in self._prefix(self._key(attempt, "waiting/"))}
        return bool(nodes) and nodes <= marked

    def returned(self, attempt: int) -> dict[int, float]:
        me = self.config.node_rank
        return {int(n): float(v) for n, v in self._prefix(self._key(attempt, "returned/")).items() if int(n) != me}

    def never_arrived(self, attempt: int) -> RendezvousError | None:
        return None  # a round starts with the nodes that joined it: none can be missing from it

    def gone_error(self, local: WorkerFailed) -> RendezvousError:
        return RendezvousError(f"etcd at {self.client.endpoints} does not answer, so this node cannot learn what "
                               f"the others saw; the failures below are what this node saw\n{local}")

    def pause(self, attempt: int) -> None:
        """Until a key of the round changes (a watch: no poll), or :data:`_PAUSE` seconds."""
        from etcd3gw import exceptions

        try:
            self.client.call(lambda c: c.watch_prefix_once(self._key(attempt, ""), timeout=_PAUSE), timeout=_PAUSE)
        except exceptions.WatchTimedOut:
            pass

    def leave(self) -> None:
        """Done with the job: this launcher's lease goes, and the last launcher to leave removes the job's keys."""
        if not self.reached:
            return
        try:
            self.client.call(lambda c: c.put(self.prefix + "left/" + self.me, "1"), timeout=2.0)
            last = max(self.rounds, default=None)
            left = self.client.call(lambda c: c.get_prefix(self.prefix + "left/"), timeout=2.0)
            if last is not None and len(left) >= self.rounds[last].nnodes:
                self.client.call(lambda c: c.delete_prefix(self.prefix), timeout=2.0)
        except RendezvousGone:
            pass
        if self._lease is not None:
            self._lease.revoke()


def _grpc_code(error: Exception) -> int | None:
    """The gRPC status code in the gateway's answer to a refused request (5: NOT_FOUND, e.g. a lease gone)."""
    try:
        code = json.loads(getattr(error, "detail_text", None) or "{}").get("code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) else None


def _create(client: Any, key: str, value: str | bytes) -> bool:
    return bool(client.create(key, value))


class _EtcdKeys:
    """core/nodes/membership.py's keys, in etcd: arrivals put with the launcher's lease."""

    def __init__(self, link: EtcdRendezvous) -> None:
        self.link = link

    def arrive(self, attempt: int, me: str, arrival: str) -> None:
        self.link._put(self.link._key(attempt, "join", me), arrival, leased=True)

    def arrivals(self, attempt: int) -> dict[str, str]:
        return {m: v.decode() for m, v in self.link._prefix(self.link._key(attempt, "join/")).items()}

    def decided(self, attempt: int) -> str | None:
        found = self.link._get(self.link._key(attempt, "members"))
        return found.decode() if found is not None else None

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
    """One round's beat on etcd: this node's progress put when it moved, and the round's keys read in one
    request, for the others' progress and the round's first failure (core/nodes/c10d.py's has the rules)."""

    def __init__(self, link: EtcdRendezvous, attempt: int, share: Callable[[], bytes | None] | None = None) -> None:
        super().__init__(attempt, share)
        self.link = link
        self._calls: dict[int, bytes] = {}
        self._thread.start()

    def _run(self) -> None:
        link, node = self.link, self.link.config.node_rank
        mine = 0
        try:
            while not self._stop.is_set():
                if self._progress.is_set():
                    self._progress.clear()
                    mine += 1
                    link._put(link._key(self.attempt, "progress", node), str(mine))
                if self.share is not None and (snapshot := self.share()) is not None:
                    link._put(link._key(self.attempt, "calls", node), snapshot)
                keys = link._prefix(link._key(self.attempt, ""))
                self.remote_progress = sum(int(v) for k, v in keys.items()
                                           if k.startswith("progress/") and k != f"progress/{node}")
                self._calls = {int(k[6:]): v for k, v in keys.items() if k.startswith("calls/") and k != f"calls/{node}"}
                if (written := keys.get("failure")) and (record := FailureRecord.decode(written)).node_rank != node:
                    self.remote_failure = record
                self._stop.wait(INTERVAL)
        except RendezvousGone:
            return

    def others_calls(self) -> list[bytes]:
        return list(self._calls.values())
