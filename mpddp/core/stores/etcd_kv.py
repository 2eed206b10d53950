"""Keys in etcd as mpddp reads and writes them: the one place that speaks etcd's JSON.

Owns: :class:`EtcdKV`, over :class:`~mpddp.core.stores.etcd_client.EtcdClient` (any member that answers) and this
launcher's :class:`~mpddp.core.stores.etcd_client.KeptLease` (taken on first use, and again once etcd dropped it):
core/stores/kv.py's protocol (a get, a put with the lease where asked, a create-if-absent, an entry under a prefix,
a prefix's keys or only their count: no key read, whether keys are there, a compare-and-set), and one transaction
(:meth:`EtcdKV.commit`) built from this module's pieces: requests (:func:`put`, :func:`read`, :func:`counted`,
:func:`delete`), compares (:func:`absent`, :func:`equal`), and their answers (:func:`found`, :func:`number`).
Leaves what the keys mean to core/nodes/ (the etcd backend, and a job's incarnation).
"""

from __future__ import annotations

from typing import Any

from .etcd_client import EtcdClient, KeptLease, grpc_code

_NOT_FOUND = 5  # the gRPC status of a put with a lease that is gone


def _enc(value: str | bytes) -> str:
    from etcd3gw.utils import _encode

    return str(_encode(value))


def span(prefix: str) -> dict[str, str]:
    """Every key under ``prefix``, as a request or a compare names them."""
    from etcd3gw.utils import _increment_last_byte

    return {"key": _enc(prefix), "range_end": _enc(_increment_last_byte(prefix))}


def put(key: str, value: str | bytes, lease: int | None = None) -> dict[str, Any]:
    return {"request_put": {"key": _enc(key), "value": _enc(value), **({"lease": lease} if lease else {})}}


def read(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _enc(key)}}


def counted(prefix: str) -> dict[str, Any]:
    """A request that counts the keys under ``prefix`` without reading them (count_only)."""
    return {"request_range": {**span(prefix), "count_only": True}}


def delete(key: str, under: bool = False) -> dict[str, Any]:
    """A request that deletes ``key`` (``under``: every key under it)."""
    return {"request_delete_range": span(key) if under else {"key": _enc(key)}}


def absent(key: str, under: bool = False) -> dict[str, Any]:
    """A compare: ``key`` is not there (``under``: no key under it is)."""
    return {**(span(key) if under else {"key": _enc(key)}), "target": "VERSION", "result": "EQUAL", "version": 0}


def equal(key: str, value: str | bytes) -> dict[str, Any]:
    return {"key": _enc(key), "target": "VALUE", "result": "EQUAL", "value": _enc(value)}


def found(response: dict[str, Any]) -> bytes | None:
    """The value one :func:`read` of a transaction found, or None."""
    from etcd3gw.utils import _decode

    kvs = response.get("response_range", {}).get("kvs")
    return bytes(_decode(kvs[0]["value"])) if kvs else None


def number(response: dict[str, Any]) -> int:
    """The count one :func:`counted` of a transaction found."""
    return int(response.get("response_range", {}).get("count", 0))


class EtcdKV:
    """Keys in etcd through ``client``, put with this launcher's lease (of ``ttl`` seconds) where asked."""

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self.client, self.ttl = client, ttl
        self.kept: KeptLease | None = None  # this launcher's lease, once taken

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        answer = self.client.call(lambda c: c.get(key), timeout=timeout)
        return answer[0] if answer else None

    def under(self, prefix: str, limit: int = 0, keys_only: bool = False) -> dict[str, bytes]:
        """The keys under ``prefix`` (their names less it), at most ``limit`` of them (0: all)."""
        from etcd3gw.utils import _increment_last_byte

        end = _increment_last_byte(prefix)
        items = self.client.call(lambda c: c.get(prefix, metadata=True, range_end=end, limit=limit or None,
                                                 keys_only=keys_only or None))
        return {meta["key"].decode()[len(prefix):]: value for value, meta in items}

    def count(self, prefix: str) -> int:
        """How many keys lie under ``prefix``: one request, no key read (etcd's count_only)."""
        return int(self.client.call(lambda c: c.post(c.get_url("/kv/range"), json={**span(prefix), "count_only": True}))
                   .get("count", 0))

    def enter(self, prefix: str, name: str, value: str, leased: bool = False) -> int:
        """``prefix + name`` put (with the lease where asked) and the keys under ``prefix`` counted: one transaction."""
        answer = self.commit([], [put(prefix + name, value, self.lease() if leased else None), counted(prefix)])
        return number(answer["responses"][1])

    def has(self, keys: list[str]) -> bool:
        return all(self.get(key) is not None for key in keys)

    def put(self, key: str, value: str | bytes, leased: bool = False) -> None:
        from etcd3gw import exceptions
        from etcd3gw.lease import Lease

        try:
            lease = Lease(self.lease(), client=None) if leased else None  # type: ignore[arg-type]  # put reads its id
            self.client.call(lambda c: c.put(key, value, lease=lease))
        except exceptions.Etcd3Exception as e:
            if not (leased and grpc_code(e) == _NOT_FOUND and self.kept is not None):
                raise
            self.kept.lost = True  # the lease ran out before its thread saw it (a starved machine): a new one
            lease = Lease(self.lease(), client=None)  # type: ignore[arg-type]
            self.client.call(lambda c: c.put(key, value, lease=lease))

    def commit(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
               failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One transaction: ``success``'s requests if every ``compare`` holds, else ``failure``'s; etcd's answer
        (``succeeded``, and each request's ``responses``)."""
        txn = {"compare": compare, "success": success, "failure": failure or []}
        answer = dict(self.client.call(lambda c: c.transaction(txn)))
        return {"succeeded": False, "responses": [], **answer}  # etcd's JSON leaves out a false and an empty list

    def create(self, key: str, value: str | bytes, leased: bool = False) -> bytes | None:
        """``key`` put unless it exists, in one transaction: None once put, else the value it holds (empty: it
        went meanwhile)."""
        answer = self.commit([absent(key)], [put(key, value, self.lease() if leased else None)], [read(key)])
        if answer.get("succeeded"):
            return None
        return found(answer.get("responses", [{}])[0]) or b""

    def swap(self, key: str, old: bytes | None, new: str, marks: list[tuple[str, str, str]]) -> bytes | None:
        same = equal(key, old) if old is not None else absent(key)
        answer = self.commit([same], [*(put(prefix + name, value) for prefix, name, value in marks), put(key, new)],
                             [read(key)])
        return new.encode() if answer["succeeded"] else found(answer["responses"][0])

    def lease(self) -> int:
        """This launcher's lease id: taken on first use, and again once etcd dropped it (a starved machine)."""
        if self.kept is None or self.kept.lost:
            if self.kept is not None:
                self.kept.stop()  # its thread may not have seen the loss yet: it refreshes nothing from now on
            self.kept = KeptLease(self.client, self.ttl)
        return self.kept.id
