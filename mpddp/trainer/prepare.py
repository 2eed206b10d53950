"""Before any worker starts: check the task and the resume file, fix the run directory.

Owns: :func:`resolve` (and :func:`resolve_run`), which runs in the launching
process: it checks the task, the resume file and that the run and
checkpoint directories can be made and written (so bad input fails with one
line and exit code 2, nothing written) and fixes the run directory (a new
one's proposed name, or the last run's for ``resume="auto"``) and the
checkpoint to resume from, so that every rank, and every restart of the
group, agrees on them. Leaves the options to trainer/config.py, building the
task to trainer/tasks.py, reading checkpoints to trainer/checkpoint.py, and
making and locking the run directory (a new one's name is only taken there,
atomically) to trainer/rundir.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..limits import check_dir_creatable
from . import checkpoint, rundir
from .config import BUILTIN_TASKS, RUNS_ROOT, TrainConfig, task_name


def resolve(config: TrainConfig) -> TrainConfig:
    """Check the task and the resume file; fix the run directory and checkpoint.

    Runs before any worker starts and writes nothing; a user's factory is
    called once here to check what it returns. A fresh run gets
    ``runs/<task>/<date-time>`` (the first free name now: trainer/rundir.py
    takes it, or the next, when the run starts); ``resume="auto"`` without
    ``run_dir`` takes the newest run of that task that has a checkpoint.
    """
    return resolve_run(config)[0]


def resolve_run(config: TrainConfig) -> tuple[TrainConfig, bool]:
    """:func:`resolve`, and whether its ``run_dir`` is a new run's proposed name (taken by
    :func:`~mpddp.trainer.rundir.held` as it is, or as the next free number of its second)."""
    run_dir, new = _run_dir(config)
    return _resolve(config, run_dir), new


def _resolve(config: TrainConfig, run_dir: str) -> TrainConfig:
    given = task = config.task
    if task == "digits" and importlib.util.find_spec("sklearn") is None:
        raise ConfigError("task 'digits' reads its images from scikit-learn, which is not installed: "
                          "pip install 'mpddp[train]' (or scikit-learn), or pass --dataset synthetic")
    if isinstance(task, str) and task not in BUILTIN_TASKS:
        from .tasks import load_factory

        load_factory(task)
        target, colon, attr = task.rpartition(":")
        if target.endswith(".py") or task.endswith(".py"):  # workers may start elsewhere: make it absolute
            task = str(Path(target or task).resolve()) + (colon + attr if target else "")
    config = dataclasses.replace(config, task=task, run_dir=run_dir)
    # rank 0 writes there only after its first epoch: a path it cannot make is one line now
    check_dir_creatable("run_dir", str(config.run_dir), "runs/mine")
    check_dir_creatable("checkpoint_dir", config.checkpoint_path, "checkpoints")
    if config.resume is None and config.task in BUILTIN_TASKS:
        return _check_fresh(config)  # built-in tasks keep their contract: skip building one here
    # Build the task once here: a factory that breaks the contract or raises, or a checkpoint of
    # another model, is then one line before any worker starts, not a failure on every rank.
    from .tasks import build_task_before_launch  # torch: a fresh run of a built-in task never gets here

    model = build_task_before_launch(given, config.seed, config.task_options).model
    if config.resume is None:
        return _check_fresh(config)
    return dataclasses.replace(config, resume=_resume_file(config, checkpoint.signature(model)))


def _run_dir(config: TrainConfig) -> tuple[str, bool]:
    """(the run directory, whether it is a new run's proposed name)."""
    if config.run_dir:
        return config.run_dir, False
    base = Path(RUNS_ROOT) / task_name(config.task)
    if config.resume == "auto" and not config.checkpoint_dir and base.is_dir():
        runs = [p for p in base.iterdir() if checkpoint.candidates(p / "checkpoints")]
        if runs:  # the newest: by date and time, then by number (20261205-101112-10 after -9)
            return str(max(runs, key=lambda p: rundir.order(p.name))), False
    stamp, n = rundir.new_name(), 1
    while (base / rundir.numbered(stamp, n)).exists():
        n += 1
    return str(base / rundir.numbered(stamp, n)), True


def _check_fresh(config: TrainConfig) -> TrainConfig:
    found = checkpoint.candidates(config.checkpoint_path)
    if found:
        raise ConfigError(f"checkpoint_dir={str(config.checkpoint_path)!r} already holds checkpoints "
                          f"(newest {found[0].name}): pass --resume auto to continue that run, "
                          "or a new --run-dir / --checkpoint-dir to start fresh")
    return config


def _resume_file(config: TrainConfig, expected: dict[str, Any]) -> str | None:
    if config.resume == "auto":
        found = checkpoint.newest(config.checkpoint_path, expected)
        files = checkpoint.candidates(config.checkpoint_path)
        if found is None and files:  # starting from scratch would hide them, and prune them later
            raise ConfigError(f"resume='auto': no checkpoint in {str(config.checkpoint_path)!r} loads (the newest, "
                              f"{files[0].name}, is damaged or not an mpddp checkpoint): move the damaged files "
                              "away, or pass a new --checkpoint-dir to start fresh")
        return str(found[0]) if found else None  # nothing yet: start from scratch
    path = Path(str(config.resume))
    if path.is_dir():
        found = checkpoint.newest(path, expected)
        if found is None:
            raise ConfigError(f"resume={str(path)!r} holds no complete checkpoint (ckpt-*.pt); "
                              "pass a checkpoint file or the run's checkpoints directory")
        return str(found[0])
    checkpoint.load(path, expected)
    return str(path)
