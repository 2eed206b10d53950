"""Several machines from one command: a launcher on every ``--hosts`` host, started over ssh.

Owns: the head's side of a ``--hosts`` launch. First every host is checked
in parallel over the user's own ssh (``BatchMode``: a password prompt is an
error, never a hang): it answers within the timeout and has mpddp and torch
at the head's versions, at the head's Python path; each problem is one line
naming the host, before anything starts. Then node 0's launcher (core/launcher/hosts_node.py)
starts on the first host and tells the port it holds, and the others start
with it. The head relays every node's ``[rank N]`` lines as they come,
collects every node's values (global rank order), and on the first failure,
a Ctrl-C or a SIGTERM stops every node by closing its stdin (each node then
tears down as on SIGTERM: nothing is left on any host), then ssh itself.
The report is the failing node's own (stacks included), chosen by outcome
as on one node. Leaves the node's side to core/launcher/hosts_node.py and each node's
launch to core/launcher/api.py.
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import IO, Any

from ..._version import __version__
from ...config import LaunchConfig
from ...errors import ConfigError, MpddpError, Outcome, RendezvousError, WorkerFailed
from ..wire.protocol import (
    NODE_MARK,
    NodeEnded,
    NodeFailed,
    NodeMessage,
    NodePort,
    NodeRequest,
    NodeResult,
    encode_request,
    read_node_line,
)

CHECK_TIMEOUT = 20.0  # seconds a host has to answer the environment check over ssh
_STOP_GRACE = 10.0  # seconds a node has to stop its ranks after its stdin closed, beyond the ranks' own grace
_REPORT_WINDOW = 5.0  # seconds the other nodes have to send their reports after the first failure
_CAUSE = {Outcome.RAISED: 0, Outcome.EXITED: 0, Outcome.DIED: 1, Outcome.EARLY_EXIT: 2, Outcome.MISMATCH: 2,
          Outcome.HUNG: 3,
          Outcome.COLLECTIVE: 4, Outcome.STOPPED: 5, Outcome.OK: 6}
_FORWARD = ("PYTHONPATH", "MPDDP_")  # variables that travel to the remote launchers (prefixes)


def _ssh(config: LaunchConfig, host: str, command: list[str]) -> list[str]:
    """The user's ssh (their keys, agent and ~/.ssh/config), never prompting, then the remote command."""
    connect = min(max(config.timeout / 2, 5.0), CHECK_TIMEOUT / 2)  # an unreachable host: ssh's own answer first
    return [*shlex.split(config.ssh), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect:.0f}", host, "--",
            shlex.join(command)]


