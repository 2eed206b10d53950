"""The ``c10d`` backend's one client of node 0's store, for the whole job (core/nodes/c10d.py is the backend).

Owns: :class:`C10dClient`, which connects once, trying again until node 0's launcher serves its store or
--timeout ran out, then runs every operation under one lock, and turns any failure of torch's client into
:class:`~mpddp.errors.RendezvousGone`; after a failed first connection it fails fast. Leaves the
store's keys to the backend and its helpers, and torch's client to core/wire/store.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ...config import LaunchConfig
from ...errors import RendezvousGone


class StoreGone(RendezvousGone):
    """Node 0's store does not answer."""

    went = "node 0's store went away"


class C10dClient:
    """A client of node 0's store at ``config.master_addr``:``port``; every call is thread-safe.

    ``config`` is the launch's, as started: its address, timeout and node rank are the job's."""

    def __init__(self, config: LaunchConfig, port: int) -> None:
        self.config, self.port = config, port
        self.reached = False  # node 0's store answered once, this launcher or one of its ranks
        self._unreachable = False  # a connection failed, after retrying for as long as asked: fail fast from now
        self._store: Any = None
        self._lock = threading.Lock()  # one operation at a time on the client
        self._connecting = threading.Lock()

    def call(self, op: Callable[[Any], Any], connect_timeout: float | None = None) -> Any:
        """``op(store)`` under the lock; :class:`RendezvousGone` when node 0's store cannot be reached."""
        try:
            with self._connecting:  # one connection at a time: it retries until node 0 is up, or the timeout
                if self._unreachable:
                    raise StoreGone(f"node 0's store at {self.config.master_addr}:{self.port} did not answer",
                                    self.gone_line())
                if self._store is None:
                    self._store = self._connect(connect_timeout if connect_timeout is not None else self.config.timeout)
                    self.reached = True
            with self._lock:
                return op(self._store)
        except RendezvousGone:
            raise
        except Exception as e:  # noqa: BLE001 - torch raises several types for a store that is gone
            if self._store is None:
                self._unreachable = True
            raise StoreGone(f"node 0's store at {self.config.master_addr}:{self.port} does not answer "
                            f"({type(e).__name__})", self.gone_line()) from e

    def gone_line(self) -> str:
        """Node 0's store does not answer: never reached (not started, wrong address), or gone since."""
        config = self.config
        if not self.reached:
            return (f"node 0's rendezvous store at {config.master_addr}:{self.port} did not answer within --timeout "
                    f"{config.timeout:g} s: node 0's launcher does not run there, not started yet or the job already "
                    "ended (its nodes give up on a node that does not come within --timeout); start every node within "
                    "--timeout of the others, with node 0's launcher (--node-rank 0) there, or check --master-addr "
                    "and --master-port")
        return (f"node 0, which hosts the rendezvous at {config.master_addr}:{self.port}, is gone (its launcher was "
                "killed, or its machine lost)")

    def _connect(self, timeout: float) -> Any:
        """A client, trying again every second until ``timeout``: torch's own retries wait up to several
        seconds between tries, and a launcher that connects late can miss a store that was up meanwhile."""
        from ..wire.store import connect, load_torch

        # torch first: on a loaded machine its import took 7.9 s (beside a second suite), and node 0's store can be
        # gone by then: the plain socket below, tried after it, says so at once, where torch's client retried the
        # refused connection for 3.8 s more, and a node whose own rank failed meanwhile waited for both to tell it
        deadline = time.monotonic() + timeout
        load_torch()
        while True:
            try:
                # A plain socket first: each failed try of torch's client prints a C++ stack on stderr. It is
                # accepted as soon as node 0's launcher listens, before its store server serves the store, and torch's
                # client, once stuck in that window, can wait out its whole timeout: so short tries, again.
                socket.create_connection((self.config.master_addr, self.port), timeout=1.0).close()
                store: Any = connect(self.config.master_addr, self.port, max(0.5, min(2.0, deadline - time.monotonic())))
                store.set_timeout(timedelta(seconds=self.config.timeout))  # each operation's, once connected
                return store
            except Exception as e:  # noqa: BLE001 - OSError from the socket, torch's own types from its client
                # refused on node 0 (it listens before our first try) or once it answered our ranks: lost, not late
                refused = isinstance(e, ConnectionRefusedError) and (self.config.node_rank == 0 or self.reached)
                if refused or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
