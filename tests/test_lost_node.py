"""A node lost at the wrong moment, on 127.0.0.1: node 0 as a rank of node 1 raised, a round's first node before its
store listened, and a lost node's --node-rank given again after the restart (a node that comes after the others gave
up on it: tests/test_roll_call.py). Real launchers of ``mpddp run`` as the nodes of one job, c10d on node 0's store
or etcd on a real 3-member cluster, a whole machine (every process of it) SIGKILLed at the moment each case needs.
Machines cut off and frozen, on namespace hosts: tests/test_lost_machine.py (a frozen machine on 127.0.0.1 was this
file's; the namespace hosts' story asserts all it did, at the default --timeout). Node 0's machine lost mid-run, one
story on every survivor: tests/test_node0_lost.py.

Each case's bound: one true story on every surviving node within --timeout + 15 s of the fault, no traceback of the
launcher's own, nothing left behind.
"""

from __future__ import annotations

import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
from multinode import free_port
from test_elastic import _c10d_nodes, _end, _lose, _lose_at, _nodes

from runs import Run

pytestmark = pytest.mark.timeout(240)


TIMEOUT = 20.0  # the launchers' --timeout (test_elastic's)


def _said_matching(run, pattern: str, timeout: float) -> str:
    """The first line of ``run``'s stderr that matches ``pattern``, once it is there."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(rf"^{pattern}.*$", run.stderr, re.MULTILINE)):
        assert time.monotonic() < deadline, run.stderr
        time.sleep(0.05)
    return found.group(0)


def _port(run: Run) -> int:
    return int(run.proc.args[run.proc.args.index("--master-port") + 1])  # type: ignore[union-attr]


def _job_keys(cluster, job_id: str) -> list[str]:
    """Every key of job ``job_id`` in etcd, as text."""
    keys = [meta["key"] for _, meta in cluster.client(0).get_prefix(f"/mpddp/{job_id}/")]
    return [k.decode() if isinstance(k, bytes) else k for k in keys]


def _arrived(cluster, job_id: str, round_number: int, pid: int) -> bool:
    """Whether the launcher of ``pid`` has put its arrival in round ``round_number`` of job ``job_id`` (its key
    names its host, pid and a random tail)."""
    return any(re.search(rf"/r/{round_number}/join/.*-{pid}-[0-9a-f]+$", key) for key in _job_keys(cluster, job_id))


def _published_store(cluster, job_id: str, round_number: int) -> bool:
    """Whether round ``round_number``'s first node published its store's address (once it served it)."""
    return any(key.endswith(f"/r/{round_number}/store") for key in _job_keys(cluster, job_id))


RAISES = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(1, 10**6):
        dist.all_reduce(torch.ones(1))
        print(f"STEP {step}", flush=True)
        if rank == 1 and step == 20:
            print("FAILING rank 1", flush=True)
            raise RuntimeError("rank 1 fails on purpose")
        time.sleep(0.05)
""")


RAISED = "mpddp: rank 1 (node 1, local rank 0) failed first: it raised RuntimeError: rank 1 fails on purpose"


def _launchers(tmp_path: Path, where: list[str]) -> list[Run]:
    (tmp_path / "job.py").write_text(RAISES)
    runs = []
    for node in range(3):
        (tmp_path / f"node{node}").mkdir()
        runs.append(Run(["-m", "mpddp", "run", "--nnodes", "3", "--node-rank", str(node), "--nprocs", "1", *where,
                         "--timeout", f"{TIMEOUT:g}", str(tmp_path / "job.py")], tmp_path / f"node{node}"))
    return runs


def _first(run: Run) -> str:
    """The first of mpddp's own lines, up to its first ';' (what follows says what this node saw beside it)."""
    return next(line for line in run.stderr.splitlines() if line.startswith("mpddp:")).split(";")[0]


def _one_story(runs: list[Run], gone: str | tuple[str, ...]) -> None:
    """Node 0's launcher SIGKILLed 0.1 s after node 1's rank said it raises; nodes 1 and 2 tell one story."""
    try:
        runs[1].wait_for(r"FAILING rank 1", timeout=120)
        for run in runs:
            run.list_tree()
        time.sleep(0.1)
        runs[0].proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        codes = [run.finish(TIMEOUT + 60) for run in runs[1:]]
        took = time.monotonic() - killed
        firsts = [_first(run) for run in runs[1:]]
        stories = "\n\n".join(f"--- node {n}:\n{run.stderr}" for n, run in enumerate(runs))
        assert firsts[0] == firsts[1], stories
        assert firsts[0] == RAISED or firsts[0].startswith(gone), stories
        assert codes[0] == codes[1] == 1, stories
        assert took < TIMEOUT + 15, took
        for run in runs[1:]:
            run.assert_no_launcher_frame()
        runs[0].proc.wait(10)
        for run in runs:
            run.assert_nothing_left()
    finally:
        for run in runs:
            run.kill()


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_node_0_killed_as_a_rank_raised_is_one_story(tmp_path: Path, backend: str,
                                                     request: pytest.FixtureRequest) -> None:
    """Node 0's launcher SIGKILLed 0.1 s after a rank of node 1 raised: every surviving node tells one story, the
    rank that raised where a node could know it, else node 0's loss. On etcd that loss is told by whichever node
    finds it first: as its round store gone ("error: node 0 ..."), or as a node that went away (under load node 2
    wrote that record while node 1 still stopped its ranks)."""
    if backend == "c10d":
        _one_story(_launchers(tmp_path, ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]),
                   "mpddp: error: node 0, which hosts the rendezvous at 127.0.0.1:")
        return
    etcd_cluster = request.getfixturevalue("etcd_cluster")
    _one_story(_launchers(tmp_path, ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints,
                                     "--rdzv-id", f"raised-{free_port()}", "--local-addr", "127.0.0.1"]),
               ("mpddp: error: node 0", "mpddp: node(s) 0 went away"))


