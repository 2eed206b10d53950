"""mpddp: launch PyTorch DistributedDataParallel training with no torchrun.

The public API: :func:`launch`, :class:`LaunchConfig`, :class:`WorkerContext`
and the errors. The layers, in data-flow order: this top level (config,
ranks, context, errors, log: what every layer shares), ``machine/`` (GPUs,
interfaces, SLURM, cores), ``core/`` (the launcher), ``trainer/`` (the example
trainer, on the public API only) and ``cli/`` (on top). ``import mpddp``
stays light (no torch import) so that the command line and the launcher's
own start-up are fast; torch is imported where it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .config import LaunchConfig
from .context import WorkerContext
from .errors import (
    ConfigError,
    HangError,
    MainGuardError,
    MpddpError,
    Outcome,
    RankFailure,
    RendezvousError,
    RestartsExhausted,
    ShipError,
    WorkerFailed,
)

if TYPE_CHECKING:
    from .core.api import launch as launch

__all__ = [
    "ConfigError",
    "HangError",
    "LaunchConfig",
    "MainGuardError",
    "MpddpError",
    "Outcome",
    "RankFailure",
    "RendezvousError",
    "RestartsExhausted",
    "ShipError",
    "WorkerContext",
    "WorkerFailed",
    "launch",
]


def __getattr__(name: str) -> Any:
    if name == "launch":  # the core loads on first use
        from .core.api import launch

        return launch
    raise AttributeError(f"module 'mpddp' has no attribute {name!r}")
