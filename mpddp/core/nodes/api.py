"""The seam between the launcher and what the nodes of a job agree on: one interface, a backend behind it.

Owns: :class:`Rendezvous`, what a launcher asks of the other nodes of its
job, whichever backend keeps it (today ``c10d``: node 0's TCPStore,
core/nodes/c10d.py), and :class:`RoundWatch`, the beat of one round seen
from the attempt; the error a backend raises when it stops answering
(:class:`RendezvousGone`) and the beat's timing; core/nodes/backends.py
picks a backend by name. What crosses the seam is plain values and
:class:`~mpddp.core.wire.protocol.FailureRecord`. Above core/nodes/ nothing
names a backend: the launcher and the settlement (core/nodes/settle.py) use
this module only, and a test keeps it so.

The interface, by what it is for:

* a round: :meth:`~Rendezvous.join` it (every node's launcher is there; its
  :class:`Round` says who), where its store listens and what its loss means
  (:meth:`~Rendezvous.round_store`, a :class:`RoundStore`: node 0's for the
  whole job, or one per round that its first node hosts), its store for
  env:// scripts (:meth:`~Rendezvous.set_script_port`,
  :meth:`~Rendezvous.script_port`), :meth:`~Rendezvous.watch` it (the beat),
  :meth:`~Rendezvous.end_round`, and :meth:`~Rendezvous.finish` it when this
  node's ranks all returned (wait for the others);
* its first failure: :meth:`~Rendezvous.publish` (the first writer wins),
  :meth:`~Rendezvous.record`, :meth:`~Rendezvous.stopped` (this launcher was);
* liveness, for a node that waits for that record: the beats
  (:meth:`~Rendezvous.heartbeats`, :meth:`~Rendezvous.stalled`,
  :meth:`~Rendezvous.silent`), who still works (:meth:`~Rendezvous.busy`),
  who waits too (:meth:`~Rendezvous.mark_waiting`, :meth:`~Rendezvous.waiting`),
  whose ranks returned (:meth:`~Rendezvous.returned`), which nodes never
  arrived (:meth:`~Rendezvous.never_arrived`), and what to say when the backend
  itself is gone (:meth:`~Rendezvous.gone_error`);
* :meth:`~Rendezvous.pause` between two looks (longer the more nodes look), and
  :meth:`~Rendezvous.leave` the job.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ... import rank_math
from ...config import LaunchConfig
from ...errors import NeverArrived, Outcome, RendezvousError, StoreLost, WorkerFailed
from ..wire.protocol import FailureRecord

INTERVAL = 0.25  # seconds between two beats (and two looks for another node's failure)
STALLED_AFTER = 6 * INTERVAL  # a beat that did not move for this long, while others moved: its launcher is gone
POLL = 0.05  # seconds between two looks of a launcher that waits for the other nodes


class NotNeeded(Exception):  # noqa: N818 - not an error: the job ended well without this node
    """This launcher waited as a spare (the job had ``MAX`` nodes), and the job ended without needing it."""


class RendezvousGone(StoreLost):
    """The backend does not answer (node 0's store: its launcher or store server is gone)."""


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
        """The round's nodes and their ranks, old -> new: ``node 1 -> 0: ranks 2, 3 -> 0, 1``, ``a new node -> 1: ...``."""
        lines = []
        for new, old in enumerate(self.old):
            ranks = names([rank_math.global_rank(new, i, nprocs) for i in range(nprocs)])
            if old is None:
                lines.append(f"  a new node -> {new}: ranks {ranks}")
            else:
                before = names([rank_math.global_rank(old, i, nprocs) for i in range(nprocs)])
                lines.append(f"  node {old} -> {new}: ranks {before} -> {ranks}")
        return lines


@dataclass(frozen=True)
class RoundStore:
    """Where a round's process-group store listens, as the backend placed it, and what its loss means: what the
    launcher asks instead of which backend runs (core/launcher/job.py)."""

    host: str
    port: int
    lost: str | None = None  # one store serves every round (node 0's): why its loss ends the job, in words.
    # None: each round has its own, hosted by its first node, and the next round's replaces a lost one

    @property
    def serves_every_round(self) -> bool:
        """The same store serves every round of the job."""
        return self.lost is not None


class RoundWatch(Protocol):
    """One round's beat, as the attempt and its watchdog see it."""

    remote_progress: int  # moves when a rank of another node made progress
    remote_failure: FailureRecord | None  # the round's first failure, once another node wrote it

    def progressed(self) -> None: ...
    def others_calls(self) -> list[bytes]: ...
    def share_now(self) -> None: ...
    def stop(self) -> None: ...


class BeatThread:
    """What every backend's round watch shares: the two values the attempt reads, the flag the watchdog sets,
    and the daemon thread that runs the backend's ``_run`` until :meth:`stop`."""

    def __init__(self, attempt: int, share: Callable[[bool], bytes | None] | None) -> None:
        self.attempt = attempt
        self.share = share  # this node's ranks' collectives when they moved (core/launcher/board.py's snapshot)
        self.remote_progress = 0  # the other nodes' progress, as last read
        self.remote_failure: FailureRecord | None = None  # the round's first failure, once another node wrote it
        self._progress = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpddp-round-watch", daemon=True)

    def progressed(self) -> None:
        self._progress.set()

    def share_now(self) -> None:
        """This node's ranks' collectives into the store now, whole, from the caller's thread: before a node
        says it waits for the round's record, so that a node that tells a hang once it waits reads them as
        they ended, not as a starved beat last shared them."""
        if self.share is not None and (snapshot := self.share(True)) is not None:
            try:
                self._put_calls(snapshot)
            except RendezvousGone:  # the store is gone: what that means is settled after
                return

    def _put_calls(self, snapshot: bytes) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


class Rendezvous(Protocol):
    """What one launcher asks of the other nodes of its job, for the whole job (see the module's list)."""

    config: LaunchConfig  # this round's: nnodes and node_rank may change from round to round
    nprocs: int  # ranks per node
    reached: bool  # the backend answered once, this launcher or one of its ranks
    gone: set[int]  # nodes found lost
    me: str  # this launcher, for the others: its host, pid and a random tail

    def join(self, attempt: int) -> Round: ...
    # where the round's store listens: ``host(address)`` starts one there, when this node is to host it, its port
    def round_store(self, attempt: int, host: Callable[[str], int]) -> RoundStore: ...
    def set_script_port(self, attempt: int, port: int) -> None: ...
    def script_port(self, attempt: int) -> int: ...
    def watch(self, attempt: int, share: Callable[[bool], bytes | None] | None = None) -> RoundWatch: ...
    def end_round(self, attempt: int) -> None: ...
    def finish(self, attempt: int) -> FailureRecord | None: ...
    def publish(self, attempt: int, record: FailureRecord) -> FailureRecord: ...
    def record(self, attempt: int) -> FailureRecord | None: ...
    def stopped(self, attempt: int, cause: BaseException) -> None: ...
    def heartbeats(self, attempt: int) -> dict[int, int]: ...
    def stalled(self, attempt: int, before: dict[int, int]) -> list[int] | None: ...
    def silent(self, attempt: int) -> list[int]: ...
    def busy(self, attempt: int) -> bool: ...  # another node still runs the round
    def mark_waiting(self, attempt: int) -> None: ...
    def waiting(self, attempt: int, nodes: set[int]) -> bool: ...
    def returned(self, attempt: int) -> dict[int, float]: ...
    def never_arrived(self, attempt: int) -> NeverArrived | None: ...
    def gone_line(self) -> str: ...  # the backend does not answer: why, in words
    def gone_error(self, local: WorkerFailed) -> RendezvousError: ...
    def last_word(self, attempt: int) -> FailureRecord | None: ...  # node 0's, its store lost
    def until_read(self, attempt: int) -> None: ...  # node 0, stopped itself: the others read why
    def pause(self, attempt: int) -> None: ...  # until the round's keys change, or a moment (POLL and more)
    def leave(self) -> None: ...


def stopped_record(config: LaunchConfig, nprocs: int, cause: BaseException) -> FailureRecord:
    """The round's failure when this launcher was stopped (Ctrl-C, SIGTERM, ...) while its ranks ran."""
    node = config.node
    ranks = [s.rank for s in rank_math.layout(config.nnodes, nprocs) if s.node_rank == node]
    signum = getattr(cause, "signum", None)  # the CLI's Terminated carries the signal
    code = 130 if isinstance(cause, KeyboardInterrupt) else 128 + signum if isinstance(signum, int) else 1
    how = "interrupted (SIGINT)" if isinstance(cause, KeyboardInterrupt) else (
        f"stopped by {signal.Signals(signum).name}" if isinstance(signum, int) else f"stopped ({type(cause).__name__})")
    line = f"mpddp: node {node}'s launcher was {how} while its ranks ran, taking rank(s) {names(ranks)} with it"
    return FailureRecord(ranks[0], node, 0, Outcome.STOPPED, code, line, time.time())


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
    parts = [f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1))) for a, b in runs]
    return ", ".join(parts)
