"""``mpddp plot``: redraw a training run's curves.png.

Owns: the command and its help, nothing more. Reading the metrics file,
drawing and every check live in trainer/curves.py, which raises ConfigError
(one line, exit code 2) for a missing run directory and a missing or damaged
metrics file.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigError


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def plot(run_dir: Path) -> None:
    """Redraw RUN_DIR/curves.png from its metrics.jsonl, for a finished run or one still training.

    \b
    mpddp plot runs/digits/20261129-200513
    """
    from ..trainer import curves

    drawn = curves.redraw(run_dir)
    if drawn is None:
        raise ConfigError(f"drawing curves.png needs matplotlib, which is not installed: {curves.INSTALL} "
                          "(or matplotlib)")
    click.echo(f"curves: {drawn}")
