"""One attempt of one node's worker group: start, watch, stop.

Owns: one attempt of this node (:class:`Attempt`: start, watch, stop,
report), and in it starting the ranks (each with a message channel, two output
pipes and a pipe for stack dumps), the watch loop that drains typed
messages while waiting (reading only after join deadlocks past the 64 KiB
pipe buffer), notices a store keeper that died or another node's failure
(on several nodes) and asks the watchdog each turn, SIGUSR1's "where is
every rank", noting where each rank was before it is stopped, the teardown
that always runs, and loading the ranks' return values. Leaves the job's
store and the restart loop to core/launcher/job.py, the plan to core/launcher/plan.py, hangs
to core/launcher/watchdog.py, stacks to core/wire/stacks.py, the report to
core/launcher/report.py, which node's failure came first to core/nodes/rounds.py, killing
to core/procs/teardown.py, lines to core/launcher/output.py and reading the ranks' ``@record``
error files (in a directory of this attempt's, removed when it ends) to
core/wire/errorfile.py.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import util
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import psutil

from ...config import LaunchConfig
from ...context import WorkerContext
from ...errors import MainGuardError, Outcome, RendezvousError, StoreLost, WorkerFailed
from ...log import logger
from ...ranks import banner
from ..nodes import rounds
from ..nodes.rounds import NodeLink, RoundWatch
from ..nodes.store_server import StoreServer
from ..procs import teardown
from ..procs.start import forkserver_pid, start_process
from ..rank import boot
from ..wire import errorfile, protocol, stacks
from . import board, stragglers
from .board import Board, Mismatch
from .classify import Hang, RankState, Verdict, classify, root_cause
from .output import Relay
from .plan import Plan, node_env, rank_env
from .report import early_exit_line, failure_error, hang_error, mismatch_error, remote_error
from .watchdog import Watchdog

_FAILURE_WINDOW = 0.3  # seconds to collect other ranks' reports after the first failure
_TEARDOWN_GRACE = 0.5
_NO_STATUS = 255  # the exit code multiprocessing gives a forkserver child whose status never came


# The ranks and keepers of every launch running in this process: launches may run in several threads at
# once, and all share one forkserver, whose children are either such processes or orphans it adopted.
LIVE_LOCK = threading.Lock()
LIVE: set[int] = set()


@dataclass
class Job:
    """What every attempt of one launch shares, built once."""

    plan: Plan
    mp_context: Any
    payload: bytes  # cloudpickle of (fn, args, kwargs, notebook cells' lines)
    init_group: bool  # False: fn (or the script) calls init_process_group itself
    port: int  # node 0's store, for the whole job
    store: StoreServer | None = None  # node 0 only
    # A script that calls init_process_group("env://") itself (init_group False) uses MASTER_PORT's store with no
    # prefix of its own: from the second round on it gets a fresh store of the round's (core/launcher/job.py).
    script_port: int | None = None
    script_store: StoreServer | None = None  # node 0 only
    link: NodeLink | None = None  # several nodes only: this launcher's client of the store
    lags: stragglers.Stragglers = field(default_factory=stragglers.Stragglers)  # arrivals at collectives, job-wide

    @property
    def config(self) -> LaunchConfig:
        return self.plan.config


def _pipe() -> tuple[int, Connection]:
    """A pipe: the parent's raw read end, the worker's write end."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


@dataclass
class _Channels:
    """One rank's four pipes: typed messages (core/wire/protocol.py), stdout, stderr and stack dumps."""

    messages: tuple[Connection, Connection]
    out: tuple[int, Connection]
    err: tuple[int, Connection]
    stack: tuple[int, Connection]

    @property
    def worker_ends(self) -> tuple[Connection, ...]:
        return self.messages[1], self.out[1], self.err[1], self.stack[1]

    @property
    def fds(self) -> set[int]:
        return {self.messages[0].fileno(), self.out[0], self.err[0], self.stack[0]} | {
            c.fileno() for c in self.worker_ends}


