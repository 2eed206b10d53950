"""The rendezvous backends by name, as a launcher picks one (``c10d`` today).

Owns: the one table from a backend's name to its class, each implementing
core/nodes/api.py's :class:`~mpddp.core.nodes.api.Rendezvous`.
"""

from __future__ import annotations

from collections.abc import Callable

from ...config import LaunchConfig
from .api import Rendezvous
from .c10d import C10dRendezvous


def _etcd(config: LaunchConfig, port: int, nprocs: int) -> Rendezvous:
    from .etcd import EtcdRendezvous  # etcd3gw is an extra: imported only where asked for

    return EtcdRendezvous(config, port, nprocs)


def _c10d(config: LaunchConfig, port: int, nprocs: int) -> Rendezvous:
    return C10dRendezvous(config, port, nprocs)


BACKENDS: dict[str, Callable[[LaunchConfig, int, int], Rendezvous]] = {"c10d": _c10d, "static": _c10d, "etcd": _etcd}


def open_rendezvous(config: LaunchConfig, port: int, nprocs: int) -> Rendezvous:
    """This launcher's rendezvous for the job, by --rdzv-backend (``c10d``: node 0's store at ``port``)."""
    backend = config.rdzv_backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown rendezvous backend {backend!r}: one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](config, port, nprocs)
