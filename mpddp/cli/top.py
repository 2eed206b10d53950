"""``mpddp top``: a live table of a running job, from another terminal on any of its nodes.

Owns: the command, its flags and the terminal's redraw, nothing more. Finding the launchers of this user
on this machine, choosing one and asking it are core/launcher/runtime_dir.py's; what a row says is
core/launcher/live.py's, its words core/launcher/live_table.py's.
"""

from __future__ import annotations

import shutil
import sys
import time

import click

from ..core.launcher import live_table, runtime_dir


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
    node's ranks are shown, from any node. Ctrl-C leaves; the job goes on.

    \b
    mpddp top
    mpddp top --once --json
    """
    entry = runtime_dir.pick(runtime_dir.entries(), job)
    first = True
    while True:
        try:
            snapshot = runtime_dir.look(entry, wait if first else 0.0)
        except TimeoutError:
            raise runtime_dir.NoJob(f"the launcher {entry.pid} of job {entry.job} did not answer within "
                                    f"{runtime_dir.ASK_TIMEOUT:g} s (a machine this loaded: try --wait 60)") from None
        except (OSError, ValueError) as e:  # it ended between two looks: the job is over here
            if first:
                raise runtime_dir.NoJob(f"the launcher {entry.pid} of job {entry.job} did not answer "
                                        f"({type(e).__name__}): it has just ended") from None
            click.echo(f"mpddp top: the launcher {entry.pid} of job {entry.job} ended")
            return
        first = False
        if as_json:
            click.echo(snapshot.to_json())
        else:
            tty = sys.stdout.isatty()  # a terminal: rows cut to its width; a pipe or a file: whole
            text = live_table.table(snapshot, shutil.get_terminal_size().columns if tty else 1 << 16)
            if not once and tty:
                text = "\x1b[H\x1b[2J" + text  # home, clear: the table redrawn in place
            click.echo(text)
        if once:
            return
        time.sleep(interval)
