"""One attempt of one node's ranks, in four steps: start, watch, stop (always), report.

Owns: :class:`Attempt` and :func:`run_group`, which runs its steps in order
and always stops the ranks, whatever happened (a second Ctrl-C included);
the report step: this node's own report of a failure, the settlement of a
round of several nodes, and loading the ranks' return values. Each step's
work is elsewhere: starting to core/launcher/channels.py, watching to
core/launcher/watch.py, stopping to core/launcher/stop.py, deciding the verdict to
core/launcher/classify.py, its words to core/launcher/report.py and what several nodes
report to core/nodes/settle.py. The ranks' ``@record`` error files lie in a
directory of the attempt's, removed when it ends (core/wire/errorfile.py).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import util
from typing import Any

import cloudpickle

from ...errors import ConfigError, MainGuardError, Outcome, RendezvousError, RendezvousGone, StoreLost, WorkerFailed
from ...shutdown_options import signal_numbers
from ..nodes import settle
from ..nodes.api import RoundWatch, stopped
from ..nodes.rules import NodeState
from ..procs import teardown
from ..wire import errorfile, protocol, signals
from ..wire.protocol import ERROR_LINE, FailureRecord
from . import board, stragglers
from .board import Board, Mismatch
from .channels import receive, start_ranks
from .classify import Hang, RankState, Verdict, classify, node_cause
from .job_state import Job
from .output import Relay
from .report import early_exit_line, failure_error, hang_error, mismatch_error, remote_error
from .stop import forkserver_gone, forkserver_lost, release, stop_ranks
from .watch import locate, watch
from .watchdog import Watchdog


def run_group(job: Job, attempt: int) -> list[Any]:
    """Start this node's ranks for round ``attempt``, watch them, and stop them all, whatever happens."""
    this = Attempt(job, attempt)
    stopped_by: BaseException | None = None
    try:
        try:
            this.start()
            this.watch()
        except BaseException as e:  # Ctrl-C, SIGTERM: this launcher stops, and the other nodes must hear why
            stopped_by = e
            raise
        finally:
            passed = signal_numbers(job.config.signals_to_handle)
            with teardown.shielded(passed) as urgent:  # a second Ctrl-C must not leave the ranks running
                if stopped_by is not None:  # first, before the teardown: the others name it, not "node 0 is gone"
                    this.tell_stopped(stopped_by)
                told = signals.told(stopped_by, passed) if stopped_by is not None else None
                this.stop(urgent, None if told is None else (told, job.config.shutdown_timeout or 0.0))
                if stopped_by is not None and job.link is not None and not job.intruder:
                    job.link.move(attempt, NodeState.ENDED)  # node 0's store goes only once the others read why
        return this.report()
    finally:
        this.close()


