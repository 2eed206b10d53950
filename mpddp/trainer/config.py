"""The training configuration: one frozen dataclass, validated once.

Owns: every option of ``mpddp train`` / :class:`~mpddp.trainer.Trainer`, its
default and its validation, and the names of the built-in tasks. Leaves the
checks that need the task or the disk (run before launch) to
trainer/prepare.py, building tasks to trainer/tasks.py and training to
trainer/loop.py. Imports no torch, so that the CLI stays light.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import check_int
from ..errors import ConfigError
from .faults import Fault, parse_fault

PRECISIONS = ("auto", "bf16", "fp32")
RUNS_ROOT = "runs"
METRICS_FILE = "metrics.jsonl"  # in the run directory; trainer/curves.py draws from it
BUILTIN_TASKS = ("digits", "synthetic")  # built by trainer/tasks.py; --dataset offers these


def task_name(spec: str | Callable[..., Any]) -> str:
    """A short name for run directories: ``digits``, ``moons``, ``make_task``."""
    if callable(spec):
        return getattr(spec, "__name__", "task")
    if spec in BUILTIN_TASKS:
        return spec
    target = spec.rpartition(":")[0] if ":" in spec else spec
    return Path(target).stem if target.endswith(".py") else target.rpartition(".")[2]


def _check_int(name: str, value: object, low: int, example: str) -> None:
    check_int(name, value, low, None, f", e.g. {example}", verdict="is not allowed")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the same value reaches every rank.

    ``batch_size`` is per rank and per micro-step: one optimizer step sees
    ``batch_size × world_size × accumulate`` samples (the global batch).
    ``task`` is ``"digits"``, ``"synthetic"``, ``"pkg.mod:factory"``,
    ``"file.py[:factory]"`` or a factory function. ``samples`` and
    ``features`` size the synthetic task. ``resume`` is a checkpoint file, a
    directory (its newest checkpoint) or ``"auto"`` (the newest in the
    checkpoint directory). ``checkpoint_every`` adds a checkpoint every N
    optimizer steps to the one at the end of every epoch (0: epochs only).
    """

    task: str | Callable[..., Any] = "digits"
    samples: int = 8192
    features: int = 64
    epochs: int = 10
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    accumulate: int = 1
    precision: str = "auto"
    num_workers: int = 0
    find_unused_parameters: bool = False
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str | None = None
    inject_fault: str | None = None

    def __post_init__(self) -> None:
        if not (callable(self.task) or (isinstance(self.task, str) and self.task.strip())):
            raise ConfigError(f"task={self.task!r} is empty: use digits, synthetic, package.module:factory "
                              "or path/to/file.py[:factory]")
        _check_int("samples", self.samples, 2, "--samples 8192")
        _check_int("features", self.features, 1, "--features 64")
        _check_int("epochs", self.epochs, 1, "--epochs 10")
        _check_int("batch_size", self.batch_size, 1, "--batch-size 32 (per rank)")
        _check_int("seed", self.seed, 0, "--seed 0")
        _check_int("accumulate", self.accumulate, 1, "--accumulate 4 (1: no accumulation)")
        _check_int("num_workers", self.num_workers, 0, "--num-workers 2 (0: load in the training process)")
        _check_int("checkpoint_every", self.checkpoint_every, 0, "--checkpoint-every 50 (0: every epoch only)")
        _check_int("keep_checkpoints", self.keep_checkpoints, 0, "--keep-checkpoints 3 (0: keep all)")
        lr_ok = isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
        if not lr_ok or self.lr <= 0:
            raise ConfigError(f"lr={self.lr!r} is not allowed: the learning rate must be a number > 0, e.g. --lr 1e-3")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is unknown: use one of {', '.join(PRECISIONS)} "
                              "(auto: bf16 on GPUs that support it, else fp32)")
        parse_fault(self.inject_fault)

    @property
    def fault(self) -> Fault | None:
        """The parsed ``inject_fault``, or None."""
        return parse_fault(self.inject_fault)

    @property
    def task_options(self) -> dict[str, Any]:
        """Keyword options for a built-in task's factory."""
        return {"samples": self.samples, "features": self.features} if self.task == "synthetic" else {}

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint directory: ``checkpoint_dir``, else ``<run_dir>/checkpoints``."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        if self.run_dir is None:
            raise ConfigError("run_dir is not set: call mpddp.trainer.resolve(config) first or pass run_dir=")
        return Path(self.run_dir) / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        """The JSON-lines metrics file, one line per epoch."""
        return Path(self.run_dir or ".") / METRICS_FILE
