"""The forkserver's second job: nothing of a launch outlives its launcher, even one killed by SIGKILL.

Owns: :func:`serve_if_forkserver` (called by core/rank/worker.py, which the forkserver imports first),
:func:`ignore_interrupts` (the terminal's Ctrl-C is the launcher's, not the forkserver's) and giving its
children their SIGINT back (:func:`interrupts_as_before`). The
forkserver, every rank's parent, becomes a *child subreaper*: the orphans of a dead rank (a
``start_new_session=True`` child, a DataLoader worker) come to it, not to init, and the launcher stops them. When
the launcher is gone, it kills every process below it, removes the launcher's multiprocessing temporary directory
and leaves at once (``os._exit``: no slow teardown with torch loaded). Its process group is its own, so a kill of
the launcher's group (Jupyter's) does not take it before it has cleaned up.

Why here: a process killed by SIGKILL cannot clean up, so what cleans up must exist before it and outlive it. It
learns of the death from a parent-death signal it *handles* (the stdlib's "alive" pipe does not tell: every rank
holds its write end). That signal follows the *thread* that started the forkserver, so the handler checks that the
parent process is really gone. When the pipe closes (every rank gone), the stdlib's SystemExit runs the same
clean-up from atexit. No thread is started here: a thread could hold a lock at the moment of a fork.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import time
import warnings

from ..wire import signals
from ..wire.signals import LAUNCHER_GONE

FORKSERVER_PARENT = "MPDDP_FORKSERVER_PARENT"  # set by core/launcher/startup.py while it starts the forkserver
FORKSERVER_TEMP = "MPDDP_FORKSERVER_TEMP"  # the launcher's multiprocessing temporary directory
_PF_EXITING = 0x4  # include/linux/sched.h: the task is exiting


def serve_if_forkserver() -> None:
    """In the forkserver (and only there): adopt orphans, and clean up after the launcher at exit."""
    launcher = os.environ.pop(FORKSERVER_PARENT, None)
    temp = os.environ.pop(FORKSERVER_TEMP, None)
    if launcher is None:
        return  # a worker (the forkserver took the variable out before its first fork), or any other interpreter
    me, parent = os.getpid(), int(launcher)
    cache = new_inductor_cache()
    if launcher != str(os.getppid()):
        # The launcher died while this forkserver still imported torch (it was SIGKILLed a second or two after it
        # started): nobody else removes its temporary directory, and no rank is coming.
        _clean_up(me, parent, temp, cache)

    def launcher_gone(signum: int, frame: object) -> None:
        if os.getpid() == me and os.getppid() != parent:  # not merely the starting thread that ended
            _clean_up(me, parent, temp, cache)

    signal.signal(LAUNCHER_GONE, launcher_gone)
    # A process group of its own: a Jupyter kernel's shutdown signals the children in the kernel's group and
    # its manager then kills that group with SIGKILL, which would take the forkserver before it cleans up
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signals.prctl(signals.PR_SET_CHILD_SUBREAPER, 1)
    signals.on_parent_death(LAUNCHER_GONE)
    if os.getppid() != parent:  # the launcher died before the signal was armed
        _clean_up(me, parent, temp, cache)
    # the standard library's forkserver reaps adopted orphans too, and warns about each one
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_clean_up, me, parent, temp, cache)


_INTERRUPT_BEFORE: object = None  # SIGINT's handler in this forkserver before it ignored it; None elsewhere


def ignore_interrupts() -> None:
    """In the forkserver, first thing: a Ctrl-C is not its own. The terminal sends it to the launcher's whole
    process group, and the forkserver is still in it while it imports torch: measured, 2 of 8 Ctrl-Cs in the
    first seconds of ``mpddp train`` printed its 20-40 line KeyboardInterrupt traceback beside the launcher's
    one line. The launcher stops it, and its ranks. The launcher blocked SIGINT while it started this process
    (core/launcher/startup.py), so one sent before this moment waits, blocked, and is dropped here."""
    global _INTERRUPT_BEFORE
    _INTERRUPT_BEFORE = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def interrupts_as_before() -> None:
    """In a process the forkserver forked (a rank, the store server): SIGINT as the launcher had it, not the
    forkserver's ignored one (the standard library's forkserver gives its children its own handlers back)."""
    if callable(_INTERRUPT_BEFORE) or _INTERRUPT_BEFORE in (signal.SIG_DFL, signal.SIG_IGN):
        signal.signal(signal.SIGINT, _INTERRUPT_BEFORE)  # type: ignore[arg-type]


def new_inductor_cache() -> str | None:
    """torch's compile cache directory if importing torch._dynamo (a preload, or a rank's) is about to create it.

    ``import torch._dynamo`` makes ``$TMPDIR/torchinductor_<user>`` at once, empty. A launch that
    stopped at a bad option, or whose ranks never compiled anything, must not leave it behind: the forkserver
    removes it as it exits, and under fork and spawn the launcher (core/launcher/startup.py's start_context).
    """
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None  # the user's own choice
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        return None
    path = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))  # torch's name
    return None if os.path.exists(path) else path


def _clean_up(me: int, launcher: int, temp: str | None, cache: str | None) -> None:
    """Kill everything below this forkserver, remove the temp dir if the launcher died, exit now."""
    if os.getpid() != me:
        return  # a forked child that inherited the hook
    import psutil

    try:
        below = psutil.Process().children(recursive=True)
    except psutil.Error:
        below = []
    for proc in below:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank's process group: its children too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0 and not any(_alive(p) for p in below):
                break
        except ChildProcessError:
            break
        time.sleep(0.01)
    if temp and _gone(launcher):  # the launcher died without removing it
        shutil.rmtree(temp, ignore_errors=True)
    if cache is not None:
        with contextlib.suppress(OSError):
            os.rmdir(cache)  # only if still empty: a cache that holds something stays
    os._exit(0)


def _gone(launcher: int) -> bool:
    """Whether the launcher is dead or dying, not merely done with this forkserver (it stopped its helpers).

    Re-parented: dead. Else it may be exiting: a killed launcher's pipe closes while the kernel tears it down,
    before this process is re-parented, and the standard library's SystemExit on that closed pipe can come
    first. Linux marks a task that exits (PF_EXITING in /proc/PID/stat's flags) before it closes its files.
    """
    if os.getppid() != launcher:
        return True
    try:
        with open(f"/proc/{launcher}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
    except OSError:
        return True
    state, flags = fields[0], int(fields[6])  # the 3rd and 9th fields of proc(5)
    return state in ("Z", "X", "x") or bool(flags & _PF_EXITING)


def _alive(proc: object) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE  # type: ignore[attr-defined]
    except psutil.Error:
        return False
