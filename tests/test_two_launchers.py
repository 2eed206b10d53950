"""Two launchers, two "nodes" of one job on 127.0.0.1: node 1 may start first, and a launcher stopped is named on the
node that remains (a node that never arrives, or a node 0 that does not answer: test_roll_call.py).

Each node runs ``tests/scripts/multinode_job.py`` (mpddp.launch with nnodes=2, 2 ranks a node, gloo): world size 4,
global ranks by the formula, all_reduce of the ranks = 0+1+2+3. Each launcher is a tests/runs.py ``Run``: its
processes carry its marker, so that whatever a launch leaves behind is found. The same on two namespace hosts:
tests/test_two_hosts.py.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from multinode import Cluster, check_results, free_port

NODE_1 = re.compile(r"\bnode(\(s\))? 1\b")  # "node 1 ..." or "node(s) 1 never arrived"


SLACK = 60.0  # seconds beyond --timeout for starting workers and tearing down, on 2 cores under load (50 s seen


@pytest.mark.timeout(120)
def test_two_launchers_on_loopback_node_1_first(cluster: Cluster) -> None:
    """Node 1 comes before node 0's store listens, and waits for it (node 0 first: every other story here)."""
    first = 1
    port = free_port()
    nodes = {}
    nodes[first] = cluster.start([str(first), str(port), "127.0.0.1", "30"])
    time.sleep(2.0)  # the other node really arrives later
    nodes[1 - first] = cluster.start([str(1 - first), str(port), "127.0.0.1", "30"])
    for rank in (0, 1):
        nodes[rank].wait(60)
    for rank in (0, 1):
        check_results(nodes[rank], rank)
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(180)
def test_a_launcher_stopped_by_sigterm_stops_the_other_node(cluster: Cluster) -> None:
    """SIGKILL's story, a launcher gone without a word, is test_named_across_nodes.py's (its first line, exactly)."""
    sig = signal.SIGTERM
    port, timeout = free_port(), 10.0
    node0 = cluster.start(["0", str(port), "127.0.0.1", str(timeout), "120"])
    node1 = cluster.start(["1", str(port), "127.0.0.1", str(timeout), "120"])
    cluster.wait_for("READY rank", 4, timeout=60)
    cluster.wait_for_beats(port, 2, timeout=60)  # lost while it beat (a launcher that never beat: --timeout)
    killed_at = time.monotonic()
    node1.proc.send_signal(sig)
    node1.wait(30)
    code = node0.wait(timeout + SLACK)
    took = time.monotonic() - killed_at
    left = cluster.leftovers(wait=5)
    assert code != 0
    assert took < timeout + SLACK
    assert NODE_1.search(node0.stderr), f"the message does not name the missing node:\n{node0.stderr}"
    assert left == [], "processes left running after a launcher was killed"
