"""The seam between the launcher and what the nodes of a job agree on: one interface, a backend behind it.

Owns: :class:`Rendezvous`, what a launcher asks of the other nodes of its job, whichever backend keeps it (``c10d``:
node 0's TCPStore, core/nodes/c10d.py; ``etcd``: core/nodes/etcd.py; core/nodes/backends.py picks one by name);
:class:`RoundWatch`, one round's beat as the attempt sees it, its loop written once, and the look at the other
nodes' liveness while the ranks run (a node found lost ends the round on every node at once: :func:`went_away`, the
round's record); the beat's timing.
What crosses the seam is plain values: core/nodes/rules.py's :class:`~mpddp.core.nodes.rules.NodeState` and
:class:`~mpddp.core.nodes.rules.RoundView` (one look at a round: core/nodes/view.py's, on either backend), and
:class:`~mpddp.core.wire.protocol.FailureRecord`; a backend that stops answering raises
:class:`~mpddp.errors.RendezvousGone`. Above core/nodes/ nothing names a
backend: the launcher and the settlement (core/nodes/settle.py) use this module only, and a test keeps it so.

A backend is storage, liveness and a watch, in twelve methods:

* a round: :meth:`~Rendezvous.join` it (its :class:`Round` says who), where its stores listen
  (:meth:`~Rendezvous.round_store`, a :class:`RoundStore`: node 0's for the whole job, or one per round that its first
  node hosts; and a restarted env:// script's own), :meth:`~Rendezvous.watch` it (the beat), and
  :meth:`~Rendezvous.move` this node's record in it (waiting, returned, ended: the one transition function);
* its first failure: :meth:`~Rendezvous.publish` (the first writer wins), and :meth:`~Rendezvous.until_heard` (told
  once every node can tell it: a store that can go with a node waits for the others to read it);
* one look at it: :meth:`~Rendezvous.view` (the record, who is busy, whose ranks returned, who waits, who never
  arrived), and who is :meth:`~Rendezvous.lost` (by the backend's own means: beats, or leases);
* what a node hears when the backend itself is gone: :meth:`~Rendezvous.last_word` (node 0's, where it hosts the
  store; etcd full, the record on the round's store); why it went is worded by the client that found it gone
  (:class:`~mpddp.errors.RendezvousGone`'s ``line``); and what node 0 says last, its store server lost while its
  launcher lives (:meth:`~Rendezvous.say_last_word`, :meth:`~Rendezvous.last_word_heard`: only a backend whose
  node 0 serves every round has one);
* :meth:`~Rendezvous.leave` the job.

What is not a backend's is above it: :func:`stopped` (a record like any other), core/nodes/settle.py's wait for the
record and :func:`~mpddp.core.nodes.settle.finish` (loops over views, by the rules), and the error a gone backend means.
"""

from __future__ import annotations

import abc
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ... import rank_math
from ...config import LaunchConfig
from ...errors import Outcome, RendezvousGone, StoreLost
from ..stores.clock import Clock
from ..stores.store_beat import WATCHED_FOR, StoreBeat
from ..wire import protocol
from ..wire.protocol import FailureRecord
from ..wire.signals import Terminated
from .rules import Lost, NodeState, RoundView

INTERVAL = 0.25  # seconds between two beats (and two looks for another node's failure)
POLL = 0.05  # seconds between two looks of a launcher that waits for the other nodes
LOOK_EVERY = 0.5  # seconds between two looks at the other nodes' liveness while the ranks run


class NotNeeded(Exception):  # noqa: N818 - not an error: the job ended well without this node
    """This launcher waited as a spare (the job had ``MAX`` nodes), and the job ended without needing it; or it came
    below ``MAX`` as the job was ending (:func:`ending`)."""


def ending(job: str, attempt: int) -> NotNeeded:
    """A newcomer whose admission found round ``attempt``'s door closed (core/nodes/rules.py's :func:`door`): the
    same line on every backend; ``job`` names the job (where its rendezvous is)."""
    return NotNeeded(f"mpddp: {job} was ending as this node came (round {attempt}'s ranks had returned on a node): "
                     "this node ran nothing, it was not needed")


class RoundLost(StoreLost):
    """A round's store host was lost (its lease ran out) before its store listened: its ranks never started, and the
    other nodes go on to the next round without it, as after any lost node."""

    def __init__(self, message: str, round_number: int) -> None:
        super().__init__(message)
        self.round_number = round_number

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.round_number)


