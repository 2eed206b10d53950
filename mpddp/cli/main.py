"""The ``mpddp`` command: its group, and every error and signal turned into one line and an exit code.

Owns: the ``mpddp`` group, registering each command (one module each:
cli/ranks.py, cli/info.py, cli/run.py, cli/train.py, cli/plot.py, cli/top.py, all plain
click commands that import nothing back from here), :func:`run_cli` (the
signal handlers a launcher's own process gets: SIGTERM and SIGHUP raised as
:class:`Terminated` for the teardown, SIGUSR1 for every rank's stack; each
error's one line and exit code), and the exit without the interpreter's
module teardown. The shared launch options and exit codes are in
cli/options.py, an unknown option's words in cli/usage.py.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import NoReturn

import click

from .. import __version__
from ..core.launcher.startup import exits_after_launch
from ..core.wire import signals, stacks
from ..core.wire.signals import Terminated  # SIGTERM, SIGHUP, or one of --signals-to-handle
from ..errors import ConfigError, MpddpError, WorkerFailed
from . import info, plot, ranks, run, top, train, usage
from .options import EXIT_BAD_INPUT, EXIT_SIGINT


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    signals.raise_stop(Terminated(signum), signum, frame)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signals.raise_stop(KeyboardInterrupt(), signum, frame)


_STOPPED: dict[int, str] = {signal.SIGTERM: "terminated (SIGTERM)",
                            signal.SIGHUP: "hung up (SIGHUP: the terminal or SSH session closed)"}


EXAMPLES = """Examples:

\b
  mpddp train --nprocs 2                    digits CNN with DDP on 2 ranks
  mpddp run --nprocs 2 train.py --epochs 3  your torchrun-style script
  mpddp ranks --nnodes 2 --nprocs 4         how each rank is computed
  mpddp top                                 watch a running job, rank by rank
  mpddp plot RUN_DIR                        redraw a run's curves.png

Each command's own options and examples: mpddp COMMAND --help."""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXAMPLES)
@click.version_option(__version__, prog_name="mpddp")
def main() -> None:
    """Launch PyTorch DistributedDataParallel jobs with no torchrun."""


def run_cli(args: list[str] | None = None) -> NoReturn:
    """Entry point: run the group, turn errors into one line and an exit code.

    ``args=None`` (the ``mpddp`` command, ``python -m mpddp``): this process
    is the launcher's own, and it exits at once (see :func:`_exit_process`).
    """
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)  # default: die at once, leaving the ranks' children
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGUSR1, stacks.request)  # `kill -USR1`: where is every rank; never kills the launcher
    if args is None:  # the launcher's own process: it launches once at most, then exits
        exits_after_launch()
    try:
        code = main.main(args=args, prog_name="mpddp", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.NoSuchOption as e:  # every command's in the same words (cli/usage.py)
        click.echo(f"mpddp: error: {usage.unknown_option(e.option_name, e.ctx)}", err=True)
        code = EXIT_BAD_INPUT
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
    except KeyboardInterrupt:
        _stopped(args, "interrupted (SIGINT)")
        code = EXIT_SIGINT
    except click.exceptions.Abort as e:  # click's word for a KeyboardInterrupt, and for an EOFError
        if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):
            _stopped(args, "interrupted (SIGINT)")
            code = EXIT_SIGINT
        else:
            cause = e.__cause__ or e.__context__
            click.echo(f"mpddp: error: {type(cause).__name__} ({cause}): an input or a pipe ended early", err=True)
            code = 1
    except Terminated as e:
        _stopped(args, _STOPPED.get(e.signum) or f"stopped by {signal.Signals(e.signum).name}")
        code = 128 + e.signum  # 143 for SIGTERM, 129 for SIGHUP
    code = code if isinstance(code, int) else 0
    if args is None:
        _exit_process(code)
    sys.exit(code)


def _stopped(args: list[str] | None, how: str) -> None:
    """A signal stopped the command: a command that starts workers says it stopped them; another (``top``,
    ``ranks``, ``info``, ``plot``) stopped nothing, and says nothing (its exit code, 128 + the signal, tells it)."""
    if _starts_workers(sys.argv[1:] if args is None else args):
        _say(f"mpddp: {how}; every worker was stopped")


def _starts_workers(args: list[str]) -> bool:
    """Whether the command line names a command that starts workers (its first word that is no option of the
    group's: the group takes only --help and --version)."""
    name = next((a for a in args if not a.startswith("-")), None)
    return name is not None and main.commands.get(name) in _WORKERS


def _exit_process(code: int) -> NoReturn:
    """Run the atexit handlers, then exit without the interpreter's module teardown.

    By now the workers are gone, the store is closed and the relay flushed.
    The teardown of the modules takes about a second once torch is imported
    (measured on 2 busy cores), and the run is not over for the shell, or
    for a scheduler, until the launcher has exited. The atexit handlers still
    run (multiprocessing's removes its temporary directory).
    """
    import atexit

    from ..core.launcher.startup import stop_helpers

    stop_helpers()  # the forkserver and the resource tracker are gone too when the shell goes on
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing more to say
            pass
    os._exit(code)


def _say(line: str) -> None:
    try:
        click.echo(line, err=True)
    except OSError:  # the terminal is gone (SIGHUP): nobody to tell
        pass


_WORKERS = (train.train, run.run)  # the commands that start workers: a signal's line says they were stopped
for _command in (train.train, plot.plot, run.run, ranks.ranks, info.info, top.top):  # each module's one click command
    main.add_command(_command)
