"""The rendezvous backends by name, as a launcher picks one (``c10d`` today).

Owns: the one table from a backend's name to its class, each implementing
core/nodes/api.py's :class:`~mpddp.core.nodes.api.Rendezvous`.
"""

from __future__ import annotations

from collections.abc import Callable

from ...config import LaunchConfig
from .api import Rendezvous
from .c10d import C10dRendezvous

BACKENDS: dict[str, Callable[[LaunchConfig, int, int], Rendezvous]] = {"c10d": C10dRendezvous}


def open_rendezvous(config: LaunchConfig, port: int, nprocs: int, backend: str = "c10d") -> Rendezvous:
    """This launcher's rendezvous for the job: ``backend`` by name (``c10d``: node 0's store at ``port``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rendezvous backend {backend!r}: one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](config, port, nprocs)
