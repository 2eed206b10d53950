"""``mpddp run``: a torchrun-style script in N workers, with no torchrun.

Owns: the ``run`` command's arguments. The worker side is core/script.py;
the launch itself is the same as for every other command.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import click

from ..errors import ConfigError
from .options import build_config, launch_options


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@launch_options
@click.option("-m", "is_module", is_flag=True, help="TARGET is a module, run as with `python -m`.")
@click.argument("target")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(target: str, script_args: tuple[str, ...], is_module: bool, **options: Any) -> None:
    """Run a torchrun-style SCRIPT (or -m MODULE) in every worker.

    \b
    mpddp run --nprocs 2 train.py --epochs 3
    mpddp run --nprocs 2 -m mypkg.train --epochs 3

    Each worker sees RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR and MASTER_PORT as under torchrun, its own
    sys.argv, and __name__ == "__main__"; init_process_group("env://")
    joins the launcher's store. The exit code is the failing rank's.
    """
    from ..core.api import launch
    from ..core.script import run_script

    if target.startswith("-") and (is_module or not os.path.isfile(target)):
        raise _no_such_option(target)
    if not is_module and not os.path.isfile(target):
        raise ConfigError(f"script {target!r} does not exist: pass a path to a .py file, or -m for a module")
    if is_module and not _importable(target):
        raise ConfigError(
            f"module {target!r} cannot be found from {os.getcwd()}: check its name, run from the directory "
            "that holds its package, or install it (pip install -e .)"
        )
    config = build_config(**options)
    # rank 0's env:// rendezvous connects to the launcher's store as a client; torch compares
    # the value with str(True), so "1" would make rank 0 try to bind the port itself
    config = replace(config, env=(*config.env, ("TORCHELASTIC_USE_AGENT_STORE", "True")))
    launch(run_script, config=config, args=(target, script_args, is_module), init_process_group=False)


def _no_such_option(target: str) -> click.UsageError:
    """An unknown option lands in TARGET (everything after the script is the script's): call it what it is."""
    import difflib

    ctx = click.get_current_context()
    known = [name for param in ctx.command.params for name in getattr(param, "opts", []) if name.startswith("--")]
    name = target.partition("=")[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    return click.UsageError(f"No such option: {name}.{hint} A script whose name starts with '-' goes after --, "
                            f"as in `mpddp run -- {target}`.", ctx=ctx)


def _importable(module: str) -> bool:
    """Whether ``python -m module`` would find it here (the workers add the cwd too)."""
    import importlib.util
    import sys

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())
