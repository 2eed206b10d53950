"""The signals mpddp itself uses, in one table, and the one call that asks Linux for a parent-death signal.

Owns: which real-time signal carries what (they must never collide, and glibc keeps the first
real-time signals for itself, which ``SIGRTMIN`` already counts), and ``prctl(PR_SET_PDEATHSIG)``.
Leaves what each signal's handler does to the module named beside it. Imports nothing but the
standard library: the forkserver and every process mpddp starts load it before torch.
"""

from __future__ import annotations

import ctypes
import signal

STACK_SIGNAL = signal.SIGRTMIN + 4  # "print your stacks" to a rank (core/wire/stacks.py)
LAUNCHER_GONE = signal.SIGRTMIN + 5  # the forkserver's parent-death signal: its launcher died (core/rank/forkserver.py)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def on_parent_death(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process the moment its parent dies (no-op off Linux/glibc)."""
    prctl(PR_SET_PDEATHSIG, signum)


def prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        pass
