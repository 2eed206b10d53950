"""Start-up: the forkserver, the start method's context, and Ctrl-C while torch loads.

Owns: starting multiprocessing's forkserver with mpddp's worker module
preloaded (torch imported once, no CUDA touched, no torch op run), the
``torch.multiprocessing`` context of the chosen start method, holding a
Ctrl-C back while torch is imported, refusing a launch that a worker
reached by re-importing a script with no main guard, and stopping the
helpers (forkserver, resource tracker) before the launcher exits. Leaves
what the forkserver does besides forking to core/guardian.py, the launch
itself to core/api.py and the worker's side to core/worker.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .guardian import FORKSERVER_PARENT, FORKSERVER_TEMP

FORKSERVER_PRELOAD = ["mpddp.core.worker"]
_START_LOCK = threading.Lock()  # launches from several threads: one forkserver, started once, with our variables


def refuse_bootstrap() -> None:
    """A worker importing a script without a main guard reaches launch() again."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        from .protocol import MAIN_GUARD_EXIT

        os._exit(MAIN_GUARD_EXIT)


def start_forkserver(method: str = "forkserver") -> None:
    """Start the forkserver now, in parallel with whatever this process imports next.

    The forkserver imports torch once, touches no CUDA and runs no torch op,
    so every worker forked from it is as clean as a spawned one, but starts
    in milliseconds. Started before this process imports torch, the two
    imports overlap; commands that import torch themselves before launching
    (``mpddp train``) call this first. Idempotent; a no-op for other methods.
    """
    if method != "forkserver":
        return
    # the stdlib's context: importing torch.multiprocessing would import all of torch first
    multiprocessing.get_context(method).set_forkserver_preload(FORKSERVER_PRELOAD)
    from multiprocessing import forkserver, util

    with _START_LOCK:
        # read by core/guardian.py when the forkserver imports the worker module: it cleans up after us
        os.environ[FORKSERVER_PARENT] = str(os.getpid())
        os.environ[FORKSERVER_TEMP] = util.get_temp_dir()
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(FORKSERVER_PARENT, None)
            os.environ.pop(FORKSERVER_TEMP, None)


def forkserver_pid() -> int | None:
    """The running forkserver's pid (every rank's parent under the default start method), or None."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def stop_helpers(timeout: float = 3.0) -> None:
    """Stop the forkserver and the resource tracker and wait until both have exited.

    A command that follows ``mpddp`` at once must not see them: without this
    they would linger a few milliseconds after the launcher, until they
    noticed its pipes close. Each stop closes the helper's pipe and reaps it.
    """
    from multiprocessing import forkserver, resource_tracker

    def stop() -> None:
        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            stop_helper = getattr(helper, "_stop", None)  # the stdlib's own (used by its tests)
            with contextlib.suppress(OSError, ChildProcessError):
                if stop_helper is not None:
                    stop_helper()

    worker = threading.Thread(target=stop, name="mpddp-stop-helpers", daemon=True)
    worker.start()
    worker.join(timeout)  # a helper that does not exit must not hold the launcher

def start_context(method: str) -> Any:
    """The multiprocessing context, from ``torch.multiprocessing`` (the stdlib's
    object plus torch's tensor reductions), once the forkserver is running."""
    start_forkserver(method)
    import torch.multiprocessing

    return torch.multiprocessing.get_context(method)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back while torch is imported, then raise it.

    A KeyboardInterrupt in the middle of ``import torch`` leaves torch half
    imported: measured, the interrupt was then swallowed (the run went on) or
    turned into "cannot load module more than once per process". Nothing has
    started yet, so raising it right after costs nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt("mpddp: interrupted before any worker started")
