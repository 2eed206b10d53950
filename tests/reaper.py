"""Whatever a test run starts goes when the run goes, also when it is killed (SIGKILL, a CI's time limit) and no
fixture's teardown runs: etcd members, launchers, ranks, daemons, namespace hosts.

The run's first process (pytest, or xdist's controller) marks its environment with a token of its own
(:data:`TOKEN`), which every process it starts inherits, in whatever session or namespace, and starts this file as
a watcher in a session of its own. Once that process is gone, the watcher kills every process that carries the
token, then brings down the namespace hosts where no other run holds them (tests/multinode.py's lock). A run that
ended well has nothing left for it to find.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

TOKEN = "MPDDP_TEST_SUITE"
NETNS = Path(__file__).resolve().parent.parent / "scripts" / "netns_hosts.sh"
NETNS_LOCK = Path("/tmp/mpddp-ci-netns.lock")  # tests/multinode.py's


def watch_this_run() -> str:
    """A new token for this run, and its watcher; called once, in the run's first process."""
    token = os.environ[TOKEN] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != TOKEN}  # the watcher is not one of the run's processes
    # started by a shell that returns at once: no child of this run's (tests count those as left running)
    subprocess.run(["sh", "-c", '"$0" "$@" &', sys.executable, __file__, str(os.getpid()), token], env=env,
                   start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    return token


def carrying(name: str, value: str) -> list[psutil.Process]:
    """The live processes (this one aside) whose environment sets ``name`` to ``value``: a run's (:data:`TOKEN`), or
    one launcher's (tests/runs.py's marker)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def marked(token: str) -> list[psutil.Process]:
    """The live processes of the run whose token is ``token``."""
    return carrying(TOKEN, token)


def reap(token: str) -> None:
    """Kill the run's processes (again while new ones appear: a launcher forks as it dies), then its hosts."""
    for _ in range(10):
        if not (left := marked(token)):
            break
        for proc in left:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=2.0)
    _hosts_down()


def _hosts_down() -> None:
    """The namespace hosts, unless another run holds them: their lock is free once their run's process died."""
    import fcntl

    if shutil.which("ip") is None or not NETNS_LOCK.exists() or subprocess.run(
            ["ip", "link", "show", "mpddp-br0"], capture_output=True, check=False).returncode != 0:
        return
    with open(NETNS_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        subprocess.run([str(NETNS), "down"], capture_output=True, timeout=60, check=False)


if __name__ == "__main__":
    run, token = psutil.Process(int(sys.argv[1])), sys.argv[2]
    while run.is_running() and run.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.5)
    reap(token)
