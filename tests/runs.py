"""Watching a real ``python -m mpddp ...`` launch from outside, for reliability tests.

A :class:`Run` starts the launcher with a marker in its environment (every
worker and DataLoader worker inherits it), its own TMPDIR and output files,
lists the whole process tree while it runs, and answers afterwards what is
left: processes (found by the marker, so re-parented ones count too),
zombies, temporary files and listening ports.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from reaper import carrying

from helpers import running, short_dir

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"


class Run:
    """One launcher started by a test, the one harness of every test that starts launchers: alone, as one node of
    a :class:`~multinode.Cluster`, or on a namespace host (tests/machines.py)."""

    def __init__(self, argv: list[str], tmp_path: Path, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None, command: list[str] | None = None, name: str | None = None) -> None:
        """Start ``python *argv`` (e.g. ``["-m", "mpddp", "run", ...]``), or ``command`` (mpirun ...), in
        ``tmp_path``, behind ``prefix`` (a namespace host's, tests/machines.py); its output in ``NAME.out`` and
        ``NAME.err`` where ``name`` is given (several launchers in one folder), else ``stdout.txt`` and
        ``stderr.txt``."""
        self.marker = uuid.uuid4().hex
        self.tmpdir = short_dir("run-")
        self.go_file = tmp_path / "go"
        self.out_path, self.err_path = ((tmp_path / f"{name}.out", tmp_path / f"{name}.err") if name else
                                        (tmp_path / "stdout.txt", tmp_path / "stderr.txt"))
        self.started = time.monotonic()
        full_env = dict(os.environ, MPDDP_TEST_RUN=self.marker, TMPDIR=str(self.tmpdir), FAIL_GO=str(self.go_file))
        full_env.pop("PYTEST_CURRENT_TEST", None)
        full_env.update(env or {})
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # its own session, SIGINT at its default action (tests/conftest.py): as from a terminal
            self.proc = subprocess.Popen([*(prefix or []), *(command or [sys.executable, *argv])], stdout=out,
                                         stderr=err, env=full_env, cwd=tmp_path, start_new_session=True,
                                         restore_signals=True)
        self.pids: set[int] = set()
        self.exited_at: float | None = None

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def said(self) -> list[str]:
        """mpddp's own lines on its terminal (:func:`said`)."""
        return said(self.stderr)

    def assert_no_launcher_frame(self) -> None:
        """No frame of mpddp's own on the launcher's terminal (a rank's traceback in the report shows the script's)."""
        assert not re.search(r'File "[^"]*/mpddp/', self.stderr), self.stderr

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60.0,
                 also: tuple[Run, ...] = ()) -> list[re.Match[str]]:
        """Wait until ``pattern`` matched ``count`` times in stdout; fail if the launcher exits first, telling its
        output and that of the launchers ``also`` (the other nodes: one of them may hold the cause)."""
        deadline = time.monotonic() + timeout
        while True:
            found = list(re.finditer(pattern, self.stdout))
            if len(found) >= count:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                others = "".join(f"\n--- another launcher (rc={r.proc.poll()}):\n{r.stdout}\n{r.stderr}" for r in also)
                raise AssertionError(f"no {count}× {pattern!r} (rc={self.proc.poll()}):\n{self.stdout}\n{self.stderr}"
                                     f"{others}")
            time.sleep(0.02)

    def list_tree(self) -> set[int]:
        """The launcher and every descendant now, plus processes carrying the marker."""
        root = psutil.Process(self.proc.pid)
        self.pids |= {root.pid, *(p.pid for p in root.children(recursive=True))}
        self.pids |= {p.pid for p in marked(self.marker)}
        return self.pids

    def go(self) -> None:
        self.go_file.write_text("go")

    def worker_pids(self) -> list[int]:
        return [int(m.group(1)) for m in re.finditer(r"UP rank=\d+ pid=(\d+)", self.stdout)]

    def port(self) -> int:
        return int(self.wait_for(r"port=(\d+)")[0].group(1))

    def fail_time(self) -> float:
        return float(self.wait_for(r"FAIL_AT ([0-9.]+)")[0].group(1))

    def all_gone_at(self, pids: set[int], timeout: float = 30.0) -> float:
        """Monotonic time at which none of ``pids`` runs any more (zombies count as gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not running(pids):
                return time.monotonic()
            time.sleep(0.01)
        raise AssertionError(f"still running after {timeout} s: {running(pids)}")

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        self.exited_at = time.monotonic()
        return rc

    def kill(self) -> None:
        """Last resort in a failing test: nothing of the run may outlive it."""
        for pid in [*(p.pid for p in marked(self.marker)), *running(self.pids)]:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:  # gone since it was listed
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def assert_nothing_left(self) -> None:
        """No process of the run (not even a zombie), no temp file, no listening socket on its port."""
        self.assert_no_process_left()
        assert not list(self.tmpdir.iterdir()), f"temporary files left: {list(self.tmpdir.iterdir())}"

    def assert_no_process_left(self) -> None:
        """No process of the run, not even a zombie, within 3 s: all a lost machine's run is checked for (its
        temporary files are its lost disk's)."""
        deadline = time.monotonic() + 3.0
        while ((left := alive_or_zombie(self.pids) + [p.pid for p in marked(self.marker)])
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert not left, f"processes of the run left: {describe(left)}"


def said(stderr: str) -> list[str]:
    """mpddp's own lines of ``stderr`` (on a loaded machine torch's store client may print its retries between
    them)."""
    return [line for line in stderr.splitlines() if line.startswith("mpddp:")]


RESTARTING = re.compile(r"mpddp: restarting the group \((\d+) of \d+\)")


def rounds_told(stderr: str) -> tuple[list[tuple[str, int]], list[str]]:
    """What a launcher of a job that restarted said, from mpddp's own lines (a rank's C++ warning may come between
    any two lines of the file): each round's cause, the line before its "restarting the group (k of n)", with k;
    and its lines after the last restart (the job's end)."""
    lines, rounds, last = said(stderr), [], 0
    for i, line in enumerate(lines):
        if (found := RESTARTING.fullmatch(line)) and i > 0:
            rounds.append((lines[i - 1], int(found.group(1))))
            last = i + 1
    return rounds, lines[last:]


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``MPDDP_TEST_RUN=marker``."""
    return carrying("MPDDP_TEST_RUN", marker)


def alive_or_zombie(pids: set[int]) -> list[int]:
    """``pids`` still in the process table: running, or zombies that a process of ours should reap.

    A zombie re-parented to the machine's init is init's to reap (a container
    without an init, such as ``docker run`` without ``--init``, never does).
    """
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE or proc.ppid() in pids | {os.getpid()}:
                left.append(pid)
        except psutil.NoSuchProcess:
            continue
    return left


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {p.status()} ppid={p.ppid()} {' '.join(p.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid} gone")
    return out


def port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` any more, and the launcher's own bind would succeed again."""
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    if listening:
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True
