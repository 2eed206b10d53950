"""The Trainer: how mpddp trains a Task with DistributedDataParallel.

Owns the DDP delta over a single-process training loop, and nothing else: the same initial weights on every rank
(seed before the model is built), the model on the rank's device in ``DistributedDataParallel``, a
``DistributedSampler`` with ``set_epoch``, gradient accumulation with ``no_sync()`` on all but the last micro-step,
evaluation sharded over ranks (metrics all-reduced as sums and counts), rank-0 checkpoints of ``model.module`` with
a barrier and exact resume, and rank-0 progress and metrics. Starting processes is the launcher's: trainer/run.py's
:func:`~mpddp.trainer.train` calls the public :func:`mpddp.launch` with :func:`train_worker`, as any user code would.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ..context import WorkerContext
from . import checkpoint, rundir, state
from .config import TrainConfig
from .faults import SAVING, check_fault_rank
from .output import Reporter, TrainResult
from .prepare import resolve_run


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start ``skip`` samples into its shard.

    The order depends only on (seed, epoch), so a run resumed mid-epoch skips
    exactly the samples it had already trained on and then sees the same
    batches as an uninterrupted run.
    """

    skip = 0  # samples of this rank's shard already trained on
    base = 0  # samples of the epoch's order trained on under another world size: the shards are cut after them

    def _shard(self) -> list[Any]:
        if not self.base:
            return list(super().__iter__())
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(  # type: ignore[arg-type]
            self.seed + self.epoch)).tolist()[self.base:]  # DistributedSampler's order, what is left of it
        order += order[:(-len(order)) % self.num_replicas]  # every rank the same count, as DistributedSampler pads
        return order[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._shard()[self.skip:])

    def __len__(self) -> int:
        if not self.base:
            return super().__len__() - self.skip
        return -(-(len(self.dataset) - self.base) // self.num_replicas) - self.skip  # type: ignore[arg-type]


def _solo_context() -> WorkerContext:
    return WorkerContext(rank=0, local_rank=0, node_rank=0, world_size=1, nprocs_per_node=1, nnodes=1,
                         device="cpu", backend="gloo")


class Trainer:
    """Train ``config.task`` on this rank; call :meth:`fit` on every rank.

    ``ctx`` is the worker's context (None: one process, no process group).
    """

    def __init__(self, config: TrainConfig, ctx: WorkerContext | None = None, owner: str = "") -> None:
        from .tasks import build_task

        self.config, self.ctx = config, ctx or _solo_context()
        self.owner = owner  # the run's token, in checkpoints' temporary names (trainer/checkpoint.py)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.device = torch.device(self.ctx.device)
        torch.manual_seed(config.seed)  # every rank builds the same initial weights (DDP also broadcasts rank 0's)
        self.task = build_task(config.task, config.seed, config.task_options)
        self.model = self.task.model.to(self.device)
        self.optimizer = self.task.optimizer(self.model.parameters(), config.lr)
        self.epoch, self.batches_done, self.global_step, self.epoch_base = 0, 0, 0, 0
        # This epoch's training loss so far: a device tensor, so adding to it never waits for the device.
        self.loss_sum, self.loss_count = torch.zeros((), dtype=torch.float64, device=self.device), 0
        self.last_checkpoint: Path | None = None
        self.last_train_loss = float("nan")
        self.fault = config.fault  # parsed once, checked every step
        check_fault_rank(config.inject_fault, self.world, f"world_size={self.world}")  # nprocs chosen at launch
        self.report = Reporter(self.rank, self.ctx.verbose, config.epochs, config.metrics_path)
        state.seed_rank(config.seed, self.rank)  # dropout etc. should differ between ranks
        self._resume()
        self.ddp = self._wrap(self.model)
        self._build_loaders()
        self.autocast = self._autocast()

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.world == 1:
            return model  # nothing to average: DDP would only add hooks and a copy of the gradients
        return DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.config.find_unused_parameters,  # a graph walk per step: only when asked
            gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy
        )

    def _build_loaders(self) -> None:
        cfg, on_gpu = self.config, self.device.type == "cuda"
        # The sampler shuffles (seeded, the same on every rank) and hands each rank its
        # own shard; the DataLoader must not shuffle on its own.
        self.sampler = ResumableSampler(self.task.train_set, num_replicas=self.world, rank=self.rank,
                                        shuffle=True, seed=cfg.seed, drop_last=False)
        self.loader_rng = torch.Generator()  # worker seeds come from here, not from the global RNG
        # DataLoader workers are forked from the rank, as under torchrun on Linux: the rank itself was
        # started by a forkserver, whose children would have to unpickle the dataset (and could not
        # import a task module loaded from a file).
        context = "fork" if cfg.num_workers and sys.platform == "linux" else None
        # Workers forked once and kept: re-forking every epoch, right while the last epoch's
        # queue feeder threads exit, can deadlock the child inside CPython's fork (seen here,
        # Python 3.11: stuck in _PyThreadState_DeleteExcept). It also saves a fork per epoch.
        persistent = cfg.num_workers > 0
        self.train_loader = DataLoader(self.task.train_set, batch_size=cfg.batch_size, sampler=self.sampler,
                                       num_workers=cfg.num_workers, pin_memory=on_gpu, generator=self.loader_rng,
                                       multiprocessing_context=context, persistent_workers=persistent)
        # Evaluation shards without padding (rank, rank+world, ...): no sample is counted twice.
        shard = Subset(self.task.test_set,
                       range(self.rank, len(self.task.test_set), self.world))  # type: ignore[arg-type]
        self.test_loader = DataLoader(shard, batch_size=cfg.batch_size * 4, num_workers=cfg.num_workers,
                                      pin_memory=on_gpu, multiprocessing_context=context,
                                      persistent_workers=persistent)
        self.batches_per_epoch = -(-len(self.sampler) // cfg.batch_size)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        precision = self.config.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
        if precision == "fp32":
            return contextlib.nullcontext()  # not even a disabled autocast: nothing to do per step
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ---- training ---------------------------------------------------------------------------------

    def fit(self, draw: bool = True) -> TrainResult:
        """Train up to ``config.epochs``, evaluating and checkpointing every epoch.

        ``draw``: rank 0 draws ``curves.png`` at the end (False: its caller
        does, and logs the last epoch's TensorBoard point, as :func:`train`'s
        launcher does once the ranks exit: output.finish_curves).
        """
        start = time.perf_counter()
        test = {"loss": float("nan"), "accuracy": None}
        if self.epoch >= self.config.epochs:
            test = self.evaluate()
            self.report.say(f"already trained {self.epoch} epochs: pass --epochs N > {self.epoch} to train more")
        self.report.start_run(self.global_step, hand_over=not draw)
        try:
            while self.epoch < self.config.epochs:
                test = self._fit_epoch(start)
        finally:
            self.report.end_run()
        return self._result(test, *(self.report.draw_curves() if draw else (None, "")))

    def _fit_epoch(self, start: float) -> dict[str, Any]:
        """Train, evaluate, record and checkpoint one epoch; return its test metrics."""
        samples, seconds = self._train_epoch()
        train_loss = self.last_train_loss = self._epoch_loss()
        test = self.evaluate()
        self.epoch, self.batches_done, self.epoch_base = self.epoch + 1, 0, 0
        self.loss_sum.zero_()
        self.loss_count = 0
        self.report.end_epoch({
            "epoch": self.epoch, "step": self.global_step, "train_loss": train_loss, "test_loss": test["loss"],
            "test_accuracy": test["accuracy"], "lr": self.optimizer.param_groups[0]["lr"],  # the first group's
            "samples_per_s": samples / seconds, "elapsed_s": time.perf_counter() - start, "world_size": self.world,
            "global_batch": self.global_batch}, last=self.epoch >= self.config.epochs)
        self.save()
        return test

    def _train_epoch(self) -> tuple[int, float]:
        """Train the rest of ``self.epoch``; return (global samples, seconds)."""
        self.model.train()
        self.sampler.set_epoch(self.epoch)  # a new shuffle every epoch, the same permutation on every rank
        self.sampler.base, self.sampler.skip = self.epoch_base, 0
        self.batches_per_epoch = -(-len(self.sampler) // self.config.batch_size)
        self.sampler.skip = self.batches_done * self.config.batch_size  # resumed mid-epoch: skip what was done
        self.loader_rng.manual_seed(state.epoch_seed(self.config.seed, self.epoch))
        batches, samples, begin = iter(self.train_loader), 0, time.perf_counter()
        self.report.start_epoch(self.epoch, self.batches_per_epoch, self.batches_done)
        while self.batches_done < self.batches_per_epoch:
            micro = min(self.config.accumulate, self.batches_per_epoch - self.batches_done)
            loss, n = self._step(batches, micro)
            samples += n * self.world
            self.report.step(loss, samples / max(time.perf_counter() - begin, 1e-9))
            self._after_step()
        return samples, max(time.perf_counter() - begin, 1e-9)

    def _step(self, batches: Iterator[Any], micro: int) -> tuple[torch.Tensor, int]:
        """One optimizer step over ``micro`` micro-batches; return (last loss, local samples)."""
        samples = 0
        for i in range(micro):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(batches))
            # Gradients are all-reduced in backward; skip that on all but the last micro-step
            # (no_sync) so accumulating K micro-batches costs one all-reduce, not K.
            last = i == micro - 1
            with contextlib.nullcontext() if last or self.world == 1 else self.ddp.no_sync():  # type: ignore[operator]
                with self.autocast:
                    loss = self.task.loss_fn(self.ddp(inputs), targets)
                (loss / micro if micro > 1 else loss).backward()  # the mean over micro-batches, as one big batch
            n = int(targets.shape[0])
            self.loss_sum.add_(loss.detach(), alpha=n)  # one small op, no sync
            self.loss_count += n
            samples += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.batches_done += micro
        return loss, samples

    def _after_step(self) -> None:
        fault = self.fault
        if fault is not None and fault.kind not in SAVING and fault.due(self.rank, self.global_step,
                                                                            self.ctx.restart):
            fault.fire()
        every = self.config.checkpoint_every
        if every and self.global_step % every == 0 and self.batches_done < self.batches_per_epoch:
            self.save()  # mid-epoch; the end of the epoch saves anyway

    def _epoch_loss(self) -> float:
        """This epoch's mean training loss over every rank: sums and counts, one all-reduce."""
        total = self._all_reduce([float(self.loss_sum), float(self.loss_count)])
        return total[0] / max(total[1], 1)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test loss and accuracy over the whole test set, each sample counted once.

        Each rank evaluates its shard; (loss sum, correct, count) are summed
        over ranks, so the result equals a single process's, whatever the
        shard sizes (an average of per-rank averages would not).
        """
        self.model.eval()  # the bare module: DDP's forward would sync buffers, and shards differ in length
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct, count, classified = torch.zeros_like(loss_sum), 0, True
        for inputs, targets in self.test_loader:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with self.autocast:
                outputs = self.model(inputs)
                loss = self.task.loss_fn(outputs, targets)
            loss_sum += loss.double() * targets.shape[0]
            count += int(targets.shape[0])
            classified = classified and outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point()
            if classified:
                correct += (outputs.argmax(dim=1) == targets).sum()
        self.model.train()
        total = self._all_reduce([float(loss_sum), float(correct), float(count), float(classified)])
        return {"loss": total[0] / max(total[2], 1),
                "accuracy": total[1] / max(total[2], 1) if total[3] == self.world else None}

    def _all_reduce(self, values: list[float]) -> list[float]:
        if self.world == 1 or not dist.is_initialized():
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)  # SUM: sums and counts add up exactly; averages would not
        return tensor.tolist()

    # ---- checkpoints ------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Rank 0 writes a checkpoint; every rank must call this (RNG states are gathered)."""
        # collectives, so every rank takes part: each rank's generators, and this epoch's loss over all ranks
        rngs = state.gather_rngs(self.device, self.world)
        epoch_loss = self._all_reduce([float(self.loss_sum), float(self.loss_count)])
        position = state.Position(self.epoch, self.batches_done, self.global_step, self.epoch_base)
        content = state.payload(self.model, self.optimizer, position, self.config, self.world, rngs, epoch_loss)
        path = None
        if self.rank == 0:
            fault = self.fault
            dies = fault is not None and fault.kind in SAVING and fault.due(
                0, self.global_step, self.ctx.restart)
            path = checkpoint.save(content, self.config.checkpoint_path, self.global_step,
                                   before_replace=(lambda tmp: fault.fire()) if dies and fault else None,
                                   owner=self.owner)
            checkpoint.prune(self.config.checkpoint_path, self.config.keep_checkpoints, written=path, owner=self.owner)
        self._barrier()  # nobody moves on (or exits) before the file is complete
        self.last_checkpoint = self.config.checkpoint_path / checkpoint.checkpoint_name(self.global_step)
        return path

    def _resume(self) -> None:
        path = self.config.resume
        if self.ctx.restart > 0:  # the group was restarted after a failure: continue from the newest
            found = checkpoint.newest(self.config.checkpoint_path) if self.rank == 0 else None
            box = [str(found[0]) if found else path]
            if self.world > 1 and dist.is_initialized():
                dist.broadcast_object_list(box, src=0)  # rank 0 wrote them: every rank takes its choice
            path = box[0]
        if path is not None:
            saved = checkpoint.load(Path(path), checkpoint.signature(self.model))
            back = state.restore(saved, self.model, self.optimizer, self.config, self.rank, self.world, self.device)
            self.epoch, self.batches_done, self.global_step, self.epoch_base = (
                back.position.epoch, back.position.batches_done, back.position.global_step, back.position.base)
            if back.layout is not None:
                self.config = replace(self.config, batch_size=back.layout[0], accumulate=back.layout[1])
            if back.note:
                self.report.say(back.note)
            if back.epoch_loss is not None and self.rank == 0:  # rank 0 carries the sum the others left behind
                self.loss_sum.fill_(back.epoch_loss[0])
                self.loss_count = back.epoch_loss[1]
            self.last_checkpoint = Path(path)
            self.report.say(f"resumed from {path}: epoch {self.epoch + 1}, step {self.global_step}")

    def _barrier(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: batch_size × world_size × accumulate."""
        return self.config.batch_size * self.world * self.config.accumulate

    def _result(self, test: dict[str, Any], curves: str | None, curves_note: str) -> TrainResult:
        return TrainResult(epochs=self.epoch, global_step=self.global_step, train_loss=self.last_train_loss,
                           test_loss=test["loss"], test_accuracy=test["accuracy"],
                           checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
                           metrics=str(self.config.metrics_path), run_dir=str(self.config.run_dir),
                           curves=curves, curves_note=curves_note, rank=self.rank)


def train_worker(ctx: WorkerContext, config: TrainConfig, owner: str = "", draw: bool = True, *, lock: bool = True,
                 new: bool = False) -> TrainResult:
    """The function :func:`mpddp.launch` runs on every rank; ``owner``: the run's token (see
    :func:`~mpddp.trainer.train`).

    ``draw``: rank 0 draws ``curves.png`` before it returns (False: the
    caller draws it and logs TensorBoard's last point, see :meth:`Trainer.fit`).
    ``lock``: rank 0 takes the run directory and its lock for the run
    (trainer/rundir.py; False: :func:`~mpddp.trainer.train`'s launcher holds
    them); ``new``: ``config.run_dir`` is a new run's proposed name. With
    ``run_dir=None`` rank 0 resolves the config first. Every rank then
    takes rank 0's run directory and resume file.
    """
    with contextlib.ExitStack() as stack:
        if ctx.rank == 0:
            if config.run_dir is None:  # called through mpddp.launch directly: rank 0 decides, everyone agrees
                config, new = resolve_run(config)
            if lock:
                config = replace(config, run_dir=stack.enter_context(rundir.held(str(config.run_dir), new, owner)))
        if ctx.world_size > 1 and dist.is_initialized():
            # One writer, one directory: another node's launcher resolved its own (it neither makes nor uses it),
            # and its own view of resume="auto", which must not differ from rank 0's.
            box = [(config.run_dir, config.resume)]
            dist.broadcast_object_list(box, src=0)
            config = replace(config, run_dir=box[0][0], resume=box[0][1])
        return Trainer(config, ctx, owner).fit(draw)
