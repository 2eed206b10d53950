"""The watch of one attempt: wait for the ranks while draining what they send, until something ends it.

Owns: the loop that waits on every rank's channel and process (reading while waiting: reading only after join deadlocks
past the 64 KiB pipe buffer), and what ends it: every rank succeeded, a failure window closed, node 0's store server is
gone, another node wrote the round's first failure (or a node was found lost), the backend stopped answering, the
watchdog found a hang, or two ranks called different collectives at one number. Also SIGUSR1's "where is every rank",
the stacks of a straggler while the others wait, and where each rank is before it is stopped. Leaves hangs to
core/launcher/watchdog.py, the collectives to core/launcher/board.py, stragglers to core/launcher/stragglers.py and
stacks to core/wire/stacks.py.
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from typing import Any

from ...log import logger
from ..nodes.api import RoundWatch
from ..stores.store_server import StoreServer
from ..wire import stacks
from . import board, stragglers
from .board import Mismatch
from .channels import receive
from .classify import Hang, RankState
from .watchdog import Watchdog

_FAILURE_WINDOW = 0.3  # seconds to collect other ranks' reports after the first failure


def watch(states: list[RankState], watchdog: Watchdog, lags: stragglers.Stragglers, store: StoreServer | None = None,
          round_watch: RoundWatch | None = None, nodes: stragglers.AcrossNodes | None = None) -> Hang | Mismatch | None:
    """Wait until every rank succeeded, a failure window has closed, the store server is gone,
    another node wrote the round's first failure, the watchdog found a hang, or two ranks called
    different collectives at the same number. ``nodes``: node 0 of several lines the nodes up for stragglers."""
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
                receive(s, board)
            if s.exitcode is None and s.process.sentinel in ready:
                s.process.join(0)
                s.exitcode = s.process.exitcode
                receive(s, board)
                if s.exitcode is not None and s.failed_at is None and (s.exitcode != 0 or not s.has_result):
                    s.failed_at = time.monotonic()
        lags.add(board.take())  # before any return: a rank's last read can come with its exit
        now = time.monotonic()
        if first_failure is None and any(s.failed_at is not None for s in states):
            first_failure = now
        if all(s.succeeded for s in states):
            return None
        if store is not None and store.lost:
            return None  # the ranks' errors, if any yet, are its consequences
        if first_failure is None and round_watch is not None and (
                round_watch.remote_failure is not None or round_watch.gone is not None):
            return None  # another node's rank failed first, or a node was lost, or the backend: ours stop now
        if first_failure is not None and (now - first_failure > _FAILURE_WINDOW or all(
                s.exitcode is not None for s in states)):
            return None
        if first_failure is None and (mismatch := board.found(now)) is not None:
            return mismatch  # a bug in the program, whatever happens next: told now
        if stacks.ASKED.is_set():  # SIGUSR1 (core/wire/stacks.py)
            stacks.ASKED.clear()
            _show_where(states, watchdog)
        lags.check(lambda rank: _sample(states, watchdog, rank))
        if nodes is not None and round_watch is not None:
            nodes.watch(board.arrivals, round_watch.others_calls, now)
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


def locate(states: list[RankState], watchdog: Watchdog, hang: Hang | None) -> None:
    """Before the teardown: where each rank that is about to be stopped is, for the report."""
    if hang is not None:
        for s in states:
            s.location = hang.locations.get(s.slot.rank)
        return
    by_rank = {s.slot.rank: s for s in states}
    for rank, where in watchdog.where([s for s in states if s.exitcode is None and s.process.is_alive()]).items():
        by_rank[rank].location = where
