"""Two launchers on two network-namespace hosts (10.99.0.1 / .2, scripts/netns_hosts.sh): a job by host names and
addresses, and ``mpddp train`` started by hand on each, as a user would on two machines. The same job on 127.0.0.1:
tests/test_two_launchers.py.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode import NETNS, Cluster, check_results, free_port, namespace_hosts


@pytest.fixture(scope="module")
def netns_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Hosts n1 (10.99.0.1) and n2 (10.99.0.2) in network namespaces; deleted at the end."""
    with namespace_hosts(tmp_path_factory.mktemp("netns")) as work:
        yield work


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_two_namespace_hosts(cluster: Cluster, netns_hosts: Path) -> None:
    """Node 0 on n1, node 1 on n2: the master is 10.99.0.1, Gloo must use eth0 (not lo)."""
    port = free_port()
    node0 = cluster.start(["0", str(port), "10.99.0.1", "30"], prefix=[str(NETNS), "run", "1", str(netns_hosts)])
    node1 = cluster.start(["1", str(port), "n1", "30"], prefix=[str(NETNS), "run", "2", str(netns_hosts)])
    node0.wait(90)
    node1.wait(90)
    check_results(node0, 0)
    check_results(node1, 1)
    assert cluster.leftovers(wait=5) == []


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_train_by_hand_on_two_namespace_hosts(cluster: Cluster, netns_hosts: Path) -> None:
    """The `python -m mpddp train` command of docs/machines.rst, once on each host, with the master named n1."""
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        train = [sys.executable, "-m", "mpddp", "train", "--nnodes", "2", "--node-rank", str(node_rank),
                 "--master-addr", "n1", "--master-port", str(port), "--nprocs", "2", "--backend", "gloo",
                 "--epochs", "1", "--dataset", "synthetic", "--samples", "512", "--verbose",
                 "--run-dir", f"runs/node{node_rank}"]
        host = [str(NETNS), "run", str(node_rank + 1), str(netns_hosts)]
        nodes.append(cluster.start([], prefix=host, command=train))
    for node in nodes:
        node.wait(120)
    for node_rank, node in enumerate(nodes):
        assert node.proc.returncode == 0, f"node {node_rank}:\n{node.stdout}\n{node.stderr}"
        formulas = set(re.findall(r"rank (\d+×\d+\+\d+ = \d+ of \d+)", node.stdout + node.stderr))
        local = {f"{node_rank}×2+{lr} = {node_rank * 2 + lr} of 4" for lr in (0, 1)}
        assert formulas == local, node.stdout
    assert "epoch   1/1" in nodes[0].stdout
    # curves.png is drawn by node 0's launcher, where rank 0's metrics are; node 1 has none to draw
    assert nodes[0].stdout.rstrip().endswith("curves: runs/node0/curves.png"), nodes[0].stdout
    assert (cluster.tmp / "runs/node0/curves.png").is_file()
    assert not (cluster.tmp / "runs/node1/curves.png").exists()
    assert cluster.leftovers(wait=5) == []
