"""A newcomer that comes while a node waits for a failure's record (hostile, end to end): real launchers of
``mpddp run`` on 127.0.0.1 as the nodes of one 2:3 job, on a real 3-member etcd (tests/etcd_cluster.py) or on
node 0's store (c10d).

On etcd, node 1's machine freezes (its launcher SIGSTOPped: its lease's keepalive stops too, and a lease of
60 s holds it for the test's while) and its rank is SIGKILLed, so node 0's rank sees its peer vanish and node 0 waits for
node 1's record (core/nodes/settle.py), seen as its ``waiting/0`` key in etcd. Only then does a third launcher
come, through :class:`EtcdTap` (a TCP proxy in front of one etcd member that reads its HTTP requests): node 1
thaws once etcd answered the newcomer's admission. Before core/nodes/rules.py's ``Door.FAILING`` the admission
was written first and stood as round 0's record: the group restarted for the newcomer, rank 1's death was told
nowhere, and its restart was not counted. On c10d node 1's rank leaves the group instead (a frozen launcher's
beat is found standing still in 1.5 s), and the newcomer's store operations go through a :class:`StoreTap`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from multinode import free_port
from proxies import Proxy, shut
from test_hardening5_c10d import _no_launcher_traceback, _said

from runs import Run

pytestmark = pytest.mark.timeout(180)

JOB = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"ROUND world={world} restart={count} UP rank={rank} pid={os.getpid()}", flush=True)
    step = 0
    while world < 3 and not (rank == 1 and os.path.exists(os.environ["LEAVE"])):  # the round of three ends at once
        dist.all_reduce(torch.ones(1))
        step += 1
        print(f"STEP {step}", flush=True)
        time.sleep(0.05)
    if world < 3:  # rank 1 leaves the group (its peer sees it vanish), and fails by itself once the test says
        dist.destroy_process_group()
        print("LEFT", flush=True)
        while not os.path.exists(os.environ["FAIL_GO"]):
            sum(i * i for i in range(20000))  # computing: a rank that sleeps makes no progress, and is called hung
        raise RuntimeError("rank 1 fails after it left the group")
    dist.all_reduce(torch.ones(1))  # every rank connected before any leaves
    print(f"DONE world={world} restart={count}", flush=True)
    dist.destroy_process_group()
""")


class Tap(Proxy):
    """A TCP proxy on 127.0.0.1 in front of a server (an etcd member, node 0's store), for one launcher: it forwards
    every byte both ways and reads the launcher's requests (:meth:`sought`), so that the test knows when the server
    answered the one it seeks (a newcomer's admission), without touching the launcher. One request at a time on
    a connection (HTTP/1.1 unpipelined, a TCPStore client): the first bytes back after it are its answer, sent once
    the server applied or refused it."""

    def __init__(self, port: int) -> None:
        self.answered = threading.Event()
        super().__init__(port)

    def sought(self, pending: bytes) -> tuple[bool, bytes]:
        """Whether the bytes sent so far on a connection hold the request sought, and those still to be read."""
        raise NotImplementedError

    def _carry(self, client: socket.socket, upstream: socket.socket) -> None:
        sent = threading.Event()  # this connection's request sought went up: its answer is the next bytes
        threading.Thread(target=self._up, args=(client, upstream, sent), daemon=True).start()
        threading.Thread(target=self._down, args=(upstream, client, sent), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, sent: threading.Event) -> None:
        pending = b""
        while data := _recv(client):
            found, pending = self.sought(pending + data)
            if found:
                sent.set()
            upstream.sendall(data)
        shut(upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, sent: threading.Event) -> None:
        while data := _recv(upstream):
            client.sendall(data)
            if sent.is_set():
                self.answered.set()
        shut(client)


class EtcdTap(Tap):
    """In front of an etcd member: the first transaction that creates round ``attempt``'s record (etcd3gw's JSON,
    each request with a Content-Length). A newcomer tries one only to be admitted."""

    def __init__(self, port: int, attempt: int) -> None:
        self.suffix = f"/r/{attempt}/failure"
        super().__init__(port)

    def sought(self, pending: bytes) -> tuple[bool, bytes]:
        found = False
        while (end := pending.find(b"\r\n\r\n")) >= 0:
            head = pending[:end].decode("latin-1")
            length = int(given.group(1)) if (given := re.search(r"(?im)^content-length:\s*(\d+)", head)) else 0
            if len(pending) < end + 4 + length:
                break
            body, pending = pending[end + 4:end + 4 + length], pending[end + 4 + length:]
            if head.split(" ", 2)[1].endswith("/kv/txn"):
                puts = [op["request_put"] for op in json.loads(body).get("success", []) if "request_put" in op]
                found |= any(base64.b64decode(put["key"]).decode().endswith(self.suffix) for put in puts)
        return found, pending