def _start(job: Job, attempt: int, relay: Relay, states: list[RankState], error_dir: str) -> None:
    """Start every rank, adding each to ``states`` at once: a Ctrl-C between two starts
    must still find the ones already running (the caller tears ``states`` down)."""
    plan, mp_context, config, port = job.plan, job.mp_context, job.config, job.port
    shared_env = node_env(plan, job.script_port or port, attempt)
    channels = [_Channels(mp_context.Pipe(duplex=False), _pipe(), _pipe(), _pipe()) for _ in plan.slots]
    all_fds = set().union(*(c.fds for c in channels))
    for slot, ch in zip(plan.slots, channels):
        ctx = WorkerContext.at(slot, nnodes=config.nnodes, backend=plan.backend, restart=attempt,
                               verbose=config.verbose)
        spec = protocol.WorkerSpec(
            ctx=ctx, store_addr=config.master_addr, store_port=port, store_prefix=protocol.attempt_prefix(attempt),
            timeout=config.timeout, env=rank_env(shared_env, slot, error_dir), threads=plan.threads,
            payload=job.payload, banner=banner(ctx) if config.verbose else None, init_group=job.init_group,
            # a forked child inherits every pipe: it must close the ends that are not its own
            close_fds=tuple(sorted(all_fds - {c.fileno() for c in ch.worker_ends}))
            if config.start_method == "fork" else (),
        )
        process = mp_context.Process(target=boot.rank_process, args=(spec, *ch.worker_ends), name=f"mpddp-rank-{slot.rank}")
        with LIVE_LOCK, boot.main_hidden(always=False):
            start_process(process)
            LIVE.add(process.pid)
        os.set_blocking(ch.stack[0], False)
        states.append(RankState(slot=slot, process=process, messages=ch.messages[0], stack_fd=ch.stack[0],
                                pid=process.pid))
        relay.add(slot.rank, ch.out[0], ch.err[0])
    for ch in channels:
        for conn in ch.worker_ends:
            conn.close()  # the parent keeps only read ends: EOF when a worker is gone


def _receive(state: RankState, board: Board) -> None:
    """Read every message waiting on this rank's channel (results can be large)."""
    conn: Connection | None = state.messages
    while conn is not None and not conn.closed:
        try:
            if not conn.poll():
                return
            message = protocol.decode(conn.recv_bytes())
        except (EOFError, OSError):
            conn.close()
            return
        if isinstance(message, protocol.Started):
            state.started, state.main_thread = True, message.main_thread
        elif isinstance(message, protocol.Joined):
            state.joined = True
        elif isinstance(message, protocol.Collectives):
            board.add(state.slot.rank, message)
        elif isinstance(message, protocol.Left):
            state.left = message
        elif isinstance(message, protocol.Result):
            state.payload, state.has_result, state.finished_at = message.payload, True, message.time
        else:
            state.failure, state.failed_at = message, message.time


