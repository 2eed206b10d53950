"""``python -m mpddp``: the same as the ``mpddp`` console script."""

from mpddp.cli import run_cli

if __name__ == "__main__":
    run_cli()
