"""``mpddp run``: a torchrun-style script in N workers, with no torchrun.

Owns: the ``run`` command's arguments, and torchrun's flags that are no
launch option's spelling (torchrun's names of launch options, such as
``--nproc-per-node``, are aliases in config.py's field metadata, so every
command has them): each becomes a launch option or a worker variable, is
accepted as what mpddp always does, or is refused in one line that says
what to use instead, before anything starts. The worker side is
core/rank/script.py; the launch itself is the same as for every other command.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import click

from ..config import LaunchConfig
from ..errors import ConfigError
from ..rank_math import global_rank
from .options import build_config, launch_options

# torchrun's flags that mpddp takes but that name no launch option (docs/torchrun.rst)
TORCHRUN_OPTIONS = (
    click.option("--standalone", is_flag=True, help="torchrun: one node on a free port, which is mpddp's default."),
    click.option("--local-ranks-filter", "--local_ranks_filter", "local_ranks_filter", metavar="0,1",
                 help="torchrun: this node's local ranks whose stdout is shown (--output-ranks, in local ranks)."),
    click.option("-r", "--redirects", "redirects", metavar="SPEC",
                 help="torchrun: accepted; every line still reaches this terminal, and --log-dir keeps a copy."),
    click.option("-t", "--tee", "tee", metavar="SPEC",
                 help="torchrun: accepted; lines always reach this terminal, and --log-dir writes rank<N>.log."),
    click.option("--role", metavar="NAME", help="torchrun: the workers' ROLE_NAME [default: default]."),
    click.option("--monitor-interval", "--monitor_interval", "monitor_interval", type=float, metavar="SECONDS",
                 help="torchrun: accepted; mpddp wakes on every worker's exit instead of polling."),
    click.option("--run-path", "--run_path", "run_path", is_flag=True,
                 help="torchrun: accepted; the worker always runs the script with runpy."),
)
_ACCEPTED = ("redirects", "tee", "monitor_interval", "run_path")  # what they ask for, mpddp does anyway
# torchrun's flags with no counterpart here (underscores read as dashes), and what to do instead
REFUSED = {
    "--no-python": "mpddp run starts a Python script or module (-m) in every worker; start any other program "
                   "with torchrun --no-python",
    "--logs-specs": "--log-dir writes one rank<N>.log per rank, and nothing else plugs in; drop --logs-specs",
    "--event-log-handler": "mpddp records no events; drop --event-log-handler",
    "--duplicate-stdout-filters": "--log-dir keeps every line of every rank: grep its rank<N>.log files",
    "--duplicate-stderr-filters": "--log-dir keeps every line of every rank: grep its rank<N>.log files",
}


def torchrun_options(command: Any) -> Any:
    """Add :data:`TORCHRUN_OPTIONS` to ``command``, after the launch options."""
    for option in reversed(TORCHRUN_OPTIONS):
        command = option(command)
    return command


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@launch_options
@torchrun_options
@click.option("-m", "--module", "is_module", is_flag=True, help="TARGET is a module, run as with `python -m`.")
@click.argument("target")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(target: str, script_args: tuple[str, ...], is_module: bool, **options: Any) -> None:
    """Run a torchrun-style SCRIPT (or -m MODULE) in every worker.

    \b
    mpddp run --nprocs 2 train.py --epochs 3
    mpddp run --nprocs 2 -m mypkg.train --epochs 3
    mpddp run --standalone --nproc-per-node 2 train.py   (torchrun's words)
    mpddp run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 train.py
        (the same on every machine: numbered as they join, node 0 at HOST)

    Each worker sees the variables torchrun sets (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID,
    TORCHELASTIC_ERROR_FILE, ...), its own sys.argv, and __name__ ==
    "__main__"; init_process_group("env://") joins the launcher's store.
    torchrun's flags work as written (its _ spellings too, and those marked
    torchrun: below); any other is refused with what to use instead. The
    exit code is the failing rank's (torchrun's is 1).
    """
    from ..core.launcher.api import launch
    from ..core.rank.script import compile_error, run_script

    if target.startswith("-") and (is_module or not os.path.isfile(target)):
        raise _no_such_option(target)
    if not is_module and not os.path.isfile(target):
        raise ConfigError(f"script {target!r} does not exist: pass a path to a .py file, or -m for a module")
    if not is_module and (error := compile_error(target)) is not None:  # once, here, not by every rank
        raise ConfigError(f"{error}; the script does not compile, and no worker was started: fix that line")
    if is_module and not _importable(target):
        raise ConfigError(
            f"module {target!r} cannot be found from {os.getcwd()}: check its name, run from the directory "
            "that holds its package, or install it (pip install -e .)"
        )
    local_ranks = options.pop("local_ranks_filter")
    env = _from_torchrun(options)
    config = build_config(**options)
    if local_ranks is not None:
        config = replace(config, output_ranks=_local_ranks(local_ranks, config, options["output_ranks"]))
    # rank 0's env:// rendezvous connects to the launcher's store as a client; torch compares
    # the value with str(True), so "1" would make rank 0 try to bind the port itself
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    config = replace(config, env=(*config.env, *env.items()))
    launch(run_script, config=config, args=(target, script_args, is_module), init_process_group=False)


def _from_torchrun(options: dict[str, Any]) -> dict[str, str]:
    """Fold torchrun's flags into the launch ``options`` (in place); return the worker variables they set.

    ``--rdzv-endpoint``, ``--rdzv-backend static`` and a node numbered as it joins (no ``--node-rank``) are
    launch options, read as such by config.py and core/launcher/api.py for ``mpddp.launch`` too."""
    standalone, role = options.pop("standalone"), options.pop("role")
    for name in _ACCEPTED:
        options.pop(name)
    if standalone:
        if options["nnodes"] not in (None, 1):
            raise ConfigError(f"--standalone is one node, but --nnodes is {options['nnodes']}: drop --standalone, "
                              "and pass node 0's --master-addr and --master-port")
        # torchrun ignores them under --standalone, and so does mpddp
        options.update(rdzv_endpoint=None, rdzv_backend=None, rdzv_id=None)
    return {"ROLE_NAME": role} if role is not None else {}


def _local_ranks(spec: str, config: LaunchConfig, output_ranks: str | None) -> tuple[int, ...]:
    """torchrun's ``--local-ranks-filter`` as global ranks: ``node_rank × nprocs + local_rank`` on this node."""
    if output_ranks is not None:
        raise ConfigError(f"--local-ranks-filter {spec} and --output-ranks {output_ranks} both pick the ranks "
                          "shown: pass one")
    parts = [part.strip() for part in spec.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ConfigError(f"--local-ranks-filter {spec!r} is not a list of local ranks: use e.g. 0 or 0,1")
    local = tuple(int(part) for part in parts)
    if config.nprocs is None:
        if config.nnodes == 1:
            return local  # on one node a local rank is the global one
        raise ConfigError(f"--local-ranks-filter {spec} on {config.nnodes} nodes needs --nproc-per-node N: "
                          "a local rank's global rank is node_rank × N + local_rank")
    if config.node_rank is None:
        raise ConfigError(f"--local-ranks-filter {spec} on a node numbered as it joins (no --node-rank): its "
                          "global ranks are known only then; pass --node-rank, or --output-ranks with global ranks")
    if max(local) >= config.nprocs:
        raise ConfigError(f"--local-ranks-filter {spec} names local rank {max(local)}, but this node has "
                          f"{config.nprocs}: pass local ranks from 0 to {config.nprocs - 1}")
    return tuple(global_rank(config.node_rank, rank, config.nprocs) for rank in local)


def _no_such_option(target: str) -> click.UsageError:
    """An unknown option lands in TARGET (everything after the script is the script's): call it what it is, in
    the words every command uses for one (cli/usage.py)."""
    name = target.partition("=")[0]
    if (instead := REFUSED.get(name.replace("_", "-"))) is not None:
        return click.UsageError(f"{name} is torchrun's, with no counterpart in mpddp: {instead}.")
    return click.NoSuchOption(name, ctx=click.get_current_context())


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
