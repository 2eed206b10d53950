"""The example trainer: how mpddp trains a model with DDP, built on the public API only.

Reading order: config (:class:`TrainConfig`) -> prepare (:func:`resolve`:
checks before any worker starts) -> rundir (a run's directory, its own: its
name and its lock) -> tasks (what is trained: :class:`Task`, the built-in
sets) -> loop (the :class:`Trainer`: the DDP delta over a one-process
loop) -> state and
checkpoint (what a checkpoint holds, how it is written) -> output (what the
user sees) -> run (:func:`train`: the launcher's side, which imports no
torch) -> faults (failing on purpose, for tests). It starts its workers
with :func:`mpddp.launch` and receives a :class:`~mpddp.WorkerContext`, as
any user code would; nothing in the launcher core imports it.

Names load lazily, so ``import mpddp.trainer.config`` costs no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import TrainConfig as TrainConfig
    from .loop import Trainer as Trainer
    from .loop import train_worker as train_worker
    from .output import TrainResult as TrainResult
    from .prepare import resolve as resolve
    from .run import train as train
    from .tasks import Task as Task

_WHERE = {"TrainConfig": "config", "resolve": "prepare", "Trainer": "loop", "TrainResult": "output", "train": "run",
          "train_worker": "loop", "Task": "tasks"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mpddp.trainer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