@dataclass(frozen=True)
class Round:
    """Who is in one round: its number, its size, this node's rank in it, and each node's rank in the round
    before (``old[new] = old``; None: it is new). A backend with a fixed membership (c10d) keeps them all."""

    number: int
    nnodes: int
    node_rank: int
    old: tuple[int | None, ...]
    decided: bool = True  # the backend placed the nodes (False: --nnodes and --node-rank did, for every round)

    def changed(self) -> bool:
        """The nodes are not those of the round before, in the same order."""
        return self.number > 0 and self.old != tuple(range(self.nnodes))

    def table(self, nprocs: int) -> list[str]:
        """The round's nodes and their ranks, old -> new: ``node 1 -> 0: ranks 2, 3 -> 0, 1``,
        ``a new node -> 1: ...``."""
        def ranks(node: int) -> str:
            return names([rank_math.global_rank(node, i, nprocs) for i in range(nprocs)])

        return [f"  a new node -> {new}: ranks {ranks(new)}" if old is None else
                f"  node {old} -> {new}: ranks {ranks(old)} -> {ranks(new)}" for new, old in enumerate(self.old)]


@dataclass(frozen=True)
class RoundStore:
    """Where a round's process-group store listens, as the backend placed it, and what its loss means: what the
    launcher asks instead of which backend runs (core/launcher/job.py)."""

    host: str
    port: int
    lost: str | None = None  # one store serves every round (node 0's): why its loss ends the job, in words.
    # None: each round has its own, hosted by its first node, and the next round's replaces a lost one
    script_port: int | None = None  # a restarted env:// script's own store, where ``port`` serves every round

    @property
    def serves_every_round(self) -> bool:
        return self.lost is not None


class Records(Protocol):
    """A backend, as what reads a round's record sees it (a round watch, the membership keys)."""

    def record(self, attempt: int) -> FailureRecord | None: ...


