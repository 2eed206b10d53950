"""Machines lost at the wrong moment, and endings, under ``--rdzv-backend c10d`` (hardening 5): real launchers of
``mpddp run`` on 127.0.0.1 as the nodes of one job on node 0's store, each in its own session, a whole machine
(every process of it) SIGKILLed at the moment each case needs, or a launcher that comes when it should not.

Each case's bound is the issue's: one true story on every surviving node within --timeout + 15 s of the fault, no
traceback of the launcher's own, nothing left behind.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from multinode import free_port
from test_elastic import JOB, _c10d_node, _c10d_nodes, _end, _lose_at

from runs import Run

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 20.0  # the launchers' --timeout (test_elastic's _c10d_node)
OWN_FIRST = re.compile(r"^mpddp: rank \d+ \(node \d+, local rank \d+\) failed first", re.M)


def _fixed(tmp_path: Path, nnodes: int, steps: int) -> list[Run]:
    """``nnodes`` launchers of a fixed-size job (``--nnodes N --node-rank n``), one rank each."""
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "ckpt").mkdir()
    port, runs = free_port(), []
    for node in range(nnodes):
        where = tmp_path / f"node{node}"
        where.mkdir()
        runs.append(Run(["-m", "mpddp", "run", "--nnodes", str(nnodes), "--node-rank", str(node), "--nprocs", "1",
                         "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", f"{TIMEOUT:g}",
                         str(tmp_path / "job.py")], where, env={"CKPT": str(tmp_path / "ckpt"), "STEPS": str(steps)}))
    return runs


def _said(run: Run) -> list[str]:
    """mpddp's own lines (on a loaded machine torch's store client may print its retries before them)."""
    return [line for line in run.stderr.splitlines() if line.startswith("mpddp:")]


def _no_launcher_traceback(run: Run) -> None:
    """No frame of mpddp's own on the launcher's terminal (a rank's traceback in the report shows the script's)."""
    assert not re.search(r'File "[^"]*/mpddp/', run.stderr), run.stderr


def _port(run: Run) -> int:
    return int(run.proc.args[run.proc.args.index("--master-port") + 1])  # type: ignore[union-attr]


def test_node_0_lost_is_one_story_on_every_survivor_none_naming_its_own_rank_first(tmp_path: Path) -> None:
    """Node 0's machine is lost mid-run: the job's store goes with it. Every survivor said "node 0 ... is gone;
    the failures below are consequences", then "rank N (node N, ...) failed first" of its own rank, so that each
    named another rank first. A rank that failed only because a peer went away failed first nowhere."""
    runs = _fixed(tmp_path, 3, 10**6)
    try:
        _lose_at(runs, 15, victim=runs[0], watched=runs[1])
        lost = time.monotonic()
        codes = [run.finish(TIMEOUT + 60) for run in runs[1:]]
        took = time.monotonic() - lost
        firsts = [_said(run)[0] for run in runs[1:]]
        assert codes[0] == codes[1] == 1, [run.stderr for run in runs[1:]]
        assert firsts[0] == firsts[1], firsts
        assert firsts[0].startswith("mpddp: error: node 0, which hosts the rendezvous at 127.0.0.1:"), firsts[0]
        for run in runs[1:]:
            assert not OWN_FIRST.search(run.stderr), run.stderr
            _no_launcher_traceback(run)
            run.assert_nothing_left()
        assert took < TIMEOUT + 15, took
    finally:
        _end(runs)


def test_a_node_rank_given_again_after_a_restart_is_refused_in_one_line(tmp_path: Path) -> None:
    """c10d, 2:3: node 2's machine is lost, the two others restart; then a second launcher with --node-rank 1
    comes. Before, --node-rank was checked only in the round a launcher first came to, against that round's
    claims: after a restart nobody had claimed 1 there, and the twin was admitted by a restart, silently."""
    runs = _c10d_nodes(tmp_path, 3, 10**6, ["--max-restarts", "1", "--rdzv-conf", "last_call_timeout=10"])
    try:
        _lose_at(runs, 15, victim=runs[2], watched=runs[0])  # a late third admitted first is a restart not counted
        runs[0].wait_for(r"RESUMED step=\d+ world=2 restart=1", timeout=120)
        runs[0].wait_for(r"STEP \d+ ", count=2, timeout=60)
        where = tmp_path / "twin"
        where.mkdir()
        twin = Run(["-m", "mpddp", "run", "--nnodes", "2:3", "--node-rank", "1", "--nprocs", "1", "--master-addr",
                    "127.0.0.1", "--master-port", str(_port(runs[0])), "--timeout", f"{TIMEOUT:g}",
                    str(tmp_path / "job.py")], where, env={"CKPT": str(tmp_path / "ckpt"), "STEPS": "10"})
        runs.append(twin)
        started = time.monotonic()
        assert twin.finish(TIMEOUT + 60) == 2, twin.stderr
        assert time.monotonic() - started < TIMEOUT + 15
        said = _said(twin)
        assert len(said) == 1 and said[0].startswith("mpddp: error: --node-rank 1 is taken: the launcher "), said
        _no_launcher_traceback(twin)
        assert "STEP" not in twin.stdout
        steps = [run.stdout.count("STEP ") for run in runs[:2]]
        time.sleep(1.0)
        assert all(run.proc.poll() is None for run in runs[:2]), [run.stderr for run in runs[:2]]
        assert all(run.stdout.count("STEP ") > n for run, n in zip(runs[:2], steps))  # the job goes on, unchanged
        assert not any("arrived" in run.stderr for run in runs[:2]), [run.stderr for run in runs[:2]]
    finally:
        _end(runs)


def test_a_spare_that_waits_as_the_job_ends_is_told_it_was_not_needed(tmp_path: Path) -> None:
    """c10d, 2:3: three nodes run, a fourth launcher without --node-rank waits as a spare; the job ends well.
    Before, node 0 kept its store only until the members had left: the spare, looking every 0.1 s, mostly found it
    gone first and said "node 0's launcher was killed, or its machine lost". Node 0 had finished."""
    runs = _c10d_nodes(tmp_path, 3, 400, ["--rdzv-conf", "last_call_timeout=60"])
    try:
        runs[0].wait_for(r"STEP 5 ", timeout=120)
        spare = _c10d_node(tmp_path, None, _port(runs[0]), 400)  # 20 s of steps left: it comes before the end
        runs.append(spare)
        deadline = time.monotonic() + 60
        while "waits as a spare" not in spare.stderr:  # it came before the end (else it is not this case)
            assert time.monotonic() < deadline and spare.proc.poll() is None, spare.stderr
            time.sleep(0.1)
        spare.list_tree()
        assert [run.finish(120) for run in runs[:3]] == [0, 0, 0], [run.stderr for run in runs[:3]]
        ended = time.monotonic()
        code = spare.finish(TIMEOUT + 60)
        said = _said(spare)
        assert code == 0 and "killed" not in spare.stderr, spare.stderr
        assert said[-1].startswith("mpddp: the job ended while this node waited as a spare"), said
        assert time.monotonic() - ended < TIMEOUT + 15
        assert "STEP" not in spare.stdout
        _no_launcher_traceback(spare)
        spare.assert_nothing_left()
    finally:
        _end(runs)


LINGER = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(1, 11):
        dist.all_reduce(torch.ones(1))
        print(f"STEP {step}", flush=True)
    dist.destroy_process_group()
    print(f"DONE rank={rank} world={world}", flush=True)
    while rank and not os.path.exists(os.environ["FAIL_GO"]):  # node 1's rank computes on until the test says go
        sum(i * i for i in range(20000))  # (a rank that sleeps makes no progress: its watchdog would call it hung)
""")


