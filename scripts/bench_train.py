"""Training-speed benchmark: the mpddp Trainer against a hand-written loop, side by side.

CPU mode (default): 2 ranks, gloo, the synthetic task (an MLP on Gaussian
inputs); the Trainer against a minimal hand-written DDP loop with the same
model, data, sampler, batch, optimizer (AdamW), ranks and threads. Both run
through ``mpddp.launch``, so start-up is not measured: each rank times its
training epochs between barriers; the first epoch is a warm-up. Checkpoints
and evaluation happen outside the timed region (the Trainer's checkpoints
are switched off here: a benchmark measures steps, not disks).

GPU mode (``--gpu``): one GPU, one rank, bf16 autocast, an MLP
4096→8192→8192→4096 (4096 classes), batch 1024, AdamW; the Trainer against a plain loop
without DDP, and for context the same loop wrapped in DDP with defaults and
with ``gradient_as_bucket_view=True, static_graph=True``.

Being watched (both modes): the Trainer runs once more while a thread of this process asks its launcher for a
snapshot every second, as ``mpddp top`` does (core/launcher/runtime_dir.py), and the line ``watched / not
watched`` is its samples/s against the plain Trainer's, paired within each repetition (goal: at most 1 %).

The flight recorder's cost (both modes): mpddp turns torch's flight recorder
on in every rank (``TORCH_FR_BUFFER_SIZE``, 64 entries, and a thread in the
rank that reads it); the Trainer runs once more with ``TORCH_FR_BUFFER_SIZE=0``
(recorder and reader off), and the line ``flight recorder on / off`` is the
Trainer's samples/s with it on against off, paired within each repetition
(goal: a cost under 1 %; the script reports it, it does not assert it). With
one GPU rank the Trainer has no DDP wrapper and calls no collective, so the
GPU figure is the reader's cost alone.

Repetitions are interleaved (trainer, loop, loop, trainer, ...) and each
ratio is samples/s against the reference loop of the same repetition.

    python scripts/bench_train.py                       # CPU, 2 ranks, 5 reps
    python scripts/bench_train.py --gpu --json train_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, summary, table, torch_version, write_json  # noqa: E402

FR_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the recorder's size; the second, its older name
FR_OFF = (("TORCH_FR_BUFFER_SIZE", "0"),)  # a rank's env with the flight recorder (and mpddp's reader) off
WATCHED = "trainer_watched"  # the variant whose launcher is asked for a snapshot every second (mpddp top)


@dataclass(frozen=True)
class Spec:
    """One benchmark setting; the same value reaches every rank of every variant."""

    gpu: bool = False
    ranks: int = 2
    samples: int = 16384
    features: int = 256
    batch: int = 64
    epochs: int = 3  # the first is a warm-up
    lr: float = 1e-3
    num_workers: int = 0
    seed: int = 0
    run_dir: str = ""


def gpu_task(seed: int = 0, samples: int = 65536) -> Any:
    """The GPU-mode task: an MLP 4096→8192→8192→4096 classifying random bf16 inputs into 4096 classes."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from mpddp import Task

    gen = torch.Generator().manual_seed(seed)
    # bf16 inputs and class-index targets: a batch is 8 MiB to load, not 32, so the
    # DataLoader (the same one in every variant) keeps up with the GPU
    x = torch.randn(samples + 1024, 4096, generator=gen, dtype=torch.bfloat16)
    y = torch.randint(0, 4096, (samples + 1024,), generator=gen)
    model = nn.Sequential(nn.Linear(4096, 8192), nn.GELU(), nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 4096))
    return Task(model, TensorDataset(x[1024:], y[1024:]), TensorDataset(x[:1024], y[:1024]), nn.CrossEntropyLoss())


def _task(spec: Spec) -> Any:
    from mpddp.trainer.tasks import synthetic_task

    if spec.gpu:
        return gpu_task(spec.seed, spec.samples)
    return synthetic_task(spec.seed, samples=spec.samples, features=spec.features)


