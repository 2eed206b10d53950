"""The ``c10d`` rendezvous backend: node 0's TCPStore keeps what the nodes of a job agree on.

Owns: :class:`C10dRendezvous`, over one client of node 0's store for the whole job (core/stores/c10d_client.py);
the barriers that start a restarted round once every node's launcher joined it and end a round once every
node's ranks returned; an elastic job's rounds (core/nodes/membership.py's rule on this store's keys); and
which nodes are lost: a launcher whose beat (core/nodes/c10d_watch.py) stood still while the others beat, or
that never beat for --timeout. Its cost: node 0 is special; when its machine is lost, the job ends everywhere
(what it says last when it lives on: core/stores/last_word.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ... import rank_math
from ...config import LaunchConfig
from ...errors import ConfigError, NeverArrived, OtherJob, Outcome, RendezvousError, RendezvousGone, StoreLost
from ..stores import last_word
from ..stores.c10d_client import C10dClient, C10dKV
from ..stores.clock import MACHINE
from ..stores.store_beat import KeptRecord, first_record, read_all, record_of
from ..wire import protocol
from ..wire.fingerprint import Fingerprint, refusal
from ..wire.protocol import FailureRecord, full_key
from . import membership
from .api import LOOK_EVERY, POLL, Lost, Round, RoundStore, names, went_away
from .c10d_keys import C10dKeys, arrived, close_door, join_barrier, missing_ranks, standing_job, take_number
from .c10d_watch import Beats, C10dRoundWatch
from .rules import NodeState, lost_nodes
from .view import Counters

ONCE_MORE = 1.5  # seconds a node gives node 0's store once more, on a fresh connection, after it went silent
READ_WAIT = 3.0  # seconds node 0, stopped itself, keeps its store for the others to read why, at most
HEARD_WAIT = 2.0  # seconds a node waits for the others to read the round's record before it tells it, at most
_LEAVE_WAIT = 10.0  # seconds node 0 keeps the store for the other launchers to read the last round
_NODE0_ONLY = ("not restarted: node 0 hosted the job's store (--rdzv-backend c10d), and no other node can take its "
               "place; with --rdzv-backend etcd the job survives the loss of any node, node 0 included")


class C10dRendezvous(Counters):
    """The ``c10d`` backend of :class:`~mpddp.core.nodes.api.Rendezvous` (see the header); every call is thread-safe."""

    hosts_round_store = False  # node 0's store serves every round
    interval = POLL  # a store has no watch: look again soon
    clock = MACHINE  # what its waits read and sleep on (a test's own, injected)

    def __init__(self, config: LaunchConfig, port: int, nprocs: int, job: str = "") -> None:
        self.config, self.port, self.nprocs = config, port, nprocs
        self.job = Fingerprint(job, nprocs) if job else None  # an elastic job's newcomer: as node 0's, or refused
        self.client = C10dClient(config, port)  # node 0's store, connected on first use
        self.kv = C10dKV(self.client)  # the same, as the keys written once over either backend's see it
        self.gone: set[int] = set()  # nodes found lost (no beat, no end): node 0 does not wait for them to leave
        self.absent: set[int] = set()  # nodes that never arrived in the first round: node 0 does not wait for them
        self.launched = config  # as started: nnodes is MAX, min_nnodes MIN (config is the round's)
        self.elastic = config.min_nnodes < config.nnodes  # --nnodes MIN:MAX
        self.me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._round: Round | None = None  # the last round this launcher joined, of an elastic job
        self._last = 0  # the last round this launcher ran
        self._kept: dict[int, KeptRecord] = {}  # each round's record, as this launcher read it
        self.stopped_in: set[int] = set()  # the rounds whose record this launcher wrote as it was stopped
        self._heard: tuple[tuple[int, float], Beats, float] | None = None  # lost(): (wait, beats, when last read)

    @property
    def reached(self) -> bool:
        """Node 0's store answered once, this launcher or one of its ranks (the attempt sets it then)."""
        return self.client.reached

    @reached.setter
    def reached(self, value: bool) -> None:
        self.client.reached = value

    def join(self, attempt: int) -> Round:
        """Round ``attempt``'s barrier: return once every node's launcher has joined it; name those that did not.
        The first round needs none: the ranks meet in node 0's store (a launcher without --node-rank takes its
        number there first). The nodes never change, but in an elastic job (--nnodes MIN:MAX:
        core/nodes/membership.py decides each round's, node 0 always first)."""
        if self.elastic:
            return self._join_elastic(attempt)
        if self.config.node_rank is None:
            self.config = replace(self.config, node_rank=self._take_number())
        node, nnodes, timeout = self.config.node, self.config.nnodes, self.config.timeout
        try:
            missing = self.client.call(lambda s: join_barrier(s, attempt, node, nnodes, timeout),
                                       wait=timeout) if attempt else []
        except RendezvousGone:
            raise self._no_round(attempt) from None
        if missing:
            raise RendezvousError(
                f"node(s) {names(missing)} did not join round {attempt} (restart {attempt} of "
                f"{self.config.max_restarts}) within --timeout {timeout:g} s: their launchers are gone or stopped "
                "(killed, preempted, machine lost); every node must be running to restart the group")
        return Round(attempt, nnodes, node, tuple(range(nnodes)), decided=self.launched.node_rank is None)

    def _take_number(self) -> int:
        """This launcher's node rank in a fixed-size job, as it comes to node 0's store (c10d_keys.take_number)."""
        nnodes = self.config.nnodes
        try:
            number = self.client.call(lambda s: take_number(s, self.me, nnodes))
        except RendezvousGone:
            raise self._gone(0) from None
        if number is None:
            raise ConfigError(f"the job at {self.config.master_addr}:{self.port} has its --nnodes {nnodes} nodes "
                              f"already (node ranks 0-{nnodes - 1}, taken as the launchers came): this launcher is one "
                              f"too many; start every node with --nnodes {nnodes + 1} for one more, or stop this one")
        return int(number)

    def _gone(self, attempt: int) -> RendezvousError:
        """Node 0's store did not answer as this launcher joined: if it never did, no job there (not started, or
        ended), not a loss."""
        return self._no_round(attempt) if self.client.reached else RendezvousError(self.client.gone_line())

    def _no_round(self, attempt: int) -> StoreLost:
        return StoreLost(f"node 0's store at {self.launched.master_addr}:{self.port} is gone, so round {attempt} "
                         "cannot start: node 0's launcher was killed, or its machine lost")

    def _join_elastic(self, attempt: int) -> Round:
        launched = self.launched
        keys = C10dKeys(self)
        try:
            if attempt == 0 and self.job is not None:  # a fixed-size job's ranks compare it (their roll call)
                self._same_job(self.job)
            here, _ = membership.join_round(
                keys, keys.latest() if attempt == 0 else attempt, self.me, low=launched.min_nnodes,
                high=launched.nnodes, node_rank=launched.node_rank,
                last_call=launched.rdzv_settings().last_call_timeout,
                timeout=launched.timeout, previous=self._round,
                start_them=f"start the missing launchers with --nnodes {launched.min_nnodes}:{launched.nnodes} "
                           f"--master-addr {launched.master_addr} --master-port {self.port}",
                decides=launched.node_rank == 0,  # the store's host, first in every round (its --node-rank 0)
                clock=self.clock)
        except RendezvousGone:
            raise self._gone(attempt) from None
        self._round = here
        self.config = replace(launched, nnodes=here.nnodes, node_rank=here.node_rank)
        self.gone = set()  # node ranks are the new round's: those lost before are not among them
        return here

    def _same_job(self, mine: Fingerprint) -> None:
        """:class:`OtherJob` when node 0's launcher runs another job than this one (node 0 says its own)."""
        found = self.client.call(lambda s: standing_job(s, mine.encode(), self.launched.node_rank == 0))
        if (standing := Fingerprint.decode(found)) is not None and (difference := mine.differs(standing)):
            raise OtherJob(refusal(f"the job at {self.launched.master_addr}:{self.port} (node 0's store)", difference,
                                   "give this job a --master-port of its own"))

    def round_store(self, attempt: int, host: Callable[[str], int], script: bool = False) -> RoundStore:
        """Node 0's, at --master-addr and --master-port, for every round: no other node can take its place. A
        restarted round of a ``script`` that makes its own env:// group gets a fresh store from node 0 (``host``)
        too, whose port the others read (waiting for it): torch's env:// rendezvous adds no prefix of the round,
        and on the job's store a restarted rank would read the dead ranks' addresses."""
        store = RoundStore(self.config.master_addr, self.port, lost=_NODE0_ONLY)
        if not (script and attempt):
            return store
        key = full_key(attempt, protocol.SCRIPT_PORT)
        if self.config.node_rank == 0:
            port = host(self.config.master_addr)
            self.client.call(lambda s: s.set(key, str(port)))
        else:
            port = int(self.client.call(lambda s: s.get(key), wait=self.config.timeout))
        return replace(store, script_port=port)

    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> C10dRoundWatch:
        """The round's beat, from a thread of its own, until it is stopped."""
        self._last = attempt
        return C10dRoundWatch(self, attempt, share, lambda lost: self.publish(attempt, went_away(self.config,
                                                                                         self.nprocs, lost)))

    def move(self, attempt: int, state: NodeState) -> None:
        """This node's record in round ``attempt`` moved to ``state`` (view.Counters' ``move_node``). Its end is no
        loss: a store gone meanwhile is none of its business, and node 0 stopped itself (Ctrl-C, a signal) keeps its
        store until the others read why (called shielded from a second one)."""
        if state in (NodeState.WAITING, NodeState.RETURNED) and self.elastic:  # first: no newcomer's admission
            self.client.call(lambda s: close_door(s, attempt, state))  # hides a failure, or restarts a job that ends
        if state is not NodeState.ENDED:
            self.move_node(attempt, self.config.node, state)
            return
        with contextlib.suppress(RendezvousGone):
            self.move_node(attempt, self.config.node, state, C10dKV(self.client, connect_timeout=2.0))
        if attempt in self.stopped_in and self.config.node_rank == 0:  # once: the attempt's end moves it again
            self.stopped_in.discard(attempt)
            # node 0's store stays until every other launcher read why, or READ_WAIT (a second Ctrl-C soon after the
            # first ended the store before they read it, and they said "node 0 ... is gone": 2 of 6 runs)
            with contextlib.suppress(RendezvousGone):
                readers = self.config.nnodes - 1 - len(self.gone)
                KeptRecord.until_read(self.client.call, attempt, readers, READ_WAIT, POLL, self.clock)

    def never_arrived(self, attempt: int) -> NeverArrived | None:
        """The nodes whose ranks never reached node 0's store in round ``attempt`` (core/rank/worker.py marks
        each rank's arrival), as the error that names them and how to start them; None when every rank came."""
        config, port, world_size = self.config, self.port, self.config.nnodes * self.nprocs
        try:
            missing = self.client.call(lambda s: missing_ranks(s, attempt, world_size), connect_timeout=2.0)
        except RendezvousGone:
            return None
        if not missing:
            return None
        nodes = sorted({rank_math.split_rank(r, self.nprocs)[0] for r in missing})
        self.absent = set(nodes)
        return NeverArrived(
            f"node(s) {names(nodes)} never arrived (rank(s) {names(missing)} "
            f"missing from the rendezvous at {config.master_addr}:{port}): start their launchers with "
            f"--nnodes {config.nnodes} --master-addr {config.master_addr} --master-port {port} --node-rank N", missing)

    def last_word(self, attempt: int) -> FailureRecord | None:
        """Node 0's store stopped answering: the record its launcher says last, if it holds the port still. Silent
        (its connection open): asked once more on a fresh connection, :data:`ONCE_MORE` s at most: a node 0 that
        answers now was not lost, this node was (frozen, or cut off), and the round's record says what the others
        did meanwhile; one still silent is lost, or this machine still cut off."""
        if self.client.silent:
            with contextlib.suppress(RendezvousGone):
                data = self.client.once(lambda s: record_of(s, attempt), ONCE_MORE)
                return FailureRecord.decode(data) if data is not None else None
            return None
        return last_word.hear(self.config.master_addr, self.port, attempt)

    def say_last_word(self, attempt: int, record: FailureRecord) -> None:
        """Node 0, its store server lost: ``record`` on the fresh one its launcher serves on the job's port
        (core/stores/last_word.py), which the others hear (:meth:`last_word`) instead of "node 0 is gone"."""
        last_word.tell(self.config.master_addr, self.port, attempt, record)

    def last_word_heard(self) -> None:
        """Until every other launcher not found lost read node 0's last word, a few seconds at most."""
        last_word.heard(self.config.master_addr, self.port, self.config.nnodes - 1 - len(self.gone))

    def record(self, attempt: int) -> FailureRecord | None:
        """The round's record, once written, as core/stores/store_beat.py's ``KeptRecord`` keeps it and counts its read
        (for the waits of :meth:`move` and :meth:`until_heard`)."""
        return self._kept_in(attempt).read(self.client.call)

    def _kept_in(self, attempt: int) -> KeptRecord:
        return self._kept.setdefault(attempt, KeptRecord(attempt, self.config.node_rank))  # None: a spare

    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord:
        """Write the round's first failure unless another node did first (store_beat.first_record); the record that
        stands (read, where another node's)."""
        if record.outcome is Outcome.STOPPED and record.node_rank == self.config.node:
            self.stopped_in.add(attempt)
        standing = FailureRecord.decode(self.client.call(lambda s: first_record(
            s, attempt, replace(record, writer=self.config.node).encode())))
        return self._kept_in(attempt).standing(self.client.call, standing)

    def until_heard(self, attempt: int) -> None:
        """Until every other node that beat in round ``attempt`` and was not found lost has read its record, or
        HEARD_WAIT. RendezvousGone when node 0's store went first: a node that had not read the record then tells
        node 0's loss, and so must this one, so that every node tells one story (core/nodes/settle.py)."""
        if (record := self.record(attempt)) is None:
            return
        came = [n for n in range(self.config.nnodes) if n not in self.absent]  # 1 of 100,000: 1 key, not 100,000
        beaten = [n for n, beat in (self.heartbeats(attempt, came) or {}).items() if beat > 0 and n != record.writer]
        KeptRecord.until_read(self.client.call, attempt, len(beaten) - self.counted(attempt, protocol.LOST),
                              HEARD_WAIT, max(0.01, membership.poll_interval(self.config.nnodes) / 10), self.clock)

    def lost(self, attempt: int, since: float) -> Lost | None:
        """The other nodes found lost since this node began to wait (``since``), by core/nodes/rules.py's
        :func:`~mpddp.core.nodes.rules.lost_nodes`: a beat that stood still while others beat (c10d_watch's
        ``Beats``), or none at all for --timeout. Every node's beat is read every
        :data:`~mpddp.core.nodes.api.LOOK_EVERY` at most, and at each look once --timeout has passed."""
        now = self.clock.now()
        if self._heard is None or self._heard[0] != (attempt, since):
            self._heard = ((attempt, since), Beats(self.config.node), float("-inf"))
        wait, heard, read_at = self._heard
        if now - read_at < LOOK_EVERY and now - since < self.config.timeout:
            return None
        self._heard, beats = (wait, heard, now), self.heartbeats(attempt) or {}
        if stalled := self.found_lost(attempt, heard.still(beats)):
            return Lost(stalled)
        never = {n: since for n, beat in beats.items() if beat == 0 and n != self.config.node_rank}
        silent = self.found_lost(attempt, lost_nodes(never, now, grace=self.config.timeout))
        return Lost(silent, beat=False) if silent else None

    def heartbeats(self, attempt: int, nodes: list[int] | None = None, every: bool = False) -> dict[int, int] | None:
        """Every node's beat count now (of ``nodes``, else of all), this node's own too (its round watch beats while
        it waits): one batch read once each node has beaten (a counter says so), else one a node (one that never beat:
        0); ``every``: None then (the round watch's look, one operation: a node that never beats is --timeout's).
        Measured with --nnodes 100000 and node 0 alone: a check of every beat key took 2.9 s of the store's time, 12.8 s
        beside 12 busy processes; the counter takes one operation."""
        nodes = list(range(self.config.nnodes)) if nodes is None else nodes
        keys, beating = ([full_key(attempt, protocol.heartbeat_key(n)) for n in nodes],
                         full_key(attempt, protocol.BEATING))

        def read(s: Any) -> list[int] | None:  # a subset (of those that came) checked, where the count is not all
            if (beaten := s.add(beating, 0)) >= len(keys) and (beaten >= self.config.nnodes or s.check(keys)):
                return [int(v) for v in read_all(s, keys)]
            return None if every else [int(s.add(k, 0)) for k in keys]

        found = self.client.call(read)
        return None if found is None else dict(zip(nodes, found))

    def found_lost(self, attempt: int, nodes: list[int]) -> list[int]:
        """Of ``nodes``, those that did not end the round: found lost from now on, their records moved to LOST
        (by the first node to find each: the others count it once)."""
        lost = [n for n in nodes
                if self.move_node(attempt, n, NodeState.LOST) or self.state(attempt, n) is NodeState.LOST]
        self.gone.update(lost)
        return lost

    def key(self, attempt: int, name: str) -> str:  # a key of round ``attempt`` in node 0's store
        return full_key(attempt, name)

    def leave(self) -> None:
        """Done with the store. Node 0 keeps it until every other launcher has left too (or a short while), a spare
        of an elastic job too (it reads the end there), but for the launchers any node found lost: they will not
        come to leave."""
        nnodes = self.config.nnodes

        def waited_for(s: Any) -> int:  # the last round's nodes and spares (its arrivals), but for the lost
            came = max(nnodes, arrived(s, self._last))  # a spare that found the store gone said node 0 was lost
            return came - len(self.absent) - max(len(self.gone - self.absent),
                                                 s.add(full_key(self._last, protocol.LOST), 0))

        with contextlib.suppress(RendezvousGone):
            self.client.call(lambda s: s.add(protocol.LEFT, 1), connect_timeout=2.0)
            if self.config.node_rank != 0:
                return
            deadline = self.clock.now() + min(self.config.timeout, _LEAVE_WAIT)
            while self.client.call(lambda s: s.add(protocol.LEFT, 0) < waited_for(s)) and self.clock.now() < deadline:
                self.clock.sleep(POLL)