def _returned(port: int, attempt: int, timeout: float) -> None:
    """Until a node's launcher is counted as returned in round ``attempt`` (its exit barrier), in node 0's store."""
    from datetime import timedelta

    import torch.distributed as dist

    from mpddp.core.wire import protocol

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    while store.add(protocol.full_key(attempt, protocol.RETURNED), 0) < 1:
        assert time.monotonic() < deadline, f"no node returned in round {attempt} within {timeout} s"
        time.sleep(0.05)
    del store


def test_a_newcomer_during_the_exit_barrier_is_not_needed_and_the_job_ends_once(tmp_path: Path) -> None:
    """c10d, 2:3 on two nodes: node 0's ranks returned, node 1's still run (the exit barrier); a third launcher
    comes. Before, it was admitted: its record restarted the group, and a job that had finished ran again."""
    port = free_port()
    job = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    newcomer_at_the_barrier(tmp_path, job, lambda: _returned(port, 0, 60), f"the job at 127.0.0.1:{port}")


def newcomer_at_the_barrier(tmp_path: Path, where: list[str], returned, job: str) -> None:
    """Nodes 0 and 1 of a 2:3 job (``where``: the backend's flags); once node 0's ranks returned (``returned()``
    waits for it) and node 1's linger, a third launcher comes: it says in one line that ``job`` was ending, exits
    0 and runs nothing; the two end 0, once each, with no word of an arrival (shared with test_hardening5_etcd)."""
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
        said = _said(newcomer)
        assert code == 0 and len(said) == 1, newcomer.stderr
        assert said[0].startswith(f"mpddp: {job} was ending as this node came"), said
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
        _end(runs)


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
    from datetime import timedelta

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
    """As on etcd (test_hardening5_etcd.py): the round watch's ``failing()``, called as the watch of a node whose
    rank failed ends, marks the round's door on node 0's store (a real TCPStore in this process), so that a
    newcomer's admission before the node's record writes nothing."""
    from datetime import timedelta

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


