"""Tiny tasks for the trainer tests: float64 so that equivalences hold to 1e-6 and beyond.

Loaded by path (``task=TINY + ":make_task"``), as users' task files are.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from mpddp import Task

TINY = str(Path(__file__).resolve())
TRAIN, TEST, FEATURES, CLASSES = 64, 21, 6, 3  # 21 test samples: shards of 11 and 10 on two ranks


def _data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(TRAIN + TEST, FEATURES, generator=gen, dtype=torch.float64)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=gen, dtype=torch.float64)).argmax(dim=1)
    return TensorDataset(x[:TRAIN], y[:TRAIN]), TensorDataset(x[TRAIN:], y[TRAIN:])


def make_task(seed: int) -> Task:
    """An MLP without randomness in training: DDP vs one process must agree."""
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()
    return Task(model, *_data(seed), nn.CrossEntropyLoss())


def make_dropout_task(seed: int) -> Task:
    """With dropout: a resume is only bit-exact if every rank's RNG state comes back."""
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, CLASSES))
    train, test = _data(seed)
    return Task(model, TensorDataset(train.tensors[0].float(), train.tensors[1]),
                TensorDataset(test.tensors[0].float(), test.tensors[1]), nn.CrossEntropyLoss())


def make_wrong(seed: int) -> dict:
    """Breaks the contract: returns a dict, not a Task."""
    return {"model": nn.Linear(1, 1)}
