"""The small family of errors mpddp raises.

Owns: every exception type a user of mpddp can catch. Each message names the
value, what is allowed and the fix, on one line where the input was bad.
Leaves to others: deciding *when* to raise (config.py, launcher.py, ...).
"""

from __future__ import annotations


class MpddpError(Exception):
    """Base class of every error mpddp raises on purpose."""


class ConfigError(MpddpError, ValueError):
    """Bad input: a launch option, a task, a checkpoint path. CLI exit code 2."""


class ShipError(ConfigError):
    """``fn`` or one of its arguments cannot be sent to the worker processes."""


class MainGuardError(MpddpError):
    """``launch`` ran again in a worker because the script has no main guard."""


class RendezvousError(MpddpError):
    """The nodes of a job did not all meet (a node missing, unreachable master)."""


class WorkerFailed(MpddpError):
    """A rank raised, exited non-zero or died by a signal; the group was stopped.

    ``rank`` is the rank that failed first (the root cause), ``failures``
    holds one :class:`mpddp.launcher.RankFailure` per rank that did not
    finish, root cause first.
    """

    def __init__(self, message: str, rank: int, failures: list | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = failures or []
        self.exit_code = exit_code  # what the CLI exits with: the failing script's own code, else 1


class HangError(WorkerFailed):
    """A rank made no progress while the others waited in a collective."""


class RestartsExhausted(WorkerFailed):
    """The group failed again after the last allowed restart."""
