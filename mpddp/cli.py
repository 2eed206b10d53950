"""The command line: thin click commands over the Python API.

Owns: the ``mpddp`` group, the launch options shared by every command that
starts workers, turning errors into one line and an exit code, and the
``ranks`` teaching command. Leaves all logic to the modules it calls; each
command's docstring is its ``--help``. Commands other than ``ranks`` live in
their own modules and attach themselves to :data:`main` (see the bottom).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from . import __version__, slurm
from . import ranks as rank_math
from .config import LaunchConfig, parse_gpus, parse_output_ranks
from .errors import ConfigError, MpddpError, WorkerFailed

EXIT_BAD_INPUT = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Terminated(BaseException):
    """SIGTERM reached the launcher; raised in the main thread to tear down."""


def _raise_terminated(signum: int, frame: object) -> NoReturn:
    raise Terminated()


def launch_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options every command that starts workers shares."""
    options = [
        click.option("--nprocs", type=int, default=None, help="Workers on this node [default: one per GPU, else 1]."),
        click.option("--nnodes", type=int, default=None, help="Number of machines [default: 1, or SLURM's]."),
        click.option("--node-rank", type=int, default=None, help="This machine's index, 0..nnodes-1."),
        click.option("--master-addr", default=None, help="Node 0's address [default: 127.0.0.1]."),
        click.option("--master-port", type=int, default=None, help="Node 0's port [default: a free one on one node]."),
        click.option("--backend", default="auto", show_default=True, help="auto (nccl on GPUs, else gloo), nccl or gloo."),
        click.option("--start-method", default="forkserver", show_default=True, help="forkserver, spawn or fork."),
        click.option("--gpus", default=None, help="GPU ids such as 0,3, or free / free:N [default: all visible]."),
        click.option("--timeout", type=float, default=None, help="Seconds a rank may wait in a collective [default: 180]."),
        click.option("--max-restarts", type=int, default=0, show_default=True, help="Restart the group after a failure."),
        click.option("--output-ranks", default="all", show_default=True, help="Ranks whose stdout is shown (0, 0,1, all)."),
        click.option("--log-dir", type=click.Path(file_okay=False), default=None, help="Also write one log file per rank."),
        click.option("--verbose", "-v", is_flag=True, help="A banner per worker; every rank's progress."),
    ]
    return functools.reduce(lambda cmd, opt: opt(cmd), reversed(options), command)


def build_config(**options: Any) -> LaunchConfig:
    """Turn the shared launch options into a validated :class:`LaunchConfig`."""
    values: dict[str, Any] = {
        "nprocs": options["nprocs"],
        "backend": options["backend"],
        "start_method": options["start_method"],
        "gpus": parse_gpus(options["gpus"]),
        "max_restarts": options["max_restarts"],
        "output_ranks": parse_output_ranks(options["output_ranks"]),
        "log_dir": options["log_dir"],
        "verbose": options["verbose"],
    }
    options = slurm.apply_slurm(options)  # under SLURM, its layout fills what the flags leave unset
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "timeout"):
        if options.get(name) is not None:
            values[name] = options[name]
    return LaunchConfig(**values)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mpddp")
def main() -> None:
    """Launch PyTorch DistributedDataParallel jobs with no torchrun.

    \b
    mpddp train --nprocs 2          train a CNN on the digits set with DDP
    mpddp ranks --nnodes 2 --nprocs 4   see how every worker's rank is computed
    """


@main.command()
@click.option("--nprocs", type=int, default=None, help="Workers per node [default: GPUs chosen, else 1].")
@click.option("--nnodes", type=int, default=None, help="Number of machines [default: 1].")
@click.option("--gpus", default=None, help="GPU ids used on every node, such as 0,1,2,5.")
def ranks(nprocs: int | None, nnodes: int | None, gpus: str | None) -> None:
    """Print every worker's node, local rank, global rank and device.

    The formula is printed filled in, so you can see why, with 4 workers a
    node, GPU 2 of node 1 is rank 1×4+2 = 6.
    """
    ids = parse_gpus(gpus)
    if isinstance(ids, str):
        raise ConfigError(f"gpus={ids!r}: `mpddp ranks` needs explicit ids such as 0,1,2,5")
    allocation = slurm.read_layout(os.environ) if nnodes is None else None
    if allocation is not None:  # inside a SLURM job: show that job's layout
        click.echo(_slurm_header(allocation))
        nnodes = allocation.nnodes
        if nprocs is None and ids is None and allocation.gpus_on_node:
            ids = allocation.gpu_ids if len(allocation.gpu_ids or ()) == allocation.gpus_on_node else None
            nprocs = allocation.gpus_on_node
    if nprocs is None:
        nprocs = len(ids) if ids else 1
    nnodes = 1 if nnodes is None else nnodes
    config = LaunchConfig(nprocs=nprocs, nnodes=nnodes, gpus=ids, master_port=29500 if nnodes > 1 else 0)
    click.echo(format_ranks(config.nnodes, config.nprocs or 1, ids))


