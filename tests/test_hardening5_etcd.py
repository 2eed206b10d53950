"""Endings under ``--rdzv-backend etcd`` (hardening 5): real launchers of ``mpddp run`` on 127.0.0.1 as the nodes of
one job on a real 3-member etcd (tests/etcd_cluster.py), and a launcher that comes when the job is ending.

The bound is the issue's: one true story on every node within --timeout + 15 s, no traceback of the launcher's own,
nothing left behind. tests/test_hardening5_c10d.py holds the same case on node 0's store.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest
from multinode import free_port
from test_hardening5_c10d import LINGER, TIMEOUT, _no_launcher_traceback, _said

from runs import Run

pytestmark = pytest.mark.timeout(240)


def _returned(cluster, job_id: str, attempt: int, timeout: float) -> None:
    """Until a node's launcher is counted as returned in round ``attempt`` (its exit barrier), in etcd: its key under
    the job's prefix (``/mpddp/<rdzv-id>/i/<incarnation>/r/<round>/returned/<node>``)."""
    client, deadline = cluster.client(0), time.monotonic() + timeout
    while not any(f"/r/{attempt}/returned/" in meta["key"].decode()
                  for _, meta in client.get_prefix(f"/mpddp/{job_id}/")):
        assert time.monotonic() < deadline, f"no node returned in round {attempt} within {timeout} s"
        time.sleep(0.05)


def test_a_newcomer_during_the_exit_barrier_is_not_needed_and_the_job_ends_once(tmp_path: Path,
                                                                               etcd_cluster) -> None:
    """etcd, 2:3 on two nodes: node 0's ranks returned, node 1's still run (the exit barrier); a third launcher
    comes. Before, it was admitted (its record created unconditionally): the group restarted, and a job that had
    finished ran again."""
    (tmp_path / "job.py").write_text(LINGER)
    job_id, runs = f"ending-{free_port()}", []
    job = ["--nnodes", "2:3", "--nprocs", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints,
           "--rdzv-id", job_id, "--local-addr", "127.0.0.1", "--timeout", f"{TIMEOUT:g}", "--rdzv-conf",
           "last_call_timeout=2", str(tmp_path / "job.py")]
    try:
        for node in ("0", "1", None):
            where = tmp_path / f"node{node or '-new'}"
            where.mkdir()
            runs.append(Run(["-m", "mpddp", "run", *(["--node-rank", node] if node else []), *job], where,
                            env={"FAIL_GO": str(tmp_path / "go")}))
            if node == "1":
                runs[0].wait_for(r"DONE rank=0 world=2", timeout=120)
                _returned(etcd_cluster, job_id, 0, 60)  # node 0's launcher is in its exit barrier: node 1's lingers
        newcomer = runs[2]
        deadline = time.monotonic() + TIMEOUT + 15
        while newcomer.proc.poll() is None and time.monotonic() < deadline:
            for run in runs:
                with contextlib.suppress(psutil.NoSuchProcess):  # the newcomer may end meanwhile
                    run.list_tree()
            time.sleep(0.1)
        (tmp_path / "go").write_text("go")
        code = newcomer.finish(60)
        said = _said(newcomer)
        assert code == 0 and len(said) == 1, newcomer.stderr
        assert said[0].startswith(f"mpddp: the job --rdzv-id {job_id} was ending as this node came"), said
        assert "STEP" not in newcomer.stdout
        assert [run.finish(60) for run in runs[:2]] == [0, 0], [run.stderr for run in runs[:2]]
        for node, run in enumerate(runs[:2]):
            assert run.stdout.count("DONE") == 1 and f"DONE rank={node} world=2" in run.stdout, run.stdout
            assert "arrived" not in run.stderr, run.stderr
        for run in runs:
            _no_launcher_traceback(run)
            run.assert_nothing_left()
    finally:
        (tmp_path / "go").write_text("go")
        for run in runs:
            run.kill()
