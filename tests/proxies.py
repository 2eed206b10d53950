"""A TCP proxy on 127.0.0.1 in front of a real server (an etcd member, a round's store), for tests that must see,
hold or cut what one client and the server say to each other, without touching either; and :func:`refused`, a
wait until a server is gone."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    """Carries every byte both ways, each client connection on one of its own to the server at ``port``.
    :meth:`cut` shuts the connections it carries (a network blip, a reset) while new ones go through; a subclass
    watches or holds what passes (:meth:`_carry`, :meth:`_pipe`)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.listens = self.server.getsockname()[1]
        self.carried: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed by close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            self.carried += [client, upstream]
            self._carry(client, upstream)

    def _carry(self, client: socket.socket, upstream: socket.socket) -> None:
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        shut(sink)

    def cut(self) -> None:
        carried, self.carried = self.carried, []
        for sock in carried:
            shut(sock)

    def close(self) -> None:
        self.cut()
        shut(self.server)  # wakes the accept: a close alone leaves it blocked, and the port listening
        self.server.close()


def shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def refused(port: int) -> None:
    """Until nothing listens at ``port`` any more (a TCPStore's server ends with the object that hosts it)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, "the store still listens"
        time.sleep(0.1)
