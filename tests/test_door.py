"""The round's door: a launcher that comes while the job runs is admitted by a restart only while no node's rank
failed, no node waits for a failure's record, and no node's ranks returned (core/nodes/rules.py's ``door``), on both
backends: node 0's store (c10d) and etcd.

End to end, real launchers of ``mpddp run`` on 127.0.0.1 on a real 3-member etcd (tests/etcd_cluster.py) or on
node 0's store, a newcomer timed by a proxy that reads the requests it carries (:class:`EtcdTap`,
:class:`StoreTap`), or at the exit barrier (a spare as the job ends: test_elastic.py, on a job it starts anyway);
in this process, each backend's admission against each node's move, on a real TCPStore or etcd. One true story on
every node, no traceback of the launcher's own, nothing left behind.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from multinode import free_port
from proxies import Proxy, shut
from test_elastic import _end

from runs import Run

pytestmark = pytest.mark.timeout(240)


TIMEOUT = 20.0  # the launchers' --timeout


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
        while not os.path.exists(os.environ["FAIL_GO"]):  # computing: a rank that sleeps makes no progress, and is
            end = time.process_time() + 0.05  # called hung; half a core is progress (core/launcher/watchdog.py's
            while time.process_time() < end:  # BUSY: a tenth), and leaves the other half to the machine
                pass
            time.sleep(0.05)
        raise RuntimeError("rank 1 fails after it left the group")
    dist.all_reduce(torch.ones(1))  # every rank connected before any leaves
    print(f"DONE world={world} restart={count}", flush=True)
    dist.destroy_process_group()
""")


LINGER = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(1, 11):
        dist.all_reduce(torch.ones(1))
        print(f"STEP {step}", flush=True)
    dist.destroy_process_group()
    print(f"DONE rank={rank} world={world}", flush=True)
    while rank and not os.path.exists(os.environ["FAIL_GO"]):  # node 1's rank computes on until the test says go
        end = time.process_time() + 0.05  # (a rank that sleeps makes no progress: its watchdog would call it hung):
        while time.process_time() < end:  # half a core (the watchdog's BUSY is a tenth), the other half left to the
            pass  # machine
        time.sleep(0.05)
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
    told = [run.said[0] for run in runs[:2]]
    assert told[0] == told[1] and told[0].startswith(
        f"mpddp: rank 1 (node 1, local rank 0) failed first: {cause}"), told
    for run in runs[:2]:
        assert "mpddp: restarting the group (1 of 1)" in run.stderr, run.stderr
    assert re.findall(r"ROUND world=\d restart=(\d)", runs[2].stdout)[0] == "1", runs[2].stdout
    for run in runs:
        assert "DONE world=3 restart=1" in run.stdout, run.stdout + run.stderr
        run.assert_no_launcher_frame()
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


def _returned_c10d(port: int, attempt: int, timeout: float) -> None:
    """Until a node's launcher is counted as returned in round ``attempt`` (its exit barrier), in node 0's store."""

    import torch.distributed as dist

    from mpddp.core.wire import protocol

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    while store.add(protocol.full_key(attempt, protocol.RETURNED), 0) < 1:
        assert time.monotonic() < deadline, f"no node returned in round {attempt} within {timeout} s"
        time.sleep(0.05)
    del store


def _returned_etcd(cluster, job_id: str, attempt: int, timeout: float) -> None:
    """Until a node's launcher is counted as returned in round ``attempt`` (its exit barrier), in etcd: its key under
    the job's prefix (``/mpddp/<rdzv-id>/i/<incarnation>/r/<round>/returned/<node>``)."""
    client, deadline = cluster.client(0), time.monotonic() + timeout
    while not any(f"/r/{attempt}/returned/" in meta["key"].decode()
                  for _, meta in client.get_prefix(f"/mpddp/{job_id}/")):
        assert time.monotonic() < deadline, f"no node returned in round {attempt} within {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_newcomer_during_the_exit_barrier_is_not_needed_and_the_job_ends_once(tmp_path: Path, backend: str,
                                                                               request: pytest.FixtureRequest) -> None:
    """2:3 on two nodes: node 0's ranks returned, node 1's still run (the exit barrier); a third launcher comes.
    Before, it was admitted (its record created unconditionally): the group restarted, and a job that had finished
    ran again."""
    if backend == "c10d":
        port = free_port()
        newcomer_at_the_barrier(tmp_path, ["--master-addr", "127.0.0.1", "--master-port", str(port)],
                                lambda: _returned_c10d(port, 0, 60), f"the job at 127.0.0.1:{port}")
        return
    etcd_cluster, job_id = request.getfixturevalue("etcd_cluster"), f"ending-{free_port()}"
    where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", job_id,
             "--local-addr", "127.0.0.1"]
    newcomer_at_the_barrier(tmp_path, where, lambda: _returned_etcd(etcd_cluster, job_id, 0, 60),
                            f"the job --rdzv-id {job_id}")