def _remote_command(argv: list[str]) -> list[str]:
    """``cd <cwd> && env PYTHONPATH=... <this python> ...``: the same environment on every host."""
    forwarded = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(_FORWARD)]
    inner = shlex.join(["env", *forwarded, sys.executable, *argv])
    return ["sh", "-c", f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec {inner}"]


_CHECK = "import mpddp, torch; print('MPDDP-VERSIONS', mpddp.__version__, torch.__version__)"


def check_hosts(config: LaunchConfig) -> None:
    """Every host answers ssh, and runs this Python with mpddp and torch at our versions: else one line."""
    import torch

    hosts = config.hosts or ()
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        problems = list(pool.map(lambda h: _check(config, h, torch.__version__), hosts))
    for problem in problems:
        if problem:
            raise ConfigError(problem)


def _check(config: LaunchConfig, host: str, torch_version: str) -> str | None:
    argv = _ssh(config, host, _remote_command(["-c", _CHECK]))
    try:
        out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"host {host} did not answer ssh within {CHECK_TIMEOUT:g} s: check that it is up and reachable"
    except OSError as e:
        return f"ssh={config.ssh!r} cannot be run ({e.strerror}): install OpenSSH's client or pass --ssh"
    found = [line.split() for line in out.stdout.splitlines() if line.startswith("MPDDP-VERSIONS ")]
    if out.returncode == 255 and not found:
        said = (out.stderr.strip().splitlines() or ["no answer"])[-1]
        return (f"host {host} refused or failed ssh ({said}): mpddp uses BatchMode, so the host needs a key "
                f"(or agent) that logs in without a prompt; try `{config.ssh} {host} true`")
    if not found:
        said = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return (f"host {host} cannot run `{sys.executable} -c 'import mpddp, torch'` ({said}): every host needs "
                "the same Python environment at the same path")
    _, mpddp_version, remote_torch = found[0]
    if (mpddp_version, remote_torch) != (__version__, torch_version):
        return (f"host {host} has mpddp {mpddp_version} and torch {remote_torch}, this machine mpddp {__version__} "
                f"and torch {torch_version}: install the same versions on every host")
    return None


@dataclass
class _Node:
    """One remote launcher: its ssh process and the messages it sent."""

    rank: int
    host: str
    proc: subprocess.Popen[bytes]
    messages: queue.Queue[tuple[int, NodeMessage | NodeEnded]]
    threads: list[threading.Thread] = field(default_factory=list)
    stopped: bool = False  # the head asked it to stop: an end without a report is then no failure

    def stop(self) -> None:
        """Close its stdin: the node tears down its ranks and exits (core/launcher/hosts_node.py)."""
        self.stopped = True
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def _pump(node: _Node, stream: IO[bytes], out: Any, messages: bool) -> None:
    """Relay one ssh stream line by line to our own (current) stream; messages go to the queue."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if messages and line.startswith(NODE_MARK):
            node.messages.put((node.rank, read_node_line(line)))
            continue
        target = sys.stdout if out == "out" else sys.stderr
        try:
            target.write(line)
            target.flush()
        except (OSError, ValueError):
            pass
    if messages:
        node.messages.put((node.rank, NodeEnded(node.proc.wait())))


def _start(config: LaunchConfig, rank: int, port: int, request: NodeRequest,
           messages: queue.Queue[tuple[int, NodeMessage | NodeEnded]]) -> _Node:
    host = (config.hosts or ())[rank]
    argv = _ssh(config, host, _remote_command(["-m", "mpddp.core.launcher.hosts_node"]))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # the terminal's Ctrl-C reaches the head only
    node = _Node(rank, host, proc, messages)
    for stream, out, msgs in ((proc.stdout, "out", True), (proc.stderr, "err", False)):
        thread = threading.Thread(target=_pump, args=(node, stream, out, msgs), daemon=True,
                                  name=f"mpddp-node-{rank}-{out}")
        thread.start()
        node.threads.append(thread)
    assert proc.stdin is not None
    proc.stdin.write(encode_request(replace(request, node_rank=rank, master_port=port)))
    proc.stdin.flush()
    return node


def launch_hosts(config: LaunchConfig, payload: bytes, init_process_group: bool, preload: tuple[str, ...],
                 runs: str = "") -> list:
    """Run the job (``runs``: its script or function, for its fingerprint) on every host; return every rank's value
    of every node, in global rank order."""
    check_hosts(config)
    request = NodeRequest(config, 0, config.master_port, payload, init_process_group, preload,
                          environ={k: v for k, v in os.environ.items() if k.startswith("MPDDP_")}, runs=runs)
    messages: queue.Queue[tuple[int, NodeMessage | NodeEnded]] = queue.Queue()
    nodes: list[_Node] = []
    with _stopping(nodes, config.shutdown_timeout or 0.0):
        nodes.append(_start(config, 0, config.master_port, request, messages))
        port = _wait_for_port(nodes[0], messages, config)
        for rank in range(1, config.nnodes):
            nodes.append(_start(config, rank, port, request, messages))
        return _collect(nodes, messages, config)
    raise AssertionError("unreachable")


def _wait_for_port(node: _Node, messages: queue.Queue[tuple[int, NodeMessage | NodeEnded]],
                   config: LaunchConfig) -> int:
    deadline = time.monotonic() + max(config.timeout, CHECK_TIMEOUT)
    while time.monotonic() < deadline:
        try:
            _, message = messages.get(timeout=0.2)
        except queue.Empty:
            continue
        if isinstance(message, NodePort):
            return message.port
        if isinstance(message, NodeFailed):
            raise message.error
        if isinstance(message, NodeEnded):
            raise RendezvousError(f"node 0's launcher on host {node.host} exited (code {message.exit_code}) before "
                                  "it held the rendezvous port: see its lines above")
    raise RendezvousError(f"node 0's launcher on host {node.host} did not start within {config.timeout:g} s")


def _collect(nodes: list[_Node], messages: queue.Queue[tuple[int, NodeMessage | NodeEnded]],
             config: LaunchConfig) -> list:
    """Wait for every node's values; on the first failure, give the others a moment to report, then stop."""
    results: dict[int, list[Any]] = {}
    failures: dict[int, MpddpError] = {}
    first: float | None = None
    while len(results) < len(nodes):
        try:
            rank, message = messages.get(timeout=0.2)
        except queue.Empty:
            rank, message = -1, None
        if isinstance(message, NodeResult):
            results[rank] = message.values
        elif isinstance(message, NodeFailed):
            failures[rank] = message.error
        elif (isinstance(message, NodeEnded) and rank not in results and rank not in failures
              and not nodes[rank].stopped):
            failures[rank] = _lost(nodes[rank], message.exit_code, config)  # killed, or its host or ssh session lost
        if failures and first is None:
            first = time.monotonic()
            for node in nodes:
                node.stop()  # the others stop as soon as they can; their reports still come
        ended = {r for r, n in enumerate(nodes) if n.proc.poll() is not None}
        if first is not None and (len(results) + len(failures) >= len(nodes) or len(ended | set(failures))
                                  >= len(nodes) or time.monotonic() - first > _REPORT_WINDOW):
            raise _root(nodes, failures)
    return [value for rank in range(len(nodes)) for value in results[rank]]


def _lost(node: _Node, code: int, config: LaunchConfig) -> WorkerFailed:
    first = node.rank * config.nprocs if config.nprocs else -1  # -1: its ranks were not counted yet
    return WorkerFailed(f"mpddp: node {node.rank}'s launcher on host {node.host} ended (ssh exit code {code}) "
                        "without a report: it was killed, or the host or its ssh session was lost; its ranks "
                        "went with it (see their lines above)", rank=first, exit_code=1)


def _root(nodes: list[_Node], failures: dict[int, MpddpError]) -> MpddpError:
    """The node whose first rank failed by itself (by outcome, as on one node), its report naming the host."""

    def order(rank: int) -> tuple[int, int]:
        error = failures[rank]
        records = getattr(error, "failures", [])
        return (_CAUSE.get(records[0].outcome, 7) if records else _CAUSE[Outcome.DIED]), rank  # lost: a death

    rank = min(failures, key=order)
    error = failures[rank]
    error.args = (f"mpddp: on host {nodes[rank].host} (node {rank}):\n{error}",)
    return error


@contextmanager
def _stopping(nodes: list[_Node], grace: float) -> Iterator[None]:
    """Whatever happens (a failure, Ctrl-C, SIGTERM), stop every node and wait for its ssh to end: a node told to
    stop gives its ranks their ``grace`` (--shutdown-timeout) to save, and the head waits that long too."""
    try:
        yield
    finally:
        for node in nodes:
            node.stop()
        deadline = time.monotonic() + grace + _STOP_GRACE
        for node in nodes:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()  # its sshd then ends the session, and the node sees its stdin close
                node.proc.wait()
            for thread in node.threads:
                thread.join(1.0)