def _watch(states: list[RankState], watchdog: Watchdog, lags: stragglers.Stragglers, store: StoreServer | None = None,
           round_watch: RoundWatch | None = None) -> Hang | Mismatch | None:
    """Wait until every rank succeeded, a failure window has closed, the store's keeper is gone,
    another node wrote the round's first failure, the watchdog found a hang, or two ranks called
    different collectives at the same number."""
    board = watchdog.board
    assert board is not None
    first_failure: float | None = None
    while True:
        waitables: list[Any] = [s.messages for s in states if not s.messages.closed]
        waitables += [s.process.sentinel for s in states if s.exitcode is None]
        if store is not None:
            waitables.append(store.process.sentinel)
        ready = wait(waitables, timeout=0.2) if waitables else []
        for s in states:
            if s.messages in ready or s.process.sentinel in ready or s.exitcode is None:
                _receive(s, board)
            if s.exitcode is None and s.process.sentinel in ready:
                s.process.join(0)
                s.exitcode = s.process.exitcode
                _receive(s, board)
                if s.exitcode is not None and s.failed_at is None and (s.exitcode != 0 or not s.has_result):
                    s.failed_at = time.monotonic()
        now = time.monotonic()
        if first_failure is None and any(s.failed_at is not None for s in states):
            first_failure = now
        if all(s.succeeded for s in states):
            return None
        if store is not None and store.lost:
            return None  # the ranks' errors, if any yet, are its consequences
        if first_failure is None and round_watch is not None and round_watch.remote_failure is not None:
            return None  # another node's rank failed first: ours stop now
        if first_failure is not None and (now - first_failure > _FAILURE_WINDOW or all(
                s.exitcode is not None for s in states)):
            return None
        if first_failure is None and (mismatch := board.found(now)) is not None:
            return mismatch  # a bug in the program, whatever happens next: told now
        if stacks.ASKED.is_set():  # SIGUSR1 (core/wire/stacks.py)
            stacks.ASKED.clear()
            _show_where(states, watchdog)
        lags.add(board.take())
        lags.check(lambda rank: _sample(states, watchdog, rank))
        if first_failure is None and (hang := watchdog.check(states, now)) is not None:
            return hang.mismatch or hang  # ranks of different nodes that called different collectives: a bug


def _show_where(states: list[RankState], watchdog: Watchdog) -> None:
    """SIGUSR1: every rank's place, grouped, on stderr; the job goes on."""
    running = [s for s in states if s.exitcode is None]
    locations = watchdog.where(running)
    rows = board.standing_rows(list(watchdog.standings(states)), time.time_ns())
    rows += stacks.grouped(locations, finished=[s.slot.rank for s in states if s.succeeded])
    logger.warning("mpddp: where every rank is (SIGUSR1; the job goes on):\n%s", "\n".join(f"  {r}" for r in rows))
    for s in running:
        if (where := locations.get(s.slot.rank)) is not None:
            s.location = where


def _sample(states: list[RankState], watchdog: Watchdog, rank: int) -> list[str]:
    """Where a straggler is while the others wait: its place in each of a few samples of every rank's stack taken
    while another rank waited in torch.distributed (samples where none waited are dropped); its own waits are ""."""
    running = [s for s in states if s.exitcode is None]
    if not any(s.slot.rank == rank for s in running):
        return []
    locations = []
    for _ in range(2 * stragglers.SAMPLES):
        seen = watchdog.where(running)
        if any(p is not None and p.waiting for r, p in seen.items() if r != rank):
            here = seen.get(rank)
            locations.append(here.text if here is not None and not here.waiting else "")
            if len(locations) == stragglers.SAMPLES:
                break
        time.sleep(0.03)
    return locations


def _teardown(states: list[RankState], urgent: threading.Event | None = None) -> None:
    # A rank the forkserver has not reported yet may have died on its own already (a zombie, or gone: under
    # load the forkserver writes its status late): that one was not stopped by mpddp, it died.
    alive = [s for s in states if s.exitcode is None and s.process.is_alive() and teardown.alive(s.process.pid)]
    for s in alive:
        s.stopped = True
    pids = [s.process.pid for s in states if s.process.pid]
    teardown.kill_tree([s.process.pid for s in alive], _TEARDOWN_GRACE, groups=pids, urgent=urgent)
    with LIVE_LOCK:
        LIVE.difference_update(pids)
        _sweep_orphans()
    for s in states:
        s.process.join(2.0)
        if s.exitcode is None:
            s.exitcode = s.process.exitcode
            if not s.stopped and s.exitcode not in (0, None) and s.failed_at is None:
                s.failed_at = time.monotonic()  # it ended by itself after the watch: its own message may follow
        if s.stack_fd is not None:
            os.close(s.stack_fd)
            s.stack_fd = None