class Attempt:
    """One round of this node's ranks, in four steps: start, watch, stop (always), report."""

    def __init__(self, job: Job, number: int) -> None:
        self.job, self.number = job, number
        config = job.config
        self.relay = Relay(config.output_ranks, config.log_dir, prefix=not config.no_prefix)
        # inside multiprocessing's temp dir, which the forkserver removes even after a SIGKILL of this process
        self.error_dir = tempfile.TemporaryDirectory(prefix="mpddp-errors-", dir=util.get_temp_dir(),
                                                     ignore_cleanup_errors=True)
        self.states: list[RankState] = []
        self.round_watch: RoundWatch | None = None  # several nodes: the beat, and the other nodes' failure
        self.board = Board(slot.rank for slot in job.plan.slots)  # the ranks' collectives (flight recorder)
        self.hang: Hang | None = None
        self.mismatch: Mismatch | None = None
        self.watchdog: Watchdog | None = None
        self.failed_here = False  # a local rank failed or hung (else another node's failure stopped ours)
        if job.live is not None:
            job.live.show(self)  # a watcher sees this round's ranks from now on

    def start(self) -> None:
        start_ranks(self.job, self.number, self.relay, self.states, self.error_dir.name)
        self.relay.start()
        if self.job.link is not None:
            live = self.job.live  # the board's snapshot, and this node's live rows while someone watches
            self.round_watch = self.job.link.watch(self.number, live.share(self.board) if live else self.board.snapshot)

    def watch(self) -> None:
        store = self.job.store
        watchdog = self.watchdog = Watchdog(self.job.config.timeout, self.round_watch, self.board,
                                            lambda: self.relay.received)
        config = self.job.config  # node 0 of several reads every node's arrivals, for a straggler on any of them
        nodes = (stragglers.AcrossNodes(config.nnodes, self.job.across)
                 if self.round_watch and config.node_rank == 0 < config.nnodes - 1 else None)
        self.job.lags.scope = f"node {config.node_rank}'s ranks" if config.nnodes > 1 else ""
        stall = watch(self.states, watchdog, self.job.lags, store, self.round_watch, nodes)
        if self.round_watch is not None:
            self.round_watch.ranks_done()  # a node lost from now on is the settlement's (or finish's) business
        if self.job.link is not None and any(s.joined for s in self.states):  # its store answered our ranks
            self.job.link.reached = True  # a refusal from now on is its loss, not a node 0 still to come
        if store is not None and store.lost:  # before the teardown: the other nodes hear why soon
            self.job.open_last_word(self.number, store.loss(several=self.job.link is not None))
        self.hang = stall if isinstance(stall, Hang) else None
        self.mismatch = stall if isinstance(stall, Mismatch) else None
        self.failed_here = stall is not None or any(s.failed for s in self.states)
        if self.failed_here and self.round_watch is not None:
            self.round_watch.failing()  # first: no newcomer's admission stands for it while the ranks stop
        if not all(s.succeeded for s in self.states) and not (store is not None and store.lost):
            locate(self.states, watchdog, self.hang)

    def stop(self, urgent: threading.Event, told: tuple[int, float] | None = None) -> None:
        stop_ranks(self.states, urgent, told)
        for s in self.states:  # what a rank said before it ended, also after the watch: its own failure, or
            # (after its result) its collectives' last read, sent as it ends: a rank that no longer waits for gloo's
            # destructor exits right after it, and the watch can see the exit before it reads the message
            if s.failure is None:
                receive(s, self.board)
            release(s)
        self.job.lags.add(self.board.take())
        self.relay.stop()
        for s in self.states:  # every rank is gone: its file is complete, or was never written
            s.error_file = errorfile.read(errorfile.path(self.error_dir.name, s.slot.rank))
        self.error_dir.cleanup()

    def report(self) -> list[Any]:
        """Every rank's value, or the error this node reports (the same first failure on every node)."""
        states, store, job = self.states, self.job.store, self.job
        if any(s.exitcode == protocol.MAIN_GUARD_EXIT and not s.started for s in states):
            raise MainGuardError(_MAIN_GUARD_MESSAGE)
        self._refused()
        # a store server lost with the forkserver is not the cause: the ranks' report names the forkserver
        lost = store is not None and store.lost and forkserver_gone(job.forkserver) is None
        stalled = store.stalled() if store is not None and not all(s.succeeded for s in states) else None
        if stalled is not None:  # a store server that does not answer explains whatever the ranks did
            raise StoreLost(store.stall(stalled))  # type: ignore[union-attr]
        verdict = classify(states, self.hang, self.mismatch)
        error = _report(states, verdict, self.hang, self.mismatch, self.relay, job.forkserver) \
            if self.failed_here and not lost else None
        remote = self.round_watch is not None and self.round_watch.remote_failure is not None and not all(
            s.succeeded for s in states)
        if (gone := self._gone()) is not None and job.link is not None and error is None and not remote and not lost:
            raise settle.gone_while_running(job.link, self.number, gone, [s.slot.rank for s in states],
                                            lambda record: remote_error(record, states, verdict, job.config.node))
        doubt = _doubt(states, verdict, self.mismatch, job.config.nnodes * job.plan.nprocs)
        settled = _settle(job, self.number, states, verdict, error, self.round_watch, self._again,
                          doubt) if job.link and (error or remote) else error
        if lost:
            raise StoreLost(store.loss(several=job.link is not None))  # type: ignore[union-attr]
        if settled is not None:
            raise settled
        if job.link is not None and (record := settle.finish(job.link, self.number)) is not None:
            for s in states:  # our ranks ended, the round did not: one of them may be the one named
                s.tail = self.relay.tail(s.slot.rank)
            raise remote_error(record, states, verdict, job.config.node)
        return [_value(s) for s in states]

    def _gone(self) -> RendezvousGone | None:
        """The backend stopped answering while this node's ranks ran, and stopped them (not all had returned)."""
        watch = self.round_watch
        if watch is None or watch.gone is None or all(s.succeeded for s in self.states):
            return None
        return watch.gone

    def _refused(self) -> None:
        """Bad input found when the nodes met (core/rank/worker.py's roll call), here or on another node: its one
        line, exit code 2. A taken node rank is this launcher's alone: it leaves the job's keys as they were."""
        job, record = self.job, self.round_watch.remote_failure if self.round_watch is not None else None
        if record is not None and record.outcome is Outcome.REFUSED:
            raise ConfigError(record.line.removeprefix(ERROR_LINE))
        refused = next((s for s in self.states if s.refused is not None), None)
        if refused is None or job.link is None:
            return
        slot, line = refused.slot, refused.refused.line
        if refused.refused.shared:
            job.link.publish(self.number, FailureRecord(slot.rank, slot.node_rank, slot.local_rank, Outcome.REFUSED,
                                                        2, ERROR_LINE + line, time.time()))
        else:
            job.intruder = True
        raise ConfigError(line)

    def _again(self) -> tuple[WorkerFailed, Outcome | None]:
        """This node's report of its hang or mismatch once more, with the other nodes' collectives as they are
        now (core/nodes/settle.py asks, once the nodes of the ranks it named wait: they see nothing better)."""
        assert self.watchdog is not None
        hang, mismatch = self.watchdog.again(self.states, self.hang, self.mismatch)
        verdict = classify(self.states, hang, mismatch)
        return (_report(self.states, verdict, hang, mismatch, self.relay, self.job.forkserver, again=True),
                node_cause(self.states, verdict))

    def tell_stopped(self, stopped_by: BaseException) -> None:
        """What stopped this launcher itself (Ctrl-C, a signal), as the round's failure, so that the other nodes
        name it instead of their own ranks' broken collectives. Called shielded from a second Ctrl-C, before
        the teardown: node 0 keeps the store for the others, and a second one soon after ends it (measured:
        written after the teardown, node 1 said "node 0 ... is gone" in 5 of 5 runs)."""
        if self.round_watch is not None and self.job.link is not None and not self.job.intruder:
            stopped(self.job.link, self.number, stopped_by)

    def close(self) -> None:
        """The round is over for this node: its beat stops now, and the other nodes read that as no loss."""
        link = self.job.link
        if self.round_watch is None or link is None:
            return
        if self.job.intruder:  # the node rank is another launcher's: its keys are not this one's to mark
            self.round_watch.stop()
            return
        link.move(self.number, NodeState.ENDED)
        self.round_watch.stop()


