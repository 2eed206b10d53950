"""What every command that starts workers shares: its launch options and exit codes.

Owns: the click options made from :class:`~mpddp.config.LaunchConfig`'s
fields (their help and type live in each field's ``metadata``, so a new
launch option appears in every command at once and the two cannot drift
apart), turning the parsed values into one validated config, and the exit
codes. Leaves validation to config.py and the SLURM rule to core/launcher/api.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

import click

from ..config import LaunchConfig
from ..core.launcher.api import make_config
from ..errors import ConfigError

EXIT_BAD_INPUT = 2
EXIT_SIGINT = 130

LAUNCH_FIELDS = tuple(f.name for f in fields(LaunchConfig) if "cli" in f.metadata)


def _option(f: Field[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--master-port`` for field ``master_port``; default None: unset, so LaunchConfig's (or SLURM's) applies."""
    cli = f.metadata["cli"]
    name, kind = "--" + f.name.replace("_", "-"), cli["type"]
    if kind == "flag":
        return click.option(name, *cli["decls"], f.name, is_flag=True, default=False, help=cli["help"])
    click_type = click.Path(file_okay=False) if kind == "directory" else kind
    more: dict[str, Any] = {"metavar": cli["metavar"]} if "metavar" in cli else {}
    if "bare" in cli:  # a value of its own when given alone (last, or before another option): --dashboard
        more |= {"is_flag": False, "flag_value": cli["bare"]}
    if "check" in cli:  # told as the line is read: a word taken for the value (the script's name) is named
        more["callback"] = _checked(cli["check"])
    return click.option(name, *cli["decls"], f.name, type=click_type, default=None, help=cli["help"], **more)


def _checked(check: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return check(value)
        except ConfigError as e:
            raise click.BadParameter(str(e), ctx, param) from None

    return callback


def launch_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add every launch option to ``command``, in LaunchConfig's field order."""
    options = [_option(f) for f in fields(LaunchConfig) if "cli" in f.metadata]
    return functools.reduce(lambda cmd, opt: opt(cmd), reversed(options), command)


def pop_launch_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the launch options out of a command's parsed options (the rest are the command's own)."""
    return {name: options.pop(name) for name in LAUNCH_FIELDS}


def build_config(**options: Any) -> LaunchConfig:
    """The launch options as one validated config (under SLURM, its layout fills what is unset)."""
    return make_config({name: options[name] for name in LAUNCH_FIELDS})
