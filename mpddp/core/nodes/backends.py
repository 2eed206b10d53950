"""The rendezvous backends by name, as --rdzv-backend picks one (LaunchConfig checked the name before anything starts).

Owns: the one table from a backend's name to its class (``static`` is ``c10d`` at a fixed size), each implementing
core/nodes/api.py's :class:`~mpddp.core.nodes.api.Rendezvous`, and the one question a launcher asks of a backend
before the job's rendezvous opens (:func:`hosts_round_store`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...config import LaunchConfig
from .api import Rendezvous
from .c10d import C10dRendezvous

if TYPE_CHECKING:
    from .etcd import EtcdRendezvous


def _etcd() -> type[EtcdRendezvous]:
    from .etcd import EtcdRendezvous  # etcd3gw is an extra: imported only where asked for

    return EtcdRendezvous


def _c10d() -> type[C10dRendezvous]:
    return C10dRendezvous


BACKENDS: dict[str, Callable[[], type[C10dRendezvous | EtcdRendezvous]]] = {"c10d": _c10d, "static": _c10d,
                                                                            "etcd": _etcd}


def open_rendezvous(config: LaunchConfig, port: int, nprocs: int, job: str = "") -> Rendezvous:
    """This launcher's rendezvous for the job, by --rdzv-backend (``c10d``: node 0's store at ``port``), for a
    launcher that runs ``job`` (core/wire/fingerprint.py)."""
    return BACKENDS[config.rdzv_backend]()(config, port, nprocs, job)


def hosts_round_store(config: LaunchConfig) -> bool:
    """Each round's first node hosts the round's store (else node 0 one for the whole job, which its launcher binds
    before anything starts: core/launcher/api.py). Asked of the backend's class: its rendezvous is not open yet."""
    return BACKENDS[config.rdzv_backend]().hosts_round_store