def _report(states: list[RankState], verdict: Verdict, hang: Hang | None, mismatch: Mismatch | None,
            relay: Relay, forkserver: int | None, again: bool = False) -> WorkerFailed:
    """This node's own report of the failure: the root cause, with each rank's last lines and stacks (written
    into the ranks' logs once, not ``again``); ``forkserver``: the job's, which may have been lost with them."""
    forkserver_lost(states, forkserver)
    for s in states:
        s.tail = relay.tail(s.slot.rank)
        if s.location is not None and not again:
            relay.note(s.slot.rank, f"mpddp: rank {s.slot.rank}'s stacks when it was stopped:\n{s.location.dump}")
    if mismatch is not None:
        return mismatch_error(states, verdict, mismatch)
    if hang is not None:
        return hang_error(states, verdict, hang)
    return failure_error(states, verdict)


def _settle(job: Job, attempt: int, states: list[RankState], verdict: Verdict, local: WorkerFailed | None,
            round_watch: RoundWatch | None,
            again: Callable[[], tuple[WorkerFailed, Outcome | None]],
            doubt: frozenset[int] = frozenset()) -> WorkerFailed | RendezvousError:
    """Several nodes: the same first failure on every node (core/nodes/settle.py), whichever node it happened on.
    ``doubt``: the ranks a mismatch could not see the call of (another node's), which may outvote its odd one."""
    link = job.link
    assert link is not None
    cause = node_cause(states, verdict) if local is not None else None
    remote = round_watch.remote_failure if round_watch is not None else None
    node = job.config.node
    link.reached |= any(s.joined for s in states)  # our ranks got through the store: it was up
    if round_watch is not None:
        round_watch.share_now()  # our ranks' collectives as they ended, before this node waits or tells
    stop = verdict.case in ("hang", "mismatch")
    blame = settle.Blame.of({*verdict.culprits, *doubt} if stop else (), here=[s.slot.rank for s in states],
                            early_exit=lambda rank: early_exit_line(states, verdict, rank),
                            again=again if stop else None)
    return settle.settle(link, attempt, local, cause, remote,
                         remote_error=lambda record: remote_error(record, states, verdict, node),
                         missing=lambda: link.view(attempt).never_arrived if job.store else None,
                         blame=blame)


def _doubt(states: list[RankState], verdict: Verdict, mismatch: Mismatch | None, world_size: int) -> frozenset[int]:
    """The other nodes' ranks this node's verdict may wrong, for their nodes' word first (several nodes): those a
    mismatch did not see the call of, and all of them when a hang found no rank behind another (this node saw
    only its own ranks wait, the culprit may be anywhere)."""
    if mismatch is not None:
        return board.unseen(mismatch, world_size)
    if verdict.hang is not None and verdict.hang.case == "nowhere":
        return frozenset(range(world_size)) - {s.slot.rank for s in states}
    return frozenset()


def _value(state: RankState) -> Any:
    """A rank's return value, loaded here; a value this process cannot load names its rank."""
    try:
        return cloudpickle.loads(state.payload or b"")
    except Exception as e:
        rank = state.slot.rank
        raise WorkerFailed(
            f"mpddp: rank {rank} returned a value that the launcher cannot load ({type(e).__name__}: {e}): "
            "it was pickled by reference to something only the worker had (a module it imported, a class "
            "defined under `if` in a worker); return plain data (numbers, lists, dicts, tensors) or make that "
            "module importable in the launching process",
            rank, [state.record(Outcome.RAISED)], exit_code=1,
        ) from None


_MAIN_GUARD_MESSAGE = """\
mpddp.launch() ran again inside a worker: your script has no main guard.
Each worker process imports your script; put the launch under the guard:

    if __name__ == "__main__":
        mpddp.launch(train, nprocs=2)
"""
