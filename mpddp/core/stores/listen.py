"""Node 0's TCPStore, on a socket the launcher already holds.

Owns: binding the listening socket (port 0 -> the OS picks a free port that
stays bound, so no other job can take it between "probe" and "use"; or only if
it can, for a launcher numbered on joining: :func:`try_listen`), handing
it to ``torch.distributed.TCPStore`` through ``master_listen_fd``. A single-node job listens on 127.0.0.1 only:
``TCPStore("127.0.0.1", 0, is_master=True)`` would listen on every address.
Leaves resolving names to machine/netif.py, the process that serves the
store to core/stores/store_server.py, the clients' connection to core/wire/store.py and starting
workers to core/launcher/attempt.py.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from datetime import timedelta

from ...errors import AddressError
from ...machine.netif import resolve


def listen(addr: str, port: int) -> socket.socket:
    """Bind and listen on ``addr:port`` (port 0: a free one, kept bound)."""
    numeric = resolve(addr)  # a literal such as 127.0.0.1 costs no lookup
    try:
        return _bound(numeric, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise AddressError(
                f"master_port={port} is already in use on {addr}: another job holds it; "
                "pick another --master-port (or 0 on a single node)"
            ) from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise AddressError(
                f"master_addr={addr!r} ({numeric}) is not an address of this machine, but node 0 hosts the "
                "store there: run node 0 on that machine, or pass one of its own addresses"
            ) from e
        raise


def try_listen(addr: str, port: int) -> socket.socket | None:
    """``listen``, for a launcher that hosts the store only if it can (numbered on joining): None when
    ``addr`` is not an address of this machine or ``port`` is taken (another launcher here came first)."""
    try:
        return _bound(resolve(addr), port)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise


def _bound(numeric: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(numeric).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((numeric, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(sock: socket.socket, timeout: float) -> object:
    """The master TCPStore, serving on the already-bound ``sock``."""
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(
        host,
        port,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns (and closes) the fd now
    return store
