"""Start-up: the forkserver, the start method's context, and Ctrl-C while torch loads.

Owns: starting multiprocessing's forkserver with mpddp's worker module
preloaded (torch imported once, no CUDA touched, no torch op run) and what
the command asks for besides (``mpddp train``: ``torch._dynamo``, which every
optimizer and DDP constructor imports), the forkserver's garbage collector
(paused while it imports, its objects frozen for the workers), the
``torch.multiprocessing`` context of the chosen start method, holding a
Ctrl-C back while torch is imported, refusing a launch that a worker
reached by re-importing a script with no main guard, and stopping the
helpers (forkserver, resource tracker) before the launcher exits. Leaves
what the forkserver does besides forking to core/rank/forkserver.py, the launch
itself to core/launcher/api.py and the worker's side to core/rank/worker.py.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from ..procs.start import forkserver_pid
from ..rank.forkserver import FORKSERVER_PARENT, FORKSERVER_TEMP, ignore_interrupts, new_inductor_cache
from ..wire import signals

# In this order: this module first (it pauses the forkserver's collector, below), then the worker (torch).
FORKSERVER_PRELOAD = ("mpddp.core.launcher.startup", "mpddp.core.rank.worker")
# What a training step imports besides: torch.optim's Optimizer and DDP's constructor import
# torch._dynamo, which costs as much as torch itself. A command whose every rank trains preloads
# it; a launch() whose fn never builds one would pay it for nothing (README, Performance).
TRAINING_PRELOAD = ("torch._dynamo",)
# `mpddp train`'s: its ranks run the trainer too (named, not imported: the core does not import the trainer).
# Started from mpddp/__main__.py before the command line loads, and from cli/train.py where that did not run.
TRAIN_COMMAND_PRELOAD = (*TRAINING_PRELOAD, "mpddp.trainer.loop")
_in_forkserver = False  # True in the forkserver only; each child it forks sets it back at once
_START_LOCK = threading.Lock()  # launches from several threads: one forkserver, started once, with our variables


def refuse_bootstrap() -> None:
    """A worker importing a script without a main guard reaches launch() again."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        from ..wire.protocol import MAIN_GUARD_EXIT

        os._exit(MAIN_GUARD_EXIT)


def _pause_gc_while_preloading() -> None:
    """In the forkserver: no garbage collection during its imports, its objects frozen for the workers.

    Importing torch and torch._dynamo creates about a million objects, and
    the collector's passes over them are a quarter of the import time
    (measured). The forkserver never collects (it only forks), each worker
    collects again from its first moment, and the objects the forkserver
    made stay out of the workers' collections (``gc.freeze``): no worker
    pays to walk them, or copies their pages by touching them. The recipe
    of ``gc.freeze``'s documentation.
    """
    global _in_forkserver
    _in_forkserver = True
    gc.disable()
    os.register_at_fork(before=_freeze_in_forkserver, after_in_child=_collect_in_child)


def _freeze_in_forkserver() -> None:
    if _in_forkserver:
        gc.freeze()


def _collect_in_child() -> None:
    global _in_forkserver
    if _in_forkserver:  # a worker: the hooks stay registered, so its own forks pass through here
        _in_forkserver = False
        gc.enable()


# core/launcher/api.py's process leaves the variable unset; only a forkserver it starts sees its own parent's pid
if os.environ.get(FORKSERVER_PARENT) == str(os.getppid()):
    ignore_interrupts()
    _pause_gc_while_preloading()


def start_forkserver(method: str = "forkserver", preload: Sequence[str] = ()) -> None:
    """Start the forkserver now, in parallel with whatever this process imports next.

    The forkserver imports torch once, touches no CUDA and runs no torch op,
    so every worker forked from it is as clean as a spawned one, but starts
    in milliseconds. Started before this process imports torch, the two
    imports overlap; commands that import torch themselves before launching
    (``mpddp train``) call this first. ``preload``: modules every worker of
    this command imports anyway (:data:`TRAINING_PRELOAD`), imported once in
    the forkserver instead of once per rank. Idempotent: the first call of a
    process decides the forkserver's modules; a no-op for other methods.
    """
    if method != "forkserver":
        return
    _check_socket_room()
    # the stdlib's context: importing torch.multiprocessing would import all of torch first
    multiprocessing.get_context(method).set_forkserver_preload([*FORKSERVER_PRELOAD, *preload])
    if forkserver_pid() is None and (cache := new_inductor_cache()) is not None:
        # the forkserver makes it and removes it as it exits; this process too, at its exit, for a forkserver that
        # could not (killed as it imported, by stop_helpers or from outside)
        atexit.register(_remove_if_empty, cache)
    _ensure_running()


