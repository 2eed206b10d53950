"""Many jobs on one machine, and single-node jobs that listen on loopback only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from runs import REPO, SCRIPTS, Run, marked, port_is_free

pytestmark = pytest.mark.usefixtures("no_leftovers")

LAUNCHES = 8


@pytest.mark.bench  # a step of its own in .ci/run: eight launches at once load the machine's 2 cores for a minute
@pytest.mark.timeout(300)
def test_eight_launches_at_the_same_moment_all_succeed(tmp_path):
    """No "Address already in use": each launcher holds its own OS-chosen port."""
    cmd = [sys.executable, "-m", "mpddp", "run", "--nprocs", "2", str(SCRIPTS / "torchrun_style.py")]
    outs = [open(tmp_path / f"out{i}.txt", "w+") for i in range(LAUNCHES)]
    errs = [open(tmp_path / f"err{i}.txt", "w+") for i in range(LAUNCHES)]
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=o, stderr=e, cwd=REPO) for o, e in zip(outs, errs)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"{LAUNCHES} launches of 2 ranks each, all at once: {time.monotonic() - start:.1f} s")
    for i, code in enumerate(codes):
        outs[i].seek(0)
        errs[i].seek(0)
        out, err = outs[i].read(), errs[i].read()
        assert code == 0, f"launch {i}: {err}"
        assert "Address already in use" not in err and "EADDRINUSE" not in err
        results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]
        assert sorted(r["rank"] for r in results) == [0, 1] and {r["sum"] for r in results} == {3.0}, out


@pytest.mark.timeout(120)
def test_a_single_node_job_listens_on_loopback_only(tmp_path):
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(SCRIPTS / "fail_modes.py"), "block"], tmp_path)
    try:
        run.wait_for(r"READY rank=\d", count=2)  # after init_process_group and a barrier
        pids = run.list_tree()
        port = run.port()
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.pid in pids and c.status == psutil.CONN_LISTEN]
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 143, run.stderr
        run.assert_nothing_left()
        assert port_is_free(port)
    finally:
        run.kill()
    addresses = sorted({(c.laddr.ip, c.laddr.port) for c in listening})
    print("listening sockets of the run:", addresses)
    assert (("127.0.0.1", port)) in addresses  # the store, held by the launcher
    public = [a for a in addresses if a[0] not in ("127.0.0.1", "::1")]
    assert not public, f"listening on non-loopback addresses: {public}"
    assert not marked(run.marker)