def _slurm_header(layout: slurm.SlurmLayout) -> str:
    """Where the values came from, and why the layout would not work (if so)."""
    try:
        slurm.check_layout(layout, sys.argv)
        problem = ""
    except ConfigError as e:
        problem = f"\nnote: {e}"
    return f"{slurm.describe(layout)}{problem}\n"


def format_ranks(nnodes: int, nprocs: int, gpus: tuple[int, ...] | None) -> str:
    """The teaching table of ``mpddp ranks``."""
    slots = rank_math.layout(nnodes, nprocs, gpus)
    size = rank_math.world_size(nnodes, nprocs)
    lines = [
        f"world_size = nnodes × nprocs_per_node = {nnodes} × {nprocs} = {size}",
        "rank       = node_rank × nprocs_per_node + local_rank",
        "",
        f"{'node':>4}  {'local_rank':>10}  {'rank (formula)':<16}  {'device':<7}  physical GPU",
    ]
    for s in slots:
        gpu = "-" if s.gpu is None else str(s.gpu)
        lines.append(f"{s.node_rank:>4}  {s.local_rank:>10}  {s.formula:<16}  {s.device:<7}  {gpu}")
    if nnodes > 1:
        last = slots[-1]
        lines += [
            "",
            f"local_rank is not rank: node {last.node_rank}'s local rank {last.local_rank} is rank {last.rank}. "
            f"Passing local_rank as rank would give {nnodes} workers rank 0 and the job would hang or fail.",
        ]
    return "\n".join(lines)


def run_cli(args: list[str] | None = None) -> NoReturn:
    """Entry point: run the group, turn errors into one line and an exit code.

    ``args=None`` (the ``mpddp`` command, ``python -m mpddp``): this process
    is the launcher's own, and it exits at once (see :func:`_exit_process`).
    """
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main.main(args=args, prog_name="mpddp", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.UsageError as e:
        where = f"mpddp {e.ctx.info_name} --help" if e.ctx is not None and e.ctx.parent is not None else "mpddp --help"
        click.echo(f"mpddp: error: {e.format_message()} See `{where}`.", err=True)
        code = EXIT_BAD_INPUT
    except ConfigError as e:
        click.echo(f"mpddp: error: {e}", err=True)
        code = EXIT_BAD_INPUT
    except WorkerFailed as e:
        click.echo(str(e), err=True)
        code = e.exit_code
    except MpddpError as e:
        click.echo(f"mpddp: error: {e}", err=True)
        code = 1
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("mpddp: interrupted (SIGINT); every worker was stopped", err=True)
        code = EXIT_SIGINT
    except Terminated:
        click.echo("mpddp: terminated (SIGTERM); every worker was stopped", err=True)
        code = EXIT_SIGTERM
    code = code if isinstance(code, int) else 0
    if args is None:
        _exit_process(code)
    sys.exit(code)


def _exit_process(code: int) -> NoReturn:
    """Run the atexit handlers, then exit without the interpreter's module teardown.

    By now the workers are gone, the store is closed and the relay flushed.
    The teardown of the modules takes about a second once torch is imported
    (measured on 2 busy cores), and the run is not over for the shell, or
    for a scheduler, until the launcher has exited. The atexit handlers still
    run (multiprocessing's removes its temporary directory).
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing more to say
            pass
    os._exit(code)


# Commands defined in their own modules attach themselves to `main` on import.
from . import info, run_cmd, train_cli  # noqa: E402,F401
