"""What is trained: the Task contract, the built-in tasks, and loading users' tasks.

Owns: the :class:`Task` value a factory returns (model, datasets, loss), the
built-in ``digits`` task (scikit-learn's 8×8 handwritten digits, a small CNN,
no download) and the deterministic ``synthetic`` task for benchmarks, and
turning ``--task package.module:factory`` or ``--task path/to/file.py[:factory]``
into a factory with one-line errors (a file that does not load, a callable
that is not a factory, a factory that raises in the launching process).
Leaves *how* a task is trained (DDP, sampling, checkpoints) to trainer/loop.py.

A factory is called as ``factory(seed=seed)`` on every rank after
``torch.manual_seed(seed)``, so every rank builds the same initial weights and
the same datasets; it must not depend on the rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ..errors import ConfigError
from .config import BUILTIN_TASKS

DEFAULT_FACTORY = "make_task"
_TASK_FORMS = "digits, synthetic, package.module:factory or path/to/file.py[:factory]"


def _default_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


@dataclass(frozen=True)
class Task:
    """Everything the trainer needs to know about a problem.

    ``train_set[i]`` and ``test_set[i]`` return ``(input, target)`` pairs that
    the default collate function can batch. ``loss_fn(output, target)``
    returns the *mean* loss of a batch (as ``nn.CrossEntropyLoss()`` does).
    Test accuracy is reported when ``output`` is ``(batch, classes)`` and
    ``target`` holds class indices. ``optimizer(params, lr)`` builds the
    optimizer (AdamW by default).
    """

    model: nn.Module
    train_set: Dataset
    test_set: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[Any, float], torch.optim.Optimizer] = field(default=_default_optimizer)


class TaskFactory(Protocol):
    """``factory(seed=0) -> Task``: the one function a user task provides."""

    def __call__(self, *, seed: int) -> Task: ...


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions and two linear layers for 1×8×8 images, 10 classes."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 digits shipped inside scikit-learn: images (N, 1, 8, 8) in [0, 1], labels (N,).

    Reads the CSV file of the installed package directly: importing
    ``sklearn.datasets`` costs about a second in every rank.
    """
    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is not None and csv.is_file():
        data = np.loadtxt(csv, delimiter=",")
        pixels, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:  # another layout: the public API
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, target = bunch.images, bunch.target
    images = torch.tensor(pixels / 16.0, dtype=torch.float32).unsqueeze(1)
    return images, torch.tensor(target, dtype=torch.int64)


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test indices holding every class in the same proportion, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in labels.unique():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        cut = round(len(idx) * test_fraction)
        test.append(idx[:cut])
        train.append(idx[cut:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def digits_task(seed: int = 0, test_fraction: float = 0.2) -> Task:
    """The handwritten digits that ship inside scikit-learn, split 80/20 from ``seed``, and a small CNN."""
    images, labels = load_digits_arrays()
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    train_set = TensorDataset(images[train_idx], labels[train_idx])
    test_set = TensorDataset(images[test_idx], labels[test_idx])
    return Task(DigitsCNN(), train_set, test_set, nn.CrossEntropyLoss())


def synthetic_task(seed: int = 0, samples: int = 8192, features: int = 64, classes: int = 10) -> Task:
    """Deterministic Gaussian inputs labelled by a fixed random teacher, and an MLP.

    The data depend only on ``seed``, ``samples`` and ``features``; a fifth
    of the samples (at least one) form the test set.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    n_test = max(1, samples // 5)
    model = nn.Sequential(nn.Linear(features, 4 * features), nn.ReLU(), nn.Linear(4 * features, classes))
    return Task(model, TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test]),
                nn.CrossEntropyLoss())


_BUILTIN: dict[str, Callable[..., Task]] = {"digits": digits_task, "synthetic": synthetic_task}  # BUILTIN_TASKS


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"task={spec!r}: the file {path} does not exist; check the path (relative to {Path.cwd()})")
    name = f"mpddp_task_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"task={spec!r}: {path} is not a Python file; pass path/to/file.py[:factory]")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so pickle (e.g. DataLoader workers) finds classes defined there
    try:
        # compiled here, not by the loader: checking a file leaves no __pycache__ beside it
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"task={spec!r}: loading {path} raised {_one_line(e)}; fix the file "
                          f"(`python {path}` shows the whole traceback)") from e
    return module


def load_factory(spec: str) -> Callable[..., Any]:
    """``"pkg.mod:factory"`` or ``"file.py[:factory]"`` -> the factory function."""
    target, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if target.endswith(".py") or spec.endswith(".py"):
        module = _load_file(Path(target or spec).resolve(), spec)
        attr = attr or DEFAULT_FACTORY
    elif target and attr:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"task={spec!r}: cannot import module {target!r} ({e}); "
                              "install it or add its folder to PYTHONPATH") from e
        except Exception as e:  # it was found, and its code failed
            raise ConfigError(f"task={spec!r}: importing {target} raised {_one_line(e)}; fix the module "
                              f"(`python -c 'import {target}'` shows the whole traceback)") from e
    else:
        raise ConfigError(f"task={spec!r} is unknown: use {_TASK_FORMS}")
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"task={spec!r}: {module.__name__} has no function {attr!r}; "
                          f"define `def {attr}(seed: int) -> mpddp.Task` or name yours after ':'")
    return factory


def build_task(spec: str | Callable[..., Any], seed: int, options: dict[str, Any] | None = None) -> Task:
    """Call the task's factory and check that it kept the contract."""
    if isinstance(spec, str) and spec in BUILTIN_TASKS:
        task: Any = _BUILTIN[spec](seed, **(options or {}))
    else:
        factory = spec if callable(spec) else load_factory(spec)
        task = _call(factory, spec, seed)
    _check_task(task, spec)
    return task


def build_task_before_launch(spec: str | Callable[..., Any], seed: int,
                             options: dict[str, Any] | None = None) -> Task:
    """:func:`build_task` in the launching process: whatever the factory raises is one ConfigError line.

    On a rank the same exception is that rank's failure, with its traceback;
    here, before any worker starts, it is a bad task (exit code 2).
    """
    try:
        return build_task(spec, seed, options)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"task={_label(spec)!r}: the factory raised {_one_line(e)}; fix it "
                          "(it is called once here, before any worker starts)") from e


def _call(factory: Callable[..., Any], spec: object, seed: int) -> Any:
    try:
        return factory(seed=seed)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:  # the call itself failed: no seed=
            name = getattr(factory, "__name__", repr(factory))
            raise ConfigError(f"task={_label(spec)!r}: {name} is not a task factory: {name}(seed={seed}) fails "
                              f"({e}); point --task at a function `def make_task(seed: int) -> mpddp.Task`"
                              ) from e
        raise


def _label(spec: object) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


def _one_line(e: BaseException) -> str:
    """``ValueError: boom (/path/file.py, line 3)``: the exception and where it was raised."""
    if isinstance(e, SyntaxError):
        text, where = e.msg, f"{e.filename}, line {e.lineno}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        text, where = str(e), f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else "no traceback"
    lines = text.strip().splitlines()
    return f"{type(e).__name__}: {lines[0]} ({where})" if lines else f"{type(e).__name__} ({where})"


def _check_task(task: Any, spec: object) -> None:
    where = _label(spec)
    if not isinstance(task, Task):
        raise ConfigError(f"task={where!r}: the factory returned {type(task).__name__}, not mpddp.Task; "
                          "return Task(model, train_set, test_set, loss_fn)")
    problems = [
        (isinstance(task.model, nn.Module), "model must be a torch.nn.Module"),
        (_sized(task.train_set), "train_set must be a Dataset with len() > 0"),
        (_sized(task.test_set), "test_set must be a Dataset with len() > 0"),
        (callable(task.loss_fn), "loss_fn must be callable(output, target) -> mean loss"),
    ]
    for ok, what in problems:
        if not ok:
            raise ConfigError(f"task={where!r}: the factory's Task is wrong: {what}")


def _sized(dataset: object) -> bool:
    try:
        return len(dataset) > 0  # type: ignore[arg-type]
    except TypeError:
        return False
