"""mpddp: launch PyTorch DistributedDataParallel training with no torchrun.

The public API: :func:`launch`, :func:`spawn`, :class:`LaunchConfig`,
:class:`WorkerContext`, the errors, and :class:`Task` (what a task file for
``mpddp train --task`` returns). The layers, in data-flow order: this top level (config,
ranks, context, errors, log: what every layer shares), ``machine/`` (GPUs,
interfaces, SLURM, cores), ``core/`` (the launcher), ``trainer/`` (the example
trainer, on the public API only) and ``cli/`` (on top). ``import mpddp``
loads none of these until they are used (no torch, not even the config's
dataclasses), so that the command line and the launcher's own start-up
are fast; torch is imported where it is used.
"""

from __future__ import annotations

import os
import sys


def _interrupted_early(signum: int, frame: object) -> None:
    # A Ctrl-C while the command line's modules load: nothing has started yet, so leave quietly, and at once
    # (a SystemExit raised in an import's callback can be swallowed: core/wire/signals.py's raise_stop)
    if _command() in ("train", "run"):  # the others start no worker: nothing to say (mpddp top, mpddp ranks)
        sys.stderr.write("mpddp: interrupted (SIGINT) before any worker started\n")
        sys.stderr.flush()
    os._exit(130)


def _command() -> str | None:
    """The command named on the command line (its first word that is no option), read while this package loads."""
    argv = sys.orig_argv[sys.orig_argv.index("-m") + 2:] if sys.argv[:1] == ["-m"] else sys.argv[1:]
    return next((a for a in argv if not a.startswith("-")), None)


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

if TYPE_CHECKING:
    from .config import LaunchConfig as LaunchConfig
    from .context import WorkerContext as WorkerContext
    from .core.launcher.api import launch as launch
    from .core.launcher.api import spawn as spawn
    from .errors import AddressError as AddressError
    from .errors import CollectiveMismatch as CollectiveMismatch
    from .errors import ConfigError as ConfigError
    from .errors import ForkserverLost as ForkserverLost
    from .errors import HangError as HangError
    from .errors import MainGuardError as MainGuardError
    from .errors import MpddpError as MpddpError
    from .errors import Outcome as Outcome
    from .errors import RankFailure as RankFailure
    from .errors import RendezvousError as RendezvousError
    from .errors import RestartsExhausted as RestartsExhausted
    from .errors import ShipError as ShipError
    from .errors import StoreLost as StoreLost
    from .errors import WorkerFailed as WorkerFailed
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


# Every name loads on first use: `mpddp train` starts its forkserver before the config's dataclasses and
# the errors load (about 15 ms, measured), and launch, spawn and Task load torch.
_LAZY = {"LaunchConfig": "config", "WorkerContext": "context", "launch": "core.launcher.api",
         "spawn": "core.launcher.api", "Task": "trainer.tasks", **dict.fromkeys(
             (n for n in __all__ if n[0].isupper() and n not in ("LaunchConfig", "WorkerContext", "Task")), "errors")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpddp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