def restart_forkserver() -> int | None:
    """A new forkserver in place of the job's, killed from outside while its ranks ran, before the next round
    starts: with mpddp's duties (core/rank/forkserver.py) and the modules the first one preloaded. Left to
    multiprocessing, the next start made one silently, without either. Its pid. The compile cache the lost one
    made, it could not remove: the new one finds it there, and this process removes it at exit, if empty
    (:func:`start_forkserver`)."""
    _ensure_running()
    return forkserver_pid()


def _ensure_running() -> None:
    from multiprocessing import forkserver, resource_tracker, util

    with _START_LOCK:
        # read by core/rank/forkserver.py when the forkserver imports the worker module: it cleans up after us
        os.environ[FORKSERVER_PARENT] = str(os.getpid())
        os.environ[FORKSERVER_TEMP] = util.get_temp_dir()
        # the forkserver starts with SIGINT blocked, until it ignores it (core/rank/forkserver.py); this thread's
        # Ctrl-C meanwhile waits and comes after, as the standard library starts its resource tracker. That one
        # first: its start unblocks SIGINT in this thread as it ends (seen: a Ctrl-C 0.9 s into a loaded start
        # still reached the forkserver's interpreter as it began, "Fatal Python error: init_import_site")
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.environ.pop(FORKSERVER_PARENT, None)
            os.environ.pop(FORKSERVER_TEMP, None)


_HELPER_PATIENCE = 0.15  # seconds an idle forkserver takes to exit once its pipe is closed, at most
_SOCKET_PATH_MAX = 107  # bytes in an AF_UNIX socket path (sun_path, less its NUL)
_SOCKET_NAME = len("/pymp-12345678/listener-12345678")  # what multiprocessing adds to the temp dir


def _check_socket_room() -> None:
    """The forkserver listens on a socket in TMPDIR: a TMPDIR too long for one is one line, not a crash."""
    import tempfile

    from ...errors import ConfigError

    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + _SOCKET_NAME > _SOCKET_PATH_MAX:
        raise ConfigError(
            f"TMPDIR={base!r} is too long for the forkserver's socket ({len(os.fsencode(base))} bytes; a socket "
            f"path holds {_SOCKET_PATH_MAX} in all): set a shorter TMPDIR, e.g. TMPDIR=/tmp, or pass "
            "--start-method spawn"
        )


def stop_helpers(timeout: float = 3.0) -> None:
    """Stop the forkserver and the resource tracker and wait until both have exited.

    A command that follows ``mpddp`` at once must not see them: without this
    they would linger a few milliseconds after the launcher, until they
    noticed its pipes close. Each stop closes the helper's pipe and reaps it
    (the forkserver's exit takes about 0.03 s: it has torch loaded), in a
    thread begun here, or already when the launch ended (:func:`launch_ended`).
    """
    from ..procs import teardown

    server = forkserver_pid()
    worker = _stopping_helpers()
    worker.join(_HELPER_PATIENCE)
    if worker.is_alive() and server is not None and teardown.alive(server):
        # still importing torch (a Ctrl-C during start-up, bad input): it notices its closed pipe only once the
        # import is done, seconds later; it has started nothing yet that needs it, so it is stopped now
        with contextlib.suppress(OSError):
            os.kill(server, signal.SIGKILL)
    worker.join(timeout)  # a helper that does not exit must not hold the launcher


def exits_after_launch() -> None:
    """This process launches once, then exits (the command line's): :func:`launch_ended` then begins to stop
    the helpers, and the command's own last work (``mpddp train``'s curves.png) overlaps their exit."""
    global _exits_after_launch
    _exits_after_launch = True


