"""What the other nodes did, when a multi-node job fails.

Owns: one heartbeat counter per node in node 0's store, bumped twice a
second by each launcher, the check that names the nodes whose counter
stopped, and the lines that say which nodes never arrived or went away. A
launcher that is killed (or a machine that is lost) takes its workers with
it; the other nodes then only see "Connection closed by peer" in their own
ranks, which would blame a victim. Leaves the rest of the report to
core/report.py, the watching to core/supervisor.py and the key names to
core/protocol.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .. import ranks as rank_math
from ..config import LaunchConfig
from ..errors import Outcome
from . import protocol

_INTERVAL = 0.5
_CHECK_WAIT = 3 * _INTERVAL


def _key(attempt: int, node: int) -> str:
    return protocol.full_key(attempt, protocol.beat_key(node))


class Heartbeat:
    """Bump this node's counter until :meth:`stop`, from a daemon thread.

    It also carries the watchdog's progress between nodes (core/watchdog.py):
    :meth:`progressed` marks that a local rank computed, and
    :attr:`remote_progress` moves when a rank on another node did, so that no
    node declares a hang while another node's ranks compute.
    """

    def __init__(self, addr: str, port: int, node: int, attempt: int, timeout: float, nnodes: int = 1) -> None:
        self._stop = threading.Event()
        self._progress = threading.Event()
        self.remote_progress = 0  # the sum of the other nodes' progress counters, as last read
        self._args = (addr, port, node, attempt, timeout, nnodes)
        self._thread = threading.Thread(target=self._run, name="mpddp-heartbeat", daemon=True)
        self._thread.start()

    def progressed(self) -> None:
        self._progress.set()

    def _run(self) -> None:
        from .rendezvous import connect

        addr, port, node, attempt, timeout, nnodes = self._args
        others = [protocol.full_key(attempt, protocol.progress_key(n)) for n in range(nnodes) if n != node]
        try:
            store: Any = connect(addr, port, timeout)  # retries until node 0 is up
            while not self._stop.is_set():
                store.add(_key(attempt, node), 1)
                if self._progress.is_set():
                    self._progress.clear()
                    store.add(protocol.full_key(attempt, protocol.progress_key(node)), 1)
                self.remote_progress = sum(store.add(key, 0) for key in others)
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


def remote_causes(
    config: LaunchConfig, nprocs: int, root: Outcome, hosting: bool, port: int, attempt: int, init_group: bool,
    stop_local: Callable[[], None],
) -> list[str]:
    """Lines that say what another node did (never arrived, went away); [] on one node.

    ``root`` is the outcome of this node's first failure (core/report.py):
    only an error inside a collective can be another node's doing.
    ``hosting``: this node's keeper serves the store (node 0), which knows who arrived.
    """
    if config.nnodes == 1:
        return []
    if hosting and init_group:
        missing = _missing_ranks(config.master_addr, port, config.nnodes * nprocs, attempt)
        if missing:
            return [_missing_message(missing, config, nprocs, port)]
    if root is not Outcome.COLLECTIVE:
        return []  # a rank here failed by itself: that is the story
    stop_local()  # our ranks stop now; this launcher keeps beating while it looks
    stalled = stalled_nodes(config.master_addr, port, config.nnodes, config.node_rank, attempt)
    if stalled is None:
        return [f"mpddp: node 0, which hosts the rendezvous at {config.master_addr}:{port}, is gone (its launcher "
                "was killed, or its machine lost); the failures below are consequences"]
    if not stalled:
        return []
    ranks = [s.rank for s in rank_math.layout(config.nnodes, nprocs) if s.node_rank in stalled]
    return [f"mpddp: node(s) {', '.join(map(str, stalled))} went away (the launcher's heartbeat stopped: killed, "
            f"preempted or lost), taking rank(s) {', '.join(map(str, ranks))}; the failures below are consequences"]


def _missing_ranks(addr: str, port: int, world_size: int, attempt: int) -> list[int]:
    """Ranks that never reached node 0's store (their node never arrived); see core/worker.py."""
    from .rendezvous import connect

    try:
        store: Any = connect(addr, port, 2.0)
        return [r for r in range(world_size) if not store.check([protocol.full_key(attempt, protocol.arrived_key(r))])]
    except Exception:  # noqa: BLE001 - the store is gone too: nothing to say about who arrived
        return []


def _missing_message(missing: list[int], config: LaunchConfig, nprocs: int, port: int) -> str:
    nodes = sorted({rank_math.split_rank(r, nprocs)[0] for r in missing})
    return (
        f"mpddp: node(s) {', '.join(map(str, nodes))} never arrived (rank(s) {', '.join(map(str, missing))} "
        f"missing from the rendezvous at {config.master_addr}:{port}): start their launchers with "
        f"--nnodes {config.nnodes} --master-addr {config.master_addr} --master-port {port} --node-rank N"
    )
