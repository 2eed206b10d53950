"""``mpddp train``: the command line over :func:`mpddp.trainer.train`.

Owns: the train flags and their help, nothing more. Parsing only; every
check lives in :class:`~mpddp.trainer.config.TrainConfig` and
:func:`~mpddp.trainer.prepare.resolve`, which raise ConfigError (one line,
exit code 2).
"""

from __future__ import annotations

from typing import Any

import click

from ..trainer.config import BUILTIN_TASKS
from .options import build_config, launch_options, pop_launch_options


@click.command()
@launch_options
@click.option("--dataset", type=click.Choice(BUILTIN_TASKS), default=None,
              help="A built-in task [default: digits].")
@click.option("--task", "task_spec", default=None, metavar="SPEC",
              help="Your task: package.module:factory or path/to/file.py[:factory] (default factory: make_task).")
@click.option("--samples", type=int, default=8192, show_default=True, help="Synthetic set: number of samples.")
@click.option("--features", type=int, default=64, show_default=True, help="Synthetic set: input width.")
@click.option("--epochs", type=int, default=10, show_default=True, help="Epochs to train (in all, when resuming).")
@click.option("--batch-size", type=int, default=32, show_default=True,
              help="Samples per rank per micro-step; global batch = batch size × world size × accumulate.")
@click.option("--lr", type=float, default=2e-3, show_default=True, help="Learning rate.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights, split and data order derive from it.")
@click.option("--accumulate", type=int, default=1, show_default=True, help="Micro-steps per optimizer step.")
@click.option("--precision", default="auto", show_default=True, help="auto (bf16 on GPU), bf16 or fp32.")
@click.option("--num-workers", type=int, default=0, show_default=True, help="DataLoader worker processes per rank.")
@click.option("--find-unused-parameters", is_flag=True, help="For models whose forward skips parameters.")
@click.option("--run-dir", default=None, help="Where metrics and checkpoints go [default: runs/<task>/<date-time>].")
@click.option("--checkpoint-dir", default=None, help="Where checkpoints go [default: <run dir>/checkpoints].")
@click.option("--checkpoint-every", type=int, default=0, show_default=True,
              help="Also checkpoint every N optimizer steps (0: at the end of each epoch only).")
@click.option("--keep-checkpoints", type=int, default=3, show_default=True, help="Newest checkpoints kept (0: all).")
@click.option("--resume", default=None, metavar="PATH|auto",
              help="Continue from a checkpoint file, a checkpoint directory, or auto (the newest of the last run).")
@click.option("--inject-fault", default=None, metavar="KIND:RANK:STEP",
              help="For tests: kill, raise, hang or kill-saving on RANK at global step STEP (first attempt only).")
def train(**options: Any) -> None:
    """Train with DistributedDataParallel: the digits CNN, a synthetic set, or your task.

    \b
    mpddp train --nprocs 2                     digits, 2 CPU ranks, >95% test accuracy
    mpddp train --nprocs 2 --resume auto --epochs 15   continue the last run
    mpddp train --task mpddp.examples.moons:make_task --nprocs 2   an example task, by module
    """
    from ..core.launcher.startup import TRAIN_COMMAND_PRELOAD, exit_on_interrupt, start_forkserver
    from ..errors import ConfigError

    # A Ctrl-C before launch() starts its processes (imports of torch, scikit-learn, the task): out at once,
    # since there it could be swallowed; once launch() runs, its teardown answers it.
    with exit_on_interrupt():
        # every rank builds an optimizer and DDP, which import torch._dynamo, and runs the trainer:
        # imported once in the forkserver, overlapping this process's torch import below
        start_forkserver(options["start_method"] or "forkserver", preload=TRAIN_COMMAND_PRELOAD)
        from ..trainer.config import TrainConfig
        from ..trainer.run import one_node
        from ..trainer.run import train as run_training

        launch = build_config(**pop_launch_options(options))
        dataset, spec = options.pop("dataset"), options.pop("task_spec")
        if dataset and spec:
            raise ConfigError(f"--dataset {dataset} and --task {spec} both name the task: pass only one")
        config = TrainConfig(task=spec or dataset or "digits", **options)
        if not one_node(launch, {}):
            # this launcher's own store client: its C++ warnings are off only if torch's first import here is
            # quiet (core/wire/store.py), and checking a resumed run or a task of the user's imports it first
            from ..core.wire.store import quiet_torch

            with quiet_torch():
                import torch  # noqa: F401
        run_training(config, launch_config=launch)
