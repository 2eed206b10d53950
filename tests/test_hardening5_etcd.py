"""Endings under ``--rdzv-backend etcd`` (hardening 5): real launchers of ``mpddp run`` on 127.0.0.1 as the nodes of
one job on a real 3-member etcd (tests/etcd_cluster.py), and a launcher that comes when the job is ending.

The bound is the issue's: one true story on every node within --timeout + 15 s, no traceback of the launcher's own,
nothing left behind. tests/test_hardening5_c10d.py holds the same case on node 0's store.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from multinode import free_port
from proxies import Proxy, refused, shut
from test_hardening5_c10d import newcomer_at_the_barrier

pytestmark = pytest.mark.timeout(240)


def _fill(cluster) -> None:
    """Another user of the same etcd fills it: puts of 64 KiB until etcd refuses one (its NOSPACE alarm)."""
    from etcd3gw.exceptions import Etcd3Exception

    client = cluster.client(0, 5)
    with pytest.raises(Etcd3Exception):
        for n in range(100):
            client.put(f"/someone-else/{n}", "x" * (64 * 1024))


def _ended(watch) -> None:
    """A round watch stopped, and its thread gone."""
    watch.stop()
    watch._thread.join(10)
    assert not watch._thread.is_alive()


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
    job_id = f"ending-{free_port()}"
    where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", job_id,
             "--local-addr", "127.0.0.1"]
    newcomer_at_the_barrier(tmp_path, where, lambda: _returned(etcd_cluster, job_id, 0, 60),
                            f"the job --rdzv-id {job_id}")


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
        link.move_to(0, NodeState.WAITING)
        keys.admit(0, resized_record("newcomer", 1))  # no error: it waits for the round's record, then comes
        assert link.record(0) is None
        link.move_to(1, NodeState.RETURNED)
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


def test_a_record_the_watch_read_is_kept_once_its_store_is_gone(etcd_cluster) -> None:
    """Four such jobs at once on 2 cores (tests/test_etcd_hostile.py), 2 of 25 runs: node 1's beat read the record
    on the round's store and counted its read; the store's host, every read counted, left; node 1's settlement then
    looked for the record again, in a store that was gone, and told etcd's state. Once read, it is kept."""
    import torch.distributed as dist

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.nodes.etcd_keys import EtcdRoundWatch
    from mpddp.core.stores.store_beat import first_record, reads
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    config = LaunchConfig(nnodes=3, node_rank=1, rdzv_backend="etcd", rdzv_endpoint=etcd_cluster.endpoints,
                          rdzv_id=f"kept-{free_port()}", timeout=10)
    link = EtcdRendezvous(config, 0, 1)
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's, the round's store
    watch = None
    try:
        link.put(link.key(0, "store"), f"127.0.0.1:{port}")  # as the round's first node publishes it
        watch = EtcdRoundWatch(link, 0)
        record = FailureRecord(rank=2, node_rank=2, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                               line="mpddp: rank 2 (node 2, local rank 0) failed first", wall_time=time.time(),
                               writer=2).encode()
        assert first_record(host, 0, record) == record
        deadline = time.monotonic() + 10
        while watch.record() is None:  # as the beat's thread reads it
            assert time.monotonic() < deadline, "the watch never read the record"
            time.sleep(0.1)
        assert reads(host, 0) == 1
        del host  # the store's host leaves: every read it waited for was counted
        refused(port)
        assert watch.record() == FailureRecord.decode(record)  # as the settlement looks, after
    finally:
        if watch is not None:
            _ended(watch)
        link.leave()
        link.client.call(lambda c: c.delete_prefix(link.prefix))


def test_a_round_watch_reads_the_record_after_its_connection_to_the_store_was_cut(etcd_cluster) -> None:
    """CI, loaded, etcd full (tests/test_etcd_hostile.py): node 1 told etcd's loss where the other nodes named the
    rank that failed; it had no round's store to read the record on. A watch dropped the store for good at the
    first operation that failed, the store's host alive or not. Now it connects again: a real TCPStore behind a
    proxy that cuts the watch's connection once, then carries new ones."""
    import torch.distributed as dist

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.nodes.etcd_keys import EtcdRoundWatch
    from mpddp.core.stores.store_beat import first_record, reads
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    config = LaunchConfig(nnodes=2, node_rank=1, rdzv_backend="etcd", rdzv_endpoint=etcd_cluster.endpoints,
                          rdzv_id=f"cut-{free_port()}", timeout=10)
    link = EtcdRendezvous(config, 0, 1)
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's, the round's store
    proxy, watch = Proxy(port), None
    try:
        link.put(link.key(0, "store"), f"127.0.0.1:{proxy.listens}")  # as the round's first node publishes it
        watch = EtcdRoundWatch(link, 0)
        assert watch._reached.wait(10)
        proxy.cut()
        time.sleep(1.0)  # the watch's next beats fail on the cut connection
        record = FailureRecord(rank=0, node_rank=0, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                               line="mpddp: rank 0 (node 0, local rank 0) failed first", wall_time=time.time(),
                               writer=0).encode()
        assert first_record(host, 0, record) == record
        deadline = time.monotonic() + 10
        while (read := watch.record()) is None:
            assert time.monotonic() < deadline, "the watch never read the record on its store again"
            time.sleep(0.1)
        assert read == FailureRecord.decode(record)
        assert reads(host, 0) == 1  # counted once as read: its host may leave
    finally:
        if watch is not None:
            _ended(watch)
        proxy.close()
        link.leave()
        link.client.call(lambda c: c.delete_prefix(link.prefix))


