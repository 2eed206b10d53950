"""Node 0's last word (c10d): its store server's loss, told to every node, not "node 0 is gone".

Owns: what node 0's launcher says when the store server of a job of several
nodes ended while the launcher lives (killed from outside, the out-of-memory
killer), and how another node's launcher listens for it once node 0's store
stopped answering. Node 0's launcher starts a fresh store server on the
job's port (core/launcher/job_state.py) that holds one record, the loss
(:func:`tell`), until every other launcher read it or :data:`WAIT` passed
(:func:`heard`).
Another launcher (:func:`hear`) connects to node 0's port: a connection
accepted is node 0's last word, read within :data:`WAIT`; one refused is
tried again for :data:`LISTEN_WAIT` (node 0's launcher stops its ranks
first, then listens again), after which, or after a second without any
answer (a machine lost drops what it is sent), node 0's launcher or its
machine is gone, as this node then says. Also node 0's wait, once it was
stopped itself (Ctrl-C), until the others read why (:func:`until_read`,
counted by :func:`read`): its store goes with it; and every node's wait
until the others read the round's record before it tells it
(:func:`until_heard`). Leaves the store's client
to core/wire/store.py, and telling the record to core/nodes/settle.py.
"""

from __future__ import annotations

import contextlib
import socket
import time
from datetime import timedelta
from typing import Any

from ...errors import RendezvousGone
from ..wire import protocol
from ..wire.protocol import FailureRecord, full_key
from ..wire.store import connect
from .api import POLL
from .c10d_keys import ABSENT, C10dLink, first_record

WAIT = 5.0  # seconds node 0 keeps its last word up for the others, and seconds they wait for it, at most
LISTEN_WAIT = 2.0  # seconds another launcher tries a refused connection to node 0's port again, at most
READ_WAIT = 3.0  # seconds node 0, stopped itself, keeps its store for the others to read why, at most
HEARD_WAIT = 2.0  # seconds a node waits for the others to read the round's record before it tells it, at most
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
            time.sleep(POLL)
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
            time.sleep(2 * POLL)
        except OSError:  # unreachable, or no answer for a second: its machine is lost
            return None
    deadline = time.monotonic() + WAIT
    key = full_key(attempt, protocol.FAILURE)
    try:
        store = _client(addr, port)
        while time.monotonic() < deadline:
            data = store.compare_set(key, ABSENT, ABSENT)  # the value, or ABSENT
            if data and data != ABSENT.encode():
                store.add(_READ, 1)
                return FailureRecord.decode(data)
            time.sleep(POLL)
    except Exception:  # noqa: BLE001 - torch raises several types: node 0's launcher went meanwhile
        return None
    return None


def _client(addr: str, port: int) -> Any:
    """A client whose every operation, the connection's included, waits :data:`WAIT` at most."""
    store: Any = connect(addr, port, WAIT)
    store.set_timeout(timedelta(seconds=WAIT))
    return store


def until_read(link: C10dLink, attempt: int) -> None:
    """In node 0's launcher, stopped itself (Ctrl-C, a signal) and its ranks stopped: its store stays until
    every other launcher read why (:meth:`C10dRendezvous.record` counts each), or :data:`READ_WAIT`. Shielded
    from a second Ctrl-C by the caller: soon after the first, it ended the store before the others read the
    record, and they said "node 0 ... is gone" (measured: 2 of 6 runs, with the record written first)."""
    if link.config.node_rank != 0:
        return
    others, deadline = link.config.nnodes - 1 - len(link.gone), time.monotonic() + READ_WAIT
    with contextlib.suppress(RendezvousGone):
        while link.client.call(lambda s: s.add(full_key(attempt, protocol.READ), 0)) < others:
            if time.monotonic() > deadline:
                return
            time.sleep(POLL)


def until_heard(link: C10dLink, attempt: int, readers: int, look: float) -> None:
    """Until ``readers`` nodes other than its writer have read round ``attempt``'s record (each counts its first read:
    :func:`read`), or :data:`HEARD_WAIT` with the store up, looking every ``look`` seconds. RendezvousGone when node
    0's store went first: a node that had not read the record then tells node 0's loss, and so must this one, so
    that every node tells one story (core/nodes/settle.py). A store that outlives the wait keeps the record for a
    node that reads it later."""
    deadline = time.monotonic() + HEARD_WAIT
    while link.client.call(lambda s: s.add(full_key(attempt, protocol.READ), 0)) < readers:
        if time.monotonic() > deadline:
            return
        time.sleep(look)


def read(link: C10dLink, attempt: int, record: FailureRecord) -> FailureRecord:
    """``record``, just read from the store: counted once for :func:`until_read` when another node wrote it."""
    if record.writer != link.config.node_rank and attempt not in link.read:
        link.read.add(attempt)
        link.client.call(lambda s: s.add(full_key(attempt, protocol.READ), 1))
    return record