class StoreTap(Tap):
    """In front of node 0's store: the first operation on round ``attempt``'s door (core/nodes/c10d_keys.py's
    ``admitted``, a compare_set: the key goes as it is). A newcomer touches it only to be admitted."""

    def __init__(self, port: int, attempt: int) -> None:
        from mpddp.core.wire.protocol import full_key

        self.key = full_key(attempt, "admission").encode()
        super().__init__(port)

    def sought(self, pending: bytes) -> tuple[bool, bytes]:
        return self.key in pending, pending[1 - len(self.key):]  # a key split over two reads: found in the second


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _waiting(cluster, job_id: str, node: int, timeout: float) -> None:
    """Until node ``node`` waits for round 0's record: its ``.../r/0/waiting/<node>`` key in etcd."""
    client, deadline = cluster.client(0), time.monotonic() + timeout
    while not any(meta["key"].decode().endswith(f"/r/0/waiting/{node}")
                  for _, meta in client.get_prefix(f"/mpddp/{job_id}/")):
        assert time.monotonic() < deadline, f"node {node} did not wait for round 0's record within {timeout} s"
        time.sleep(0.05)


def _record(cluster, job_id: str) -> str | None:
    """Round 0's record in etcd, if one was written: its line."""
    for value, meta in cluster.client(0).get_prefix(f"/mpddp/{job_id}/"):
        if meta["key"].decode().endswith("/r/0/failure"):
            return json.loads(value)["line"]
    return None


def _store_waiting(port: int, node: int, timeout: float) -> None:
    """Until node ``node`` waits for round 0's record, as node 0's store says (its ``waiting/<node>`` flag)."""
    from datetime import timedelta

    import torch.distributed as dist

    from mpddp.core.wire.protocol import WAITING, full_key

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    while not store.check([full_key(0, f"{WAITING}/{node}")]):
        assert time.monotonic() < deadline, f"node {node} did not wait for round 0's record within {timeout} s"
        time.sleep(0.05)
    del store


def _env(tmp_path: Path) -> dict[str, str]:
    """The files by which the test has rank 1 leave its group (``LEAVE``), then fail (``FAIL_GO``)."""
    return {"LEAVE": str(tmp_path / "leave"), "FAIL_GO": str(tmp_path / "fail")}


def _one_story(runs: list[Run], cause: str) -> None:
    """The truth every node tells, once the three ended: rank 1's failure (``cause``) is round 0's record and
    nodes 0 and 1 tell it first, their restart counted (1 of 1); the newcomer ran nothing in round 0 and its
    first round is a restarted one; the job ends at world 3 (TORCHELASTIC_RESTART_COUNT 1), 0 on all three, no
    traceback of a launcher's own, nothing left."""
    codes = [run.finish(120) for run in runs]
    assert codes == [0, 0, 0], [run.stderr for run in runs]
    told = [_said(run)[0] for run in runs[:2]]
    assert told[0] == told[1] and told[0].startswith(f"mpddp: rank 1 (node 1, local rank 0) failed first: {cause}"), told
    for run in runs[:2]:
        assert "mpddp: restarting the group (1 of 1)" in run.stderr, run.stderr
    assert re.findall(r"ROUND world=\d restart=(\d)", runs[2].stdout)[0] == "1", runs[2].stdout
    for run in runs:
        assert "DONE world=3 restart=1" in run.stdout, run.stdout + run.stderr
        _no_launcher_traceback(run)
        run.assert_nothing_left()


