"""The hang watchdog: no rank made progress for ``timeout`` seconds, told by the launcher itself.

Owns: deciding that a group hangs, without relying on any collective's timeout (frameworks pass their own, and a
rank stuck outside a collective never trips one). Progress is any of: a rank entered or completed a collective (its
flight recorder moved, core/launcher/board.py); it wrote output (a rank held back by the relay spends its time in
``write()``, not on the CPU); it used more than :data:`BUSY` of a core (its whole process tree) outside a wait, or it
wanted to and the machine was too busy to let it (:func:`_starved`).
Busy *at* a wait is still waiting: a stack last seen inside a collective, or, on a GPU rank, any CPU while a
collective it entered has not completed (NCCL returns at once, and the rank spins at its next sync). A GPU rank in
``torch.cuda.synchronize`` with no collective open waits for its own GPU, which computes: that is progress. Other
nodes' progress comes with the round's beat. After ``timeout`` without progress it asks every rank for its stack and
declares a :class:`Hang`. A rank that computes is never a hang, however long the others wait; it is told once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from ...log import logger
from ..nodes.api import RoundWatch
from ..wire import stacks
from .board import Board, Mismatch, Standing
from .classify import Hang, RankState

BUSY = 0.1  # fraction of one core over a sample: more is computing
STARVED = 2  # times the main threads of a rank's processes were preempted over a sample (and no fewer than they slept)


@dataclass
class _Rank:
    proc: Any
    use: _Use
    busy_since: float | None = None
    spinning: bool = False  # busy, but its stack was inside torch.distributed
    told: bool = False


@dataclass
class Watchdog:
    """Call :meth:`check` often (the attempt's watch loop does); it samples every ``interval``."""

    timeout: float
    heartbeat: RoundWatch | None = None  # several nodes: progress travels between nodes through the round's beat
    board: Board | None = None  # the ranks' collectives (core/launcher/board.py)
    output: Callable[[], int] | None = None  # bytes relayed so far, every rank together (core/launcher/output.py)
    interval: float = 0.0
    _moves: object = None
    _ranks: dict[int, _Rank] = field(default_factory=dict)
    _last_sample: float = 0.0
    _last_progress: float = field(default_factory=time.monotonic)
    _remote: int = 0

    def __post_init__(self) -> None:
        self.interval = self.interval or min(max(self.timeout / 5, 0.2), 2.0)

    def check(self, states: list[RankState], now: float) -> Hang | None:
        if now - self._last_sample < self.interval:
            return None
        dt, self._last_sample = now - (self._last_sample or now), now
        running = [s for s in states if s.exitcode is None and s.process.pid]
        busy = [s for s in running if self._busy(s, dt, now)]
        computing = [s for s in busy if not self._ranks[s.slot.rank].spinning and not self._open(s)]
        if self._moved() or computing:
            self._progressed(now)
            self._tell_long_compute(running, computing, now)
            return None
        if self._remote_moved():
            self._last_progress = now
        if not running or now - self._last_progress < self.timeout:
            return None
        locations = self.where(running)
        if any((p := locations.get(s.slot.rank)) is not None and not self._waits_at(s, p) for s in busy):
            self._progressed(now)  # a busy rank seen spinning earlier computes after all
            return None
        finished = tuple(s.slot.rank for s in states if s.succeeded)
        seconds = now - self._last_progress
        whole = self._whole(states)
        if whole is None:
            return Hang(seconds, locations, finished)
        crossed = whole[0].crossed() if self.heartbeat is not None else None
        return Hang(seconds, locations, finished, tuple(whole[0].standings(whole[1])),
                    replace(crossed, after=seconds) if crossed is not None else None)

    def standings(self, states: list[RankState]) -> tuple[Standing, ...]:
        """Where the ranks stand in their collectives (empty without a flight recorder)."""
        whole = self._whole(states)
        return tuple(whole[0].standings(whole[1])) if whole is not None else ()

    def again(self, states: list[RankState], hang: Hang | None,
              mismatch: Mismatch | None) -> tuple[Hang | None, Mismatch | None]:
        """A stop that named another node's ranks, seen again through the other nodes' collectives as they are
        now: a snapshot read at the stop may have been a beat old, or more on a starved machine (a rank that
        had entered the collective then looked behind)."""
        whole = self._whole(states) if hang is not None or mismatch is not None else None
        if whole is None:
            return hang, mismatch
        board, world = whole
        crossed = board.crossed()
        if crossed is not None:  # as the watch tells it: a mismatch is a bug, whatever else stopped
            return None, replace(
                crossed, after=hang.seconds if hang is not None else mismatch.after)  # type: ignore[union-attr]
        if hang is not None:
            return replace(hang, standings=tuple(board.standings(world))), None
        return None, mismatch

    def _whole(self, states: list[RankState]) -> tuple[Board, list[int]] | None:
        """The board to tell a stop from, and its ranks: on several nodes every node's ranks, from the snapshots
        the nodes share through the store; None without a flight recorder."""
        if self.board is None or not self.board.seen:
            return None
        if self.heartbeat is None or not states:
            return self.board, [s.slot.rank for s in states]
        world = list(range(states[0].slot.world_size))
        return self.board.joined(self.heartbeat.others_calls(), world), world

    def _moved(self) -> bool:
        """A rank entered or completed a collective, or wrote output, since the last sample."""
        moves = (tuple((r, s.reports) for r, s in self.board.seen.items()) if self.board is not None else (),
                 self.output() if self.output is not None else 0)
        moved, self._moves = moves != self._moves, moves
        return moved

    def _open(self, state: RankState) -> bool:
        """A GPU rank with a collective it entered and that has not completed: its CPU spins, waiting for it."""
        seen = self.board.seen.get(state.slot.rank) if self.board is not None else None
        return seen is not None and state.slot.device.startswith("cuda") and seen.pending

    def _waits_at(self, state: RankState, place: stacks.Location) -> bool:
        """Busy at ``place`` is waiting: a GPU rank's open collective; else a stack inside torch.distributed or a
        CUDA sync, if the flight recorder (when there is one) has a collective open for it."""
        if self._open(state):
            return True
        seen = self.board.seen.get(state.slot.rank) if self.board is not None else None
        if seen is not None:  # the recorder knows: busy in torch's code waits only while a collective is open
            return place.spinning and seen.pending  # (torch.distributed.checkpoint computes; a sync's GPU works)
        return place.spinning

    def where(self, running: list[RankState]) -> dict[int, stacks.Location | None]:
        """Every running rank's place, asked now (rank -> Location, None if it did not answer)."""
        fds = {s.slot.rank: s.stack_fd for s in running if s.stack_fd is not None and s.started}
        dumps = stacks.ask({s.slot.rank: s.process.pid for s in running if s.slot.rank in fds}, fds)
        return {s.slot.rank: stacks.locate(dumps.get(s.slot.rank, ""), s.main_thread) for s in running}

    def _busy(self, state: RankState, dt: float, now: float) -> bool:
        rank = self._ranks.get(state.slot.rank)
        if rank is None:
            try:
                proc = psutil.Process(state.process.pid)
            except psutil.NoSuchProcess:  # it exited just now: the watch loop sees to it
                return False
            self._ranks[state.slot.rank] = _Rank(proc, _tree_use(proc))
            return True  # a rank just started is busy starting
        use = _tree_use(rank.proc)
        before, rank.use = rank.use, use
        busy = dt > 0 and (use.cpu - before.cpu > BUSY * dt or _starved(before, use))
        rank.busy_since = (rank.busy_since or now) if busy else None
        if not busy:
            rank.spinning = False
        return busy

    def _progressed(self, now: float) -> None:
        self._last_progress = now
        if self.heartbeat is not None:
            self.heartbeat.progressed()

    def _remote_moved(self) -> bool:
        if self.heartbeat is None:
            return False
        value = self.heartbeat.remote_progress
        moved, self._remote = value != self._remote, value
        return moved

    def _tell_long_compute(self, running: list[RankState], busy: list[RankState], now: float) -> None:
        """Once per rank: "rank 0 has computed for 300 s while rank 1 waits in barrier at train.py:40"."""
        idle = [s for s in running if s not in busy]
        due = [s for s in busy if not (rank := self._ranks[s.slot.rank]).told and not rank.spinning
               and now - (rank.busy_since or now) >= self.timeout]
        if not idle or not due:
            return
        locations = self.where(due + idle)
        for s in due:
            rank = self._ranks[s.slot.rank]
            here = locations.get(s.slot.rank)
            if here is not None and self._waits_at(s, here):
                rank.spinning = True  # busy inside a collective or a CUDA sync: waiting, not computing
                continue
            rank.told = True
            others = "; ".join(stacks.grouped({i.slot.rank: locations.get(i.slot.rank) for i in idle}))
            logger.warning("mpddp: rank %d has computed for %.0f s while the others wait (%s); not a hang: the job "
                           "goes on", s.slot.rank, now - (rank.busy_since or now), others)


@dataclass(frozen=True)
class _Use:
    """What a rank's process tree used so far: CPU seconds, and how often the main thread of each of its processes
    gave the CPU up (``slept``: it waited for something) or had it taken (``preempted``: it wanted more)."""

    cpu: float = 0.0
    slept: int = 0
    preempted: int = 0


def _starved(before: _Use, after: _Use) -> bool:
    """The rank computes on a machine too busy to give it :data:`BUSY` of a core: preempted (at least
    :data:`STARVED` times) as often as it slept or more. A rank that waits (a collective, a lock, a sleep) gives
    the CPU up and is not preempted. Measured on 2 cores with 20 busy processes, each in a session of its own (a
    shared login node; a CI runner): a Python loop got 0.1 of a core and 54 preemptions in 2 s, no sleep; one
    waiting on an event or in ``time.sleep``, none of either; and two such loops as ranks were declared hung."""
    preempted = after.preempted - before.preempted
    return preempted >= STARVED and preempted >= after.slept - before.slept


def _tree_use(proc: Any) -> _Use:
    """:class:`_Use` of a process and all its descendants (children that exited are in its CPU, not its switches)."""
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return _Use()
    cpu, slept, preempted = 0.0, 0, 0
    for p in tree:
        try:
            times, switches = p.cpu_times(), p.num_ctx_switches()
        except psutil.NoSuchProcess:
            continue
        cpu += times.user + times.system + times.children_user + times.children_system
        slept, preempted = slept + switches.voluntary, preempted + switches.involuntary
    return _Use(cpu, slept, preempted)