def _release(state: RankState) -> None:
    """Close a rank's channel and process object now, not when the garbage collector gets to them: a failed
    launch's exception holds the states, and a notebook would keep their file descriptors per failed cell."""
    state.messages.close()
    try:
        state.process.close()
    except ValueError:  # still running (the teardown could not stop it): the guardian's to reap
        pass


def _sweep_orphans() -> None:
    """Stop what the forkserver adopted that is no running rank: a dead rank's children (call under LIVE_LOCK).

    A rank killed by a signal cannot take its children along (core/rank/worker.py
    does on any other exit); one started with ``start_new_session=True`` is in
    no process group the teardown stops, and is re-parented to the forkserver.
    """
    server = forkserver_pid()
    if server is None:
        return
    try:
        orphans = [p.pid for p in psutil.Process(server).children() if p.pid not in LIVE]
    except psutil.Error:
        return
    if orphans:
        teardown.kill_tree(orphans, grace=0.2)


def _forkserver_gone() -> int | None:
    """The pid of a forkserver that was killed from outside (every rank and the keeper go with it), or None."""
    server = forkserver_pid()
    return server if server is not None and not teardown.alive(server) else None


def _forkserver_lost(states: list[RankState]) -> None:
    """Ranks that ended with the forkserver's "no status" code while it is gone were lost with it."""
    server = _forkserver_gone()
    if server is None:
        return
    for s in states:
        if s.exitcode == _NO_STATUS and s.failure is None:
            s.lost_with = server


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
            with teardown.shielded() as urgent:  # a second Ctrl-C must not leave the ranks running
                this.stop(urgent)
        return this.report()
    finally:
        this.close(stopped_by)


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
        self.failed_here = False  # a local rank failed or hung (else another node's failure stopped ours)

    def start(self) -> None:
        _start(self.job, self.number, self.relay, self.states, self.error_dir.name)
        self.relay.start()
        if self.job.link is not None:
            self.round_watch = RoundWatch(self.job.link, self.number, self.board.snapshot)

    def watch(self) -> None:
        store = self.job.store
        watchdog = Watchdog(self.job.config.timeout, self.round_watch, self.board, lambda: self.relay.received)
        stall = _watch(self.states, watchdog, self.job.lags, store, self.round_watch)
        self.hang = stall if isinstance(stall, Hang) else None
        self.mismatch = stall if isinstance(stall, Mismatch) else None
        self.failed_here = stall is not None or any(s.failed for s in self.states)
        if not all(s.succeeded for s in self.states) and not (store is not None and store.lost):
            _locate(self.states, watchdog, self.hang)

    def stop(self, urgent: threading.Event) -> None:
        _teardown(self.states, urgent)
        for s in self.states:  # what a rank said before it ended, also after the watch: its own failure
            if s.failure is None and not s.has_result:
                _receive(s, self.board)
            _release(s)
        self.relay.stop()
        for s in self.states:  # every rank is gone: its file is complete, or was never written
            s.error_file = errorfile.read(errorfile.path(self.error_dir.name, s.slot.rank))
        self.error_dir.cleanup()

    def report(self) -> list[Any]:
        """Every rank's value, or the error this node reports (the same first failure on every node)."""
        states, store, job = self.states, self.job.store, self.job
        if any(s.exitcode == protocol.MAIN_GUARD_EXIT and not s.started for s in states):
            raise MainGuardError(_MAIN_GUARD_MESSAGE)
        # a keeper lost with the forkserver is not the cause: the ranks' report names the forkserver
        lost = store is not None and store.lost and _forkserver_gone() is None
        stalled = store.stalled() if store is not None and not all(s.succeeded for s in states) else None
        if stalled is not None:  # a keeper that does not answer explains whatever the ranks did
            raise StoreLost(store.stall(stalled))  # type: ignore[union-attr]
        verdict = classify(states, self.hang, self.mismatch)
        error = _report(states, verdict, self.hang, self.mismatch, self.relay) if self.failed_here and not lost else None
        remote = self.round_watch is not None and self.round_watch.remote_failure is not None and not all(
            s.succeeded for s in states)
        settled = _settle(job, self.number, states, verdict, error, self.round_watch) if job.link and (
            error or remote) else error
        if lost:
            raise StoreLost(store.loss())  # type: ignore[union-attr]
        if settled is not None:
            raise settled
        if job.link is not None and (record := job.link.finish(self.number)) is not None:
            for s in states:  # our ranks ended, the round did not: one of them may be the one named
                s.tail = self.relay.tail(s.slot.rank)
            raise remote_error(record, states, verdict, job.config.node_rank)
        return [_value(s) for s in states]

    def close(self, stopped_by: BaseException | None = None) -> None:
        """The round is over for this node: its beat stops now, and the other nodes read that as no loss.

        ``stopped_by``: what stopped this launcher itself (Ctrl-C, a signal), written as the round's
        failure first, so that the other nodes name it instead of their own ranks' broken collectives.
        """
        link = self.job.link
        if self.round_watch is None or link is None:
            return
        if stopped_by is not None:
            link.stopped(self.number, stopped_by)
        link.end_round(self.number)
        self.round_watch.stop()