class RoundWatch(abc.ABC):
    """One round's beat, as the attempt and its watchdog see it, on every backend: the two values the attempt reads,
    the flag the watchdog sets, and the beat, from a daemon thread until :meth:`stop` (:meth:`_run`), the others'
    collectives read (:meth:`others_calls`): a backend's watch says how a call reaches the round's store
    (:meth:`_on_store`), and how the door shuts (:meth:`_shut`)."""

    beat: StoreBeat  # the round's keys on its store, set by each backend's watch
    link: Records  # the backend, set by each backend's watch: the round's record, once the beat says it is written
    admits = False  # newcomers may be admitted to the round (--nnodes MIN:MAX), set by each backend's watch
    looks = False  # this node looks at the other nodes' liveness while the ranks run (set by each backend's watch)

    def __init__(self, attempt: int, share: Callable[[bool], bytes | None] | None,
                 tell: Callable[[Lost], FailureRecord] | None = None) -> None:
        self.attempt = attempt
        self.share = share  # this node's ranks' collectives when they moved (core/launcher/board.py's snapshot)
        self.tell = tell  # nodes found lost, published as the round's record (:func:`went_away`): the one standing
        self.remote_progress = 0  # the other nodes' progress as last read: no node tells a hang while others compute
        self.remote_failure: FailureRecord | None = None  # the round's first failure, once another wrote it: it stops
        self.gone: RendezvousGone | None = None  # the backend stopped answering while the ranks ran: they stop
        self._progress = threading.Event()
        self._stop = threading.Event()
        self._done = threading.Event()  # this node's ranks no longer run: no more looks
        self._thread = threading.Thread(target=self._run, name="mpddp-round-watch", daemon=True)
        self._looker = threading.Thread(target=self._look, name="mpddp-liveness", daemon=True)

    def _begin(self) -> None:
        """The beat, and where this node looks at the others' liveness (:meth:`_lost`), the look: each backend's
        watch starts them once it is set up."""
        self._thread.start()
        if self.looks:
            self._looker.start()

    def progressed(self) -> None:
        self._progress.set()

    def look(self) -> None:
        self.beat.asked = True

    def watched(self) -> bool:
        return time.monotonic() - self.beat.watched_at < WATCHED_FOR

    def share_now(self) -> None:
        """This node's ranks' collectives into the store now, whole, from the caller's thread: before a node
        says it waits for the round's record, so that a node that tells a hang once it waits reads them as
        they ended, not as a starved beat last shared them."""
        if self.share is not None and (snapshot := self.share(True)) is not None:
            with contextlib.suppress(RendezvousGone):  # the store is gone: what that means is settled after
                self._put_calls(snapshot)

    def failing(self) -> None:
        """A rank of this node failed or hung: the round's door shuts now, before its ranks are stopped and its
        record written (a second, more under load), so that no newcomer's admission stands for this failure
        (core/nodes/rules.py's :func:`~mpddp.core.nodes.rules.door`). A store that is gone is settled after; a
        job of a fixed size admits nobody, and costs nothing here."""
        if self.admits:
            with contextlib.suppress(RendezvousGone):
                self._shut()

    def _lost(self) -> Lost | None:
        """The other nodes of the round found lost now, by the backend's own means (beats, leases): one look, from the
        liveness thread, every :data:`LOOK_EVERY` s while the ranks run. A backend whose node looks overrides it."""
        return None

    def _look(self) -> None:
        """While the ranks run: a node found lost ends the round on every node at once (its record, which every
        node's beat reads), never a collective's timeout: a machine cut off or frozen closes no connection, and
        its peers' ranks would wait in gloo until --timeout. The backend gone: the beat tells it. Once this node's
        ranks stopped (:meth:`ranks_done`), a lost node is the settlement's business (a node whose ranks all
        returned counts a node lost meanwhile as done: core/nodes/settle.py's ``finish``)."""
        with contextlib.suppress(RendezvousGone):
            while not self._stop.wait(LOOK_EVERY) and self.remote_failure is None and self.tell is not None:
                if (lost := self._lost()) is not None and not self._done.is_set():
                    standing = self.tell(lost)
                    if self.remote_failure is None:
                        self.remote_failure = standing
                    return

    def ranks_done(self) -> None:
        """This node's ranks no longer run (returned, failed or stopped): the look ends (the beat goes on)."""
        self._done.set()

    def others_calls(self) -> list[bytes]:
        """The other nodes' last snapshots of their ranks' collectives, read once a hang is suspected (none where the
        round's store is gone)."""
        with contextlib.suppress(RendezvousGone):
            return self._on_store(self.beat.others_calls) or []
        return []

    def _put_calls(self, snapshot: bytes) -> None:
        self._on_store(lambda s: self.beat.put_calls(s, snapshot))

    def _turn(self, step: int, snapshot: bytes | None, beats: int | None) -> int | None:
        """One beat on the round's store (core/stores/store_beat.py's ``turn``; ``beats``: this node's count, where
        the backend reads beats for liveness): every node's progress back, or None where the store did not answer
        (etcd's round store: its record is read in etcd then)."""
        return self._on_store(lambda s: self.beat.turn(s, step, snapshot, beats))  # type: ignore[no-any-return]

    @abc.abstractmethod
    def _on_store(self, op: Callable[[Any], Any]) -> Any:
        """``op(store)`` on the round's store: raises RendezvousGone (c10d), or None (etcd) where it does not answer."""

    @abc.abstractmethod
    def _shut(self) -> None: ...

    def _run(self) -> None:
        """Every :data:`INTERVAL`: this node's progress added and every node's read back, this node's collectives
        put when they moved; another node's failure read once the counter says one is written. The backend gone
        (RendezvousGone): what that means is settled after the local ranks stop."""
        mine, beats = 0, 0
        try:
            while not self._stop.is_set():
                beats += 1
                step = 1 if self._progress.is_set() else 0
                snapshot = self.share(False) if self.share is not None else None  # when this node's moved
                total = self._turn(step, snapshot, beats)
                if total is not None:
                    if step:
                        self._progress.clear()
                    mine += step
                    self.remote_progress = total % protocol.FAILED - mine
                if (total is None or total >= protocol.FAILED) and self.remote_failure is None:  # once
                    if (record := self.link.record(self.attempt)) is not None and (  # another's, or this node's
                            record.node_rank != self.beat.node or is_lost_node(record)):  # loss (back: thawed, healed)
                        self.remote_failure = record
                self._stop.wait(INTERVAL)
        except RendezvousGone as e:  # its store silent or gone: the ranks stop now, and what it means is settled
            self.gone = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        if self._looker.is_alive():
            self._looker.join(1.0)