def test_a_record_read_once_is_kept_once_node_0s_store_is_gone() -> None:
    """The beat's thread reads the round's record and counts the read, for node 0's wait until the others read why;
    node 0, every read counted, may leave. A settlement that looked for it in node 0's store again then found the
    store gone and told node 0's loss (as etcd's round store was seen to, measured). Once read, it is kept."""
    from datetime import timedelta

    import torch.distributed as dist
    from proxies import refused

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.c10d import C10dRendezvous
    from mpddp.core.stores.store_beat import first_record, reads
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))  # node 0's store
    link = C10dRendezvous(LaunchConfig(nnodes=3, node_rank=1, master_addr="127.0.0.1", master_port=port,
                                       timeout=10), port, 1)
    record = FailureRecord(rank=2, node_rank=2, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                           line="mpddp: rank 2 (node 2, local rank 0) failed first", wall_time=time.time(), writer=2)
    first_record(host, 0, record.encode())
    assert link.record(0) == record and reads(host, 0) == 1  # as the beat's thread reads it: counted once
    del host  # node 0 leaves
    refused(port)
    assert link.record(0) == record  # as the settlement looks, after


def test_a_record_read_as_node_0s_store_goes_is_kept(monkeypatch) -> None:
    """Node 0's store gone between the record's read and the count of that read: the count raised, and the record
    read was lost with it (the settlement then told node 0's loss). Now the record stands, and is kept."""
    from datetime import timedelta

    import torch.distributed as dist
    from proxies import refused

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.c10d import C10dRendezvous
    from mpddp.core.stores import store_beat
    from mpddp.core.stores.store_beat import first_record
    from mpddp.core.wire.protocol import FailureRecord
    from mpddp.errors import Outcome

    port = free_port()
    hosted = [dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30))]  # node 0's store
    link = C10dRendezvous(LaunchConfig(nnodes=3, node_rank=1, master_addr="127.0.0.1", master_port=port,
                                       timeout=10), port, 1)
    record = FailureRecord(rank=2, node_rank=2, local_rank=0, outcome=Outcome.RAISED, exit_code=1,
                           line="mpddp: rank 2 (node 2, local rank 0) failed first", wall_time=time.time(), writer=2)
    first_record(hosted[0], 0, record.encode())
    counted = store_beat.reads

    def store_goes_first(s, attempt, mine=0):  # node 0 leaves just before the read is counted
        if hosted:
            hosted.clear()
            refused(port)
        return counted(s, attempt, mine=mine)

    monkeypatch.setattr(store_beat, "reads", store_goes_first)
    assert link.record(0) == record and not hosted  # read, then the store went: the count could not be made
    assert link.record(0) == record  # as the settlement looks, after
