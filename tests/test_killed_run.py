"""A test run that is killed (SIGKILL: a CI's time limit, a user's kill -9) leaves nothing running, though no
fixture's teardown ran: tests/reaper.py's watcher kills what the run started once the run's process is gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from reaper import marked

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).parent / "scripts" / "killed_run.py"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(180)
def test_a_killed_run_leaves_no_etcd_member_launcher_or_rank(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("Debian's etcd-server is not installed: scripts/ci_etcd.sh install")
    out = tmp_path / "held.json"
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                            "--basetemp", str(tmp_path / "run"), str(PROBE)], cwd=REPO, start_new_session=True,
                           env={**os.environ, "KILLED_RUN_OUT": str(out)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.exists(), f"the run did not start its cluster (exit code {run.poll()})"
        held = json.loads(out.read_text())
        assert len(held["pids"]) >= 6 and all(map(_running, held["pids"]))  # 3 members, a launcher, 2 ranks (+ its own)
        # the run's process alone: its cluster and launcher are in sessions of their own
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 30  # the watcher looks twice a second; measured: gone 0.6 to 1.5 s after
        while (left := [pid for pid in held["pids"] if _running(pid)] + [p.pid for p in marked(held["token"])]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [psutil.Process(pid).cmdline() for pid in left if psutil.pid_exists(pid)]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
