"""A job of several nodes whose culprit is a rank on another node: every node names it, with one story.

Three launchers on 127.0.0.1 (``mpddp run --nnodes 3 --nprocs 1``), each running ``tests/scripts/culprit_job.py``,
whose one rank stops itself, skips a collective, calls another collective than its peers, or ends early: one fault a
round, the job restarted after each. The other nodes see that rank only through the collectives the nodes share;
before, their launchers crashed with a ``KeyError`` in ``classify()`` (a verdict that named a rank they do not run),
or blamed their own rank's broken collective. Every node must tell each round's fault with the same line, exit with
the same code, tell the hang within --timeout and a few seconds, print no traceback of its own, and leave nothing
running.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from multinode import Cluster, Node, free_port

from runs import rounds_told

JOB = Path(__file__).parent / "scripts" / "culprit_job.py"
TIMEOUT = 4  # --timeout: the hang cases are told after it


# One job, restarted after each fault (--max-restarts 3): round R goes wrong as entry R says, the last one ends it.
# Each round's story is the line every node writes before "restarting the group", or its report's first line.
ROUNDS = [("stop", 1, r"mpddp: rank 1 made no progress for \d+ s while ranks 0, 2 waited for it in all_reduce #\d+ "),
          ("broadcast", 1, r"mpddp: ranks 0, 2 called all_reduce #(\d+) \(float32\[1\]\) while rank 1 called "
                           r"broadcast #\1 "),
          ("skip", 2, r"mpddp: rank 2 \(node 2, local rank 0\) exited \(code 0\) while "),
          ("short", 1, r"mpddp: rank 1 \(node 1, local rank 0\) exited \(code 0\) while ")]


def told(nodes: list[Node]) -> str:
    return "\n\n".join(f"node {i}:\n{n.stderr}" for i, n in enumerate(nodes))


def stories(node: Node) -> list[str]:
    """The line of each round that ended in a restart, in order, then the report's first line."""
    rounds, end = rounds_told(node.stderr)
    assert [k for _, k in rounds] == list(range(1, len(rounds) + 1)), node.stderr
    return [line for line, _ in rounds] + end[:1]


@pytest.mark.timeout(240)
def test_each_fault_of_a_rank_on_another_node_is_named_with_one_story_on_every_node(cluster: Cluster) -> None:
    """A rank stopped on node 1 (a hang), a broadcast against all_reduce (a mismatch), a rank that skipped a
    collective and one that ended early (its own node saw it return and thought the round done; the others saw
    their collective break): four stories, one round each, of one job. Was four jobs of three launchers each."""
    port = free_port()
    faults, ranks = ",".join(f for f, _, _ in ROUNDS), ",".join(str(r) for _, r, _ in ROUNDS)
    nodes = [cluster.start([], command=[sys.executable, "-m", "mpddp", "run", "--nnodes", "3", "--node-rank", str(n),
                                        "--master-addr", "127.0.0.1", "--master-port", str(port), "--nprocs", "1",
                                        "--timeout", str(TIMEOUT), "--max-restarts", str(len(ROUNDS) - 1), str(JOB),
                                        faults, ranks, "40", "200"]) for n in range(3)]
    deadline, hang_told = time.monotonic() + 180, None  # when every node has told round 0's hang
    while any(node.proc.poll() is None for node in nodes) and time.monotonic() < deadline:
        if hang_told is None and all("restarting the group (1 of " in node.stderr for node in nodes):
            hang_told = time.monotonic()
        time.sleep(0.05)
    codes = [node.wait(30) for node in nodes]
    for node in nodes:  # the launcher's own traceback (a crash) never reaches the terminal
        said = [line for line in node.stderr.splitlines() if not line.startswith("[rank")]
        assert not any(line.startswith("Traceback") for line in said), told(nodes)
    told_by = [stories(node) for node in nodes]
    assert told_by[0] == told_by[1] == told_by[2], told(nodes)
    assert len(told_by[0]) == len(ROUNDS), told(nodes)
    for line, (_, _, pattern) in zip(told_by[0], ROUNDS):
        assert re.match(pattern, line), (line, pattern, told(nodes))
    assert codes == [1, 1, 1], (codes, told(nodes))
    assert cluster.leftovers(wait=5) == []
    stopped = float(re.search(r"FAULT_AT ([0-9.]+)", nodes[1].stdout).group(1))
    # from the stop: node 1 tells it after --timeout (4 s), the others wait for its record, and all end (measured
    # 6.9 and 7.4 s at load 5 to 6 to the job's end; the margin is a more loaded machine's teardown)
    assert hang_told is not None and hang_told - stopped < TIMEOUT + 30, (hang_told, stopped)