def test_a_node_that_etcd_stops_answering_when_full_tells_the_record_on_the_rounds_store(tmp_path) -> None:
    """CI, loaded: etcd full, node 1's waits for the round's record ended in etcd's not answering it (its
    members were slow) before node 2 wrote the record on the round's store; node 1 told etcd's loss where
    nodes 0 and 2 named the rank that failed. Now, with etcd full, its last word is the record on the round's
    store, waited for while the store answers. A real 3-member etcd filled to its quota, a real TCPStore, the
    record written a second later."""
    pytest.importorskip("etcd3gw")
    import torch.distributed as dist
    from etcd_cluster import EtcdCluster

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.nodes.etcd_keys import EtcdRoundWatch
    from mpddp.core.stores.etcd_client import EtcdFull
    from mpddp.core.stores.store_beat import first_record, reads
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    with EtcdCluster(base_dir=tmp_path, quota_bytes=256 * 1024) as cluster:
        config = LaunchConfig(nnodes=3, node_rank=1, rdzv_backend="etcd", rdzv_endpoint=cluster.endpoints,
                              rdzv_id="full", timeout=20)
        link = EtcdRendezvous(config, 0, 1)
        port = free_port()
        host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's, the round's store
        watch, writer = None, None
        try:
            link.put(link.key(0, "store"), f"127.0.0.1:{port}")  # as the round's first node publishes it
            watch = link.watch(0)
            assert watch._reached.wait(10)
            assert link.last_word(0) is None  # etcd takes writes: it keeps the record, and no store is looked at
            _fill(cluster)  # another user of the same etcd fills it
            with pytest.raises(EtcdFull):  # this node learns it at its next write
                link.put(link.key(0, "waiting", 1), "1")
            record = FailureRecord(rank=2, node_rank=2, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                                   line="mpddp: rank 2 (node 2, local rank 0) failed first", wall_time=time.time(),
                                   writer=2).encode()
            writer = threading.Timer(1.0, lambda: first_record(host, 0, record))  # node 2, after its teardown
            writer.start()
            started = time.monotonic()
            word = link.last_word(0)
            assert word is not None and word.encode() == record, word
            assert 0.5 < time.monotonic() - started < 8
            assert reads(host, 0) == 1  # counted as read: the store's host may leave
        finally:
            if writer is not None:
                writer.join(10)
            if isinstance(watch, EtcdRoundWatch):
                _ended(watch)
            link.leave()


class _Counting(Proxy):
    """A proxy in front of an etcd member that counts the requests for etcd's alarm list it carries."""

    alarms = 0

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.alarms += data.count(b"/maintenance/alarm")
                sink.sendall(data)
        shut(sink)


def test_an_etcd_known_full_is_not_asked_for_its_alarms_at_each_refused_write(tmp_path) -> None:
    """Each write refused for want of room asked etcd for its alarm list first; a list that did not answer in time
    on a loaded machine was taken for a rate limit, the write tried again until the call gave up, and the node
    told etcd's loss where it was only full. Once a node knows etcd is full, a refused write says so at once."""
    pytest.importorskip("etcd3gw")
    from etcd_cluster import EtcdCluster

    from mpddp.core.stores.etcd_client import EtcdClient, EtcdFull

    with EtcdCluster(base_dir=tmp_path, quota_bytes=256 * 1024) as cluster:
        _fill(cluster)  # another user of the same etcd fills it
        proxy = _Counting(int(cluster.endpoints.split(",")[0].rpartition(":")[2]))
        try:
            client = EtcdClient(f"127.0.0.1:{proxy.listens}", timeout=5)
            with pytest.raises(EtcdFull):
                client.call(lambda c: c.put("/mine", "1"))
            asked = proxy.alarms  # 1; 2 where a list took longer than a request may on a loaded machine
            assert asked >= 1
            for _ in range(2):
                with pytest.raises(EtcdFull):
                    client.call(lambda c: c.put("/mine", "1"))
            assert proxy.alarms == asked
        finally:
            proxy.close()


