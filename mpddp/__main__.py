"""``python -m mpddp``: the same as the ``mpddp`` console script.

A Ctrl-C while the modules load is answered quietly from the start: the
package's ``__init__`` installs that handler before anything else loads,
and ``run_cli`` takes SIGINT over once it runs.
"""

if __name__ == "__main__":
    from .cli import run_cli

    run_cli()
