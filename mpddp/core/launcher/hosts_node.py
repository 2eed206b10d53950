"""One node of a ``--hosts`` launch, on its machine: ``python -m mpddp.core.launcher.hosts_node``, started over ssh.

Owns: the remote end of core/launcher/hosts_head.py's protocol. It reads one request on
stdin (the node's launch options, ``fn`` already shipped by value, a few
variables), runs this node's ranks exactly as a local launch would
(core/launcher/api.py's :func:`~mpddp.core.launcher.api.run_node`), and answers on stdout
with typed messages between the ranks' ``[rank N]`` lines: node 0 first
tells the rendezvous port it holds (the OS picked it, and it stays bound),
then every node tells its ranks' values or its failure (a picklable
:class:`~mpddp.errors.MpddpError`). Every write to stdout is one whole line
under one lock, so a message never splits a rank's line. When stdin closes
(the head stopped the job, or the head or its ssh died), the node stops its
ranks as on SIGTERM and exits: nothing is left on this host. Leaves the
head's side to core/launcher/hosts_head.py.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ...errors import MpddpError
from ..wire import protocol, signals


class Stopped(signals.Terminated):
    """The head is gone or stopped the job (stdin closed: a SIGTERM to this node), or a signal arrived: tear
    down, the ranks with their grace (``--shutdown-timeout``)."""


class _Lines(io.TextIOBase):
    """A stream whose every write is whole and under one lock (the relay thread and the messages share it)."""

    def __init__(self, stream: Any, lock: threading.Lock) -> None:
        self._stream, self._lock = stream, lock

    def write(self, text: str) -> int:
        with self._lock:
            self._stream.write(text)
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._stream.flush()

    def isatty(self) -> bool:
        return False


def send(message: protocol.NodeMessage) -> None:
    """One message to the head, as one whole line on stdout."""
    sys.stdout.write(protocol.node_line(message))


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    signals.raise_stop(Stopped(signum), signum, frame)


def _watch_stdin(stream: Any) -> None:
    """EOF on stdin: the head closed it (stop) or is gone. Stop this node as SIGTERM would."""
    while stream.read(1 << 16):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def serve(stdin: Any) -> int:
    """Run this node for the head; the exit code says only whether the protocol held (0) or not."""
    from .api import run_node

    request = protocol.read_request(stdin)
    if request is None:
        raise Stopped(signal.SIGTERM)
    os.environ.update(request.environ)
    threading.Thread(target=_watch_stdin, args=(stdin,), name="mpddp-node-stdin", daemon=True).start()
    port, sock = request.master_port, None
    if request.node_rank == 0:  # hold the rendezvous port, then tell the head which one it is
        from ..stores.listen import listen

        sock = listen(request.config.master_addr, port)
        port = sock.getsockname()[1]
        send(protocol.NodePort(port))
    config = request.node_config(port)
    try:
        values = run_node(config, request.payload, request.init_process_group, request.preload, sock,
                          job=request.runs)
    except MpddpError as failure:
        send(protocol.NodeFailed(failure))
        return 0
    send(protocol.NodeResult(values))
    return 0


def main() -> None:
    lock = threading.Lock()
    stdin = sys.stdin.buffer
    sys.stdout = _Lines(sys.stdout, lock)
    sys.stderr = _Lines(sys.stderr, threading.Lock())
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _raise_stopped)
    try:
        code = serve(stdin)
    except (signals.Terminated, KeyboardInterrupt):  # Stopped, or a signal of --signals-to-handle
        code = 0  # the ranks were stopped in the launch's own teardown
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)  # done: the head closing our stdin now is the normal end
    from .startup import stop_helpers

    stop_helpers()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
