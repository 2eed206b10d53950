"""etcd used as etcd is meant to be used: a job that trains writes nothing to its Raft log, and an etcd that is full
(its NOSPACE alarm) is one line on every node, never a traceback or a silent hang; a job that ends leaves no key
and compacts the history it made.

Real launchers as the nodes of one job, on a real 3-member etcd whose quota (``--quota-backend-bytes``) is 256 KiB:
when every beat put into etcd (2.0 Raft writes and 4.3 KB a node a second, scripts/bench_etcd_writes.py), three
nodes raised the NOSPACE alarm within 20 s of training and ended in tracebacks.
"""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from runs import Run

JOB = str(Path(__file__).parent / "scripts" / "collectives_until_failed.py")  # ranks all_reduce; one fails

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("etcd") is None,
                                                          reason="Debian's etcd-server is not installed")]
QUOTA = 256 * 1024  # bytes: what 20 s of a put a beat filled, three nodes

FAILED_FIRST = "mpddp: rank 1 (node 1, local rank 0) failed first: it raised RuntimeError: rank 1 fails on purpose"


@pytest.fixture
def small_etcd():
    pytest.importorskip("etcd3gw")
    from etcd_cluster import EtcdCluster

    with EtcdCluster(quota_bytes=QUOTA) as cluster:
        yield cluster


def _counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _alarms(cluster) -> list[str]:
    client = cluster.client(cluster.leader_index(), 5)
    return [a.get("alarm") for a in client.post(client.get_url("/maintenance/alarm"), json={"action": "GET"})
            .get("alarms", [])]


def _job(tmp_path, cluster, nodes=3) -> list[Run]:
    runs = []
    for node in range(nodes):
        where = tmp_path / f"node{node}"
        where.mkdir()
        runs.append(Run(["-m", "mpddp", "run", "--nnodes", str(nodes), "--node-rank", str(node), "--nprocs", "1",
                         "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "budget",
                         "--local-addr", "127.0.0.1", "--timeout", "20", JOB, "1", "100"], where,
                        env={"FAIL_AT": str(tmp_path / "fail")}))
    for run in runs:
        run.wait_for(r"STEP 100\b", timeout=120)
    return runs


def _fail_and_end(tmp_path, runs: list[Run]) -> float:
    """Rank 1 fails; every launcher exits 1 naming it, with no traceback; the seconds until the last exited."""
    for run in runs:
        run.list_tree()
    (tmp_path / "fail").write_text("now")
    failed = time.monotonic()
    for run in runs:
        run.proc.wait(60)
    took = time.monotonic() - failed
    for node, run in enumerate(runs):
        assert run.proc.returncode == 1, (node, run.stderr)
        assert FAILED_FIRST in run.stderr, (node, run.stderr)
        assert "Traceback" not in run.stderr.split("mpddp: traceback of rank")[0], (node, run.stderr)
        assert "etcd3gw" not in run.stderr, (node, run.stderr)
    for run in runs:
        run.assert_nothing_left()
    return took


def _assert_tidy(cluster) -> None:
    """The job's keys are gone, and etcd's history before its end compacted:
    a job leaves etcd as flat as it found it."""
    from etcd3gw.exceptions import Etcd3Exception

    client = cluster.client(0, 5)
    assert client.get_prefix("/mpddp/budget/") == []
    with pytest.raises(Etcd3Exception):  # etcd refuses to read a revision that was compacted away
        client.post(client.get_url("/kv/range"), json={"key": "L21wZGRw", "revision": 2})  # "/mpddp", at revision 2


def test_a_job_that_trains_writes_nothing_to_etcd_and_its_failure_is_told_everywhere(tmp_path, small_etcd):
    runs = _job(tmp_path, small_etcd)
    try:
        leader = small_etcd.client_ports[small_etcd.leader_index()]
        writes, size = (_counter(leader, n) for n in ("etcd_server_proposals_committed_total",
                                                      "etcd_mvcc_db_total_size_in_use_in_bytes"))
        started = time.monotonic()
        time.sleep(20)  # with a put a beat, three nodes filled the 256 KiB quota within this
        seconds = time.monotonic() - started
        written = _counter(leader, "etcd_server_proposals_committed_total") - writes
        grown = _counter(leader, "etcd_mvcc_db_total_size_in_use_in_bytes") - size
        assert written / (3 * seconds) <= 0.2, written  # the bar; measured: 0
        assert grown <= 0, grown
        assert _alarms(small_etcd) == []
        assert _fail_and_end(tmp_path, runs) < 20  # within --timeout; measured 0.3-0.5 s
        _assert_tidy(small_etcd)
    finally:
        for run in runs:
            run.kill()


def test_an_etcd_that_another_client_fills_is_one_line_on_every_node(tmp_path, small_etcd):
    from etcd3gw.exceptions import Etcd3Exception

    runs = _job(tmp_path, small_etcd)
    try:
        client, filled = small_etcd.client(0, 5), 0
        with pytest.raises(Etcd3Exception):  # another user of the same etcd fills it
            while filled < 100:
                client.put(f"/someone-else/{filled}", "x" * (64 * 1024))
                filled += 1
        assert "NOSPACE" in _alarms(small_etcd)
        for run in runs:  # they train on: each prints 3 more hundreds of steps (a launcher that ended fails it)
            run.wait_for(r"STEP \d+", count=len(re.findall(r"STEP \d+", run.stdout)) + 3, timeout=60)
        assert _fail_and_end(tmp_path, runs) < 20
        for run in runs:  # etcd took no write once rank 1 failed: the record went through the round's store
            full = [line for line in run.stderr.splitlines() if "is full: its NOSPACE alarm is raised" in line]
            assert len(full) == 1, run.stderr
            assert "--quota-backend-bytes" in full[0] and "etcdctl alarm disarm" in full[0]
    finally:
        for run in runs:
            run.kill()


def test_a_job_that_starts_on_a_full_etcd_is_one_line_on_every_node(tmp_path, small_etcd):
    from etcd3gw.exceptions import Etcd3Exception

    client, filled = small_etcd.client(0, 5), 0
    with pytest.raises(Etcd3Exception):  # another user of the same etcd filled it before the job came
        while filled < 100:
            client.put(f"/someone-else/{filled}", "x" * (64 * 1024))
            filled += 1
    assert "NOSPACE" in _alarms(small_etcd)
    runs = [Run(["-m", "mpddp", "run", "--nnodes", "2", "--node-rank", str(node), "--nprocs", "1", "--rdzv-backend",
                 "etcd", "--rdzv-endpoint", small_etcd.endpoints, "--rdzv-id", "full", "--local-addr", "127.0.0.1",
                 "--timeout", "20", JOB, "1", "100"], tmp_path, env={"FAIL_AT": str(tmp_path / "fail")})
            for node in range(2)]
    try:
        for run in runs:
            run.proc.wait(60)
            lines = run.stderr.strip().splitlines()
            assert run.proc.returncode != 0 and len(lines) == 1, run.stderr
            assert "is full: its NOSPACE alarm is raised" in lines[0] and "--quota-backend-bytes" in lines[0]
            assert "STEP" not in run.stdout
            run.assert_nothing_left()
    finally:
        for run in runs:
            run.kill()
