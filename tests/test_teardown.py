"""Nothing escapes: teardown under every signal, a killed launcher or forkserver, launches from threads.

Each case drives a real ``python -m mpddp run`` in its own session (SIGINT at
its default action) and checks with psutil that no process of the job is
left, zombies and the ranks' own children included (one of them in a session
of its own), and no temporary directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from runs import SCRIPTS, Run, marked

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]

FAIL_MODES = str(SCRIPTS / "fail_modes.py")
BOUND = 8.0  # seconds until every process of the run is gone (a loaded 2-core machine)


def stubborn(tmp_path, extra: str = "") -> tuple[Run, set[int]]:
    """Two ranks that ignore SIGTERM, each with a child in its group and one in a session of its own."""
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", FAIL_MODES, "stubborn", *([extra] if extra else [])], tmp_path)
    found = run.wait_for(r"READY rank=\d children=([\d,]+)", count=2)
    children = {int(pid) for m in found for pid in m.group(1).split(",")}
    time.sleep(0.2)
    return run, run.list_tree() | children


def finished(run: Run, pids: set[int], timeout: float = 30.0) -> int:
    rc = run.finish(timeout)
    run.all_gone_at(pids, BOUND)
    run.assert_nothing_left()
    return rc


def test_ctrl_c_twice_while_ranks_ignore_sigterm_leaves_nothing(tmp_path):
    run, pids = stubborn(tmp_path)
    try:
        run.proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
        run.proc.send_signal(signal.SIGINT)  # during the teardown's grace: escalate, never cut it short
        rc = finished(run, pids)
    finally:
        run.kill()
    assert rc == 130, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "mpddp: interrupted (SIGINT); every worker was stopped"
    assert "Traceback" not in run.stderr and "atexit" not in run.stderr


def test_ctrl_c_during_the_grace_after_a_failure_leaves_nothing(tmp_path):
    run, pids = stubborn(tmp_path, "raise")
    try:
        run.go()
        run.fail_time()
        time.sleep(0.35)  # the failure window has closed: rank 0 (ignoring SIGTERM) is in its grace
        run.proc.send_signal(signal.SIGINT)
        rc = finished(run, pids)
    finally:
        run.kill()
    assert rc == 130, run.stderr
    assert "atexit" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr


@pytest.mark.parametrize("extra, code", [("raise", 1), ("kill", 137)])
def test_a_failed_rank_takes_its_own_session_children_along(tmp_path, extra, code):
    run, pids = stubborn(tmp_path, extra)
    try:
        run.go()
        rc = finished(run, pids)
    finally:
        run.kill()
    assert rc == code, run.stderr


def test_sighup_of_the_launcher_stops_the_ranks_and_their_children(tmp_path):
    run, pids = stubborn(tmp_path)
    try:
        run.proc.send_signal(signal.SIGHUP)
        rc = finished(run, pids)
    finally:
        run.kill()
    assert rc == 129, run.stderr
    assert run.stderr.strip().splitlines()[-1] == \
        "mpddp: hung up (SIGHUP: the terminal or SSH session closed); every worker was stopped"


def test_sigkill_of_the_launcher_leaves_no_process_and_no_temp_dir(tmp_path):
    run, pids = stubborn(tmp_path)
    try:
        run.proc.send_signal(signal.SIGKILL)  # nothing in the launcher runs after this
        run.finish(10)
        run.all_gone_at(pids, BOUND)
        run.assert_nothing_left()  # the forkserver cleaned up: no rank, no child, no /tmp/pymp-*
    finally:
        run.kill()


def test_after_a_normal_exit_no_helper_is_left_at_once(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n")
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(script)], tmp_path)
    try:
        assert run.finish(60) == 0, run.stderr
        left = [p.pid for p in marked(run.marker)]  # at once: no grace for the forkserver or the resource tracker
    finally:
        run.kill()
    assert not left, left


def test_a_killed_forkserver_is_named(tmp_path):
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", FAIL_MODES, "block"], tmp_path)
    try:
        run.wait_for(r"READY rank=\d", count=2)
        pids = run.list_tree()
        server = [p for p in psutil.Process(run.proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
        assert len(server) == 1
        server[0].kill()
        rc = finished(run, pids)
    finally:
        run.kill()
    assert rc == 1, run.stderr
    assert re.search(r"was lost with mpddp's forkserver \(pid \d+\), which starts every rank and reports its "
                     r"exit: it was killed from outside", run.stderr), run.stderr
    assert "exited with code 255" not in run.stderr


THREADS = textwrap.dedent("""
    import threading, time
    import torch.distributed as dist
    import mpddp

    def f(ctx, seconds=0.0):
        time.sleep(seconds)
        dist.barrier()
        return ctx.rank

    if __name__ == "__main__":
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("thread", mpddp.launch(f, nprocs=2)))
        t.start()
        t.join()  # the thread that started the forkserver is gone
        print("after thread", out["thread"], mpddp.launch(f, nprocs=2), flush=True)

        def run(name, seconds):
            out[name] = mpddp.launch(f, nprocs=2, args=(seconds,))

        both = [threading.Thread(target=run, args=("fast", 0.0)), threading.Thread(target=run, args=("slow", 3.0))]
        [x.start() for x in both]
        [x.join() for x in both]
        print("concurrent", out["fast"], out["slow"], flush=True)
