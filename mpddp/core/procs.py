"""Process-tree teardown: list the whole tree first, then TERM, grace, KILL.

Owns: finding every process a worker started (DataLoader workers included)
and making sure none survives. Leaves deciding *when* to stop to core/supervisor.py.
Workers run in their own session, so their process group catches
grandchildren that were re-parented before we could list them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants, listed before any kill."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def _alive(proc: psutil.Process) -> bool:
    # A zombie is dead for our purpose; its parent (us or the forkserver) reaps it.
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
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


def kill_tree(pids: Iterable[int], grace: float = 0.5, groups: Iterable[int] = ()) -> None:
    """Stop ``pids``, their descendants and process ``groups``: SIGTERM, then SIGKILL.

    Our own workers must not get a second chance to hang, so the grace is short.
    """
    groups = list(groups)
    procs = tree(pids)
    _signal(procs, groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.01)
    left = [p for p in procs if _alive(p)]
    if left or groups:
        _signal(left + tree(p.pid for p in left), groups, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.01)


def signal_name(code: int) -> str:
    """``-9`` (multiprocessing's exit code for a signal) -> ``"SIGKILL"``."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
