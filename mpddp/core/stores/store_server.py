"""The store server : node 0's TCPStore, served by a process of its own.

Owns: starting the store server (forked from the torch-loaded forkserver in
milliseconds, under the other start methods a process like the ranks),
handing it the rendezvous socket that core/stores/listen.py bound, what the
store server does (serve the store until the launcher closes its pipe or dies),
and stopping it. Why a process of its own: the store is the only thing on
a single node that needed torch in the launcher, and a launcher that never
imports torch neither competes with the forkserver's import nor pays
torch's interpreter teardown when a ``launch()`` script exits (about 0.45 s
on 2 cores, measured: scripts/bench_first_step.py). The store still
outlives every rank, so a rank that exits early never takes the store from
its peers. Leaves the socket and the store's construction to
core/stores/listen.py, watching the store server to core/launcher/attempt.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil

from ..procs import teardown
from ..procs.start import start_process
from ..rank.boot import main_hidden

_STOP_GRACE = 1.0  # seconds the store server has to exit once its pipe is closed


@dataclass
class StoreServer:
    """The launcher's handle: the process, and the pipe whose closing stops it."""

    process: Any
    stop_end: Connection
    stopped: bool = False  # the launcher stopped it (else an exit is a loss)
    pid: int = 0  # kept apart: the process object is closed once stopped

    def __post_init__(self) -> None:
        self.pid = self.pid or int(self.process.pid)

    @property
    def lost(self) -> bool:
        """It has ended by itself: only the launcher's :meth:`stop` may end it."""
        return not self.stopped and self.process.exitcode is not None

    def stalled(self) -> str | None:
        """The store server's state when it is stopped (SIGSTOP, a debugger): it runs, but answers no rank."""
        try:
            status = psutil.Process(self.pid).status()
        except psutil.Error:
            return None
        return status if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) else None

    def stall(self, status: str) -> str:
        """What the launcher says of a stopped store server."""
        return (f"the store server (pid {self.pid}), the process that serves this job's rendezvous store, does not "
                f"answer: it is {status} (SIGSTOP, or a debugger), so the ranks could not meet; every rank was stopped "
                f"(`kill -CONT {self.pid}` resumes a store server stopped by hand)")

    def loss(self, several: bool = False) -> str:
        """What the launcher says of a lost store server (``several``: node 0's, of a job of several nodes)."""
        code = self.process.exitcode
        how = (f"was killed by {teardown.signal_name(code)}" if code is not None and code < 0
               else f"exited with code {code}")
        who = "node 0's store server" if several else "the store server"
        return (f"{who} (pid {self.pid}), the process that serves this job's rendezvous store, {how} "
                "while the ranks ran: it was stopped from outside (a signal, or the out-of-memory killer); every rank "
                "was stopped, and their errors were its consequences")

    def stop(self) -> None:
        """Close the pipe (the store server exits), then make sure: join, and kill what did not exit. Once."""
        if self.stopped:
            return
        self.stopped = True
        self.stop_end.close()
        self.process.join(_STOP_GRACE)
        if self.process.exitcode is None:
            teardown.kill_tree([self.pid], grace=0.2)
            self.process.join(1.0)
        try:  # its sentinel now, not when the garbage collector frees a failed launch's traceback
            self.process.close()
        except ValueError:  # still running after the kill: the guardian reaps it
            pass


def start(mp_context: Any, sock: socket.socket, timeout: float, forked: bool,
          forkserver: int | None = None) -> StoreServer:
    """Start the store server with the listening ``sock`` (the caller may close its own copy once this returns).

    ``forked``: the ``fork`` start method, whose child inherits the launcher's end of the pipe. ``forkserver``:
    the job's (core/procs/start.py).
    """
    wait_end, stop_end = mp_context.Pipe(duplex=False)
    inherited = (stop_end.fileno(),) if forked else ()
    process = mp_context.Process(target=serve, args=(sock, timeout, wait_end, inherited), name="mpddp-store",
                                 daemon=True)
    try:
        with main_hidden(always=True):  # the store server runs none of the user's code
            start_process(process, forkserver)
    except BaseException:
        # a store server forked as its forkserver died runs on, unknown: the pipe's EOF ends it now, not once the
        # failed launch's traceback (which holds this frame) is freed, perhaps never in a notebook
        stop_end.close()
        wait_end.close()
        raise
    wait_end.close()
    return StoreServer(process, stop_end)


def serve(sock: socket.socket, timeout: float, wait_end: Connection, inherited: tuple[int, ...]) -> None:
    """In the store server: serve the store until the launcher closes its end of the pipe, or dies."""
    from ..rank.boot import detach

    # Its own session (Ctrl-C is the launcher's), before torch loads. Not gone with its parent, the forkserver:
    # the pipe's EOF ends it when the launcher goes, and a forkserver killed from outside takes the ranks, not the
    # store, in which node 0 then writes that loss for every node to tell (not "node 0 is gone").
    detach(inherited, with_parent=False)
    # SIGTERM keeps its default: multiprocessing's exit handler terminates a daemon child it still
    # finds, then joins it, and a store server that outlived the launch must not hang the launcher's exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .listen import host_store  # torch: already loaded in a forkserver child, imported under spawn

    store = host_store(sock, timeout)
    try:
        wait_end.recv_bytes()  # nothing is ever sent: EOF when the launcher closes its end or exits
    except (EOFError, OSError):
        pass
    del store
    sys.stderr.flush()
    os._exit(0)  # torch's interpreter teardown would only delay the launcher's join