""")


def test_launches_from_threads_one_after_another_and_at_once(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["after thread [0, 1] [0, 1]", "concurrent [0, 1] [0, 1]"], out.stderr


def test_a_tmpdir_too_long_for_the_forkservers_socket_is_one_line(tmp_path):
    long = tmp_path / ("t" * (110 - len(str(tmp_path))))
    long.mkdir()
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    out = subprocess.run([sys.executable, "-m", "mpddp", "run", "--nprocs", "1", str(script)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "TMPDIR": str(long)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"mpddp: error: TMPDIR={str(long)!r} is too long for the forkserver's socket")
    assert len(out.stderr.strip().splitlines()) == 1 and "ran" not in out.stdout
    assert not list(long.iterdir())


def test_the_forkserver_tells_a_dead_or_dying_launcher_from_one_that_stopped_it(monkeypatch):
    """The forkserver removes the launcher's temporary directory only when the launcher is gone: re-parented,
    or the parent a zombie (dead, not yet reaped) or exiting; not when a live launcher merely stopped it."""
    from mpddp.core.rank import forkserver

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while psutil.Process(dead.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped: a zombie
            time.sleep(0.01)
        for parent, gone in ((live.pid, False), (dead.pid, True)):
            monkeypatch.setattr(forkserver.os, "getppid", lambda parent=parent: parent)  # as its forkserver sees it
            assert forkserver._gone(parent) is gone
        monkeypatch.undo()
        assert forkserver._gone(live.pid)  # not this process's parent: re-parented, the launcher is gone
    finally:
        live.kill()
        live.wait()
        dead.wait()


def test_children_are_the_kernels_list_of_every_threads_children(tmp_path):
    """teardown.children reads each thread's list: a child started from a second thread is there too, and the
    result is psutil's own scan of every process's parent."""
    from mpddp.core.procs import teardown

    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import subprocess, sys, threading, time
        sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
        kids = [subprocess.Popen(sleep) for _ in range(2)]
        threading.Thread(target=lambda: kids.append(subprocess.Popen(sleep))).start()
        while len(kids) < 3:
            time.sleep(0.01)
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        started = {int(pid) for pid in parent.stdout.readline().split()}
        assert len(started) == 3
        assert sorted(teardown.children(parent.pid)) == sorted(p.pid for p in psutil.Process(parent.pid).children())
        assert set(teardown.children(parent.pid)) == started
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    with pytest.raises(psutil.NoSuchProcess):
        teardown.children(parent.pid)
