"""mpddp: launch PyTorch DistributedDataParallel training with no torchrun.

The public API: :func:`launch`, :func:`spawn`, :class:`LaunchConfig`,
:class:`WorkerContext`, the errors, and :class:`Task` (what a task file for
``mpddp train --task`` returns). The layers, in data-flow order: this top level (config,
ranks, context, errors, log: what every layer shares), ``machine/`` (GPUs,
interfaces, SLURM, cores), ``core/`` (the launcher), ``trainer/`` (the example
trainer, on the public API only) and ``cli/`` (on top). ``import mpddp``
stays light (no torch import) so that the command line and the launcher's
own start-up are fast; torch is imported where it is used.
"""

from __future__ import annotations

import sys


def _interrupted_early(signum: int, frame: object) -> None:
    # A Ctrl-C while the command line's modules load: nothing has started yet, so leave quietly.
    sys.stderr.write("mpddp: interrupted (SIGINT) before any worker started\n")
    sys.exit(130)


def _started_as_command() -> bool:
    """``python -m mpddp`` (runpy imports this package first, with sys.argv[0] "-m") or the console script."""
    argv = getattr(sys, "orig_argv", [])
    as_module = "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["mpddp"] and sys.argv[:1] == ["-m"]
    return as_module or sys.argv[0].endswith(("/mpddp", "/mpddp-script.py"))


if _started_as_command():  # the CLI's run_cli takes over SIGINT once it runs
    import signal

    signal.signal(signal.SIGINT, _interrupted_early)

from typing import TYPE_CHECKING, Any  # noqa: E402  (below the handler: a Ctrl-C while it loads is answered too)

from ._version import __version__ as __version__  # noqa: E402  (re-exported)

# (below the handler on purpose: a Ctrl-C while these load is answered quietly too)
from .config import LaunchConfig  # noqa: E402
from .context import WorkerContext  # noqa: E402
from .errors import (  # noqa: E402
    AddressError,
    CollectiveMismatch,
    ConfigError,
    ForkserverLost,
    HangError,
    MainGuardError,
    MpddpError,
    Outcome,
    RankFailure,
    RendezvousError,
    RestartsExhausted,
    ShipError,
    StoreLost,
    WorkerFailed,
)

if TYPE_CHECKING:
    from .core.launcher.api import launch as launch
    from .core.launcher.api import spawn as spawn
    from .trainer.tasks import Task as Task

__all__ = [
    "AddressError",
    "CollectiveMismatch",
    "ConfigError",
    "ForkserverLost",
    "HangError",
    "LaunchConfig",
    "MainGuardError",
    "MpddpError",
    "Outcome",
    "RankFailure",
    "RendezvousError",
    "RestartsExhausted",
    "ShipError",
    "StoreLost",
    "Task",
    "WorkerContext",
    "WorkerFailed",
    "launch",
    "spawn",
]


# these load torch: on first use
_LAZY = {"launch": "core.launcher.api", "spawn": "core.launcher.api", "Task": "trainer.tasks"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpddp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
