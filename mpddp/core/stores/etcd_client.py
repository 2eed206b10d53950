"""A client of an etcd cluster that uses any member that answers, and this launcher's lease in it.

Owns: :class:`EtcdClient`, etcd's v3 API through ``etcd3gw`` (its HTTP gateway: no generated protobuf code
to break), tried on each member of ``--rdzv-endpoint`` in turn from a member of its own (launchers spread), so that an
etcd member lost mid-job restarts nothing; and :class:`KeptLease`, the lease every key of this launcher's liveness is
put with, refreshed from a daemon thread: when the launcher's machine is lost, etcd deletes those keys by itself once
the TTL ran out, which is how the other nodes learn of the loss without a beat to read.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import RendezvousGone
from ...log import logger
from ...rendezvous_options import parse_endpoints

_REQUEST_TIMEOUT = 2.0  # seconds one request to one member may take before the next member is tried
RESOURCE_EXHAUSTED = 8  # the gRPC status of a refused write: etcd is full (NOSPACE), or rate-limits this client


class EtcdGone(RendezvousGone):
    """No member of etcd answers."""

    went = "etcd went away"


class EtcdFull(EtcdGone):
    """etcd refuses every write: its NOSPACE alarm is raised (the database reached its quota)."""

    went = "etcd took no more writes"


def grpc_code(error: Exception) -> int | None:
    """The gRPC status code in the gateway's answer to a refused request (5: NOT_FOUND, e.g. a lease gone)."""
    try:
        code = json.loads(getattr(error, "detail_text", None) or "{}").get("code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) else None


class EtcdClient:
    """etcd's v3 API on the first member of ``endpoints`` that answers; thread-safe."""

    def __init__(self, endpoints: str, tls: dict[str, str] | None = None, timeout: float = 10.0,
                 start: int | None = None) -> None:
        self.endpoints, self.tls, self.timeout = endpoints, dict(tls or {}), timeout
        self._members = parse_endpoints(endpoints)
        # Where this launcher starts: launchers spread over the members (etcd3gw talks to one), each moving on
        # to the next when its member stops answering. ``start``: this node's rank, where it is known.
        self._current = (random.randrange(len(self._members)) if start is None else start) % len(self._members)
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.full: EtcdFull | None = None  # once a write was refused for NOSPACE: what every later one raises
        self.running = False  # a job runs on it: a full etcd is then told once, as the ranks go on
        # No member answered the last call (etcd lost its quorum, say): the next waits one pass over them, so
        # that a node that ends stacks no second --timeout after the first (measured: 48 s with --timeout 20).
        self.unanswered = False

    def _client(self, index: int) -> Any:
        from etcd3gw.client import Etcd3Client

        if index not in self._clients:
            host, port = self._members[index]
            secure = "cacert" in self.tls
            self._clients[index] = Etcd3Client(
                host=host, port=port, protocol="https" if secure else "http", ca_cert=self.tls.get("cacert"),
                cert_key=self.tls.get("key"), cert_cert=self.tls.get("cert"), timeout=_REQUEST_TIMEOUT)
        return self._clients[index]

    def call(self, op: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """``op(client)`` on a member that answers, each in turn, for up to ``timeout`` (the client's own by
        default); :class:`RendezvousGone` naming the endpoints when none did."""
        from etcd3gw import exceptions

        wait = self.timeout if timeout is None else timeout
        if self.unanswered:  # the last call found no member: one pass over them, not another whole --timeout
            wait = min(wait, _REQUEST_TIMEOUT)
        deadline, tried = time.monotonic() + wait, 0
        while True:
            with self._lock:
                index = self._current
                client = self._client(index)
            try:
                answer = op(client)
                self.unanswered = False
                return answer
            except exceptions.Etcd3Exception as e:
                transient = isinstance(e, (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                                           exceptions.InternalServerError))
                if not transient and grpc_code(e) == RESOURCE_EXHAUSTED and (self.full is not None or
                                                                             self._nospace(client)):
                    raise self._full() from None  # known full: no alarm list again (it may not answer in time)
                if not transient and grpc_code(e) != RESOURCE_EXHAUSTED:
                    raise  # refused for what it asked (a lease gone, a compare failed): the caller's to read
                tried += 1
                with self._lock:
                    if self._current == index:
                        self._current = (index + 1) % len(self._members)
                if time.monotonic() >= deadline:
                    self.unanswered = True
                    raise EtcdGone(f"etcd at {self.endpoints} does not answer (tried {tried} time(s), "
                                   f"last {type(e).__name__})", self.gone_line()) from e
                if tried % len(self._members) == 0:
                    time.sleep(0.2)  # every member refused: a moment before the next round of tries


    def gone_line(self) -> str:
        """etcd does not answer this node (or is full: then it says why, and how to free it)."""
        if self.full is not None:
            return str(self.full)
        return f"etcd at {self.endpoints} does not answer, so this node cannot learn what the others saw"

    def _nospace(self, client: Any) -> bool:
        """Whether etcd's NOSPACE alarm is raised (its alarm list, not the error's words: etcd refuses writes with
        the same status when it only rate-limits a client, which a later try gets through)."""
        try:
            alarms = client.post(client.get_url("/maintenance/alarm"), json={"action": "GET"}).get("alarms", [])
        except Exception:  # noqa: BLE001 - the list cannot be read: take it for a rate limit, tried again
            return False
        return any(a.get("alarm") == "NOSPACE" for a in alarms)

    def _full(self) -> EtcdFull:
        if self.full is None:
            self.full = EtcdFull(
                f"etcd at {self.endpoints} is full: its NOSPACE alarm is raised (the database reached its "
                "--quota-backend-bytes) and it refuses every write; free it (etcdctl compact REV, etcdctl defrag, "
                "etcdctl alarm disarm) or start it with a larger --quota-backend-bytes")
            if self.running:
                logger.warning("mpddp: %s; ranks that train go on, and a failure is told through the round's "
                               "store", self.full)
        return EtcdFull(*self.full.args)


class KeptLease:
    """A lease of ``ttl`` seconds, refreshed every third of it from a daemon thread until :meth:`revoke`.

    torch is imported before the lease is taken: its first import holds the GIL for seconds at a time on a starved
    machine (measured: 3.4 s, 20 busy processes on 2 cores), and a launcher that imported it later, as its first
    round started, refreshed nothing meanwhile: etcd revoked the lease of a launcher alive and well."""

    def __init__(self, client: EtcdClient, ttl: int, timeout: float | None = None) -> None:
        from ..wire.store import load_torch

        load_torch()
        self.client, self.ttl = client, ttl
        self.id: int = client.call(lambda c: int(c.lease(ttl).id), timeout=timeout)
        self.lost = False  # a refresh found the lease gone: etcd took this launcher for lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="mpddp-etcd-lease", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        from etcd3gw import exceptions

        while not self._stop.wait(self.ttl / 3):
            try:
                left = self.client.call(self._refresh, timeout=self.ttl)
            except RendezvousGone:
                continue  # no member answers now; the next try may reach one
            except exceptions.Etcd3Exception:  # refused: the lease is gone
                left = -1
            except Exception:  # noqa: BLE001 - the HTTP stack's own (seen: getaddrinfo's TypeError as Python exits)
                continue  # the next try may do; else the lease runs out, which is what the others read as a loss
            if left <= 0:
                self.lost = True
                return

    def _refresh(self, c: Any) -> int:
        from etcd3gw.lease import Lease

        return Lease(self.id, client=c).refresh()

    def stop(self) -> None:
        """Stop refreshing (the lease runs out by itself, or is gone already)."""
        self._stop.set()
        self._thread.join(1.0)

    def revoke(self) -> None:
        """Stop refreshing and let etcd delete every key put with this lease now."""
        from etcd3gw import exceptions
        from etcd3gw.lease import Lease

        self.stop()
        try:
            self.client.call(lambda c: Lease(self.id, client=c).revoke(), timeout=2.0)
        except RendezvousGone:
            pass  # the keys go when the TTL runs out
        except exceptions.Etcd3Exception:
            pass  # refused: the lease ran out already (a starved machine), and its keys went with it
