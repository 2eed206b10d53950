"""mpddp: launch PyTorch DistributedDataParallel training with no torchrun.

``import mpddp`` stays light (no torch import) so that the command line and
the launcher's own start-up are fast; torch is imported where it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .config import LaunchConfig
from .errors import (
    ConfigError,
    HangError,
    MainGuardError,
    MpddpError,
    RendezvousError,
    RestartsExhausted,
    ShipError,
    WorkerFailed,
)

if TYPE_CHECKING:
    from .launcher import launch as launch
    from .worker import WorkerContext as WorkerContext

__all__ = [
    "ConfigError",
    "HangError",
    "LaunchConfig",
    "MainGuardError",
    "MpddpError",
    "RendezvousError",
    "RestartsExhausted",
    "ShipError",
    "WorkerContext",
    "WorkerFailed",
    "launch",
]


def __getattr__(name: str) -> Any:
    if name == "launch":
        from .launcher import launch

        return launch
    if name == "WorkerContext":
        from .worker import WorkerContext

        return WorkerContext
    raise AttributeError(f"module 'mpddp' has no attribute {name!r}")
