"""The ``etcd`` backend as core/nodes/etcd_keys.py uses it: :class:`EtcdLink`, a Protocol, so that the keys do not
import core/nodes/etcd.py, which imports them."""

from __future__ import annotations

from typing import Any, Protocol

from ...config import LaunchConfig
from ..stores.etcd_client import EtcdClient
from ..wire.protocol import FailureRecord
from .etcd_identity import Identity


class EtcdLink(Protocol):
    """What :class:`~mpddp.core.nodes.etcd_keys.EtcdKeys` and its round watch ask of the backend."""

    client: EtcdClient
    config: LaunchConfig  # this round's
    launched: LaunchConfig  # as started: nnodes is MAX, min_nnodes MIN
    prefix: str  # every key of the job lies under it
    ttl: int  # the lease's seconds: how long a frozen launcher may hold a round's store
    identity: Identity | None  # which launch of the job this launcher is part of (once it reached etcd)

    @property
    def interval(self) -> float: ...  # seconds between two looks
    def key(self, attempt: int, *parts: object) -> str: ...
    def put(self, key: str, value: str | bytes, leased: bool = False) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def under(self, prefix: str) -> dict[str, bytes]: ...
    def count(self, prefix: str) -> int: ...
    def create(self, key: str, value: str | bytes, leased: bool = False) -> bytes | None: ...
    def commit(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
               failure: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...
    def lease(self) -> int: ...
    def record(self, attempt: int) -> FailureRecord | None: ...
    def tell_failed(self, attempt: int) -> None: ...
    def store(self, attempt: int) -> tuple[str, int]: ...
