"""An unknown option's one line: the same words under every command, and the real option it is closest to.

Owns: which of a command's options a mistyped one means (:func:`closest`, pure: a prefix first, then the
same name with a letter off, never a far word picked by string likeness alone), what other launchers'
options are answered with instead (:data:`OTHER_LAUNCHERS`), and the line itself (:func:`unknown_option`).
Leaves the exit code and the printing to cli/main.py; ``mpddp run``'s unknown options, which click passes
through as the script, are turned into :class:`click.NoSuchOption` by cli/run.py.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import click

# Other launchers' options for what mpddp decides itself: an unknown one of these says what mpddp does instead
_DEVICE = ("mpddp gives each rank its device itself: cuda:LOCAL_RANK of the GPUs chosen with --gpus (e.g. --gpus 0,1; "
           "every visible GPU by default), else the CPU; for the CPU on a GPU machine, start it with "
           "CUDA_VISIBLE_DEVICES=''.")
OTHER_LAUNCHERS = {"--device": _DEVICE, "--devices": _DEVICE, "--accelerator": _DEVICE}

MOST_NAMED = 3  # a prefix shared by more options than this says too little to name any
LIKENESS = 0.75  # difflib's ratio of the names without dashes: a letter or two off (nprc/nprocs 0.91), not
# a word that merely shares letters (nproc/epochs 0.55, which click's 0.6 let through)


def _bare(name: str) -> str:
    """``--nproc_per_node`` -> ``nproc-per-node``: the spellings torchrun and click mix compare as one."""
    return name.lstrip("-").replace("_", "-").lower()


def closest(typed: str, options: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The spellings to suggest for ``typed``, given each option's spellings (its first is its own name).

    In this order: the same option in another spelling (``--batch_size``); the options that ``typed``
    begins (``--nproc`` -> ``--nprocs``, up to :data:`MOST_NAMED` of them); the longest option that
    ``typed`` begins with (``--seeds`` -> ``--seed``); the likest name, a letter or two off (``--nprcs``).
    Short options (``-x``) get nothing: one letter is too little to guess from.
    """
    word = _bare(typed)
    if not typed.startswith("--") or not word:
        return ()
    named = [[s for s in spellings if s.startswith("--")] for spellings in options]
    named = [spellings for spellings in named if spellings]
    for spellings in named:
        if any(_bare(s) == word for s in spellings):
            return (spellings[0],)
    begun = [picked for spellings in named
             if (picked := _pick([s for s in spellings if _bare(s).startswith(word)], typed)) is not None]
    if begun:
        return tuple(begun) if len(begun) <= MOST_NAMED else ()
    longer = [(len(_bare(s)), s) for spellings in named for s in spellings if word.startswith(_bare(s))]
    if longer:
        return (max(longer)[1],)
    # the likest name; of its spellings the one written likest (_ or -), else the first
    like = [(_likeness(word, _bare(s)), _likeness(typed, s), -i, -j, s)
            for i, spellings in enumerate(named) for j, s in enumerate(spellings)]
    best = max(like, default=None)
    return (best[-1],) if best is not None and best[0] >= LIKENESS else ()


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _pick(matched: list[str], typed: str) -> str | None:
    """Of one option's spellings that ``typed`` begins, the one written as ``typed`` is (its _ or -), else the
    first."""
    return next((s for s in matched if s.startswith(typed)), matched[0] if matched else None)


def unknown_option(typed: str, ctx: click.Context | None) -> str:
    """The line for an option ``ctx``'s command does not have: which command, and the fix."""
    command = ctx.command_path if ctx is not None else "mpddp"
    if typed in OTHER_LAUNCHERS:
        return f"{command} has no option {typed}: {OTHER_LAUNCHERS[typed]}"
    if ctx is not None and isinstance(ctx.command, click.Group) and (owners := _owners(typed, ctx.command, ctx)):
        listed = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
        return (f"{command} has no option {typed}, but {listed} {'has' if len(owners) == 1 else 'have'} it: "
                f"it goes after the command, as in `{command} {owners[0]} {typed} ...`.")
    names = closest(typed, [] if ctx is None else _spellings(ctx.command, ctx))
    if not names:
        return f"{command} has no option {typed}: see `{command} --help` for its options."
    return f"{command} has no option {typed}: did you mean {' or '.join(names)}? See `{command} --help`."


def _spellings(command: click.Command, ctx: click.Context) -> list[list[str]]:
    """Each option of ``command``'s spellings, its own name first (``--nprocs, --nproc-per-node, ...``)."""
    return [[*p.opts, *p.secondary_opts] for p in command.get_params(ctx) if isinstance(p, click.Option)]


def _owners(typed: str, group: click.Group, ctx: click.Context) -> list[str]:
    """The group's commands that have the option ``typed`` (given before the command's name), in the order of
    registration (train first)."""
    return [name for name, command in group.commands.items()
            if any(typed in spellings for spellings in _spellings(command, ctx))]
