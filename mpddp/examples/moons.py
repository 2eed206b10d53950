"""A complete user task for ``mpddp train``: two interleaved half-moons, an MLP.

Run it on two CPU ranks, by module from an installed mpddp, or by file from a copy of your own::

    python -m mpddp train --task mpddp.examples.moons:make_task --nprocs 2 --epochs 5
    python -m mpddp train --task my_moons.py --nprocs 2 --epochs 5

The contract (see ``mpddp.Task``): a function ``make_task(seed)`` (or
any name, passed as ``module:name`` or ``file.py:name``) returns ``Task(model, train_set,
test_set, loss_fn[, optimizer])``. It runs on every rank after
``torch.manual_seed(seed)``, so every rank builds the same weights and the
same data; it must not look at the rank. The trainer does the rest: the
DistributedSampler, DDP, accumulation, evaluation, checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from mpddp import Task


class Moons(Dataset):
    """``(point, label)`` pairs; any map-style Dataset with ``__len__`` works."""

    def __init__(self, points: torch.Tensor, labels: torch.Tensor) -> None:
        self.points, self.labels = points, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.labels[i]


def moons(samples: int, seed: int) -> Moons:
    """Two noisy interleaved half circles, labels 0 and 1 (no download, fixed by ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % 2
    angle = torch.rand(samples, generator=gen) * math.pi
    upper = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
    lower = torch.stack([1 - torch.cos(angle), 0.5 - torch.sin(angle)], dim=1)
    points = torch.where(labels[:, None] == 0, upper, lower) + 0.15 * torch.randn(samples, 2, generator=gen)
    return Moons(points, labels)


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    """Optional: the optimizer (the trainer passes ``--lr``); AdamW when left out."""
    return torch.optim.SGD(params, lr=lr * 50, momentum=0.9)


def make_task(seed: int) -> Task:
    """The factory ``mpddp train --task mpddp.examples.moons:make_task`` calls on every rank."""
    model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return Task(
        model=model,
        train_set=moons(2048, seed),
        test_set=moons(512, seed + 1),  # another seed: unseen points
        loss_fn=nn.CrossEntropyLoss(),  # returns the batch mean, as the contract asks
        optimizer=sgd,
    )
