"""Shared test helpers: finding processes a launch may have left behind; short directories for a TMPDIR."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import time
from pathlib import Path

import psutil

_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def leftovers(wait: float = 3.0) -> list[psutil.Process]:
    """Descendants of this process other than multiprocessing's helpers.

    The forkserver itself stays (it holds no CUDA and no memory beyond torch's
    import, and exits with this process); its children, the workers and the
    store server, must not. They carry the forkserver's command line (it
    forks them without exec), so a helper is told by being this process's child.
    """
    me = psutil.Process()
    deadline = time.monotonic() + wait
    while True:
        left = []
        for proc in me.children(recursive=True):
            try:
                helper = proc.ppid() == me.pid and any(h in " ".join(proc.cmdline()) for h in _HELPERS)
                if helper or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                left.append(proc)
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def running(pids: set[int] | list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def gone(pids: list[int], wait: float = 3.0) -> bool:
    """True once none of ``pids`` is running."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not running(pids):
            return True
        time.sleep(0.05)
    return False


def store_server_pid() -> int:
    """In a rank: the store server's pid, found as the process listening on the rendezvous port among its
    parent's children (the ranks' sibling under the forkserver; under spawn or fork, a child of the launcher)."""
    import os

    port = int(os.environ["MASTER_PORT"])
    for proc in psutil.Process(os.getppid()).children():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")):
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"nobody listens on port {port}")


def short_dir(prefix: str = "t-") -> Path:
    """A new directory with a short path, for a launcher's TMPDIR: removed when this test process exits.

    The forkserver's socket lies in TMPDIR (a socket's path holds 107 bytes), and pytest's ``tmp_path`` can
    leave too few of them: pytest-xdist adds a folder per worker, a longer user name a few more letters.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def told_hung(report: str, head: str, timeout: float) -> bool:
    """``report`` starts with a hang's line ``head``, its ``{s}`` the seconds without progress: any at or above
    ``timeout``, since they are the watchdog's at its first look past --timeout, later on a loaded machine (one more
    second, twice beside a second suite)."""
    found = re.match(re.escape(head).replace(re.escape("{s}"), r"(\d+)"), report)
    return found is not None and int(found[1]) >= timeout