def _report(states: list[RankState], verdict: Verdict, hang: Hang | None, mismatch: Mismatch | None,
            relay: Relay) -> WorkerFailed:
    """This node's own report of the failure: the root cause, with each rank's last lines and stacks."""
    _forkserver_lost(states)
    for s in states:
        s.tail = relay.tail(s.slot.rank)
        if s.location is not None:
            relay.note(s.slot.rank, f"mpddp: rank {s.slot.rank}'s stacks when it was stopped:\n{s.location.dump}")
    if mismatch is not None:
        return mismatch_error(states, verdict, mismatch)
    if hang is not None:
        return hang_error(states, verdict, hang)
    return failure_error(states, verdict)


def _settle(job: Job, attempt: int, states: list[RankState], verdict: Verdict, local: WorkerFailed | None,
            round_watch: RoundWatch | None) -> WorkerFailed | RendezvousError:
    """Several nodes: the same first failure on every node (core/nodes/rounds.py), whichever node it happened on.

    What this node's own failure was comes from its ranks' outcomes (the first by the cause order), not from
    the report's type: "rank 3 made no progress while rank 2 timed out in a collective" is still a collective
    error here, which a peer on another node may have caused.
    """
    link = job.link
    assert link is not None
    cause = None
    if local is not None:
        cause = {"hang": Outcome.HUNG, "mismatch": Outcome.MISMATCH}.get(verdict.case) or \
            verdict[root_cause(states, verdict).slot.rank]
    remote = round_watch.remote_failure if round_watch is not None and local is None else None
    node = job.config.node_rank
    link.reached |= any(s.joined for s in states)  # our ranks got through the store: it was up
    # a hang or a mismatch of other nodes' ranks only, seen through their shared collectives: their node tells
    # it better
    culprits = frozenset(verdict.culprits) if verdict.case in ("hang", "mismatch") else frozenset()
    blame = rounds.Blame(culprits if not culprits & {s.slot.rank for s in states} else frozenset(),
                         early_exit=lambda rank: early_exit_line(states, verdict, rank))
    return rounds.settle(link, attempt, local, cause, remote,
                         remote_error=lambda record: remote_error(record, states, verdict, node),
                         missing=lambda: rounds.missing_ranks(link, attempt) if job.store and job.init_group else [],
                         blame=blame)


def _locate(states: list[RankState], watchdog: Watchdog, hang: Hang | None) -> None:
    """Before the teardown: where each rank that is about to be stopped is, for the report."""
    if hang is not None:
        for s in states:
            s.location = hang.locations.get(s.slot.rank)
        return
    by_rank = {s.slot.rank: s for s in states}
    for rank, where in watchdog.where([s for s in states if s.exitcode is None and s.process.is_alive()]).items():
        by_rank[rank].location = where


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
