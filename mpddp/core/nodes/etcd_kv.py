"""The etcd backend's keys: a round's key, a put (with this launcher's lease), a read, a count, and a node's record
moved from state to state.

Owns: :class:`EtcdKV`, the storage half of core/nodes/etcd.py's :class:`~mpddp.core.nodes.etcd.EtcdRendezvous`
(which is one): every key of a launch under its ``prefix`` (``/mpddp/<rdzv-id>/i/<incarnation>/``), a round's
under ``r/<round>/``; its node's record in a round (``state/<node>``) moved only by :meth:`EtcdKV.move_to`, which
core/nodes/rules.py's :func:`move` allows, in one compare-and-set transaction with the counters the state enters
it in. Leaves what the keys mean to core/nodes/etcd.py and core/nodes/etcd_keys.py, and which incarnation is this
launch's to core/nodes/etcd_identity.py.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from ...config import LaunchConfig
from ...errors import RendezvousError
from ..stores.etcd_client import EtcdClient, KeptLease, grpc_code
from .rules import NodeState, move

_NOT_FOUND = 5  # the gRPC status of a put with a lease that is gone


class EtcdKV:
    """A job's keys in etcd, through ``client``, with this launcher's lease (of ``ttl`` seconds)."""

    client: EtcdClient
    config: LaunchConfig  # this round's
    prefix: str
    ttl: int
    _lease: KeptLease | None
    _states: dict[int, NodeState]  # this node's state in each round, as last written

    def key(self, attempt: int, *parts: object) -> str:
        return self.prefix + f"r/{attempt}/" + "/".join(map(str, parts))

    def put(self, key: str, value: str | bytes, leased: bool = False) -> None:
        from etcd3gw import exceptions

        lease = self.lease() if leased else None
        try:
            self.client.call(lambda c: c.put(key, value, lease=lease))
        except exceptions.Etcd3Exception as e:
            if not (leased and grpc_code(e) == _NOT_FOUND):
                raise
            assert self._lease is not None  # the lease ran out before its thread saw it (a starved machine)
            self._lease.lost = True
            lease = self.lease()
            self.client.call(lambda c: c.put(key, value, lease=lease))

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        found = self.client.call(lambda c: c.get(key), timeout=timeout)
        return found[0] if found else None

    def under(self, prefix: str) -> dict[str, bytes]:
        items = self.client.call(lambda c: c.get_prefix(prefix))
        return {meta["key"].decode()[len(prefix):]: value for value, meta in items}

    def count(self, prefix: str) -> int:
        """How many keys lie under ``prefix``: one request, no key read (etcd's count_only)."""
        from etcd3gw.utils import _encode, _increment_last_byte

        body = {"key": _encode(prefix), "range_end": _encode(_increment_last_byte(prefix)), "count_only": True}
        return int(self.client.call(lambda c: c.post(c.get_url("/kv/range"), json=body)).get("count", 0))

    def _put_all(self, pairs: dict[str, str | bytes], leased: bool = False) -> None:
        """Several keys in one request (a transaction of puts)."""
        from etcd3gw.utils import _encode

        lease = self.lease().id if leased else None
        puts = [{"request_put": {"key": _encode(k), "value": _encode(v), **({"lease": lease} if lease else {})}}
                for k, v in pairs.items()]
        self.client.call(lambda c: c.transaction({"compare": [], "success": puts, "failure": []}))

    def move_to(self, attempt: int, target: NodeState) -> None:
        """This node's record in round ``attempt`` moved to ``target`` (core/nodes/rules.py's :func:`move` says
        whether it may), and the node entered in the target's counters, which the others count without reading
        them: one transaction, which compares the record with what this node last wrote there."""
        from etcd3gw.utils import _decode, _encode

        me = self.config.node_rank
        key = self.key(attempt, "state", me)
        current: NodeState | None = self._states.get(attempt, NodeState.RUNNING)  # None: no record (yet)
        for _ in range(2):  # a compare that failed: the record as etcd holds it, once more
            if (counters := move(current or NodeState.RUNNING, target)) is None:
                return
            puts = [{"request_put": {"key": _encode(self.key(attempt, c, me)), "value": _encode(repr(time.time()))}}
                    for c in counters]
            same = ({"target": "VALUE", "result": "EQUAL", "value": _encode(current.value)} if current is not None
                    else {"target": "VERSION", "result": "EQUAL", "version": 0})
            txn = {"compare": [{"key": _encode(key), **same}],
                   "success": [*puts, {"request_put": {"key": _encode(key), "value": _encode(target.value)}}],
                   "failure": [{"request_range": {"key": _encode(key)}}]}
            answer = self.client.call(functools.partial(_transaction, txn=txn))
            if answer.get("succeeded"):
                self._states[attempt] = target
                return
            found = answer["responses"][0].get("response_range", {}).get("kvs")
            current = NodeState(_decode(found[0]["value"]).decode()) if found else None
        raise RendezvousError(f"node {me}'s record in round {attempt} moves under it: another launcher writes it")

    def lease(self) -> Any:
        from etcd3gw.lease import Lease

        if self._lease is None or self._lease.lost:  # lost: etcd took this launcher for gone (a starved machine)
            if self._lease is not None:
                self._lease.stop()  # its thread may not have seen the loss yet: it refreshes nothing from now on
            self._lease = KeptLease(self.client, self.ttl)
        return Lease(self._lease.id, client=None)  # type: ignore[arg-type]  # put() reads only its id


def _transaction(client: Any, txn: dict[str, Any]) -> Any:
    return client.transaction(txn)
