"""The one small key-value protocol both rendezvous backends' stores speak: what core/nodes/ writes once above them.

Owns: :class:`KV`, seven methods: a key read, put (with this launcher's lease where asked) and created only if absent
(the first writer wins); an entry under a prefix (a set of names: a round's arrivals, the nodes a counter counts),
counted without being read, its entries read, and whether given keys are all there; and one compare-and-set,
:meth:`KV.swap`, which enters its key's node in counters with the same write (a node's record and its counters
moved together: written once, core/nodes/view.py's ``Counters.move_node``, where both backends wrote their own).
Implemented by
core/stores/c10d_client.py's :class:`~mpddp.core.stores.c10d_client.C10dKV` (node 0's TCPStore: a prefix's entries
numbered by a counter, for a store lists no keys; no lease: a node's liveness is its beat) and
core/stores/etcd_kv.py's :class:`~mpddp.core.stores.etcd_kv.EtcdKV` (a prefix's keys counted by etcd itself). No
add: what needs more for its atomicity (a newcomer's admission against the counters) is each backend's own, in
one transaction (etcd) or under node 0's lock (c10d).
Leaves what the keys mean to core/nodes/.
"""

from __future__ import annotations

from typing import Protocol


class KV(Protocol):
    """Keys in a backend's store; a prefix ends with "/", and its entries are ``prefix + name``."""

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: str | bytes, leased: bool = False) -> None: ...
    def create(self, key: str, value: str | bytes, leased: bool = False) -> bytes | None: ...  # None: put; else
    # the value that stands (empty: it went meanwhile)
    def enter(self, prefix: str, name: str, value: str, leased: bool = False) -> int: ...  # how many now, this one's in
    def count(self, prefix: str) -> int: ...  # one operation: no entry read
    def under(self, prefix: str) -> dict[str, bytes]: ...  # name -> value, of every entry
    def has(self, keys: list[str]) -> bool: ...  # every one of ``keys`` is there
    # ``key`` from ``old`` (None: absent) to ``new``, and each of ``marks`` (prefix, name, value) entered once it is:
    # one transaction (etcd), one call under node 0's lock (c10d). The value that stands (``new``: swapped)
    def swap(self, key: str, old: bytes | None, new: str, marks: list[tuple[str, str, str]]) -> bytes | None: ...