def test_a_newcomer_while_a_node_waits_for_a_failures_record_comes_next_and_the_failure_is_told(
        tmp_path: Path, etcd_cluster) -> None:
    """etcd, 2:3 on nodes 0 and 1, --max-restarts 1: node 1 freezes and its rank is killed; once node 0 waits for
    node 1's record, a newcomer comes, and node 1 thaws once etcd answered the newcomer's admission: node 1's
    launcher then finds its rank killed, and writes round 0's record (:func:`_one_story`)."""
    (tmp_path / "job.py").write_text(JOB)
    job_id = f"door-{free_port()}"
    line = ["--nnodes", "2:3", "--nprocs", "1", "--rdzv-backend", "etcd", "--rdzv-id", job_id, "--local-addr",
            "127.0.0.1", "--timeout", "60", "--max-restarts", "1", "--rdzv-conf", "ttl=60"]
    env = _env(tmp_path)  # rank 1 is killed here: it neither leaves nor fails by itself
    runs: list[Run] = []
    tap = EtcdTap(etcd_cluster.client_ports[2], attempt=0)
    try:
        for node in ("0", "1"):
            (tmp_path / f"node{node}").mkdir()
            runs.append(Run(["-m", "mpddp", "run", *line, "--node-rank", node, "--rdzv-endpoint",
                             etcd_cluster.endpoints, str(tmp_path / "job.py")], tmp_path / f"node{node}", env=env))
        runs[0].wait_for(r"STEP 5\b", timeout=120)
        runs[1].wait_for(r"STEP 5\b", timeout=60)
        for run in runs:
            run.list_tree()
        frozen = psutil.Process(runs[1].proc.pid)
        frozen.send_signal(signal.SIGSTOP)  # node 1's machine freezes: its launcher, lease and all
        deadline = time.monotonic() + 10
        while frozen.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, frozen.status()
            time.sleep(0.01)
        os.kill(runs[1].worker_pids()[0], signal.SIGKILL)  # its rank dies: node 0's sees its peer vanish
        _waiting(etcd_cluster, job_id, 0, 60)
        assert _record(etcd_cluster, job_id) is None
        (tmp_path / "newcomer").mkdir()
        runs.append(Run(["-m", "mpddp", "run", *line, "--rdzv-endpoint", f"127.0.0.1:{tap.listens}",
                         str(tmp_path / "job.py")], tmp_path / "newcomer", env=env))
        assert tap.answered.wait(60), runs[2].stderr  # etcd answered its admission while node 0 waited
        frozen.send_signal(signal.SIGCONT)
        _one_story(runs, "it was killed by SIGKILL")
    finally:
        for run in runs:
            if run.proc.poll() is None:
                os.kill(run.proc.pid, signal.SIGCONT)
            run.kill()
        tap.close()


def test_c10d_a_newcomer_while_a_node_waits_for_a_failures_record_comes_next_and_the_failure_is_told(
        tmp_path: Path) -> None:
    """c10d, 2:3 on nodes 0 (the store's host) and 1, --max-restarts 1. A frozen node 1 would be found lost by its
    beat in 1.5 s, too soon to order a newcomer's start against: here node 1's rank leaves the group instead (its
    peer sees it vanish) and computes on, node 1's launcher beating, so node 0 waits for node 1's record until the
    test has that rank fail, once node 0's store answered the newcomer's admission (through a :class:`StoreTap`).
    The same truths as on etcd (:func:`_one_story`)."""
    (tmp_path / "job.py").write_text(JOB)
    port = free_port()
    line = ["--nnodes", "2:3", "--nprocs", "1", "--master-addr", "127.0.0.1", "--timeout", "60", "--max-restarts",
            "1"]
    env = _env(tmp_path)
    runs: list[Run] = []
    tap = StoreTap(port, attempt=0)
    try:
        for node in ("0", "1"):
            (tmp_path / f"node{node}").mkdir()
            runs.append(Run(["-m", "mpddp", "run", *line, "--node-rank", node, "--master-port", str(port),
                             str(tmp_path / "job.py")], tmp_path / f"node{node}", env=env))
        runs[0].wait_for(r"STEP 5\b", timeout=120)
        for run in runs:
            run.list_tree()
        (tmp_path / "leave").write_text("leave")
        runs[1].wait_for(r"LEFT", timeout=60)
        _store_waiting(port, 0, 60)
        (tmp_path / "newcomer").mkdir()
        runs.append(Run(["-m", "mpddp", "run", *line, "--master-port", str(tap.listens), str(tmp_path / "job.py")],
                        tmp_path / "newcomer", env=env))
        assert tap.answered.wait(60), runs[2].stderr  # the store answered its admission while node 0 waited
        (tmp_path / "fail").write_text("fail")
        _one_story(runs, "it raised RuntimeError: rank 1 fails after it left the group")
    finally:
        for run in runs:
            run.kill()
        tap.close()