def _sync(device: Any) -> None:
    """Every rank's queued work done: the timer then measures finished steps."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def run_trainer(ctx: Any, spec: Spec) -> tuple[list[tuple[int, float]], float | None]:
    """The mpddp Trainer; returns (global samples, seconds) per epoch, and the share of this rank's time its
    flight-recorder reader took (None: off)."""
    from mpddp.trainer.config import TrainConfig
    from mpddp.trainer.loop import Trainer

    epochs: list[tuple[int, float]] = []

    class TimedTrainer(Trainer):
        def _train_epoch(self) -> tuple[int, float]:
            _sync(self.device)
            start = time.perf_counter()
            samples, seconds = super()._train_epoch()
            _sync(self.device)
            epochs.append((samples, time.perf_counter() - start))
            return samples, seconds

        def save(self) -> None:  # no checkpoints: they are not what is measured
            return None

    task: Any = (lambda seed: gpu_task(seed, spec.samples)) if spec.gpu else "synthetic"
    config = TrainConfig(task=task, samples=spec.samples, features=spec.features, epochs=spec.epochs,
                         batch_size=spec.batch, lr=spec.lr, seed=spec.seed, num_workers=spec.num_workers,
                         precision="bf16" if spec.gpu else "fp32", run_dir=spec.run_dir)
    TimedTrainer(config, ctx).fit()
    from mpddp.core.rank import recorder

    reader = recorder.RUNNING  # its own clock: what the reader thread took of this rank's time
    return epochs, (reader.busy / (time.perf_counter() - reader.since) if reader is not None else None)


def run_loop(ctx: Any, spec: Spec, ddp: str) -> list[tuple[int, float]]:
    """A minimal hand-written loop; ``ddp``: "none", "default" or "tuned" (bucket view + static graph)."""
    import contextlib

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    device = torch.device(ctx.device)
    torch.manual_seed(spec.seed)
    task = _task(spec)
    model = task.model.to(device)
    if ddp != "none":
        tuned = ddp == "tuned"
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=tuned, static_graph=tuned)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    sampler: DistributedSampler = DistributedSampler(task.train_set, num_replicas=ctx.world_size, rank=ctx.rank,
                                                     shuffle=True, seed=spec.seed)
    loader = DataLoader(task.train_set, batch_size=spec.batch, sampler=sampler, num_workers=spec.num_workers,
                        pin_memory=device.type == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if spec.gpu else contextlib.nullcontext()
    epochs = []
    for epoch in range(spec.epochs):
        sampler.set_epoch(epoch)
        _sync(device)
        start, samples = time.perf_counter(), 0
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with autocast:
                loss = task.loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += int(targets.shape[0])
        _sync(device)
        epochs.append((samples * ctx.world_size, time.perf_counter() - start))
    return epochs


def _rate(epochs: list[tuple[int, float]]) -> float:
    timed = epochs[1:] or epochs  # the first epoch warms up caches and allocators
    return sum(n for n, _ in timed) / sum(t for _, t in timed)


def variants(spec: Spec) -> dict[str, tuple[str, Any, tuple, tuple]]:
    """name -> (label, fn, extra args, the ranks' extra env); the first is the reference. "trainer" runs with
    the flight recorder on (mpddp's default), "trainer_fr_off" without it, next to each other in every repetition."""
    trainer = {
        "trainer": ("mpddp Trainer", run_trainer, (), ()),
        "trainer_fr_off": ("mpddp Trainer, flight recorder off", run_trainer, (), FR_OFF),
        WATCHED: ("mpddp Trainer, watched by mpddp top", run_trainer, (), ()),
    }
    if spec.gpu:
        return {
            "loop": ("plain loop, no DDP (reference)", run_loop, ("none",), ()),
            **trainer,
            "ddp_default": ("plain loop + DDP defaults", run_loop, ("default",), ()),
            "ddp_tuned": ("plain loop + DDP bucket view, static graph", run_loop, ("tuned",), ()),
        }
    return {
        "loop": ("hand-written DDP loop (reference)", run_loop, ("default",), ()),
        **trainer,
    }


def bench(spec: Spec, reps: int) -> dict[str, Any]:
    import mpddp

    table_of = variants(spec)
    names = list(table_of)
    rates: dict[str, list[float]] = {name: [] for name in names}
    shares: list[float] = []  # the reader thread's share of rank 0's time, from the rank's own clock
    answers: list[int] = []  # snapshots the watched launcher gave, a repetition
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            _, fn, extra, env = table_of[name]
            with watcher(name == WATCHED) as asked:
                out = mpddp.launch(fn, nprocs=spec.ranks, args=(spec, *extra), env=env)[0]
            if name == WATCHED:
                answers.append(asked[0])
            epochs, share = out if isinstance(out, tuple) else (out, None)
            if share is not None:
                shares.append(share)
            rates[name].append(_rate(epochs))
        print(f"  rep {rep + 1}/{reps}: " + "  ".join(f"{n} {rates[n][-1]:,.0f}/s" for n in names), flush=True)
    reference = rates[names[0]]
    results = {name: {"label": table_of[name][0], **summary(rates[name], reference)} for name in names}
    results["trainer"]["reader_share"] = max(shares) if shares else None
    results[WATCHED]["answers"] = answers
    return results


@contextlib.contextmanager
def watcher(on: bool) -> Iterator[list[int]]:
    """``mpddp top`` as a thread of this process while the block runs (``on``): this process's launcher asked for
    a snapshot every second; yields the count of its answers."""
    asked = [0]
    if not on:
        yield asked
        return
    from mpddp.core.launcher import runtime_dir

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            for entry in (e for e in runtime_dir.entries() if e.pid == os.getpid()):
                with contextlib.suppress(OSError):
                    runtime_dir.ask(entry)
                    asked[0] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        stop.set()
        thread.join()


def watched(results: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's samples/s watched against not, paired by repetition, as :func:`flight_recorder` pairs."""
    paired = summary(results[WATCHED]["values"], results["trainer"]["values"])
    return {**{k: paired[k] for k in ("ratio", "ratio_min", "ratio_max", "ratios")},
            "cost_percent": (1 - paired["ratio"]) * 100, "answers": results[WATCHED]["answers"]}


def flight_recorder(results: dict[str, Any], buffer: str) -> dict[str, Any]:
    """The Trainer's samples/s with the flight recorder on against off, paired by repetition: ``ratio`` is
    on / off (median of the repetitions' ratios), ``cost_percent`` what the recorder takes off the rate."""
    paired = summary(results["trainer"]["values"], results["trainer_fr_off"]["values"])
    reader = results["trainer"].get("reader_share")
    return {"on": "trainer", "off": "trainer_fr_off", "buffer": buffer,
            **{k: paired[k] for k in ("ratio", "ratio_min", "ratio_max", "ratios")},
            "cost_percent": (1 - paired["ratio"]) * 100,
            "reader_percent": None if reader is None else reader * 100}


def fr_buffer() -> str:
    """The flight recorder's size in the "on" variant: mpddp's default, unless this environment sets it
    (the ranks inherit it, and mpddp then leaves it alone)."""
    from mpddp.core.rank.recorder import BUFFER

    for name in FR_SIZE:
        if name in os.environ:
            return f"{os.environ[name]} entries, from {name} in this environment"
    return f"{BUFFER} entries, mpddp's default"


def report(spec: Spec, results: dict[str, Any], fr: dict[str, Any], seen: dict[str, Any]) -> str:
    rows = [[r["label"], f"{r['median']:,.0f}", f"{r['ratio']:.3f}", f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"]
            for r in results.values()]
    mode = "GPU, 1 rank, bf16" if spec.gpu else f"CPU, {spec.ranks} ranks, fp32"
    fr_line = (f"flight recorder on / off: {fr['ratio']:.3f} (cost {fr['cost_percent']:.1f} %; range "
               f"{fr['ratio_min']:.3f}-{fr['ratio_max']:.3f} over {len(fr['ratios'])} "
               f"rep{'s' if len(fr['ratios']) > 1 else ''}; goal: under 1 %)"
               f"; on: {fr['buffer']}")
    if fr["reader_percent"] is not None:
        fr_line += (f"\nflight recorder reader: {fr['reader_percent']:.2f} % of a rank's time (its own clock, the "
                    "largest of the repetitions; the ratio above is the whole cost, within the machine's noise)")
    seen_line = (f"watched by mpddp top / not watched: {seen['ratio']:.3f} (cost {seen['cost_percent']:.1f} %; range "
                 f"{seen['ratio_min']:.3f}-{seen['ratio_max']:.3f}; goal: at most 1 %); snapshots given a repetition: "
                 f"{', '.join(map(str, seen['answers']))}")
    return (f"{mode}, batch {spec.batch} per rank\n" + table(["variant", "samples/s", "x ref", "range"], rows)
            + "\n\n" + fr_line + "\n" + seen_line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="GPU mode: 1 rank, bf16, the 4096-8192 MLP, batch 1024")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions [5]")
    parser.add_argument("--ranks", type=int, default=None, help="ranks [2 on CPU, 1 on the GPU]")
    parser.add_argument("--batch", type=int, default=None, help="batch per rank [64 on CPU, 1024 on the GPU]")
    parser.add_argument("--samples", type=int, default=None,
                        help="training set size [16384 on CPU, 65536 on the GPU: 64 steps an epoch]")
    parser.add_argument("--features", type=int, default=256, help="CPU mode: input width of the MLP [256]")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run, the first a warm-up [3]")
    parser.add_argument("--num-workers", type=int, default=None, help="DataLoader workers [0 on CPU, 8 on the GPU]")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--tiny", action="store_true", help="test mode: one repetition, small sizes")
    args = parser.parse_args()
    if args.gpu:
        import torch

        if torch.cuda.device_count() == 0:  # device_count, not is_available: no CUDA context in this process
            raise SystemExit("bench_train: --gpu needs a CUDA GPU, but torch.cuda.device_count() is 0 here; "
                             "run without --gpu for the CPU benchmark")
    spec = Spec(gpu=args.gpu, ranks=args.ranks or (1 if args.gpu else 2),
                batch=args.batch or (1024 if args.gpu else 64),
                samples=args.samples or (65536 if args.gpu else 16384), features=args.features, epochs=args.epochs,
                num_workers=args.num_workers if args.num_workers is not None else (8 if args.gpu else 0))
    reps = args.reps
    if args.tiny:
        spec = replace(spec, samples=args.samples or (2048 if args.gpu else 1024), features=min(args.features, 32),
                       epochs=2)
        reps = 1
    print(f"bench_train: {machine()}, torch {torch_version()}, {spec}, {reps} interleaved reps", flush=True)
    if any(os.environ.get(name, "").strip() == "0" for name in FR_SIZE):
        print("bench_train: the flight recorder is off in this environment, so 'on' is off too; unset "
              f"{' and '.join(FR_SIZE)} to measure its cost", flush=True)
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-train-") as tmp:
        results = bench(replace(spec, run_dir=tmp), reps)
    fr, seen = flight_recorder(results, fr_buffer()), watched(results)
    print()
    print(report(spec, results, fr, seen))
    write_json(args.json, {"benchmark": "train", "torch": torch_version(), "spec": spec.__dict__, "reps": reps,
                           "results": results, "flight_recorder": fr, "watched": seen})


if __name__ == "__main__":
    main()
