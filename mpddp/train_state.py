"""A run's state in a checkpoint: what is saved besides the weights, and how a rank gets it back.

Owns: gathering every rank's random-number-generator states onto the
checkpoint (dropout must continue bit for bit after a resume, and each rank
has its own generators), the training position (epoch, batches done in it,
global step) and restoring all of it on every rank. Leaves the file itself
to checkpoint.py and the loop to trainer.py.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import checkpoint

if TYPE_CHECKING:
    from .trainer import Trainer


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


def gather_state(t: Trainer) -> dict[str, Any]:
    """The checkpoint payload; a collective, so every rank calls it."""
    rngs: list[Any] = [rng_state(t.device)]
    if t.world > 1 and dist.is_initialized():
        mine, rngs = rngs[0], [None] * t.world
        dist.all_gather_object(rngs, mine)
    cfg = t.config
    return {
        "signature": checkpoint.signature(t.model),
        "model": t.model.state_dict(),  # the bare module's: loads without DDP's "module." prefix
        "optimizer": t.optimizer.state_dict(),
        "epoch": t.epoch, "batches_done": t.batches_done, "global_step": t.global_step,
        "world_size": t.world, "batch_size": cfg.batch_size, "accumulate": cfg.accumulate, "seed": cfg.seed,
        "rng": rngs,
        "epoch_loss": t._all_reduce([float(t.loss_sum), float(t.loss_count)]),  # this epoch so far, all ranks
    }


def restore_state(t: Trainer, state: dict[str, Any]) -> None:
    """Load weights, optimizer, position and this rank's generators from ``state``."""
    t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    t.global_step = state["global_step"]
    cfg = t.config
    same_layout = (state["world_size"], state["batch_size"], state["accumulate"]) == (
        t.world, cfg.batch_size, cfg.accumulate)
    t.epoch, t.batches_done = state["epoch"], state["batches_done"]
    if t.batches_done and not same_layout:
        t.report.say(f"note: the checkpoint was written with world_size×batch_size×accumulate = {state['world_size']}×"
               f"{state['batch_size']}×{state['accumulate']}; its epoch cannot be continued exactly, "
               f"starting epoch {t.epoch + 2}")
        t.epoch, t.batches_done = t.epoch + 1, 0
    if t.batches_done and t.rank == 0:
        t.loss_sum.fill_(state["epoch_loss"][0])
        t.loss_count = int(state["epoch_loss"][1])
    if len(state["rng"]) == t.world:
        set_rng_state(state["rng"][t.rank], t.device)
    else:  # another world size: fresh, distinct, reproducible generators
        torch.manual_seed(cfg.seed * 10_007 + t.rank + 1 + 7919 * t.global_step)
        random.seed(cfg.seed * 10_007 + t.rank + 1 + 7919 * t.global_step)