def test_a_record_written_before_etcd_filled_stands_over_one_on_the_rounds_store(tmp_path) -> None:
    """Node 2's record was created in etcd; etcd then filled, and node 1's record went to the round's store: node 1
    told its own, where every other node read node 2's in etcd. A node whose write etcd refuses now reads etcd's
    record first: the one written there stands."""
    pytest.importorskip("etcd3gw")
    import torch.distributed as dist
    from etcd_cluster import EtcdCluster

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.stores.store_beat import record_of
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    def record(node: int) -> FailureRecord:
        return FailureRecord(rank=node, node_rank=node, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                             line=f"mpddp: rank {node} (node {node}, local rank 0) failed first", wall_time=time.time())

    with EtcdCluster(base_dir=tmp_path, quota_bytes=256 * 1024) as cluster:
        nodes = [EtcdRendezvous(LaunchConfig(nnodes=3, node_rank=n, rdzv_backend="etcd", rdzv_id="filled",
                                             rdzv_endpoint=cluster.endpoints, timeout=20), 0, 1) for n in (1, 2)]
        port = free_port()
        host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's, the round's store
        watches = []
        try:
            nodes[0].put(nodes[0].key(0, "store"), f"127.0.0.1:{port}")
            watches = [link.watch(0) for link in nodes]
            assert all(watch._reached.wait(10) for watch in watches)
            assert nodes[1].publish(0, record(2)).rank == 2  # in etcd
            _fill(cluster)  # another user of the same etcd fills it
            told = nodes[0].publish(0, record(1))
            assert told.rank == 2 and told.writer == 2, told
            assert nodes[0].client.full is not None and record_of(host, 0) is None  # nothing on the store
        finally:
            for watch in watches:
                _ended(watch)
            for link in nodes:
                link.leave()


class _Unread(Proxy):
    """A proxy in front of an etcd member that, once :attr:`hold` is set, carries no read (``kv/range``) further: a
    member too slow to answer one (CI, loaded), while it still refuses a write at once (etcd's quota is checked
    before Raft). Each connection that asked for a read is left unanswered until its client gives up on it."""

    hold = False

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        held = False
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                held = held or (self.hold and b"/kv/range" in data)
                if not held:
                    sink.sendall(data)
        shut(sink)


def test_a_refused_write_on_a_full_etcd_that_does_not_answer_reads_goes_to_the_rounds_store(tmp_path) -> None:
    """etcd full, and its reads not answered: node 1's write of the round's record refused, its read of etcd's
    record (one that stands, written before etcd filled) waited for --timeout, then failed publish: its record was
    never on the round's store, and no other node could name its rank. Now the read waits a lease's TTL at most,
    and the record goes to the round's store, as before that read."""
    pytest.importorskip("etcd3gw")
    import torch.distributed as dist
    from etcd_cluster import EtcdCluster

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous
    from mpddp.core.stores.store_beat import record_of
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    with EtcdCluster(base_dir=tmp_path, quota_bytes=256 * 1024) as cluster:
        proxy = _Unread(int(cluster.endpoints.split(",")[0].rpartition(":")[2]))
        link = EtcdRendezvous(LaunchConfig(nnodes=3, node_rank=1, rdzv_backend="etcd", rdzv_id="unread",
                                           rdzv_endpoint=f"127.0.0.1:{proxy.listens}", timeout=30), 0, 1)
        port = free_port()
        host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's, the round's store
        watch = None
        try:
            link.put(link.key(0, "store"), f"127.0.0.1:{port}")  # as the round's first node publishes it
            watch = link.watch(0)
            assert watch._reached.wait(10)
            _fill(cluster)  # another user of the same etcd fills it
            proxy.hold = True
            mine = FailureRecord(rank=1, node_rank=1, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                                 line="mpddp: rank 1 (node 1, local rank 0) failed first", wall_time=time.time())
            started = time.monotonic()
            told = link.publish(0, mine)
            took = time.monotonic() - started
            assert link.client.full is not None and told.rank == 1 and told.writer == 1, told
            assert record_of(host, 0) == told.encode()  # on the round's store: every node reads it there
            assert took < 20, took  # a lease's TTL (3 s) for the read, not --timeout (30 s)
        finally:
            if watch is not None:
                _ended(watch)
            proxy.close()
            link.leave()
