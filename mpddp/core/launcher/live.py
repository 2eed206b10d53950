"""A live look at a running job, from any node: one row a rank, and a header, built on demand.

Owns: :class:`LiveView`, one a launcher, which builds a :class:`~mpddp.core.launcher.live_snapshot.Snapshot` (its
typed values, and how they are read at the door, are core/launcher/live_snapshot.py's) from what the launcher
already keeps: the attempt's rank states (core/launcher/classify.py), its board of collectives
(core/launcher/board.py), the job's lags (core/launcher/stragglers.py) and the relay's last lines
(core/launcher/output.py); CPU and memory from psutil, GPUs from NVML or nvidia-smi (machine/gpus.py), never CUDA.
Also the whole job's lags over the last minutes, every node's, for the dashboard's chart (:meth:`LiveView.timeline`).

Across nodes, a node's part (its rows, when they were computed, and its ranks' lags) rides its board's snapshot,
which the round's beat already puts on the round's store (node 0's under c10d, the round's own under etcd: no etcd
write). It is computed only while someone watches: the watched launcher says so in the progress counter that every
node's beat already adds to (core/stores/store_beat.py), and while any node is watched
(:data:`~mpddp.core.stores.store_beat.WATCHED_FOR` s after the last ask) each adds its part: its rows at most once a
second, its lags at most every :data:`LAGS_EVERY` s.
Nobody watching, nothing here runs. Leaves the runtime folder and its socket to core/launcher/runtime_dir.py, the
table shown by the launcher itself (``launch(..., live=True)``: a notebook cell, else stderr) to
core/launcher/live_display.py, and the words of the table to core/launcher/live_table.py.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import psutil

from ...config import LaunchConfig
from ...errors import MpddpError
from ...log import logger
from ..nodes.api import Rendezvous, RoundWatch
from ..wire import typed
from . import stragglers
from .board import Board
from .classify import RankState
from .live_snapshot import Header, Part, RankRow, Snapshot, read_part
from .output import Relay
from .plan import Plan
from .stragglers import Stragglers

EVERY = 1.0  # seconds: a node's rows are computed at most this often
LAGS_EVERY = 2.0  # seconds: its ranks' lags over the last minutes (the dashboard's chart), at most this often


class JobFacts(Protocol):
    """What the live view reads of the job (core/launcher/job_state.py's Job), as it changes round to round."""

    plan: Plan
    port: int
    restarts: int
    lags: Stragglers
    across: Stragglers  # node 0 of several: each node's last arrival lined up (stragglers.AcrossNodes); else empty
    link: Rendezvous | None

    @property
    def config(self) -> LaunchConfig: ...


class Shown(Protocol):
    """What the live view reads of the attempt that runs now (core/launcher/attempt.py's Attempt)."""

    number: int
    states: list[RankState]
    board: Board
    relay: Relay
    round_watch: RoundWatch | None


class LiveView:
    """One launcher's live view of its job: its own rows on demand, the other nodes' from their snapshots."""

    def __init__(self, job: JobFacts) -> None:
        self.job = job
        self.shown: Shown | None = None  # the attempt that runs now
        self.started = time.monotonic()
        self.failure: str | None = None
        self.max_nnodes = job.config.nnodes  # as launched: an elastic job's MAX (each round's plan has its size)
        self.job_id = job_id(job)
        self._lock = threading.Lock()
        self._procs: dict[int, psutil.Process] = {}
        self._counts: dict[int, tuple[float, int]] = {}  # rank -> (when, collectives) at the last look
        self._rows: tuple[float, list[RankRow]] = (float("-inf"), [])
        self._others: tuple[float, list[Part]] = (float("-inf"), [])
        self._spares: tuple[float, int | None] = (float("-inf"), None)
        self._lags: tuple[float, tuple[dict[str, Any], ...]] = (float("-inf"), ())  # (wall clock, timelines)

    def show(self, shown: Shown | None) -> None:
        self.shown = shown

    def failed(self, line: str) -> None:
        """The job's first failure (a round that failed, restarted or not): kept for the header."""
        self.failure = self.failure or line.removeprefix("mpddp: ")  # the header says whose line it is

    def share(self, board: Board) -> Callable[[bool], bytes | None]:
        """The round watch's ``share``: the board's snapshot, and while someone watches the job this node's part
        beside it (:class:`~mpddp.core.launcher.live_snapshot.Part`), in every snapshot (a snapshot without it would
        hide it until the next), computed at most once a second; whole then, so that a node whose ranks wait in a
        collective still tells its rows."""
        last: list[Any] = [float("-inf"), None]

        def share(whole: bool) -> bytes | None:
            shown, now = self.shown, time.monotonic()
            watch = shown.round_watch if shown is not None else None
            if watch is None or not watch.watched():
                return board.snapshot(whole)
            due = now - last[0] >= EVERY
            try:
                if due or last[1] is None:
                    last[:] = [now, self._part().shared()]
            except Exception as e:  # noqa: BLE001 - the beat's thread must go on, whatever a watcher's rows meet
                logger.warning("mpddp: this node's rows for `mpddp top` failed (%s: %s)", type(e).__name__, e)
                return board.snapshot(whole)
            return board.snapshot(whole or due, last[1])

        return share

    def _part(self) -> Part:
        """This node's part of the look: its rows, and its ranks' lags (node 0 of several: the nodes' first), the
        lags computed at most every :data:`LAGS_EVERY` s (a job of 8 ranks at 100 collectives a second keeps
        100,000 points: 63 ms to walk, measured)."""
        at, rows = self._rows_at()
        wall = time.time()
        with self._lock:
            taken, lags = self._lags
        if wall - taken >= LAGS_EVERY:
            lags = tuple(stragglers.timeline(k.points, k.told, k.told_at, wall) | {"nodes": k is self.job.across}
                         for k in (self.job.across, self.job.lags) if k.rows)
            with self._lock:
                self._lags = taken, _ = wall, lags
        part_taken = wall - (time.monotonic() - at)  # its rows' time, which is the part's: the lags are moved to it
        shift = round(part_taken - taken, 2)
        return Part(part_taken, tuple(rows), tuple(_moved(t, shift) for t in lags) if shift else lags)

    def snapshot(self, ask: bool = True) -> Snapshot:
        """The job now: this node's rows, and the other nodes' as they last shared them (asking them to), each row
        with its age. ``ask=False``, the look a notebook keeps once the job ended (core/launcher/live_display.py):
        this node's rows afresh, the others' as last read; no store is asked (the round's may be gone). Node 0 of
        several marks the straggler the nodes lined up name, wherever its row comes from."""
        shown = self.shown
        watch = shown.round_watch if shown is not None else None
        at, mine = self._rows_at(fresh=not ask)
        now, wall = time.monotonic(), time.time()
        rows = [replace(r, age=round(now - at, 2)) for r in mine]
        if watch is not None:
            if ask:
                watch.look()
            parts = self._other_parts(watch) if ask else self._others[1]
            rows += [replace(r, age=round(max(0.0, wall - p.taken), 2)) for p in parts for r in p.rows]
        if (named := self.job.across.told) is not None:
            rows = [replace(r, straggler=r.rank == named) for r in rows]
        here = {r.node for r in rows}
        missing = tuple(n for n in range(self.job.config.nnodes) if n not in here) if shown is not None else ()
        return Snapshot(self._header(), tuple(sorted(rows, key=lambda r: r.rank)), missing)

    def timeline(self) -> dict[str, Any]:
        """Every rank's lags over the last minutes, the whole job's (core/launcher/dashboard.py's chart): this
        node's ranks', the other nodes' as they last shared them, and node 0's nodes lined up, which name the
        straggler of the whole job (:func:`~mpddp.core.launcher.stragglers.merged`)."""
        shown = self.shown
        watch = shown.round_watch if shown is not None else None
        parts = [self._part(), *(self._other_parts(watch) if watch is not None else [])]
        lags = [(p.taken, t) for p in parts for t in p.lags]
        return stragglers.merged(sorted(lags, key=lambda pt: not pt[1].get("nodes")), time.time())

    def _other_parts(self, watch: RoundWatch) -> list[Part]:
        """The other nodes' parts from their last snapshots on the round's store, read at most once a second."""
        with self._lock:
            at, parts = self._others
            if time.monotonic() - at < EVERY:
                return parts
        parts, mine = [], {s.slot.rank for s in self.shown.states} if self.shown is not None else set()
        for snapshot in watch.others_calls():
            try:
                part = read_part(snapshot)
            except typed.Malformed as e:  # a node of another mpddp version, or a snapshot that is not one
                logger.debug("mpddp: a node's live rows left out (%s)", e)
                continue
            if part is not None:
                parts.append(replace(part, rows=tuple(r for r in part.rows if r.rank not in mine)))
        with self._lock:
            self._others = (time.monotonic(), parts)
        return parts

    def _header(self) -> Header:
        job, shown = self.job, self.shown
        config, plan = job.config, job.plan  # this round's
        failure = self.failure
        if failure is None and shown is not None:
            failure = _failure_now(shown)
        return Header(job=self.job_id, round=shown.number if shown is not None else 0,
                      world_size=plan.slots[0].world_size if plan.slots else 0,
                      nnodes=config.nnodes, max_nnodes=self.max_nnodes, restarts=job.restarts,
                      elapsed=time.monotonic() - self.started, failure=failure,
                      node=plan.config.node_rank, host=socket.gethostname(), spares=self._waiting(shown))

    def _waiting(self, shown: Shown | None) -> int | None:
        """The launchers that came to this round without a place in it, read at most once a second while someone
        looks (one store operation, or one etcd count: never a write); 0 on one node (no launcher can come), None
        before this node has a round, or when nothing answers."""
        link = self.job.link
        if link is None:
            return 0
        if shown is None:
            return None
        with self._lock:
            at, spares = self._spares
            if time.monotonic() - at < EVERY:
                return spares
        try:
            spares = max(0, link.view(shown.number).arrived - self.job.config.nnodes)
        except (MpddpError, OSError):  # the store or etcd gone: the round's end says why, not a watcher
            spares = None
        with self._lock:
            self._spares = (time.monotonic(), spares)
        return spares

    def rows(self, fresh: bool = False) -> list[RankRow]:
        """This node's rows, computed at most once a second (the beat and a watcher may both ask) unless ``fresh``."""
        return self._rows_at(fresh)[1]

    def _rows_at(self, fresh: bool = False) -> tuple[float, list[RankRow]]:
        """This node's rows and when they were computed (time.monotonic())."""
        with self._lock:
            at, rows = self._rows
            now = time.monotonic()
            if fresh or now - at >= EVERY or not rows:
                rows = self._compute(now)
                self._rows = at, rows = now, rows
            return at, rows

    def _compute(self, now: float) -> list[RankRow]:
        shown = self.shown
        if shown is None:
            return []
        states = list(shown.states)
        lags = _lags(self.job)
        gpus = _gpus([s.slot.gpu for s in states])
        rows = []
        for s in states:
            calls, pending = shown.board.lasts(s.slot.rank)
            count = sum(c.seq for c in calls)
            last = max(calls, key=lambda c: c.entered, default=None)
            before = self._counts.get(s.slot.rank)
            rate = (count - before[1]) / (now - before[0]) if before is not None and now > before[0] else None
            self._counts[s.slot.rank] = (now, count)
            cpu, rss = self._usage(s)
            lag, straggler = lags.get(s.slot.rank, (None, False))
            tail = shown.relay.tail(s.slot.rank)
            gpu = gpus.get(s.slot.gpu) if s.slot.gpu is not None else None
            used = next((p.used_mib for p in gpu.processes if p.pid == s.pid), None) if gpu is not None else None
            rows.append(RankRow(
                s.slot.rank, s.slot.node_rank, s.slot.local_rank, s.pid, _state(s, pending),
                count, rate, f"#{last.seq} {last.op}" if last is not None else None, lag, straggler, cpu, rss,
                s.slot.gpu, gpu.utilization if gpu is not None else None,
                used if used is not None else gpu.memory_used_mib if gpu is not None else None,
                tail[-1] if tail else ""))
        return rows

    def _usage(self, state: RankState) -> tuple[float | None, int | None]:
        """CPU (percent of a core, since the last look: None at the first) and resident memory of a rank."""
        if state.pid is None or state.exitcode is not None:
            return None, None
        try:
            proc = self._procs.get(state.pid)
            first = proc is None
            if proc is None:
                proc = self._procs[state.pid] = psutil.Process(state.pid)
            with proc.oneshot():
                cpu = proc.cpu_percent(None)
                rss = proc.memory_info().rss
            return (None if first else cpu), rss
        except psutil.Error:
            return None, None


def _moved(timeline: dict[str, Any], shift: float) -> dict[str, Any]:
    """A timeline computed ``shift`` s before its part's time: its points and its naming as seconds before that."""
    named = timeline["named"]
    return timeline | {"ranks": [{"rank": r["rank"], "points": [[round(a - shift, 2), v] for a, v in r["points"]]}
                                 for r in timeline["ranks"]],
                       "named": None if named is None else named | {"ago": round(named["ago"] - shift, 2)}}


def job_id(job: JobFacts) -> str:
    """The job's name for a watcher: --rdzv-id, else node 0's address (every node of a c10d job knows it), else
    the single node's run id."""
    config = job.config
    if config.rdzv_id:
        return config.rdzv_id
    if config.nnodes > 1:
        return f"{config.master_addr}:{config.master_port or job.port}"
    return job.plan.run_id[:8]


def _state(state: RankState, pending: bool) -> str:
    if state.exitcode is not None:
        return "done" if state.succeeded else "failed" if state.failed else f"exited {state.exitcode}"
    if not state.started:
        return "starting"
    return "waiting" if pending else "running"


def _failure_now(shown: Shown) -> str | None:
    """The round's first failure as this node knows it while it runs: another node's record, or a rank of ours."""
    if shown.round_watch is not None and (record := shown.round_watch.remote_failure) is not None:
        return record.line.splitlines()[0] if record.line else f"rank {record.rank} failed"
    failed = sorted((s for s in shown.states if s.failed_at is not None), key=lambda s: s.failed_at or 0.0)
    if not failed:
        return None
    s = failed[0]
    how = s.failure.error_type if s.failure is not None else f"exit code {s.exitcode}"
    return f"rank {s.slot.rank} (node {s.slot.node_rank}) failed: {how}"


def _lags(job: JobFacts) -> dict[int, tuple[float | None, bool]]:
    """Each rank's median arrival lag behind the first rank at this node's last collectives (ms), and whether the
    straggler rule names it (core/launcher/stragglers.py). Read from another thread than the watch's: a window that
    moves while it is copied is left for the next look."""
    lags = job.lags
    try:
        medians = {rank: statistics.median(list(window)) for rank, window in list(lags.window.items()) if window}
        named = lags.told if lags.told is not None else lags.suspect()
    except RuntimeError:
        return {}
    return {rank: (lag * 1e3, rank == named) for rank, lag in medians.items()}


def _gpus(ids: list[int | None]) -> dict[int, Any]:
    """The GPUs the ranks drive, as NVML or nvidia-smi reports them now; none on a CPU job (nothing is asked)."""
    if not any(i is not None for i in ids):
        return {}
    from ...machine.gpus import query_gpus

    return {g.index: g for g in query_gpus().gpus}
