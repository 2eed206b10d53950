"""A run's state in a checkpoint: what is saved besides the weights, and how a rank gets it back.

Owns: the seeds of each rank's generators (one formula), gathering every
rank's random-number-generator states onto the checkpoint (dropout must
continue bit for bit after a resume, and each rank has its own generators),
the training :class:`Position` (epoch, batches done in it, global step),
the checkpoint payload and restoring all of it on one rank. Plain functions
of the values they are given: the Trainer calls them and applies what they
return. Leaves the file itself to trainer/checkpoint.py and the loop to
trainer/loop.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .config import TrainConfig

_SEED_STRIDE = 10_007  # a prime: rank and epoch seeds of nearby base seeds never collide
_STEP_STRIDE = 7_919


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank ``rank``'s own generators (dropout differs between ranks), fresh after ``step``."""
    return seed * _SEED_STRIDE + rank + 1 + _STEP_STRIDE * step


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """Seed torch's and Python's generators of this rank from :func:`rank_seed`."""
    torch.manual_seed(rank_seed(seed, rank, step))
    random.seed(rank_seed(seed, rank, step))


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's DataLoader workers: the same on every rank."""
    return seed * _SEED_STRIDE + epoch


@dataclass(frozen=True)
class Position:
    """Where training stands: ``batches_done`` batches into ``epoch``, ``global_step`` optimizer steps in all."""

    epoch: int = 0
    batches_done: int = 0
    global_step: int = 0
    base: int = 0  # samples of the epoch done before, under another world size: the shards are cut after them


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back to one rank besides the weights."""

    position: Position
    epoch_loss: tuple[float, int] | None  # this epoch's (loss sum, count) so far, all ranks: rank 0 keeps it
    note: str | None  # said to the user when the epoch cannot be continued exactly, or the world size changed
    layout: tuple[int, int] | None = None  # (batch_size, accumulate) that keep the global batch in a new world


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators: torch CPU, CUDA (on GPU) and Python's ``random``."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.empty(0, dtype=torch.uint8)
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def gather_rngs(device: torch.device, world: int) -> list[Any]:
    """Every rank's generator states, in rank order; a collective, so every rank calls it."""
    mine = rng_state(device)
    if world == 1 or not dist.is_initialized():
        return [mine]
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, mine)
    return rngs


def payload(model: nn.Module, optimizer: torch.optim.Optimizer, position: Position, config: TrainConfig,
            world: int, rngs: list[Any], epoch_loss: list[float]) -> dict[str, Any]:
    """The checkpoint's content (rank 0 writes it)."""
    return {
        "signature": checkpoint.signature(model),
        "model": model.state_dict(),  # the bare module's: loads without DDP's "module." prefix
        "optimizer": optimizer.state_dict(),
        "epoch": position.epoch, "batches_done": position.batches_done, "global_step": position.global_step,
        "epoch_base": position.base,
        "world_size": world, "batch_size": config.batch_size, "accumulate": config.accumulate, "seed": config.seed,
        "rng": rngs,
        "epoch_loss": epoch_loss,  # this epoch so far, all ranks
    }


def restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig,
            rank: int, world: int, device: torch.device) -> Restored:
    """Load weights, optimizer and this rank's generators from ``state``; return the position."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step, epoch, done = state["global_step"], state["epoch"], state["batches_done"]
    base = state.get("epoch_base", 0)
    note, layout = None, None
    if state["world_size"] != world:  # a node lost or added: the same global batch, the epoch cut where it was
        layout, note = keep_global_batch(state["batch_size"] * state["world_size"] * state["accumulate"],
                                         state["world_size"], world, config.batch_size)
        base, done = base + done * state["batch_size"] * state["world_size"], 0
    elif done and (state["batch_size"], state["accumulate"]) != (config.batch_size, config.accumulate):
        note = (f"note: the checkpoint was written with world_size×batch_size×accumulate = {state['world_size']}×"
                f"{state['batch_size']}×{state['accumulate']}; its epoch cannot be continued exactly, "
                f"starting epoch {epoch + 2}")
        epoch, done, base = epoch + 1, 0, 0
    if len(state["rng"]) == world:
        set_rng_state(state["rng"][rank], device)
    else:  # another world size: fresh, distinct, reproducible generators
        seed_rank(config.seed, rank, step)
    loss = state["epoch_loss"]
    carried = (loss[0], int(loss[1])) if done or base else None
    return Restored(Position(epoch, done, step, base), carried, note, layout)


def keep_global_batch(global_batch: int, before: int, world: int, batch_size: int) -> tuple[tuple[int, int], str]:
    """(batch_size, accumulate) that give ``world`` ranks the global batch ``before`` ranks had, and the line
    that says how: accumulation when it divides, else the per-rank batch; the nearest when neither does."""
    said = f"world size {before} -> {world}: the global batch of {global_batch} is kept as"
    if global_batch % (world * batch_size) == 0:
        accumulate = global_batch // (world * batch_size)
        return (batch_size, accumulate), f"{said} {world} × {batch_size} × accumulate {accumulate} (accumulation)"
    if global_batch % world == 0:
        return (global_batch // world, 1), f"{said} {world} × {global_batch // world} (the per-rank batch)"
    nearest = max(1, round(global_batch / world))
    return (nearest, 1), (f"world size {before} -> {world}: a global batch of {global_batch} does not divide by "
                          f"{world}; the nearest is {world} × {nearest} = {world * nearest} (the per-rank batch)")
