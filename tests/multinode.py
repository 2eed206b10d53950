"""Helpers for tests that run several launchers ("nodes"): ports, tagged processes, results."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from runs import Run, marked

JOB = Path(__file__).parent / "scripts" / "multinode_job.py"
REPO = Path(__file__).parent.parent


def free_port() -> int:
    """A port free on 127.0.0.1 now (the launchers bind it later: fine for a test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Node(Run):
    """One launcher of a :class:`Cluster`: a :class:`~runs.Run` named after its place in the cluster."""

    @property
    def out(self) -> Path:
        return self.out_path

    @property
    def err(self) -> Path:
        return self.err_path

    def wait(self, timeout: float) -> int:
        return self.finish(timeout)

    def results(self) -> list[dict]:
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 1, f"no RESULT line:\n{self.stdout}\n{self.stderr}"
        return json.loads(lines[0][len("RESULT "):])


def check_results(node: Node, node_rank: int) -> None:
    """multinode_job.py's results on node ``node_rank`` of two, 2 ranks a node: ranks by the formula, the sum."""
    assert node.proc.returncode == 0, f"node {node_rank} failed:\n{node.stdout}\n{node.stderr}"
    results = node.results()
    assert [r["rank"] for r in results] == [node_rank * 2, node_rank * 2 + 1]  # rank = node_rank × 2 + local_rank
    assert [r["local_rank"] for r in results] == [0, 1]
    assert {r["node_rank"] for r in results} == {node_rank}
    assert {r["world_size"] for r in results} == {4}
    assert {r["sum"] for r in results} == {6.0}  # 0+1+2+3


class Cluster:
    """Several launchers of one test in one folder (tests/runs.py's :class:`~runs.Run` each, its marker in their
    environment), so that every process they leave is found."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nodes: list[Node] = []

    def start(self, args: list[str], prefix: list[str] | None = None, env: dict[str, str] | None = None,
              command: list[str] | None = None) -> Node:
        """Start ``multinode_job.py ARGS`` (or ``command``), behind ``prefix`` (e.g. netns_hosts.sh run 1 DIR)."""
        node = Node([str(JOB), *args], self.tmp, env={"PYTHONPATH": str(REPO), **(env or {})}, prefix=prefix,
                    command=command, name=f"node{len(self.nodes)}")
        self.nodes.append(node)
        return node

    def tagged(self) -> list[psutil.Process]:
        """Every live process that carries one of its launchers' markers (launchers, workers, helpers)."""
        return [proc for node in self.nodes for proc in marked(node.marker)]

    def leftovers(self, wait: float) -> list[str]:
        """Tagged processes still alive after ``wait`` seconds, as command lines."""
        deadline = time.monotonic() + wait
        while True:
            left = self.tagged()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        names = []
        for proc in left:
            try:
                names.append(f"{proc.pid}: {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                continue
        return names

    def kill_all(self) -> None:
        """Last resort at the end of a test: SIGKILL every tagged process by pid."""
        for proc in self.tagged():
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait(10)

    def wait_for(self, text: str, count: int, timeout: float) -> None:
        """Until ``text`` appears ``count`` times in the nodes' output together."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(node.stdout.count(text) for node in self.nodes) >= count:
                return
            if any(node.proc.poll() is not None for node in self.nodes):
                break
            time.sleep(0.1)
        outputs = "\n".join(f"node {i}:\n{n.stdout}\n{n.stderr}" for i, n in enumerate(self.nodes))
        raise AssertionError(f"{text!r} did not appear {count} times:\n{outputs}")

    def wait_for_beats(self, port: int, nnodes: int, timeout: float, attempt: int = 0) -> None:
        """Until every node's launcher has beaten in round ``attempt``, as node 0's store at 127.0.0.1:PORT says.

        Before its first beat a launcher killed is found lost only after --timeout (core/nodes/rounds.py):
        a test of a launcher lost *while it beat* waits for this first, so that it does not wait --timeout.
        """
        from datetime import timedelta

        import torch.distributed as dist

        from mpddp.core.wire import protocol

        keys = [protocol.full_key(attempt, protocol.heartbeat_key(n)) for n in range(nnodes)]
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        deadline = time.monotonic() + timeout
        try:
            while not all(store.add(key, 0) > 0 for key in keys):
                if time.monotonic() > deadline or any(node.proc.poll() is not None for node in self.nodes):
                    raise AssertionError(f"not every launcher beat within {timeout} s (round {attempt})")
                time.sleep(0.05)
        finally:
            del store


NETNS = REPO / "scripts" / "netns_hosts.sh"


@contextlib.contextmanager
def namespace_hosts(work: Path) -> Iterator[Path]:
    """Hosts n1 (10.99.0.1) and n2 (10.99.0.2) in network namespaces (scripts/netns_hosts.sh), deleted after.

    Skips (with the reason) where they cannot be made: not root, no iproute2, or another run holds them.
    """
    import pytest

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.skip("network namespaces need root, iproute2 and nsenter")
    with machine_lock():
        up = subprocess.run([str(NETNS), "up", str(work)], capture_output=True, text=True, timeout=30)
        if up.returncode == 3:
            pytest.skip(f"cannot make network namespaces here: {up.stderr.strip()}")
        try:
            assert up.returncode == 0, up.stderr
            yield work
        finally:
            subprocess.run([str(NETNS), "down"], timeout=30, check=False)


# The machine's own path, not TMPDIR's: two test runs with TMPDIRs of their own still share one bridge
NETNS_LOCK = Path("/tmp/mpddp-ci-netns.lock")
LOCK_WAIT = 45.0  # seconds, within the first test's timeout (which counts its fixtures); then skip


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """This machine's namespace hosts and SLURM daemons, for one test run at a time.

    They are the machine's (one bridge, fixed names): a second test run beside this one would fail to
    make them, or bring them down under this one. The lock waits :data:`LOCK_WAIT`, then skips.
    """
    import fcntl

    import pytest

    with open(NETNS_LOCK, "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(f"another test run holds this machine's namespace hosts ({NETNS_LOCK})")
                time.sleep(1.0)
        yield
