"""``python -m mpddp``: the same as the ``mpddp`` console script."""

import signal
import sys


def _interrupted_early(signum: int, frame: object) -> None:
    # A Ctrl-C while the CLI's modules load: nothing has started yet, so leave quietly.
    sys.stderr.write("mpddp: interrupted (SIGINT) before any worker started\n")
    sys.exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_early)  # run_cli puts KeyboardInterrupt back
    from mpddp.cli import run_cli

    run_cli()
