"""``python -m mpddp`` and the ``mpddp`` console script: :func:`main`.

A Ctrl-C while the modules load is answered quietly from the start: the
package's ``__init__`` installs that handler before anything else loads,
and ``run_cli`` takes SIGINT over once it runs.

``mpddp train`` starts its forkserver here, before the command line's own
modules load (click, and the other commands' imports: about 0.1 s, measured):
the forkserver's import of torch and torch._dynamo is the longest part of the
first step's path, and it starts that much sooner.
"""

from __future__ import annotations

import sys


def main() -> None:
    if _trains_with_the_forkserver(sys.argv[1:]):
        from .core.launcher.startup import TRAIN_COMMAND_PRELOAD, exit_on_interrupt, start_forkserver

        with exit_on_interrupt():  # a Ctrl-C now stops the forkserver too, and says so
            # the same call as cli/train.py's, which then finds it running
            start_forkserver("forkserver", preload=TRAIN_COMMAND_PRELOAD)
            from .cli import run_cli
    else:
        from .cli import run_cli
    run_cli()


def _trains_with_the_forkserver(args: list[str]) -> bool:
    """``mpddp train ...`` with the default start method, and not asking for its help."""
    return args[:1] == ["train"] and not any(
        a.startswith(("--start-method", "--start_method")) or a in ("-h", "--help") for a in args[1:])


if __name__ == "__main__":
    main()
