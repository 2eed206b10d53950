"""The ``etcd`` rendezvous backend: what the nodes of a job agree on, kept by an etcd cluster, so that no node
is special.

Owns: :class:`EtcdRendezvous`, core/nodes/api.py's interface on etcd's own means (its round watch,
:class:`~mpddp.core.nodes.etcd_keys.EtcdRoundWatch`, reads a round's progress and first failure in one request a beat). Every key lies under ``/mpddp/<rdzv-id>/``;
a round's keys under ``r/<round>/``. Membership is decided per round: each launcher puts ``join/<its id>``;
once ``MAX`` have joined, or ``MIN`` and no newcomer came for ``last_call_timeout``, the first launcher to
see it writes ``members`` (a create-if-absent transaction: the first writer wins) and the order of that list
is the round's node ranks: the last round's nodes first, in their old order, then ``--node-rank``, then
arrival. So the ranks are compacted when a node is gone. The round's first node hosts its process-group
store and publishes ``store``. Liveness is the launcher's lease: its ``join`` and ``alive/<node>`` keys are
put with it, and a node whose keys vanished without ``ended/<node>`` was lost (its launcher, or its
machine); the alive keys are counted, and read only when the count fell. The first failure is ``failure``,
created only if absent, as under c10d. What a node costs is flat: core/nodes/etcd_keys.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...config import LaunchConfig
from ...errors import AddressError, NeverArrived, RendezvousError, WorkerFailed
from ...log import logger
from ..wire.protocol import FailureRecord
from . import etcd_probe, membership
from .api import RendezvousGone, Round, stopped_record
from .etcd_client import EtcdClient, KeptLease
from .etcd_keys import EtcdKeys, EtcdRoundWatch, etcd_interval

_FIRST_CONTACT = 5.0  # seconds the first contact with etcd may take, at most
_NOT_FOUND = 5  # the gRPC status of a put with a lease that is gone


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
        self._known_gone: dict[int, set[int]] = {}  # a round's nodes whose lease is known gone (lost, or left)
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

    def _count(self, prefix: str) -> int:
        """How many keys lie under ``prefix``: one request, no key read (etcd's count_only)."""
        from etcd3gw.utils import _encode, _increment_last_byte

        body = {"key": _encode(prefix), "range_end": _encode(_increment_last_byte(prefix)), "count_only": True}
        return int(self.client.call(lambda c: c.post(c.get_url("/kv/range"), json=body)).get("count", 0))

    def _put_all(self, pairs: dict[str, str | bytes], leased: bool = False) -> None:
        """Several keys in one request (a transaction of puts)."""
        from etcd3gw.utils import _encode

        lease = self._lease_object().id if leased else None
        puts = [{"request_put": {"key": _encode(k), "value": _encode(v), **({"lease": lease} if lease else {})}}
                for k, v in pairs.items()]
        self.client.call(lambda c: c.transaction({"compare": [], "success": puts, "failure": []}))

    def _mark(self, attempt: int, *marks: str) -> None:
        """This node's ``marks`` in the round (``waiting``, ``returned``, ``ended``), and ``quiet`` (all three)
        and ``done`` (the last two) beside them, which the others count without reading them."""
        me = self.config.node_rank
        pairs: dict[str, str | bytes] = {self._key(attempt, m, me): repr(time.time()) for m in marks}
        pairs[self._key(attempt, "quiet", me)] = "1"
        if set(marks) & {"returned", "ended"}:
            pairs[self._key(attempt, "done", me)] = "1"
        self._put_all(pairs)

    def _lease_object(self) -> Any:
        from etcd3gw.lease import Lease

        if self._lease is None or self._lease.lost:  # lost: etcd took this launcher for gone (a starved machine)
            if self._lease is not None:
                self._lease.stop()  # its thread may not have seen the loss yet: it refreshes nothing from now on
            self._lease = KeptLease(self.client, self.ttl)
        return Lease(self._lease.id, client=None)  # type: ignore[arg-type]  # put() reads only its id

    # ---- a round ------------------------------------------------------------------------------------------

    def join(self, attempt: int) -> Round:
        """This launcher's place in the job's next round from ``attempt`` on, once its membership is decided
        (core/nodes/membership.py: a launcher that comes to a running job is admitted, or waits as a spare)."""
        if attempt == 0 and not self.reached:
            self._first_contact()
        keys = EtcdKeys(self)
        try:
            if attempt == 0:
                attempt = self._clear_stale(keys)
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
        self._put(self._key(here.number, "alive", here.node_rank), "1", leased=True)  # counted, not read
        return here

    def _first_contact(self) -> None:
        """Bad input, before any rank starts, when no member of --rdzv-endpoint answers within a few seconds, or
        one answers but not as an etcd this launcher may use (core/nodes/etcd_probe.py). Then this launcher's
        lease is granted: the join puts its arrival with it (one round trip the less)."""
        wait = min(self.config.timeout, _FIRST_CONTACT)
        try:
            etcd_probe.check(self.client.endpoints, self.client.tls, self.prefix, wait)  # not etcd, or auth on
            if self._lease is None:
                self._lease = KeptLease(self.client, self.ttl, timeout=wait)
        except RendezvousGone:
            raise AddressError(f"no etcd member answers at --rdzv-endpoint {self.client.endpoints} (tried for "
                               f"{wait:g} s): start etcd there, or pass the members that run (host:port,...)") from None
        self.reached = True

    def _clear_stale(self, keys: EtcdKeys) -> int:
        """The round the job is in (0: a new job; one request then), once the keys an earlier job with this
        --rdzv-id left, all of whose launchers are gone, are removed: they are not this job's."""
        latest = self._get(self.prefix + "round")
        if latest is None:
            return 0
        if self._get(self._key(int(latest), "members")) is not None and not self._count(self._key(int(latest), "join/")):
            logger.info("mpddp: etcd holds an ended job's keys under %s: removed", self.prefix)
            self.client.call(lambda c: c.delete_prefix(self.prefix))
        return keys.latest()

    def set_store(self, attempt: int, host: str, port: int) -> None:
        """The round's first node: where its process-group store listens, for the others."""
        self._put(self._key(attempt, "store"), f"{host}:{port}")

    def store(self, attempt: int) -> tuple[str, int]:
        """Where the round's process-group store listens, once its first node has published it."""
        deadline = time.monotonic() + self.config.timeout
        key = self._key(attempt, "store")
        while (found := self._get(key)) is None:
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

    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> EtcdRoundWatch:
        return EtcdRoundWatch(self, attempt, share)

    def end_round(self, attempt: int) -> None:
        with contextlib.suppress(RendezvousGone):
            self._mark(attempt, "ended")

    def finish(self, attempt: int) -> FailureRecord | None:
        """This node's ranks all returned: wait for the others' (or their end, or their loss); the round's
        record if one is written meanwhile (as core/nodes/c10d.py's, whose docstring says why)."""
        me = self.config.node_rank
        try:
            self._mark(attempt, "returned")
            while True:
                pending = self._short_of(attempt, "done")
                if (record := self.record(attempt)) is not None:
                    return record
                if not pending:
                    return None
                self.pause(attempt)
        except RendezvousGone:
            logger.warning("mpddp: etcd went away before every node ended round %d; node %d's ranks had all "
                           "returned", attempt, me)
            return None

    # ---- the round's first failure --------------------------------------------------------------------------

    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord:
        key = self._key(attempt, "failure")
        mine = replace(record, writer=self.config.node).encode()
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
        """The other nodes of the round whose lease ran out (their ``alive`` key, put with it, is gone) and that
        did not end it: lost, never a guess from timing. One request (a count) while the leases held that are
        not known gone (lost, or ended and left); the keys themselves are read only when the count says more
        went than are known: a node lost, one that left after its end, or one not yet alive at the start."""
        members = self._members_of.get(attempt, [])
        known = self._known_gone.setdefault(attempt, set())
        alive = self._count(self._key(attempt, "alive/"))
        if alive + len(known) >= len(members):
            return sorted(n for n in known if n in self.gone)
        here = {int(n) for n in self._prefix(self._key(attempt, "alive/"))}
        ended = {int(n) for n in self._prefix(self._key(attempt, "ended/"))}
        joined = set(self._prefix(self._key(attempt, "join/")))  # put with the same lease: alive too, till then
        me = self.config.node_rank
        lost = [n for n, m in enumerate(members) if n != me and n not in here | ended and m not in joined]
        known |= {n for n in range(len(members)) if n not in here and (n in ended or n in lost)}
        self.gone.update(lost)
        return sorted(set(lost) | (known & self.gone))

    def silent(self, attempt: int) -> list[int]:
        return self.stalled(attempt, {})

    def busy(self, attempt: int) -> bool:
        return self._short_of(attempt, "quiet")

    def _short_of(self, attempt: int, mark: str) -> bool:
        """Fewer nodes have put ``mark`` (or are lost without it) than the round has: counted, not read."""
        lost = self.stalled(attempt, {})
        unmarked = sum(self._get(self._key(attempt, mark, n)) is None for n in lost)
        return self._count(self._key(attempt, mark + "/")) + unmarked < self.config.nnodes

    def mark_waiting(self, attempt: int) -> None:
        self._mark(attempt, "waiting")

    def waiting(self, attempt: int, nodes: set[int]) -> bool:
        return bool(nodes) and all(self._get(self._key(attempt, "waiting", n)) is not None for n in sorted(nodes))

    def returned(self, attempt: int) -> dict[int, float]:
        """One request (a count) while no node's ranks returned; their keys once some did."""
        me, key = self.config.node_rank, self._key(attempt, "returned/")
        if not self._count(key):
            return {}
        return {int(n): float(v) for n, v in self._prefix(key).items() if int(n) != me}

    def never_arrived(self, attempt: int) -> NeverArrived | None:
        return None  # a round starts with the nodes that joined it: none can be missing from it

    def gone_line(self) -> str:
        return f"etcd at {self.client.endpoints} does not answer, so this node cannot learn what the others saw"

    def gone_error(self, local: WorkerFailed) -> RendezvousError:
        return RendezvousError(f"{self.gone_line()}; the failures below are what this node saw\n{local}")

    def until_read(self, attempt: int) -> None:
        return None  # etcd outlives every launcher: its record stays for the others to read

    def last_word(self, attempt: int) -> FailureRecord | None:
        return None  # no node hosts etcd: none has a store of its own to lose

    def pause(self, attempt: int) -> None:
        """A moment between two looks, longer the more nodes look (:func:`etcd_interval`). Not a
        watch: etcd's HTTP gateway serves a few hundred streams at once (etcd_keys.py's await_decided)."""
        time.sleep(etcd_interval(self.config.nnodes))

    def leave(self) -> None:
        """Done with the job: this launcher's lease goes, and the last launcher to leave removes the job's keys."""
        if not self.reached:
            return
        try:
            self.client.call(lambda c: c.put(self.prefix + "left/" + self.me, "1"), timeout=2.0)
            last = max(self.rounds, default=None)
            if last is not None and self._count(self.prefix + "left/") >= self.rounds[last].nnodes:
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
