"""``mpddp top``: a live table of a running job, from another terminal on any of its nodes.

Owns: the command, its flags, the terminal's redraw, and how it is left: ``q`` (a terminal) and the end of the job
with code 0; Ctrl-C (130) and SIGTERM (143) end it without a word too (cli/main.py speaks of workers only for a
command that starts them). The job goes on. Finding the launchers of this user on this
machine, choosing one and asking it are core/launcher/runtime_dir.py's; what a row says is core/launcher/live.py's,
its words core/launcher/live_table.py's.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Iterator

import click

from ..core.launcher import live_table, runtime_dir
from ..core.launcher.live import Snapshot
from ..core.wire import typed


@click.command()
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts (with --once: one object; else one a line).")
@click.option("--job", metavar="ID|PID", help="The job to watch, by its id or a launcher's pid, when several run here.")
@click.option("--wait", type=click.FloatRange(0.0, 600.0), default=8.0, show_default=True,
              help="Seconds the first look waits for every node's rows (they come with the nodes' next beats).")
@click.option("--interval", type=click.FloatRange(0.2, 60.0), default=1.0, show_default=True,
              help="Seconds between two refreshes.")
def top(once: bool, as_json: bool, job: str | None, wait: float, interval: float) -> None:
    """Watch a running job: a row a rank (state, collectives a second, the last collective, lag, CPU, memory,
    the last output line), refreshed every second. Finds this user's jobs on this machine by itself; every
    node's ranks are shown, from any node. To leave: q (in a terminal, exit code 0) or Ctrl-C (130); the job
    goes on.

    \b
    mpddp top
    mpddp top --once --json
    """
    entry = runtime_dir.pick(runtime_dir.entries(skipped=_say), job)
    with _keys(not once) as pressed:  # Ctrl-C and SIGTERM: cli/main.py's exit code, and no word
        _watch(entry, once, as_json, wait, interval, pressed)


def _watch(entry: runtime_dir.Entry, once: bool, as_json: bool, wait: float, interval: float, pressed: _Keys) -> None:
    first = True
    while True:
        snapshot = _look(entry, wait if first else 0.0, first)
        if snapshot is None:
            return
        first = False
        if as_json:
            click.echo(snapshot.to_json())
        else:
            tty_out = sys.stdout.isatty()  # a terminal: rows cut to its width; a pipe or a file: whole
            text = live_table.table(snapshot, shutil.get_terminal_size().columns if tty_out else 1 << 16)
            if not once and tty_out:
                text = "\x1b[H\x1b[2J" + text  # home, clear: the table redrawn in place
            click.echo(text)
        if once or pressed(interval):
            return


def _look(entry: runtime_dir.Entry, wait: float, first: bool) -> Snapshot | None:
    """The next look; the first one that fails is one line and exit code 1, a later one ends the watch."""
    who = f"the launcher {entry.pid} of job {entry.job}"
    try:
        return runtime_dir.look(entry, wait)
    except TimeoutError:
        raise runtime_dir.NoJob(f"{who} did not answer within {runtime_dir.ASK_TIMEOUT:g} s (a machine this "
                                "loaded: try --wait 60)") from None
    except typed.Malformed as e:  # not a launcher of this mpddp, or not a launcher at all: never trusted
        raise runtime_dir.NoJob(f"{who} answered what is no snapshot ({e}); is it an mpddp of another "
                                "version?") from None
    except OSError as e:  # it ended between two looks: the job is over here
        if first:
            raise runtime_dir.NoJob(f"{who} did not answer ({type(e).__name__}): it has just ended") from None
        click.echo(f"mpddp top: {who} ended")
        return None


class _Keys:
    """Waits between two looks; True once ``q`` was pressed (stdin a terminal, read key by key)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def __call__(self, seconds: float) -> bool:
        if self.fd is None:
            time.sleep(seconds)
            return False
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                key = os.read(self.fd, 64)
                if not key or b"q" in key.lower():  # q, or the terminal gone
                    return True
        return False


@contextlib.contextmanager
def _keys(on: bool) -> Iterator[_Keys]:
    """``q`` leaves: stdin in cbreak mode (a key without Enter, echo off) while top runs, as it was after."""
    fd = sys.stdin.fileno() if on and sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield _Keys(None)
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield _Keys(fd)
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _say(line: str) -> None:
    click.echo(f"mpddp top: {line.removeprefix('mpddp: ')}", err=True)
