"""Node heartbeats: which node's launcher is gone, when a multi-node job fails.

Owns: one counter per node in node 0's store, bumped twice a second by each
launcher, and the check that names the nodes whose counter stopped. A
launcher that is killed (or a machine that is lost) takes its workers with
it; the other nodes then only see "Connection closed by peer" in their own
ranks, which would blame a victim. Leaves the report itself to group.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_INTERVAL = 0.5
_CHECK_WAIT = 3 * _INTERVAL


def _key(attempt: int, node: int) -> str:
    return f"mpddp/attempt_{attempt}/beat/{node}"


class Heartbeat:
    """Bump this node's counter until :meth:`stop`, from a daemon thread."""

    def __init__(self, addr: str, port: int, node: int, attempt: int, timeout: float) -> None:
        self._stop = threading.Event()
        self._args = (addr, port, node, attempt, timeout)
        self._thread = threading.Thread(target=self._run, name="mpddp-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from .rendezvous import connect

        addr, port, node, attempt, timeout = self._args
        try:
            store: Any = connect(addr, port, timeout)  # retries until node 0 is up
            while not self._stop.is_set():
                store.add(_key(attempt, node), 1)
                self._stop.wait(_INTERVAL)
        except Exception:  # noqa: BLE001 - node 0 gone: nothing left to tell
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(0.2)


def stalled_nodes(addr: str, port: int, nnodes: int, me: int, attempt: int) -> list[int] | None:
    """Other nodes whose counter did not move for a while; None if node 0 is gone."""
    from .rendezvous import connect

    try:
        store: Any = connect(addr, port, 2.0)
        others = [n for n in range(nnodes) if n != me]
        before = [store.add(_key(attempt, n), 0) for n in others]
        time.sleep(_CHECK_WAIT)
        after = [store.add(_key(attempt, n), 0) for n in others]
    except Exception:  # noqa: BLE001 - the store (node 0's launcher) does not answer
        return None
    return [n for n, b, a in zip(others, before, after) if a == b]