def launch_ended() -> None:
    """Called once every process a launch started has exited (core/launcher/job.py): in a process that exits
    after its launch, the helpers' stop begins now; :func:`stop_helpers` waits for it."""
    if _exits_after_launch:
        _stopping_helpers()


_exits_after_launch = False


def launcher_process() -> bool:
    """Whether this process is mpddp's own (the command line's), which says itself why it stopped."""
    return _exits_after_launch
_helpers_stop: threading.Thread | None = None  # the stop under way, or done


def _stopping_helpers() -> threading.Thread:
    """The thread that stops the helpers: the one under way, else a new one."""
    global _helpers_stop
    from multiprocessing import forkserver, resource_tracker

    def stop() -> None:
        _remove_temp_dir()  # first: the forkserver, which removes it after a SIGKILL of this process, goes now
        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            stop_helper = getattr(helper, "_stop", None)  # the stdlib's own (used by its tests)
            with contextlib.suppress(OSError, ChildProcessError):
                if stop_helper is not None:
                    stop_helper()

    with _START_LOCK:
        if _helpers_stop is None or not _helpers_stop.is_alive():
            _helpers_stop = threading.Thread(target=stop, name="mpddp-stop-helpers", daemon=True)
            _helpers_stop.start()
        return _helpers_stop


def _remove_temp_dir() -> None:
    """multiprocessing's temporary directory (the forkserver's socket, the ranks' error files), removed now by its
    own finalizer, which then does not run again (a later launch would make a new one). Its removal at exit
    came after the forkserver's stop: a launcher SIGKILLed in between (found: 0.1 s after its ranks ended, under
    load) left it in TMPDIR; and an exit that skips the finalizers (``hosts_node``'s) left it too."""
    from multiprocessing import util

    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                finalizer()


def start_context(method: str, preload: Sequence[str] = ()) -> Any:
    """The multiprocessing context, once the forkserver is running.

    The stdlib's, not ``torch.multiprocessing``'s: they are the same object,
    and torch's tensor reductions are registered by any ``import torch``, so
    a launcher whose caller sends tensors has them. Under the forkserver and
    spawn this process imports no torch for the launch (the store is served
    by core/stores/store_server.py). Under ``fork`` it imports what the forkserver would
    have: the point of a fork is that every child inherits it, instead of
    each importing torch again, on every launch (measured: a second launch of
    2 forked ranks took 4 s instead of 0.1 s).
    """
    if method != "forkserver" and (cache := new_inductor_cache()) is not None:
        atexit.register(_remove_if_empty, cache)  # made here (fork) or by the ranks (spawn): the forkserver's work
    if method == "fork":
        import importlib

        for module in (*FORKSERVER_PRELOAD, *preload):
            importlib.import_module(module)
    start_forkserver(method, preload)
    return multiprocessing.get_context(method)


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)  # only if still empty: a cache that holds something stays


LAUNCHING = threading.Event()  # set once launch() starts its processes: a Ctrl-C is then the teardown's


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """A command's own start-up (``mpddp train`` importing torch and the trainer): a Ctrl-C exits at once.

    Raised in the middle of ``import torch``, a KeyboardInterrupt can be swallowed (measured: a SIGINT 0.4 s
    into ``mpddp train`` was lost, and the run trained to its end). Nothing has started but the forkserver,
    so the handler stops it and ends this process itself, exit code 130. Only for the command line, whose
    process is mpddp's own; ``launch()`` in a user's process uses :func:`interrupts_deferred`.
    """
    def leave(signum: int, frame: FrameType | None) -> None:
        import shutil

        if LAUNCHING.is_set():  # launch() has begun: its teardown answers the interrupt
            signals.raise_stop(KeyboardInterrupt(), signum, frame)
            return
        server = forkserver_pid()
        if server is not None:
            with contextlib.suppress(OSError):
                os.kill(server, signal.SIGKILL)
        tempdir = multiprocessing.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
        # (the forkserver's socket is in it, and atexit, which removes it, will not run)
        if tempdir:
            shutil.rmtree(tempdir, ignore_errors=True)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("mpddp: interrupted (SIGINT) before any worker started\n")
            sys.stderr.flush()
        os._exit(130)

    previous = signal.signal(signal.SIGINT, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
