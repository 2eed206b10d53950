"""The ``c10d`` rendezvous backend: node 0's TCPStore keeps what the nodes of a job agree on.

Owns: :class:`C10dRendezvous`, over one client of node 0's store for the whole job (core/nodes/c10d_client.py);
the barriers that start a restarted round once every node's launcher joined it and end a round once every
node's ranks returned; an elastic job's rounds (core/nodes/membership.py's rule on this store's keys); and
which nodes are lost: a launcher whose beat (core/nodes/c10d_watch.py) stood still while the others beat, or
that never beat for --timeout. Its cost: node 0 is special; when its machine is lost, the job ends everywhere
(what it says last when it lives on: core/nodes/last_word.py).
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
from datetime import timedelta
from typing import Any

from ... import rank_math
from ...config import LaunchConfig
from ...errors import ConfigError, NeverArrived, RendezvousError, StoreLost, WorkerFailed
from ...log import logger
from ..wire import protocol
from ..wire.protocol import FailureRecord, full_key
from . import last_word, membership
from .api import POLL, STALLED_AFTER, RendezvousGone, Round, RoundStore, names, stopped_record
from .c10d_client import C10dClient
from .c10d_keys import ABSENT, C10dKeys, first_record, missing_ranks, take_number
from .c10d_watch import C10dRoundWatch
from .store_beat import read_all

_LIVE_BEATS = 12  # ... by at least this many beats (3 s of them): a starved launcher beats again before that
_LEAVE_WAIT = 10.0  # seconds node 0 keeps the store for the other launchers to read the last round
_NODE0_ONLY = ("not restarted: node 0 hosted the job's store (--rdzv-backend c10d), and no other node can take its "
               "place; with --rdzv-backend etcd the job survives the loss of any node, node 0 included")


class C10dRendezvous:
    """The ``c10d`` backend of :class:`~mpddp.core.nodes.api.Rendezvous`: this launcher's client of node 0's
    store, for the whole job; every call is thread-safe."""

    hosts_round_store = False  # node 0's store serves every round

    def __init__(self, config: LaunchConfig, port: int, nprocs: int) -> None:
        self.config, self.port, self.nprocs = config, port, nprocs
        self.client = C10dClient(config, port)  # node 0's store, connected on first use
        self.gone: set[int] = set()  # nodes found lost (no beat, no end): node 0 does not wait for them to leave
        self.absent: set[int] = set()  # nodes that never arrived in the first round: node 0 does not wait for them
        self.launched = config  # as started: nnodes is MAX, min_nnodes MIN (config is the round's)
        self.me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rounds: dict[int, Round] = {}
        self._last = 0  # the last round this launcher ran
        self.read: set[int] = set()  # the rounds whose record, another node's, this launcher counted as read

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
        if self.launched.min_nnodes < self.launched.nnodes:
            return self._join_elastic(attempt)
        if self.config.node_rank is None:
            self.config = replace(self.config, node_rank=self._take_number())
        node, nnodes, timeout = self.config.node, self.config.nnodes, self.config.timeout
        if attempt:
            try:
                self._join(attempt, node, nnodes, timeout)
            except RendezvousGone:
                raise self._no_round(attempt) from None
        return Round(attempt, nnodes, node, tuple(range(nnodes)), decided=self.launched.node_rank is None)

    def _take_number(self) -> int:
        """This launcher's node rank in a fixed-size job, as it comes to node 0's store (c10d_keys.take_number)."""
        nnodes = self.config.nnodes
        try:
            number = self.client.call(lambda s: take_number(s, self.me, nnodes))
        except RendezvousGone:
            if self.client.reached:
                raise self._no_round(0) from None
            raise RendezvousError(self.gone_line()) from None
        if number is None:
            raise ConfigError(f"the job at {self.config.master_addr}:{self.port} has its --nnodes {nnodes} nodes "
                              f"already (node ranks 0-{nnodes - 1}, taken as the launchers came): this launcher is one "
                              f"too many; start every node with --nnodes {nnodes + 1} for one more, or stop this one")
        return int(number)

    def _no_round(self, attempt: int) -> StoreLost:
        return StoreLost(f"node 0's store at {self.launched.master_addr}:{self.port} is gone, so round {attempt} "
                         "cannot start: node 0's launcher was killed, or its machine lost")

    def _join_elastic(self, attempt: int) -> Round:
        launched = self.launched
        keys = C10dKeys(self)
        try:
            here, members = membership.join_round(
                keys, keys.latest() if attempt == 0 else attempt, self.me, low=launched.min_nnodes,
                high=launched.nnodes, node_rank=launched.node_rank, last_call=launched.rdzv_settings().last_call_timeout,
                timeout=launched.timeout, previous=max(self.rounds.values(), key=lambda r: r.number, default=None),
                start_them=f"start the missing launchers with --nnodes {launched.min_nnodes}:{launched.nnodes} "
                           f"--master-addr {launched.master_addr} --master-port {self.port}")
        except RendezvousGone:
            raise self._no_round(attempt) from None
        self.rounds[here.number] = here
        self.config = replace(launched, nnodes=here.nnodes, node_rank=here.node_rank)
        self.gone = set()  # node ranks are the new round's: those lost before are not among them
        return here

    def _join(self, attempt: int, node: int, nnodes: int, timeout: float) -> None:
        """The last launcher to arrive says so; the others wait for that key in the store (no poll)."""
        everyone = full_key(attempt, protocol.ALL_JOINED)

        def arrive(s: Any) -> bool:
            s.set(full_key(attempt, protocol.joined_key(node)), "1")
            if s.add(full_key(attempt, protocol.JOINED), 1) >= nnodes:
                s.set(everyone, "1")
                return True
            try:
                s.wait([everyone], timedelta(seconds=timeout))
                return True
            except Exception:  # noqa: BLE001 - torch's timeout; a store that is gone fails the next operation
                return False

        if self.client.call(arrive):
            return
        joined = self.client.call(lambda s: [s.check([full_key(attempt, protocol.joined_key(n))]) for n in range(nnodes)])
        missing = [n for n in range(nnodes) if not joined[n]]
        raise RendezvousError(
            f"node(s) {names(missing)} did not join round {attempt} (restart {attempt} of "
            f"{self.config.max_restarts}) within --timeout {timeout:g} s: their launchers are gone or stopped "
            "(killed, preempted, machine lost); every node must be running to restart the group")

    def round_store(self, attempt: int, host: Callable[[str], int]) -> RoundStore:
        """Node 0's, at --master-addr and --master-port, for every round: no other node can take its place."""
        return RoundStore(self.config.master_addr, self.port, lost=_NODE0_ONLY)

    def set_script_port(self, attempt: int, port: int) -> None:
        """Node 0: the port of the round's own store for env:// scripts, for the other nodes to read."""
        self.client.call(lambda s: s.set(full_key(attempt, protocol.SCRIPT_PORT), str(port)))

    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> C10dRoundWatch:
        """The round's beat, from a thread of its own, until it is stopped."""
        self._last = attempt
        return C10dRoundWatch(self, attempt, share)

    def mark_waiting(self, attempt: int) -> None:
        """This node waits for the round's record: its ranks only saw a peer vanish."""
        me = self.config.node
        self.client.call(lambda s: s.set(full_key(attempt, protocol.waiting_key(me)), "1"))
        self._count_once(attempt, me, (protocol.quiet_key, protocol.QUIET))

    def _count_once(self, attempt: int, node: int, *marks: tuple[Callable[[int], str], str]) -> None:
        """Count ``node`` in each mark's counter, the first time only: a set-once key says whether it was."""
        token = f"{self.me}-{time.monotonic_ns()}"

        def count(s: Any) -> None:
            for key, counter in marks:
                if s.compare_set(full_key(attempt, key(node)), "", token) == token.encode():
                    s.add(full_key(attempt, counter), 1)

        self.client.call(count)

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

    def gone_line(self) -> str:
        """Node 0's store does not answer: never reached (not started, wrong address), or gone since."""
        config = self.config
        if not self.client.reached:
            return (f"node 0's rendezvous store at {config.master_addr}:{self.port} did not answer within --timeout "
                    f"{config.timeout:g} s: start node 0's launcher (--node-rank 0) there, or check --master-addr and "
                    "--master-port")
        return (f"node 0, which hosts the rendezvous at {config.master_addr}:{self.port}, is gone (its launcher was "
                "killed, or its machine lost)")

    def gone_error(self, local: WorkerFailed) -> RendezvousError:
        return (StoreLost if self.client.reached else RendezvousError)(f"{self.gone_line()}; the failures below are "
                                                                 f"consequences\n{local}")

    def last_word(self, attempt: int) -> FailureRecord | None:
        """Node 0's store stopped answering: the record its launcher says last, if it holds the port still."""
        return last_word.hear(self.config.master_addr, self.port, attempt)

    def script_port(self, attempt: int) -> int:
        """The port of the round's own store for env:// scripts, which node 0 set before it joined (core/launcher/job.py)."""
        return int(self.client.call(lambda s: s.get(full_key(attempt, protocol.SCRIPT_PORT))))

    def record(self, attempt: int) -> FailureRecord | None:
        """The round's record, once written; read once as another node's, it is counted for :meth:`until_read`."""
        key = full_key(attempt, protocol.FAILURE)
        data = self.client.call(lambda s: s.compare_set(key, ABSENT, ABSENT))  # one operation: the value, or ABSENT
        if not data or data == ABSENT.encode():
            return None
        return last_word.read(self, attempt, FailureRecord.decode(data))

    def until_read(self, attempt: int) -> None:
        last_word.until_read(self, attempt)

    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord:
        """Write the round's first failure unless another node did first; the record that stands. Its writer
        also adds :data:`~mpddp.core.wire.protocol.FAILED` to the progress counter: every node's next beat sees it."""
        return FailureRecord.decode(self.client.call(lambda s: first_record(s, attempt, replace(
            record, writer=self.config.node).encode())))

    def stopped(self, attempt: int, cause: BaseException) -> None:
        """This launcher was stopped (Ctrl-C, SIGTERM, ...) while its ranks ran: the round's failure, if first."""
        with contextlib.suppress(RendezvousGone):
            self.publish(attempt, stopped_record(self.config, self.nprocs, cause))

    def end_round(self, attempt: int) -> None:
        """This node's part of the round is over: its beat stops now, and that is no loss."""
        me = self.config.node
        try:
            self.client.call(lambda s: s.set(full_key(attempt, protocol.ended_key(me)), "1"), connect_timeout=2.0)
            self._count_once(attempt, me, (protocol.quiet_key, protocol.QUIET), (protocol.done_key, protocol.DONE))
        except RendezvousGone:
            pass

    def heartbeats(self, attempt: int) -> dict[int, int]:
        """Every node's beat counter now, this node's own too (its round watch beats while it waits): one
        operation (a batch) once every node has beaten, read only while this node waits for the round's end."""
        keys = [full_key(attempt, protocol.heartbeat_key(n)) for n in range(self.config.nnodes)]

        def read(s: Any) -> list[int]:
            if hasattr(s, "multi_get") and s.check(keys):
                return [int(v) for v in s.multi_get(keys)]
            return [int(s.add(k, 0)) for k in keys]  # a node that never beat: 0 (torch 2.1, 2.2: always so)

        return dict(enumerate(self.client.call(read)))

    def stalled(self, attempt: int, before: dict[int, int]) -> list[int] | None:
        """Other nodes whose beat did not move since ``before`` although they did not end the round.

        None when that cannot be told yet: no node's beat, this one's included, moved by
        :data:`_LIVE_BEATS` meanwhile. Then the beats stood still everywhere (a loaded machine starves the
        beating threads, or node 0's store), which says nothing about any one node. A node is lost only when
        its beat stood still while another's moved.

        A node that never beat in this round is not lost by that alone: its launcher may still be making its
        first connection to node 0's store, which imports torch (the round watch connects once the ranks
        run); on a loaded machine that takes longer than any window of beats. Such a node is lost only by
        :meth:`silent`, after --timeout.
        """
        me = self.config.node_rank
        after = self.heartbeats(attempt)
        still = [n for n in before if n != me and after[n] == before[n]]
        if max((after[n] - before[n] for n in before if n not in still), default=0) < _LIVE_BEATS:
            return None
        return self._not_ended(attempt, [n for n in still if after[n] > 0])

    def silent(self, attempt: int) -> list[int]:
        """Other nodes that never beat in this round and did not end it: lost, once this node waited --timeout
        for them (the time every other wait of a launcher for another node is given)."""
        me = self.config.node_rank
        return self._not_ended(attempt, [n for n, beat in self.heartbeats(attempt).items() if n != me and beat == 0])

    def _not_ended(self, attempt: int, nodes: list[int]) -> list[int]:
        """Of ``nodes``, those that did not end the round: found lost from now on."""
        ended = self.client.call(lambda s: {n: s.check([full_key(attempt, protocol.ended_key(n))]) for n in nodes})
        lost = [n for n in nodes if not ended[n]]
        for n in set(lost) - self.gone:  # counted once, for node 0, which waits for the launchers to leave
            self._count_once(attempt, n, (protocol.lost_key, protocol.LOST))
        self.gone.update(lost)
        return lost

    def busy(self, attempt: int) -> bool:
        """Another node still runs the round: it neither ended it, nor waits for its record or for the other
        nodes (its ranks all returned), nor is lost. Two operations (a counter), and one a lost node."""
        return self._short_of(attempt, protocol.QUIET, protocol.quiet_key)

    def _short_of(self, attempt: int, counter: str, mark: Callable[[int], str]) -> bool:
        """Fewer nodes counted in ``counter`` (or lost without its mark) than the round has."""
        gone = sorted(self.gone)
        counted, unmarked = self.client.call(lambda s: (s.add(full_key(attempt, counter), 0),
                                                 sum(not s.check([full_key(attempt, mark(n))]) for n in gone)))
        return bool(counted + unmarked < self.config.nnodes)

    def waiting(self, attempt: int, nodes: set[int]) -> bool:
        """Every one of ``nodes`` waits for the round's record itself (its ranks only saw a peer vanish)."""
        keys = [full_key(attempt, protocol.waiting_key(n)) for n in sorted(nodes)]
        return bool(keys) and self.client.call(lambda s: s.check(keys))

    def returned(self, attempt: int) -> dict[int, float]:
        """The other nodes whose ranks all returned in this round, and when (their wall clock): one operation
        while none has, two once some have (their entries, numbered by a counter)."""
        me = self.config.node_rank

        def read(s: Any) -> list[bytes]:
            count = s.add(full_key(attempt, protocol.RETURNED), 0)
            keys = [full_key(attempt, protocol.returned_entry(n)) for n in range(1, count + 1)]
            return read_all(s, keys)

        entries = [json.loads(value) for value in self.client.call(read)]
        return {int(node): float(when) for node, when in entries if node != me}

    def finish(self, attempt: int) -> FailureRecord | None:
        """This node's ranks all returned: say so, and wait until every other node's ranks returned too, or it
        ended the round (or was found lost). The round's record if one is written meanwhile: a node whose ranks
        still waited for ours in a collective names one of ours (they returned too early), or its own failure
        is the round's. None: the round ended well on every node.

        torchrun's agents wait so too (their exit barrier): a rank of node 0 that saves the checkpoint alone
        after the others returned keeps them waiting, and its failure is still every node's.
        """
        me = self.config.node
        try:
            entry = json.dumps([me, time.time()])
            self.client.call(lambda s: s.set(full_key(attempt, protocol.returned_entry(
                s.add(full_key(attempt, protocol.RETURNED), 1))), entry))
            self._count_once(attempt, me, (protocol.quiet_key, protocol.QUIET), (protocol.done_key, protocol.DONE))
            start = time.monotonic()
            beats, since = self.heartbeats(attempt), start
            while True:
                pending = self._short_of(attempt, protocol.DONE, protocol.done_key)
                if (record := self.record(attempt)) is not None:  # read after: a node writes it, then ends
                    return record
                if not pending:
                    return None
                now = time.monotonic()
                if now - since >= STALLED_AFTER and self.stalled(attempt, beats) is not None:
                    beats, since = self.heartbeats(attempt), now  # lost nodes are in self.gone from now on
                if now - start > self.config.timeout:
                    self.silent(attempt)
                time.sleep(2 * POLL)
        except RendezvousGone:  # node 0 gone after our ranks returned: nothing more to learn, and nothing went wrong here
            logger.warning("mpddp: node 0's store went away before every node ended round %d; node %d's ranks had "
                           "all returned", attempt, me)
            return None

    def pause(self, attempt: int) -> None:
        time.sleep(POLL)  # a store has no watch: look again soon

    def leave(self) -> None:
        """Done with the store. Node 0 keeps it until every other launcher has left too (or a short while),
        but for the launchers that any node found lost: they will not come to leave."""
        nnodes = self.config.nnodes

        def waited_for(s: Any) -> int:  # the nodes of the last round, but for those any node found lost
            return nnodes - len(self.absent) - max(len(self.gone - self.absent),
                                                   s.add(full_key(self._last, protocol.LOST), 0))

        try:
            self.client.call(lambda s: s.add(protocol.LEFT, 1), connect_timeout=2.0)
            if self.config.node_rank != 0:
                return
            deadline = time.monotonic() + min(self.config.timeout, _LEAVE_WAIT)
            while self.client.call(lambda s: s.add(protocol.LEFT, 0) < waited_for(s)) and time.monotonic() < deadline:
                time.sleep(POLL)
        except RendezvousGone:
            pass
