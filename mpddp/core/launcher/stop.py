"""One attempt's ranks stopped, whatever happens: every tree torn down, and what the forkserver adopted.

Owns: the processes of every launch running in this process (:data:`LIVE`),
stopping an attempt's ranks (a rank the forkserver has not reported yet may
have died on its own: that one was not stopped by mpddp), with the grace
of a launcher told to stop (``--shutdown-timeout``) or the short one after a
failure, closing their channels and process objects at once, the orphans a rank killed by a signal
left to the forkserver, and ranks lost with a forkserver killed from outside.
Leaves killing a tree to core/procs/teardown.py.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from ..procs import start, teardown
from ..procs.start import forkserver_pid
from .classify import RankState

_TEARDOWN_GRACE = 0.5
_NO_STATUS = 255  # the exit code multiprocessing gives a forkserver child whose status never came


# The ranks and store servers of every launch running in this process: launches may run in several threads at
# once, and all share one forkserver, whose children are either such processes or orphans it adopted.
LIVE_LOCK = threading.Lock()
LIVE: set[int] = set()


def stop_ranks(states: list[RankState], urgent: threading.Event | None = None,
               told: tuple[int, float] | None = None) -> None:
    """Stop every rank of ``states`` still running. ``told``: this launcher was told to stop (a signal, Ctrl-C):
    the signal its ranks are passed and their grace, in seconds, to save and exit, as torchrun's
    ``--shutdown-timeout``; else (a rank failed, a store was lost) SIGTERM and half a second: the peers of a
    failed rank have nothing to save. ``urgent`` (a second Ctrl-C) ends either grace at once."""
    # A rank the forkserver has not reported yet may have died on its own already (a zombie, or gone: under
    # load the forkserver writes its status late): that one was not stopped by mpddp, it died.
    alive = [s for s in states if s.exitcode is None and s.process.is_alive() and teardown.alive(s.process.pid)]
    for s in alive:
        s.stopped = True
    pids = [s.process.pid for s in states if s.process.pid]
    passed, grace = told if told is not None else (None, _TEARDOWN_GRACE)
    teardown.kill_tree([s.process.pid for s in alive], grace, groups=pids, urgent=urgent, passed=passed)
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


def release(state: RankState) -> None:
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
        orphans = [pid for pid in teardown.children(server) if pid not in LIVE]
    except psutil.Error:
        return
    if orphans:
        teardown.kill_tree(orphans, grace=0.2)


def forkserver_gone(server: int | None) -> int | None:
    """The pid of the job's forkserver (``server``, None under spawn and fork) if it was killed from outside (every
    rank goes with it, and the store server's exit is no longer reported), or None."""
    return server if server is not None and start.lost(server) else None


def forkserver_lost(states: list[RankState], server: int | None) -> None:
    """Ranks that ended with the forkserver's "no status" code while the job's ``server`` is gone were lost with it."""
    if forkserver_gone(server) is None:
        return
    for s in states:
        if s.exitcode == _NO_STATUS and s.failure is None:
            s.lost_with = server