def newcomer_at_the_barrier(tmp_path: Path, where: list[str], returned, job: str) -> None:
    """Nodes 0 and 1 of a 2:3 job (``where``: the backend's flags); once node 0's ranks returned (``returned()``
    waits for it) and node 1's linger, a third launcher comes: it says in one line that ``job`` was ending, exits
    0 and runs nothing; the two end 0, once each, with no word of an arrival (both backends)."""
    (tmp_path / "job.py").write_text(LINGER)
    runs: list[Run] = []
    job_line = ["--nnodes", "2:3", "--nprocs", "1", *where, "--timeout", f"{TIMEOUT:g}", "--rdzv-conf",
                "last_call_timeout=2", str(tmp_path / "job.py")]
    try:
        for node in ("0", "1", None):
            at = tmp_path / f"node{node or '-new'}"
            at.mkdir()
            runs.append(Run(["-m", "mpddp", "run", *(["--node-rank", node] if node else []), *job_line], at,
                            env={"FAIL_GO": str(tmp_path / "go")}))
            if node == "1":
                runs[0].wait_for(r"DONE rank=0 world=2", timeout=120)
                returned()  # node 0's launcher is in its exit barrier: node 1's rank lingers on
        newcomer = runs[2]
        deadline = time.monotonic() + TIMEOUT + 15
        while newcomer.proc.poll() is None and time.monotonic() < deadline:
            for run in runs:
                with contextlib.suppress(psutil.NoSuchProcess):  # the newcomer may end meanwhile
                    run.list_tree()
            time.sleep(0.1)
        (tmp_path / "go").write_text("go")
        code = newcomer.finish(60)
        said = newcomer.said
        assert code == 0 and len(said) == 1, newcomer.stderr
        assert said[0].startswith(f"mpddp: {job} was ending as this node came"), said
        assert "STEP" not in newcomer.stdout
        assert [run.finish(60) for run in runs[:2]] == [0, 0], [run.stderr for run in runs[:2]]
        for node, run in enumerate(runs[:2]):
            assert run.stdout.count("DONE") == 1 and f"DONE rank={node} world=2" in run.stdout, run.stdout
            assert "arrived" not in run.stderr, run.stderr
        for run in runs:
            run.assert_no_launcher_frame()
            run.assert_nothing_left()
    finally:
        (tmp_path / "go").write_text("go")
        _end(runs)


# A spare that waits as the job ends is told it was not needed: test_elastic.py tells it on the job of its c10d
# story of a lost node and a newcomer (the door is shut to it as the job ends).


@pytest.mark.parametrize("first, door", [
    (None, "OPEN"),  # the round runs: the admission is its record
    ("WAITING", "FAILING"),  # a node waits for a failure's record: the admission must not stand for it
    ("RETURNED", "CLOSED"),  # a node's ranks returned: the job is ending
    ("newcomer", "RECORD"),  # another newcomer came first: the round restarts with it, this one comes next
])
def test_a_newcomers_admission_on_node_0s_store_finds_what_came_first(first, door) -> None:
    """The door of a round on node 0's store (a real TCPStore in this process), in the order this test sets: a
    node's move to WAITING shuts it as its move to RETURNED does, and a second newcomer is no job that ends (it
    was told "not needed" before)."""

    import torch.distributed as dist

    from mpddp.core.nodes.api import resized_record
    from mpddp.core.nodes.c10d_keys import admitted, close_door
    from mpddp.core.nodes.rules import Door, NodeState
    from mpddp.core.wire import protocol

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    if first == "newcomer":
        assert admitted(store, 0, resized_record("early", 1).encode()) is Door.OPEN
    elif first is not None:
        close_door(store, 0, NodeState[first])
    record = resized_record("late", 1).encode()
    assert admitted(store, 0, record) is Door[door]
    standing = store.get(protocol.full_key(0, protocol.FAILURE)) if store.check(
        [protocol.full_key(0, protocol.FAILURE)]) else None
    assert (standing == record) is (door == "OPEN")
    assert (standing is None) is (first in ("WAITING", "RETURNED"))