class Rendezvous(Protocol):
    """What one launcher asks of the other nodes of its job, for the whole job (see the module's list)."""

    config: LaunchConfig  # this round's: nnodes and node_rank may change from round to round
    nprocs: int  # ranks per node
    reached: bool  # the backend answered once, this launcher or one of its ranks
    gone: set[int]  # nodes found lost
    me: str  # this launcher, for the others: its host, pid and a random tail
    hosts_round_store: bool  # each round's first node hosts its store (else node 0's serves every round)
    clock: Clock  # what the waits read and sleep on: the machine's (core/stores/clock.py), or a test's

    @property
    def interval(self) -> float: ...  # seconds between two looks of a launcher that waits for the others

    def join(self, attempt: int) -> Round: ...
    # where the round's store listens: ``host(address)`` starts one there, when this node is to host it, its port;
    # ``script``: the ranks make their own env:// group, and a restarted round needs a store no dead rank wrote
    def round_store(self, attempt: int, host: Callable[[str], int], script: bool = False) -> RoundStore: ...
    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> RoundWatch: ...
    def move(self, attempt: int, state: NodeState) -> None: ...  # this node's record (rules.move says if it may)
    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord: ...  # the record that stands
    def until_heard(self, attempt: int) -> None: ...  # the others have the record (RendezvousGone: gone before)
    def view(self, attempt: int) -> RoundView: ...
    def lost(self, attempt: int, since: float) -> Lost | None: ...  # ``since``: when this node began to wait
    def last_word(self, attempt: int) -> FailureRecord | None: ...  # the backend gone: node 0's word, or the store's
    # node 0, whose store serves every round (RoundStore.serves_every_round), its store server lost: ``record`` on the
    # fresh one the launcher started on its port, and the wait until the others read it
    def say_last_word(self, attempt: int, record: FailureRecord) -> None: ...
    def last_word_heard(self) -> None: ...
    def leave(self) -> None: ...


def stopped(link: Rendezvous, attempt: int, cause: BaseException) -> None:
    """This launcher was stopped (Ctrl-C, SIGTERM, ...) while its ranks ran: the round's failure, if first."""
    node = link.config.node
    ranks = [s.rank for s in rank_math.layout(link.config.nnodes, link.nprocs) if s.node_rank == node]
    signum = cause.signum if isinstance(cause, Terminated) else None
    code = 130 if isinstance(cause, KeyboardInterrupt) else 128 + signum if isinstance(signum, int) else 1
    how = "interrupted (SIGINT)" if isinstance(cause, KeyboardInterrupt) else (
        f"stopped by {signal.Signals(signum).name}" if isinstance(signum, int) else f"stopped ({type(cause).__name__})")
    line = f"mpddp: node {node}'s launcher was {how} while its ranks ran, taking rank(s) {names(ranks)} with it"
    with contextlib.suppress(RendezvousGone):
        link.publish(attempt, FailureRecord(ranks[0], node, 0, Outcome.STOPPED, code, line, time.time()))


def went_away(config: LaunchConfig, nprocs: int, lost: Lost) -> FailureRecord:
    """The round's record when nodes were found lost (their launcher killed or stopped, their machine crashed, cut
    off or frozen): the same line on every node, whoever found them."""
    ranks = [s.rank for s in rank_math.layout(config.nnodes, nprocs) if s.node_rank in lost.nodes]
    how = ("stopped beating without ending its round" if lost.beat else
           f"never beat in this round within --timeout {config.timeout:g} s, nor ended it")
    line = (f"mpddp: node(s) {names(lost.nodes)} went away (the launcher {how}: killed, preempted or its machine "
            f"lost), taking rank(s) {names(ranks)}")
    return FailureRecord(ranks[0], lost.nodes[0], 0, Outcome.DIED, 1, line, time.time())


def is_lost_node(record: FailureRecord) -> bool:
    """The record says its node went away, found by another node (:func:`went_away`): its ranks' own death is told
    by the node itself."""
    return record.outcome is Outcome.DIED and record.writer not in (-1, record.node_rank)


def resized_record(newcomer: str, nnodes: int) -> FailureRecord:
    """The round's record when a node arrives while the job runs below ``MAX``: every node restarts to admit it,
    and that restart is not counted against --max-restarts (torchrun's rule)."""
    line = (f"mpddp: a node arrived ({newcomer}) while the job ran on {nnodes} node(s): the group restarts to "
            "admit it (not counted against --max-restarts)")
    return FailureRecord(-1, -1, 0, Outcome.RESIZED, 0, line, time.time())


def names(items: list[int]) -> str:
    """``0, 2, 3``: nodes or ranks in a line; a run of three or more as a range (``1-99999``), so that a line
    that names the nodes of --nnodes 100000 stays one line."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive items
    for item in items:
        if runs and item == runs[-1][1] + 1:
            runs[-1][1] = item
        else:
            runs.append([item, item])
    return ", ".join(f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1))) for a, b in runs)
