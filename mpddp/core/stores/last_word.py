"""Node 0's last word (c10d): its store server's loss, told to every node, not "node 0 is gone".

Owns: what node 0's launcher says when the store server of a job of several nodes ended while the launcher
lives (killed from outside, the out-of-memory killer), and how another node's launcher listens for it once node
0's store stopped answering. Node 0's launcher starts a fresh store server on the job's port
(core/launcher/job_state.py) that holds one record, the loss (:func:`tell`), until every other launcher read it
or :data:`WAIT` passed (:func:`heard`). Another launcher (:func:`hear`) connects to node 0's port: a connection
accepted is node 0's last word, read within :data:`WAIT`; one refused is tried again for :data:`LISTEN_WAIT`
(node 0's launcher stops its ranks first, then listens again), after which, or after a second without any answer
(a machine lost drops what it is sent), or once an accepted connection goes unanswered (a frozen machine's kernel
accepts), node 0's launcher or its machine is gone, as that node then says. Leaves
the store's client to core/wire/store.py, and telling the record to core/nodes/settle.py.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

from ..wire.protocol import FailureRecord
from ..wire.store import connect
from .deadline import SILENT, within
from .store_beat import first_record, record_of

WAIT = 5.0  # seconds node 0 keeps its last word up for the others, and seconds they wait for it, at most
LISTEN_WAIT = 2.0  # seconds another launcher tries a refused connection to node 0's port again, at most
_POLL = 0.05  # seconds between two looks
_READ = "last-word-read"  # how many other launchers have read it


def tell(addr: str, port: int, attempt: int, record: FailureRecord) -> None:
    """In node 0's launcher, once a fresh store server serves on its port: ``record`` as round ``attempt``'s."""
    try:
        first_record(_client(addr, port), attempt, record.encode())
    except Exception:  # noqa: BLE001 - torch raises several types; the others then say node 0 is gone
        return


def heard(addr: str, port: int, readers: int) -> None:
    """In node 0's launcher: until ``readers`` other launchers have read its last word, or :data:`WAIT`."""
    deadline = time.monotonic() + WAIT
    try:
        store = _client(addr, port)
        while store.add(_READ, 0) < readers and time.monotonic() < deadline:
            time.sleep(_POLL)
    except Exception:  # noqa: BLE001 - torch raises several types: nothing more to wait for
        return


def hear(addr: str, port: int, attempt: int) -> FailureRecord | None:
    """In another node's launcher, once node 0's store stopped answering: node 0's last word, or None when
    nobody listens at its port (its launcher is gone, or its machine)."""
    listening = time.monotonic() + LISTEN_WAIT
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            break
        except ConnectionRefusedError:  # nobody listens: node 0's launcher is gone, or still stops its ranks
            if time.monotonic() >= listening:
                return None
            time.sleep(2 * _POLL)
        except OSError:  # unreachable, or no answer for a second: its machine is lost
            return None
    deadline = time.monotonic() + WAIT

    def read() -> FailureRecord | None:
        store = _client(addr, port)
        while time.monotonic() < deadline:
            if (data := record_of(store, attempt)) is not None:
                store.add(_READ, 1)
                return FailureRecord.decode(data)
            time.sleep(_POLL)
        return None

    try:  # within a deadline: a frozen node 0's kernel accepts the connection, and its store answers nothing
        return within(WAIT + SILENT, read)
    except Exception:  # noqa: BLE001 - torch raises several types: node 0's launcher went meanwhile; Silent
        return None


def _client(addr: str, port: int) -> Any:
    """A client whose every operation, the connection's included, waits :data:`WAIT` at most."""
    store: Any = connect(addr, port, WAIT)
    store.set_timeout(timedelta(seconds=WAIT))
    return store
