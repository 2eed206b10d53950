"""Starting one process of the launcher's, and which process is the forkserver that forks them.

Owns: ``process.start()`` with a forkserver killed under it named as such
(multiprocessing raises a bare EOFError, which the command line would read
as a Ctrl-C), and the running forkserver's pid. Used by the launcher for
its ranks and by node 0 for its store server; leaves starting the
forkserver itself to core/launcher/startup.py.
"""

from __future__ import annotations

from typing import Any


def start_process(process: Any) -> None:
    """``process.start()``; a forkserver killed under it is named (multiprocessing raises a bare EOFError, or a
    refused connection, which the command line would read as a Ctrl-C)."""
    try:
        process.start()
    except (EOFError, OSError) as e:
        # not on the way to the forkserver's start (core/launcher/startup.py): psutil, and the errors' dataclasses
        from ...errors import ForkserverLost
        from . import teardown

        server = forkserver_pid()
        if server is None or teardown.alive(server):
            raise
        raise ForkserverLost(
            f"mpddp's forkserver (pid {server}), which starts every rank, was killed from outside while the job "
            f"started its processes (a signal, or the out-of-memory killer; {type(e).__name__}); every process of "
            "the job was stopped, and the next launch starts a new forkserver") from None


def forkserver_pid() -> int | None:
    """The running forkserver's pid (every rank's parent under the default start method), or None."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