def test_a_rounds_first_node_lost_before_its_store_listened_is_a_restart_not_the_end(tmp_path, etcd_cluster,
                                                                                      monkeypatch):
    """Node 1 is lost mid-run; the three others start round 1, node 0 first (the old order). Node 0's machine is
    lost as soon as it arrived in round 1, so round 1 is decided with it, and its store never listens. The two
    others must go on in round 2 and finish; before, they gave up: "round 1's first node did not publish its
    store within --timeout", though MIN nodes and restarts remained."""
    job_id = "storelost"
    hold = tmp_path / "hold"  # the job steps while it exists (test_elastic's job), not a number of steps
    hold.write_text("hold")
    monkeypatch.setenv("HOLD", str(hold))  # every launcher's environment (tests/runs.py), so its ranks'
    runs = _nodes(tmp_path, etcd_cluster, 4, "2:4", 0, job_id,
                  ["--max-restarts", "3", "--rdzv-conf", "ttl=12,last_call_timeout=3"])
    try:
        runs[0].wait_for(r"STEP 10 ", timeout=90)
        for run in runs:
            run.list_tree()
        _lose(runs[1])
        deadline = time.monotonic() + 60
        while not _arrived(etcd_cluster, job_id, 1, runs[0].proc.pid):
            assert time.monotonic() < deadline, runs[0].stderr
            time.sleep(0.01)
        _lose(runs[0])  # in the last call (3 s), its lease (12 s) alive: round 1 is decided with it all the same
        lost_at = time.monotonic()
        # Its store published is its store listening (the key is put once it serves): on a loaded machine node 0
        # got that far before the test's kill (seen once in a suite), and the true story is then a node lost. Read
        # before its lease (12 s) runs out: round 2 may tidy round 1's keys away
        time.sleep(1.0)  # a put sent before the kill has landed
        listened = _published_store(etcd_cluster, job_id, 1)
        for run in runs[2:]:
            _said_matching(run, r"mpddp: (round 1's first node|node\(s\) 0 went away)", timeout=120)
        told = time.monotonic() - lost_at  # from the loss, not the job's end (that counts round 2's start too)
        story = "mpddp: node(s) 0 went away" if listened else "mpddp: round 1's first node"
        print(f"round 1's store {'listened' if listened else 'never listened'} before node 0 was lost")
        hold.unlink()  # round 2 steps no more once it started: its DONE line tells it ran
        codes = [run.finish(120) for run in runs[2:]]
        assert codes == [0, 0], [run.stderr for run in runs[2:]]
        for run in runs[2:]:
            assert "DONE world=2 restart=2" in run.stdout, run.stdout + run.stderr
            said = [line for line in run.stderr.splitlines() if line.startswith(story)]
            assert said and (listened or "was lost before the store listened" in said[0]), run.stderr
            assert not any(line.startswith("Traceback") for line in run.stderr.splitlines()), run.stderr
            run.assert_nothing_left()
        # the story's bound: node 0's lease (ttl=12) runs out, then a look (measured 12.07 s twice, quiet); the
        # margin, TIMEOUT + 15 - 12, is a loaded machine's
        assert told < TIMEOUT + 15, told
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
        said = twin.said
        assert len(said) == 1 and said[0].startswith("mpddp: error: --node-rank 1 is taken: the launcher "), said
        twin.assert_no_launcher_frame()
        assert "STEP" not in twin.stdout
        steps = [run.stdout.count("STEP ") for run in runs[:2]]
        time.sleep(1.0)
        assert all(run.proc.poll() is None for run in runs[:2]), [run.stderr for run in runs[:2]]
        assert all(run.stdout.count("STEP ") > n for run, n in zip(runs[:2], steps))  # the job goes on, unchanged
        assert not any("arrived" in run.stderr for run in runs[:2]), [run.stderr for run in runs[:2]]
    finally:
        _end(runs)
