"""tests/etcd_cluster.py's EtcdCluster: a real 3-member etcd cluster on loopback (Debian's etcd-server)."""

from __future__ import annotations

import importlib.util
import shutil
import time
import uuid

import psutil
import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("etcd") is None,
                       reason="Debian's etcd-server is not installed: apt-get install etcd-server"),
    pytest.mark.skipif(importlib.util.find_spec("etcd3gw") is None,
                       reason="etcd3gw is not installed: pip install -e '.[etcd]'"),
]  # fmt: skip


@pytest.mark.timeout(60)
def test_every_member_answers(etcd_cluster):
    ports = etcd_cluster.client_ports
    assert etcd_cluster.endpoints == ",".join(f"127.0.0.1:{port}" for port in ports)
    assert len(set(ports)) == 3 and len(set(etcd_cluster.pids)) == 3
    key, value = f"/test/{uuid.uuid4().hex}", uuid.uuid4().hex
    etcd_cluster.client(0).put(key, value)
    for i in (1, 2):
        assert etcd_cluster.client(i).get(key) == [value.encode()], f"member {i} does not read member 0's key"
        etcd_cluster.client(i).put(f"{key}/{i}", "x")
        assert etcd_cluster.client(0).get(f"{key}/{i}") == [b"x"]
    assert etcd_cluster.leader_index() in (0, 1, 2)


def put_get(cluster, index: int, key: str, within: float) -> float:
    """Seconds until member ``index`` answers a put and a get of ``key`` (tries for ``within`` seconds)."""
    from etcd3gw.exceptions import Etcd3Exception

    start = time.monotonic()
    while True:
        try:
            cluster.client(index, timeout=0.5).put(key, "after")
            if cluster.client(index, timeout=0.5).get(key) == [b"after"]:
                return time.monotonic() - start
        except Etcd3Exception:
            if time.monotonic() - start > within:
                raise
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_new_leader_after_the_leader_is_killed():
    from etcd_cluster import EtcdCluster

    with EtcdCluster() as cluster:  # not the module's: this one loses a member
        leader = cluster.leader_index()
        cluster.kill(leader)
        assert not psutil.pid_exists(cluster.pids[leader])
        others = [i for i in range(3) if i != leader]
        for i in others:
            assert put_get(cluster, i, f"/test/after-kill/{i}", within=10) < 10
        assert cluster.leader_index() in others


@pytest.mark.timeout(60)
def test_nothing_left_after_exit():
    from etcd_cluster import EtcdCluster

    with EtcdCluster() as cluster:
        procs = [psutil.Process(pid) for pid in cluster.pids]
        assert all(proc.name() == "etcd" for proc in procs)
        directory = cluster.dir
        assert directory is not None and directory.is_dir()
    # is_running() is True for a zombie and False for a new process that took the pid
    assert not [proc.pid for proc in procs if proc.is_running()], "etcd members left (or left unreaped)"
    assert not directory.exists()
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(directory) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes still using {directory}: {left}"
