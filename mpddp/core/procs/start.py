"""Starting one process of the launcher's, and which process is the forkserver that forks them.

Owns: ``process.start()`` with a forkserver killed under it named as such
(multiprocessing raises a bare EOFError, which the command line would read
as a Ctrl-C, or starts another forkserver without a word), and the running
forkserver's pid. Used by the launcher for its ranks and by node 0 for its
store server; leaves starting the forkserver itself to
core/launcher/startup.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any


def start_process(process: Any, forkserver: int | None = None) -> None:
    """``process.start()`` from the job's ``forkserver`` (its pid; None under spawn and fork); one killed from
    outside, before or under the start, is named (:class:`~mpddp.errors.ForkserverLost`), and nothing is started.

    Why each check: multiprocessing asks for every start whether its forkserver still runs, and reaps a dead one
    and starts another in its place, silently. The job's store server and first ranks came from the old one,
    which reports their exits as 255 once it is gone (the store server, which runs on, was told as lost), and
    the new one has none of mpddp's duties (core/rank/forkserver.py). So a start from a lost forkserver, or from
    its stand-in, is undone: the process stopped, the stand-in too (the next launch starts its own).
    """
    if forkserver is not None and lost(forkserver):
        raise _lost_error(forkserver, "found gone before the next process started")
    try:
        process.start()
    except (EOFError, OSError) as e:
        if forkserver is None or not _seen_lost(forkserver):
            raise
        _stand_in_stopped(forkserver)
        raise _lost_error(forkserver, type(e).__name__) from None
    if forkserver is not None and lost(forkserver):
        _stopped(process)
        _stand_in_stopped(forkserver)
        raise _lost_error(forkserver, "found gone as a process started")


def lost(forkserver: int) -> bool:
    """Whether the job's ``forkserver`` is gone: dead (a zombie too: only its parent, this process, reaps it), or
    reaped and replaced by multiprocessing."""
    from . import teardown  # psutil: not on the way to the forkserver's start (core/launcher/startup.py)

    return forkserver_pid() != forkserver or not teardown.alive(forkserver)


_DEATH_WAIT = 2.0  # seconds a forkserver whose pipe ended has to be seen dead, at most


def _seen_lost(forkserver: int) -> bool:
    """Whether the job's ``forkserver``, whose pipe just ended, is lost. The kernel closes a killed process's files
    before it shows it dead: looked at once, it still ran (1 of 3 kills as a restart started, the command line
    said "EOFError (unexpected EOF)"). A forkserver ends a start's pipe unwritten only as it dies."""
    deadline = time.monotonic() + _DEATH_WAIT
    while not lost(forkserver):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def forkserver_pid() -> int | None:
    """The running forkserver's pid (every rank's parent under the default start method), or None.

    Also from a Ctrl-C's handler that interrupted the stdlib module's own import (seen 0.6 s into a loaded
    start: "partially initialized module 'multiprocessing.forkserver' has no attribute '_forkserver'"): None."""
    module = sys.modules.get("multiprocessing.forkserver")
    return getattr(getattr(module, "_forkserver", None), "_forkserver_pid", None)


def _lost_error(forkserver: int, seen: str) -> Exception:
    from ...errors import ForkserverLost  # the errors' dataclasses: not on the way to the forkserver's start

    return ForkserverLost(
        f"mpddp's forkserver (pid {forkserver}), which starts every rank, was killed from outside while the job "
        f"started its processes (a signal, or the out-of-memory killer; {seen}); every process of the job was "
        "stopped, and the next launch starts a new forkserver")


def _stopped(process: Any) -> None:
    """A process just started by a forkserver that is gone, or by its stand-in: it must not run the job's work."""
    with contextlib.suppress(OSError, ValueError):
        process.kill()
        process.join(2.0)
        process.close()


def _stand_in_stopped(forkserver: int) -> None:
    """The forkserver multiprocessing started in place of the job's lost one, if it did: stopped and reaped."""
    from multiprocessing import forkserver as module

    stand_in = forkserver_pid()
    if stand_in is None or stand_in == forkserver:
        return
    with contextlib.suppress(OSError):
        os.kill(stand_in, signal.SIGKILL)  # it may still import torch: it would see its closed pipe only then
    stop = getattr(module._forkserver, "_stop", None)  # the stdlib's own (its tests'): pipe closed, process reaped
    with contextlib.suppress(OSError, ChildProcessError):
        if stop is not None:
            stop()
