"""Scale, simulated: 8 launchers ("nodes") × 2 ranks on 127.0.0.1, with node ranks.

Two jobs, each a few scenarios at once, to keep the suite's time in check: one whose rank on a random
node is SIGKILLed at a random step and which recovers with ``--max-restarts 1`` (the same cause named
on all 8 nodes, every value returned, the weights equal on all 16 ranks), and one whose launcher on a
random node is SIGKILLed (named lost on the 7 others). Nothing tagged may be left running.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from multinode import Cluster, free_port
from test_rounds import first_report_line, start, weights

NODES = 8
pytestmark = pytest.mark.bench  # a step of its own in .ci/run: eight launchers at once load 2 cores for minutes


@pytest.mark.timeout(240)
def test_eight_nodes_name_the_same_rank_and_recover_together(cluster: Cluster) -> None:
    rank = random.randrange(2 * NODES)
    nodes = start(cluster, NODES, free_port(), "--fail", str(rank), "--at", str(random.randint(1, 4)),
                  "--max-restarts", "1", "--timeout", "60")
    codes = [node.wait(200) for node in nodes]
    assert codes == [0] * NODES, "\n\n".join(f"node {i}: {n.stderr}" for i, n in enumerate(nodes) if n.proc.returncode)
    expected = f"mpddp: rank {rank} (node {rank // 2}, local rank {rank % 2}) failed first: it was killed by SIGKILL"
    lines = [first_report_line(node) for node in nodes]
    assert all(line == lines[0] for line in lines) and lines[0].startswith(expected), lines
    found = [w for node in nodes for w in weights(node)]
    assert len(found) == 2 * NODES and all(w == found[0] for w in found)
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(240)
def test_a_launcher_killed_on_one_of_eight_nodes_is_named_lost_on_the_others(cluster: Cluster) -> None:
    lost = random.randrange(1, NODES)
    port = free_port()
    nodes = start(cluster, NODES, port, "--steps", "2000", "--pause", "0.05", "--timeout", "20")
    cluster.wait_for("READY rank", 2 * NODES, timeout=150)
    cluster.wait_for_beats(port, NODES, timeout=90)  # lost while it beat (a launcher that never beat: --timeout)
    time.sleep(random.uniform(0.0, 1.0))
    nodes[lost].proc.send_signal(signal.SIGKILL)
    codes = [node.wait(90) for i, node in enumerate(nodes)]
    assert all(code != 0 for code in codes)
    said = f"mpddp: node(s) {lost} went away"
    for i, node in enumerate(nodes):
        if i != lost:
            assert first_report_line(node).startswith(said), f"node {i}:\n{node.stderr}"
    assert cluster.leftovers(wait=10) == []
