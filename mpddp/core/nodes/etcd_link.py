"""The ``etcd`` backend as core/nodes/etcd_keys.py uses it: :class:`EtcdLink`, a Protocol, so that the keys do not
import core/nodes/etcd.py, which imports them. Its underscored members are today's reach into the backend's
own helpers (tests/test_architecture.py lists them, to be made public or moved)."""

from __future__ import annotations

from typing import Any, Protocol

from ...config import LaunchConfig
from ..wire.protocol import FailureRecord
from .etcd_client import EtcdClient


class EtcdLink(Protocol):
    """What :class:`~mpddp.core.nodes.etcd_keys.EtcdKeys` and its round watch ask of the backend."""

    client: EtcdClient
    config: LaunchConfig  # this round's
    prefix: str  # every key of the job lies under it

    def _key(self, attempt: int, *parts: object) -> str: ...
    def _put(self, key: str, value: str | bytes, leased: bool = False) -> None: ...
    def _get(self, key: str) -> bytes | None: ...
    def _prefix(self, prefix: str) -> dict[str, bytes]: ...
    def _count(self, prefix: str) -> int: ...
    def _lease_object(self) -> Any: ...
    def record(self, attempt: int) -> FailureRecord | None: ...
    def pause(self, attempt: int) -> None: ...
