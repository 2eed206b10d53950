"""Process-tree teardown: list the whole tree first, then TERM, grace, KILL; never interrupted.

Owns: finding every process a worker started (DataLoader workers included),
making sure none survives, and shielding a teardown from the signals that
would cut it short: a second Ctrl-C (or a SIGTERM, a SIGHUP) while the
ranks get their grace escalates to SIGKILL at once instead of leaving them
running, and is raised again once they are gone. Leaves deciding *when* to
stop to core/launcher/attempt.py. Workers run in their own session, so their
process group catches grandchildren that were re-parented before we could
list them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator

import psutil

SHIELDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants, listed before any kill."""
    return _flat(_below(pids))


def _flat(below: dict[int, list[psutil.Process]]) -> list[psutil.Process]:
    return list({proc.pid: proc for each in below.values() for proc in each}.values())


def _below(pids: Iterable[int]) -> dict[int, list[psutil.Process]]:
    """Each of ``pids`` that runs -> [it, *its descendants]."""
    found: dict[int, list[psutil.Process]] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            found[pid] = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def children(pid: int) -> list[int]:
    """``pid``'s children, from the kernel's own list of each of its threads' children.

    psutil reads every process's stat to find them (70 files here), and in a
    launcher whose thread draws curves.png each read waited for the drawing
    to let go of the interpreter: 15-25 ms, against 0.4-11 ms for this
    (measured). psutil's scan where the kernel keeps no such list
    (CONFIG_PROC_CHILDREN). Raises psutil.NoSuchProcess once ``pid`` is gone.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    found: list[int] = []
    try:
        for tid in threads:
            with open(f"/proc/{pid}/task/{tid}/children") as listed:
                found += map(int, listed.read().split())
    except FileNotFoundError:  # a thread that just ended, or no such list in this kernel: psutil's scan
        return [p.pid for p in psutil.Process(pid).children()]
    return found


def _alive(proc: psutil.Process) -> bool:
    # A zombie is dead for our purpose; its parent (us or the forkserver) reaps it.
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _signal(procs: list[psutil.Process], groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


# Signals whose default action does not end a process (it ignores or stops it).
_DEFAULT_KEEPS = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH, signal.SIGSTOP,
                            signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def ends_at_once(pid: int, sig: int) -> bool:
    """Whether ``sig`` ends process ``pid`` by its default action: the process neither catches nor ignores it
    (the kernel's masks, /proc/PID/status). False where they cannot be read."""
    if sig in _DEFAULT_KEEPS:
        return False
    try:
        with open(f"/proc/{pid}/status") as status:
            masks = [int(line.split(":", 1)[1], 16) for line in status if line.startswith(("SigCgt:", "SigIgn:"))]
    except (OSError, ValueError):
        return False
    return len(masks) == 2 and not any(mask & (1 << (sig - 1)) for mask in masks)


def kill_tree(pids: Iterable[int], grace: float = 0.5, groups: Iterable[int] = (),
              urgent: threading.Event | None = None, passed: int | None = None) -> None:
    """Stop ``pids``, their descendants and process ``groups``: SIGTERM, then SIGKILL.

    Our own workers must not get a second chance to hang, so the grace is
    short; ``urgent`` (set by :func:`shielded`) ends it at once. ``passed``:
    a signal the launcher was told to stop by, sent to ``pids`` alone (as
    torchrun's agent sends it to its workers): their children (a checkpoint
    writer, DataLoader workers) keep running while they save, and go once
    they exit, or at the grace's end, with SIGKILL. A root that the signal ends at once (no handler) saves
    nothing: its children go first, with SIGKILL, or one of them, cut off as the root dies, may speak first
    (measured: a DataLoader worker's ConnectionResetError traceback, from multiprocessing's resource sharer,
    whose fd its rank was fetching).
    """
    groups = list(groups)
    below = _below(pids)
    procs = _flat(below)  # listed once: the roots' children are known apart for the signal that ends a root
    roots = [each[0] for each in below.values()] if passed is not None else procs
    if passed is not None:
        _signal([proc for pid, (_, *kids) in below.items() if ends_at_once(pid, passed) for proc in kids], (),
                signal.SIGKILL)
    _signal(roots, () if passed is not None else groups, signal.SIGTERM if passed is None else passed)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in roots) and not (urgent and urgent.is_set()):
        time.sleep(0.01)
    left = [p for p in procs if _alive(p)]
    if left or groups:
        _signal(left + tree(p.pid for p in left), groups, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.01)


@contextlib.contextmanager
def shielded(also: Iterable[int] = ()) -> Iterator[threading.Event]:
    """Run a teardown that SIGINT, SIGTERM and SIGHUP (and the signals ``also``, those the launch stops on)
    cannot interrupt; they set the event instead.

    Measured before: a second Ctrl-C 0.15 s after the first cut the grace
    short, the ranks (ignoring SIGTERM) lived on and the launcher hung in
    multiprocessing's exit handler, which waits for them. Each signal caught
    is raised again afterwards, when nothing is left to stop.
    """
    urgent = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield urgent  # signals reach the main thread only: nothing to shield here
        return
    caught: list[int] = []

    def escalate(signum: int, frame: object) -> None:
        caught.append(signum)
        urgent.set()

    previous = {sig: signal.signal(sig, escalate) for sig in dict.fromkeys((*SHIELDED, *also))}
    try:
        yield urgent
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for signum in dict.fromkeys(caught):
        signal.raise_signal(signum)  # its own handler runs now: KeyboardInterrupt, Terminated, ...


def signal_name(code: int) -> str:
    """``-9`` (multiprocessing's exit code for a signal) -> ``"SIGKILL"``."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
