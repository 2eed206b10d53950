"""The ``c10d`` backend's one client of node 0's store, for the whole job (core/nodes/c10d.py is the backend).

Owns: :class:`C10dClient`, which connects once, trying again until node 0's launcher serves its store or
--timeout ran out, then runs every operation under one lock, each within a deadline that a silent or frozen node 0
cannot take away (core/stores/deadline.py), and turns any failure of torch's client into
:class:`~mpddp.errors.RendezvousGone`; after a failed first connection, or a call node 0 left unanswered, it fails
fast; and :class:`C10dKV`, core/stores/kv.py's protocol over it (a prefix's entries numbered by a counter: a store
lists no keys). Leaves what the keys mean to the backend and its helpers, and torch's client to core/wire/store.py.
"""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ...config import LaunchConfig
from ...errors import RendezvousGone
from .deadline import SILENT, Silent, answered, within
from .store_beat import peek, read_all


class StoreGone(RendezvousGone):
    """Node 0's store does not answer."""

    went = "node 0's store went away"


class StoreSilent(StoreGone):
    """Node 0's store left a call unanswered past its deadline, its connection open: cut off, or frozen."""

    went = "node 0's store went silent"
    silent = True


class C10dClient:
    """A client of node 0's store at ``config.master_addr``:``port``; every call is thread-safe.

    ``config`` is the launch's, as started: its address, timeout and node rank are the job's."""

    def __init__(self, config: LaunchConfig, port: int) -> None:
        self.config, self.port = config, port
        self.reached = False  # node 0's store answered once, this launcher or one of its ranks
        self._unreachable = False  # a connection failed, after retrying for as long as asked: fail fast from now
        self._silent = False  # a call went unanswered past its deadline: node 0 is silent, its client never used again
        self._store: Any = None
        self._lock = threading.Lock()  # one operation at a time on the client
        self._connecting = threading.Lock()

    def call(self, op: Callable[[Any], Any], connect_timeout: float | None = None, wait: float = 0.0) -> Any:
        """``op(store)`` under the lock, within :data:`~mpddp.core.stores.deadline.SILENT` s (plus ``wait``: an
        operation that waits for a key); :class:`RendezvousGone` when node 0's store cannot be reached, or did not
        answer in time (silent: cut off or frozen; torch's client would wait for it for many minutes)."""
        address = f"{self.config.master_addr}:{self.port}"
        try:
            while True:
                with self._connecting:  # one connection at a time: it retries until node 0 is up, or the timeout
                    self._fail_fast(address)
                    if self._store is None:
                        try:
                            self._store = self._connect(connect_timeout if connect_timeout is not None
                                                        else self.config.timeout)
                        except Exception:
                            self._unreachable = True
                            raise
                        self.reached = True
                    store = self._store
                with self._lock:
                    self._fail_fast(address)  # another thread's call, which this one waited for, found node 0 silent
                    if store is self._store:
                        return answered(SILENT + wait, op, store)
                # the client was dropped, or connected anew, while this call waited: again, on the one there is now
        except RendezvousGone:
            raise
        except Silent as e:
            self._silent, self._store = True, None  # its thread may be blocked in it for minutes: never again
            raise StoreSilent(f"node 0's store at {address} left a call unanswered for {SILENT + wait:g} s (cut off, "
                              "or frozen)", self.silent_line(SILENT + wait)) from e
        except Exception as e:  # noqa: BLE001 - torch raises several types for a store that is gone
            raise StoreGone(f"node 0's store at {address} does not answer ({type(e).__name__})",
                            self.gone_line()) from e

    def _fail_fast(self, address: str) -> None:
        """At once, once node 0 was found silent or unreachable (until :meth:`once` hears it again)."""
        if self._silent:
            raise StoreSilent(f"node 0's store at {address} did not answer", self.silent_line(SILENT))
        if self._unreachable:
            raise StoreGone(f"node 0's store at {address} did not answer", self.gone_line())

    @property
    def silent(self) -> bool:
        """A call went unanswered past its deadline: every call fails fast until :meth:`once` hears node 0 again."""
        return self._silent

    def once(self, op: Callable[[Any], Any], seconds: float) -> Any:
        """``op(store)`` on a fresh connection, the connection's time included, within ``seconds``; the client again
        once it answered (a machine thawed or healed: this node's or node 0's). :class:`StoreGone` when it did not."""
        from ..wire.store import connect

        def fresh() -> Any:
            socket.create_connection((self.config.master_addr, self.port), timeout=seconds).close()
            return op(connect(self.config.master_addr, self.port, seconds))

        try:
            answer = within(seconds, fresh)
        except Exception as e:  # noqa: BLE001 - OSError, torch's own types, Silent: it still does not answer
            raise StoreGone(f"node 0's store at {self.config.master_addr}:{self.port} still does not answer",
                            self.gone_line()) from e
        with self._connecting:  # the next call connects anew (the silent one's thread keeps the old client)
            self._silent = self._unreachable = False
        return answer

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

    def silent_line(self, seconds: float) -> str:
        """Node 0's store left a call unanswered, its connection open: this node cannot tell whether node 0's machine
        was lost, froze or was cut off, or this one was cut off from it."""
        return (f"node 0, which hosts the rendezvous at {self.config.master_addr}:{self.port}, did not answer for "
                f"{seconds:g} s (its machine lost, frozen or cut off, or this machine cut off from it)")

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
                wait = max(0.5, min(2.0, deadline - time.monotonic()))  # a frozen node 0 accepts, and answers nothing
                store: Any = within(SILENT + wait, functools.partial(connect, self.config.master_addr, self.port, wait))
                store.set_timeout(timedelta(seconds=self.config.timeout))  # each operation's, once connected
                return store
            except Exception as e:  # noqa: BLE001 - OSError from the socket, torch's own types from its client
                # refused on node 0 (it listens before our first try) or once it answered our ranks: lost, not late
                refused = isinstance(e, ConnectionRefusedError) and (self.config.node_rank == 0 or self.reached)
                if refused or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)