def test_a_node_whose_rank_failed_shuts_node_0s_door_before_it_stops_its_ranks() -> None:
    """As on etcd (below): the round watch's ``failing()``, called as the watch of a node whose
    rank failed ends, marks the round's door on node 0's store (a real TCPStore in this process), so that a
    newcomer's admission before the node's record writes nothing."""

    import torch.distributed as dist

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.api import resized_record
    from mpddp.core.nodes.c10d import C10dRendezvous
    from mpddp.core.nodes.c10d_keys import admitted
    from mpddp.core.nodes.rules import Door
    from mpddp.core.wire import protocol

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    config = LaunchConfig(nnodes=2, min_nnodes=1, node_rank=1, master_addr="127.0.0.1", master_port=store.port,
                          timeout=10)
    watch = C10dRendezvous(config, store.port, 1).watch(0)
    try:
        watch.failing()
        assert admitted(store, 0, resized_record("newcomer", 1).encode()) is Door.FAILING
        assert not store.check([protocol.full_key(0, protocol.FAILURE)])
    finally:
        watch.stop()


def _ended(watch) -> None:
    """A round watch stopped, and its thread gone."""
    watch.stop()
    watch._thread.join(10)
    assert not watch._thread.is_alive()


def test_a_newcomers_admission_never_stands_for_a_failure_whose_record_is_on_its_way(etcd_cluster) -> None:
    """A node waits for the record of a failure (its ranks saw a peer vanish): a newcomer's admission written then
    would be the round's record, and the failure would restart the group unreported, its restart not counted.
    The admission's one transaction now finds the node's WAITING move and writes nothing; the newcomer comes to
    the next round. After a node's return alone it is not needed (the job is ending)."""
    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.api import NotNeeded, resized_record
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.nodes.etcd_keys import EtcdKeys
    from mpddp.core.nodes.rules import NodeState

    config = LaunchConfig(nnodes=2, min_nnodes=1, rdzv_backend="etcd", rdzv_endpoint=etcd_cluster.endpoints,
                          rdzv_id=f"door-{free_port()}", timeout=5)
    link = EtcdRendezvous(config, 0, 1)
    try:
        keys = EtcdKeys(link)
        link.move(0, NodeState.WAITING)
        keys.admit(0, resized_record("newcomer", 1))  # no error: it waits for the round's record, then comes
        assert link.record(0) is None
        link.move(1, NodeState.RETURNED)
        with pytest.raises(NotNeeded):
            keys.admit(1, resized_record("newcomer", 1))
        assert link.record(1) is None
    finally:
        link.leave()
        link.client.call(lambda c: c.delete_prefix(link.prefix))


def test_a_node_whose_rank_failed_shuts_the_door_before_it_stops_its_ranks(etcd_cluster) -> None:
    """The node where a rank failed tells its record only once its other ranks are stopped (a second, more under
    load); its round watch's ``failing()``, called as the watch ends, shuts the door first: a newcomer's admission
    meanwhile writes nothing, and the newcomer comes to the next round."""
    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.api import resized_record
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.nodes.etcd_keys import EtcdKeys, EtcdRoundWatch

    config = LaunchConfig(nnodes=2, min_nnodes=1, node_rank=1, rdzv_backend="etcd",
                          rdzv_endpoint=etcd_cluster.endpoints, rdzv_id=f"failing-{free_port()}", timeout=2)
    link = EtcdRendezvous(config, 0, 1)
    watch = None
    try:
        watch = EtcdRoundWatch(link, 0)  # its beat finds no round's store here: it reads etcd's record instead
        watch.failing()
        EtcdKeys(link).admit(0, resized_record("newcomer", 1))  # no error: it comes to the next round
        assert link.record(0) is None
    finally:
        if watch is not None:
            _ended(watch)  # its look for the round's store ends with --timeout
        link.leave()
        link.client.call(lambda c: c.delete_prefix(link.prefix))
