"""The ``etcd`` rendezvous backend: what the nodes of a job agree on, kept by an etcd cluster: no node is special.

Owns: :class:`EtcdRendezvous`, core/nodes/api.py's interface on etcd's own means; its round watch beats on the round's
own store (core/nodes/etcd_keys.py: no write to etcd a beat). Every key of a launch lies under
``/mpddp/<rdzv-id>/i/<incarnation>/`` (core/nodes/etcd_identity.py), a round's under ``r/<round>/``. Membership is
decided per round by core/nodes/membership.py's rule, over ``join/<launcher>`` and ``members``; the round's first node
hosts its process-group store and publishes ``store``. Liveness is the launcher's lease: its ``join`` and
``alive/<node>`` keys are put with it, and a node whose keys vanished without ``ended/<node>`` was lost (its launcher,
or its machine). The first failure is ``failure``, created only if absent. Each round's first node removes the keys of
the round before the last and compacts etcd's history; the last launcher to leave removes the job's keys.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...config import LaunchConfig
from ...errors import AddressError, RendezvousError, RendezvousGone
from ..stores import etcd_probe
from ..stores.clock import MACHINE
from ..stores.deadline import SILENT, within
from ..stores.etcd_client import EtcdClient, EtcdFull, KeptLease
from ..stores.etcd_kv import EtcdKV
from ..stores.store_beat import StoreBeat
from ..wire.fingerprint import Fingerprint
from ..wire.protocol import FailureRecord
from . import membership
from .api import Lost, Round, RoundLost, RoundStore, went_away
from .etcd_identity import Identity
from .etcd_keys import EtcdKeys, EtcdRoundWatch, etcd_interval
from .rules import NodeState, lost_nodes
from .view import Counters

_FIRST_CONTACT = 5.0  # seconds the first contact with etcd may take, at most
_UNTOLD = {NodeState.ENDED: (RendezvousGone,), NodeState.WAITING: (EtcdFull,)}  # what a move may leave unwritten


class EtcdRendezvous(EtcdKV, Counters):
    """The ``etcd`` backend of :class:`~mpddp.core.nodes.api.Rendezvous`, for the whole job; thread-safe."""

    hosts_round_store = True  # each round's first node hosts that round's store (api.Rendezvous)
    clock = MACHINE  # what its waits read and sleep on (a test's own, injected)

    def __init__(self, config: LaunchConfig, port: int, nprocs: int, job: str = "") -> None:
        settings = config.rdzv_settings()
        self.config, self.nprocs = config, nprocs  # config: this round's, from each join on
        self.job = Fingerprint(job, nprocs) if job else None  # what this launcher runs: its incarnation's, or refused
        self.launched = config  # as the user started it: nnodes is MAX, min_nnodes MIN
        client = EtcdClient(config.rdzv_endpoint or "", settings.tls, timeout=config.timeout,
                            start=config.node_rank or None)  # 0 or not given: arrival numbers it; any member
        super().__init__(client, settings.ttl)
        self.kv = self  # its keys, as view.Counters reads them
        self.last_call = settings.last_call_timeout
        self.me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.prefix = f"/mpddp/{config.rdzv_id}/"  # the job's; its launch's incarnation's from the first join on
        self.identity: Identity | None = None  # which launch of the job this launcher is part of (from first contact)
        self.gone: set[int] = set()
        self.reached = False
        self.last_round: Round | None = None  # the last round this launcher joined (None: refused, or a spare)
        self._members_of: dict[int, list[str]] = {}  # each round's launchers, by node rank
        self._known_gone: dict[int, set[int]] = {}  # a round's nodes whose lease is known gone (lost, or left)
        self._watches: dict[int, EtcdRoundWatch] = {}  # each round's beat: its first failure's writer tells it

    def key(self, attempt: int, *parts: object) -> str:
        return self.prefix + f"r/{attempt}/" + "/".join(map(str, parts))

    # ---- a round ------------------------------------------------------------------------------------------

    def join(self, attempt: int) -> Round:
        """This launcher's place in the job's next round from ``attempt`` on, once its membership is decided
        (core/nodes/membership.py: a launcher that comes to a running job is admitted, or waits as a spare)."""
        if attempt == 0 and not self.reached:
            self._first_contact()
        keys = EtcdKeys(self)
        try:
            if attempt == 0:  # the round the job is in, in this launch's incarnation (a crashed launch's are another's)
                if self.identity is not None and self.identity.token is None:
                    self.prefix = self.identity.take()
                attempt = keys.latest()
            here, members = membership.join_round(
                keys, attempt, self.me, low=self.launched.min_nnodes, high=self.launched.nnodes,
                node_rank=self.launched.node_rank, last_call=self.last_call, timeout=self.config.timeout,
                previous=self.last_round,
                start_them=f"start the missing launchers with --rdzv-backend etcd --rdzv-endpoint "
                           f"{self.client.endpoints} --rdzv-id {self.launched.rdzv_id}",
                job=f"the job --rdzv-id {self.launched.rdzv_id}", apart="a second job needs a --rdzv-id of its own",
                clock=self.clock)
        except EtcdFull as e:
            raise RendezvousError(f"{e}; round {attempt} cannot start") from None
        except RendezvousGone as e:
            raise RendezvousError(f"{e}: round {attempt} cannot start; start etcd there, or pass the members "
                                  "that run with --rdzv-endpoint host:port,host:port") from None
        self.client.running = True  # from now on a full etcd is told once, and the ranks go on
        self.last_round, self._members_of[here.number] = here, members
        self.config = replace(self.launched, nnodes=here.nnodes, node_rank=here.node_rank)
        self.gone = set()  # node ranks are the new round's: those lost before are not among them
        self.put(self.key(here.number, "state", here.node_rank), NodeState.RUNNING.value)  # its record
        self.put(self.key(here.number, "alive", here.node_rank), "1", leased=True)  # counted, not read
        if here.node_rank == 0:
            self._tidy(here.number)
        return here

    def _tidy(self, number: int, every: bool = False) -> None:
        """Round ``number``'s first node, as it starts: round ``number - 2``'s keys go (every node has left it), or
        ``every`` key of the job (the last launcher to leave), and etcd's history is compacted: keys and revisions stay
        flat however long a job runs (one compaction a round, never a beat). A refusal (another client compacted
        further) leaves it to the next round."""
        from etcd3gw import exceptions

        def tidy(c: Any) -> None:
            if every or number >= 2:
                c.delete_prefix(self.prefix if every else self.key(number - 2, ""))
            c.post(c.get_url("/kv/compaction"), json={"revision": int(c.status()["header"]["revision"])})

        with contextlib.suppress(RendezvousGone, exceptions.Etcd3Exception):
            self.client.call(tidy, timeout=2.0)
            if every and self.identity is not None:
                self.identity.forget()  # the job's token, and earlier launches' keys no lease holds any more

    def _first_contact(self) -> None:
        """Bad input, before any rank starts, when no member of --rdzv-endpoint answers within a few seconds, or
        one answers but not as an etcd this launcher may use (core/stores/etcd_probe.py). Then this launcher's
        lease is granted: the join puts its arrival with it (one round trip the less)."""
        wait = min(self.config.timeout, _FIRST_CONTACT)
        try:
            etcd_probe.check(self.client.endpoints, self.client.tls, self.prefix, wait)  # not etcd, or auth on
            if self.kept is None:
                self.kept = KeptLease(self.client, self.ttl, timeout=wait)
            if self.identity is None:
                self.identity = Identity(self, self.launched.rdzv_id or "", self.me, self._address(),
                                         self.launched.nnodes, self.job)
        except EtcdFull as e:
            raise RendezvousError(f"{e}; the job cannot start") from None
        except RendezvousGone:
            raise AddressError(f"no etcd member answers at --rdzv-endpoint {self.client.endpoints} (tried for "
                               f"{wait:g} s): start etcd there, or pass the members that run (host:port,...)") from None
        self.reached = True

    def _address(self) -> str:
        """Where the others reach this launcher: --local-addr, else its address toward etcd's first member."""
        from ...machine.netif import resolve, source_address
        from ...rendezvous_options import parse_endpoints

        member, member_port = parse_endpoints(self.launched.rdzv_endpoint or "")[0]
        return self.config.local_addr or source_address(resolve(member), member_port)

    def store(self, attempt: int) -> tuple[str, int]:
        """Where the round's process-group store listens, once its first node has published it; :class:`RoundLost`
        when that node's lease ran out first (the others start the next round without it)."""
        deadline = self.clock.now() + self.config.timeout
        key = self.key(attempt, "store")
        while (found := self.get(key)) is None:
            if 0 in self.stalled(attempt):
                first = self._members_of.get(attempt, ["?"])[0]
                raise RoundLost(f"round {attempt}'s first node ({first}), which hosts its store, was lost before "
                                "the store listened (its lease ran out): the other nodes go on without it", attempt)
            if self.clock.now() > deadline:
                raise RendezvousError(f"round {attempt}'s first node did not publish its store within --timeout "
                                      f"{self.config.timeout:g} s: its launcher is gone or stopped")
            self.clock.sleep(self.interval)
        host, _, port = found.decode().rpartition(":")
        return host, int(port)

    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> EtcdRoundWatch:
        self._watches[attempt] = EtcdRoundWatch(self, attempt, share, lambda lost: self.publish(
            attempt, went_away(self.config, self.nprocs, lost)))
        return self._watches[attempt]

    def move(self, attempt: int, state: NodeState) -> None:
        """This node's record in round ``attempt`` moved to ``state``, with its counters (view.Counters'
        ``move_node``: one transaction, which compares the record with what stands). Its end is no loss: etcd that
        did not answer, or is gone, is none of its business then; unmarked as waiting on a full etcd, the record on
        the round's store still tells the others."""
        if state is NodeState.ENDED and self.client.unanswered:
            return  # etcd just did not answer: the mark would only wait for it again
        with contextlib.suppress(*_UNTOLD.get(state, ())):
            self.move_node(attempt, self.config.node_rank, state)

    # ---- the round's first failure --------------------------------------------------------------------------

    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord:
        key = self.key(attempt, "failure")
        mine = replace(record, writer=self.config.node).encode()
        try:
            if self.client.call(lambda c: c.create(key, mine)):
                self.tell_failed(attempt)
        except EtcdFull:  # etcd full: a record written before stands, else the first one on the round's store does
            watch = self._watches.get(attempt)
            standing = self._written(key) or (watch.publish(mine) if watch is not None else None)
            if standing is None:
                raise
            return FailureRecord.decode(standing)
        return FailureRecord.decode(self.get(key) or mine)

    def _written(self, key: str) -> bytes | None:
        """The record in etcd, once it refused our write for want of room: read for a lease's TTL at most. Read with
        --timeout and let fail, the read of a full etcd that did not answer (slow members, in CI) held a failing node
        that long (180 s by default; a Ctrl-C too), then failed it, its record never on the store."""
        with contextlib.suppress(RendezvousGone):
            return self.get(key, timeout=self.ttl)
        return None

    def until_heard(self, attempt: int) -> None:
        """At once: etcd keeps the round's record for every node (a round's store that goes takes none with it)."""

    def tell_failed(self, attempt: int) -> None:
        """The first writer of round ``attempt``'s record (a failure, or a newcomer's admission): FAILED on the
        round's store, which every node's next beat reads (core/stores/store_beat.py); through this launcher's
        watch of the round, else through a client of its own (a newcomer runs no rank in it)."""
        if (watch := self._watches.get(attempt)) is not None:
            watch.tell_failed()
            return
        from ..wire.store import connect

        with contextlib.suppress(Exception):  # no store (either way): the nodes read etcd's key once theirs fails
            host, port = self.store(attempt)
            socket.create_connection((host, port), timeout=1.0).close()  # a gone host refuses at once; torch
            StoreBeat(attempt, -1).tell_failed(within(SILENT + 2.0, lambda: connect(host, port, 2.0)))  # would
            # retry until its timeout; a frozen host accepts, and answers nothing

    def record(self, attempt: int) -> FailureRecord | None:
        """The round's record. etcd full: the round's store first, at no request to etcd (a record written since is
        there; a node whose etcd requests were slow on a loaded machine read it too late, in CI), then etcd (one
        written before it filled: :meth:`publish` lets no other stand on the store beside it)."""
        watch = self._watches.get(attempt)
        if self.client.full is not None and watch is not None and (kept := watch.record()) is not None:
            return kept
        return FailureRecord.decode(data) if (data := self.get(self.key(attempt, "failure"))) else None

    # ---- liveness ---------------------------------------------------------------------------------------------

    @property
    def interval(self) -> float:
        """A moment between two looks, longer the more nodes look (:func:`etcd_interval`; not a watch: etcd_keys.py)."""
        return etcd_interval(self.config.nnodes)

    def lost(self, attempt: int, since: float) -> Lost | None:
        """The nodes whose lease ran out before they ended the round (:meth:`stalled`): known as soon as etcd knows."""
        if self.client.full is not None:  # a node that ended could not say so, and a lease may not be renewed:
            return None  # a key gone tells nothing; the record, on the round's store, and --timeout still do
        return Lost(lost) if (lost := self.stalled(attempt)) else None

    def stalled(self, attempt: int) -> list[int]:
        """The other nodes of the round whose lease ran out (their ``alive`` key, put with it, is gone) and that
        did not end it: lost, never a guess from timing. One request (a count) while the leases held that are
        not known gone (lost, or ended and left); the keys themselves are read only when the count says more
        went than are known: a node lost, one that left after its end, or one not yet alive at the start."""
        members = self._members_of.get(attempt, [])
        known = self._known_gone.setdefault(attempt, set())
        alive = self.count(self.key(attempt, "alive/"))
        if alive + len(known) >= len(members):
            return sorted(known & self.gone)
        here = {int(n) for n in self.under(self.key(attempt, "alive/"))}
        ended = {int(n) for n in self.under(self.key(attempt, "ended/"))}
        joined = set(self.under(self.key(attempt, "join/")))  # put with the same lease: alive too, till then
        heard = {n: 0.0 if n in here or m in joined else float("-inf")  # the lease's TTL is etcd's: it held, or not
                 for n, m in enumerate(members) if n != self.config.node_rank}
        lost = lost_nodes(heard, 0.0, grace=float("inf"), done=ended)  # core/nodes/rules.py's, c10d's too
        known |= {n for n in range(len(members)) if n not in here and (n in ended or n in lost)}
        self.gone.update(lost)
        return sorted(set(lost) | (known & self.gone))

    def counted(self, attempt: int, counter: str) -> int:
        """The nodes that have put ``counter``'s mark, and those lost without it: a count, no key read."""
        lost = self.stalled(attempt)
        return super().counted(attempt, counter) + sum(self.get(self.key(attempt, counter, n)) is None for n in lost)

    def never_arrived(self, attempt: int) -> None:
        return None  # a round starts with the nodes that joined it: none can be missing from it

    def last_word(self, attempt: int) -> FailureRecord | None:
        """etcd full, and then no answer to this node (a slow member on a loaded machine, in CI): the round's store
        is where a record goes now, so it is looked for there, while the store answers, up to --timeout (its host
        stays as long for the others to read it). Before, such a node told etcd's loss where the others named the
        rank that failed. None otherwise: no node hosts etcd."""
        if self.client.full is None or (watch := self._watches.get(attempt)) is None:
            return None
        return watch.last_record(self.config.timeout)

    def say_last_word(self, attempt: int, record: FailureRecord) -> None:
        """Never asked: no node's store serves every round (the next round's store replaces a lost one)."""

    def last_word_heard(self) -> None:
        """Never asked (:meth:`say_last_word`)."""

    def leave(self) -> None:
        """Done with the job: this launcher's lease goes, and the last launcher to leave removes the job's keys.
        etcd full, the last round's store host first waits for the others to read a record on its store."""
        if self.identity is not None:
            self.identity.close()  # this launcher answers no probe from now on: it is done with the job
        last = self.last_round
        if last is not None and last.node_rank == 0 and self.client.full is not None and (
                watch := self._watches.get(last.number)) is not None:  # before etcd's answers: the store needs none
            watch.until_read(last.nnodes - 1 - len(self.gone), self.config.timeout)
        # No first contact (a lease taken by a put all the same stops refreshing), or etcd did not answer the last
        # call: the lease's TTL removes this one's keys.
        if not self.reached or self.client.unanswered:
            if self.kept is not None:
                self.kept.stop()
            return
        with contextlib.suppress(RendezvousGone):
            if last is not None:
                self.client.call(lambda c: c.put(self.prefix + "left/" + self.me, "1"), timeout=2.0)
                if self.count(self.prefix + "left/") >= last.nnodes:
                    self._tidy(last.number, every=True)
        if self.kept is not None:
            self.kept.revoke()

    def round_store(self, attempt: int, host: Callable[[str], int], script: bool = False) -> RoundStore:
        """A fresh store each round (a restarted env:// ``script`` finds no dead rank's keys in it), hosted by the
        round's first node at :meth:`_address` (the interface the others reach too)."""
        if self.config.node_rank != 0:
            return RoundStore(*self.store(attempt))
        address = self._address()
        port = host(address)
        self.put(self.key(attempt, "store"), f"{address}:{port}")  # for the others (:meth:`store`)
        return RoundStore(address, port)