def enter(s: Any, prefix: str, name: str, value: str) -> int:
    """An entry under ``prefix`` in node 0's store: its own key, the prefix's counter (the prefix less its "/"), and
    the entry numbered by it (read back whole by :func:`under`): three operations. How many entries there are now."""
    s.set(prefix + name, value)
    number = int(s.add(prefix.rstrip("/"), 1))
    s.set(f"{prefix.rstrip('/')}#{number}", json.dumps([name, value]))
    return number


def under(s: Any, prefix: str) -> dict[str, bytes]:
    """Every entry under ``prefix``: one operation while there is none, two else, however many."""
    numbered = [f"{prefix.rstrip('/')}#{n}" for n in range(1, int(s.add(prefix.rstrip("/"), 0)) + 1)]
    return {name: value.encode() for name, value in map(json.loads, read_all(s, numbered))}


class C10dKV:
    """core/stores/kv.py's :class:`~mpddp.core.stores.kv.KV` on node 0's store through ``client``, each method one
    call (its operations under the client's lock, within its deadline; a first connection's, ``connect_timeout``
    where given). No lease: a node's liveness is its beat."""

    def __init__(self, client: C10dClient, connect_timeout: float | None = None) -> None:
        self.client, self.connect_timeout = client, connect_timeout

    def get(self, key: str) -> bytes | None:
        return self.client.call(lambda s: peek(s, key), self.connect_timeout)  # type: ignore[no-any-return]

    def swap(self, key: str, old: bytes | None, new: str, marks: list[tuple[str, str, str]]) -> bytes | None:
        def swap(s: Any) -> bytes:
            standing = bytes(s.compare_set(key, old.decode() if old else "", new))
            if standing == new.encode():
                for prefix, name, value in marks:  # each a counter, a flag and a numbered entry: counted in one
                    enter(s, prefix, name, value)  # operation, read in two
            return standing

        return self.client.call(swap, self.connect_timeout)  # type: ignore[no-any-return]

    def put(self, key: str, value: str | bytes, leased: bool = False) -> None:
        self.client.call(lambda s: s.set(key, value))

    def create(self, key: str, value: str | bytes, leased: bool = False) -> bytes | None:
        standing = bytes(self.client.call(lambda s: s.compare_set(key, "", value)))
        return None if standing == (value.encode() if isinstance(value, str) else value) else standing

    def enter(self, prefix: str, name: str, value: str, leased: bool = False) -> int:
        return int(self.client.call(lambda s: enter(s, prefix, name, value)))

    def count(self, prefix: str) -> int:
        return int(self.client.call(lambda s: s.add(prefix.rstrip("/"), 0)))

    def under(self, prefix: str) -> dict[str, bytes]:
        return dict(self.client.call(lambda s: under(s, prefix)))

    def has(self, keys: list[str]) -> bool:
        return bool(self.client.call(lambda s: s.check(keys)))
