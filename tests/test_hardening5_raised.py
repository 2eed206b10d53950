"""Node 0's launcher SIGKILLed 0.1 s after a rank of node 1 raised (hardening 5), on both backends: real launchers
of ``mpddp run`` on 127.0.0.1 as the three nodes of one job, c10d on node 0's store or etcd on a real 3-member
cluster (tests/etcd_cluster.py).

The rule: every surviving node tells one story, the same first line: the rank that raised where a node could know
it, else node 0's loss; within --timeout + 15 s of the kill, no traceback of the launcher's own, nothing left
behind (node 0's ranks, store server and forkserver included: they go with their launcher).
"""

from __future__ import annotations

import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
from multinode import free_port

from runs import Run

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 20.0  # the launchers' --timeout
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
            assert not re.search(r'File "[^"]*/mpddp/', run.stderr), run.stderr
        runs[0].proc.wait(10)
        for run in runs:
            run.assert_nothing_left()
    finally:
        for run in runs:
            run.kill()


def test_c10d_node_0_killed_as_a_rank_raised_is_one_story(tmp_path: Path) -> None:
    _one_story(_launchers(tmp_path, ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]),
               "mpddp: error: node 0, which hosts the rendezvous at 127.0.0.1:")


def test_etcd_node_0_killed_as_a_rank_raised_is_one_story(tmp_path: Path, etcd_cluster) -> None:
    """Node 0's loss is told by whichever node finds it first: as its round store gone ("error: node 0 ..."), or
    as a node that went away (under load node 2 wrote that record while node 1 still stopped its ranks)."""
    _one_story(_launchers(tmp_path, ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints,
                                     "--rdzv-id", f"raised-{free_port()}", "--local-addr", "127.0.0.1"]),
               ("mpddp: error: node 0", "mpddp: node(s) 0 went away"))
