"""The small family of errors mpddp raises, and what a failed launch reports.

Owns: every exception type a user of mpddp can catch, the :class:`Outcome`
of a rank, and :class:`RankFailure`, the plain record of one rank that did
not finish. Each message names the value, what is allowed and the fix, on
one line where the input was bad. Every error survives pickling (a launch
run under submitit or a process pool hands its error to another process):
it holds data only, never a live process. Leaves deciding *when* to raise
to config.py, core/launcher/api.py and core/launcher/report.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Outcome(enum.Enum):
    """How one rank ended, as the launcher tells it (set where it is known, never read from text).

    The worker itself reports ``RAISED``, ``EXITED`` or ``COLLECTIVE`` (from
    the exception's type and the frame it was raised in); the launcher adds
    what only it can see.
    """

    OK = "ok"  # returned a value
    RAISED = "raised"  # its own exception: a root cause, whatever its message says
    EXITED = "exited"  # sys.exit / os._exit with a non-zero code
    DIED = "died"  # killed by a signal, or gone without a word
    EARLY_EXIT = "early-exit"  # returned (or exited 0) while its peers still waited for it
    HUNG = "hung"  # declared hung by the launcher's watchdog
    MISMATCH = "mismatch"  # called another collective than its peers at the same number (the flight recorder)
    COLLECTIVE = "collective"  # an error raised inside torch.distributed after a peer went away
    STOPPED = "stopped"  # stopped by mpddp after another rank failed
    RESIZED = "resized"  # stopped by mpddp to admit a node that arrived (an elastic job grows): no failure
    ABSENT = "absent"  # never reached node 0's store in the job's first round: its node never arrived
    REFUSED = "refused"  # did not join: the nodes were started with different --nnodes or --nprocs (bad input)
    STORE_LOST = "store-lost"  # node 0's store server ended while its launcher lived: no rank's fault


@dataclass(frozen=True)
class RankFailure:
    """One rank that did not finish: where it sat, how it ended, what it said."""

    rank: int
    node_rank: int
    local_rank: int
    outcome: Outcome
    pid: int | None = None
    exit_code: int | None = None  # the process's (negative: killed by that signal)
    error_type: str | None = None  # e.g. "ValueError", for a rank that raised
    message: str | None = None
    traceback: str | None = None
    where: str | None = None  # the frame it was stopped at, e.g. "barrier at train.py:12"


class MpddpError(Exception):
    """Base class of every error mpddp raises on purpose."""


class ReturnValueError(MpddpError, TypeError):
    """A rank's return value cannot be sent back to the launcher (it cannot be pickled): raised in the rank."""


class ConfigError(MpddpError, ValueError):
    """Bad input: a launch option, a task, a checkpoint path. CLI exit code 2."""


class OtherJob(ConfigError):
    """A launcher came to another job than its own: the job standing under its --rdzv-id (or at node 0's store)
    runs another script or function, other arguments or another --nprocs. Bad input: it leaves that job as it was."""


class ShipError(ConfigError):
    """``fn`` or one of its arguments cannot be sent to the worker processes."""


class MainGuardError(MpddpError):
    """``launch`` ran again in a worker because the script has no main guard."""


class ForkserverLost(MpddpError):
    """mpddp's forkserver, which starts every rank, was killed from outside while a launch started its processes."""


class RendezvousError(MpddpError):
    """The nodes of a job did not all meet (a node missing, unreachable master)."""


class NeverArrived(RendezvousError):
    """Ranks of the job never reached node 0's store in its first round: ``ranks``, the first of them first."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class TooFewNodes(RendezvousError):
    """An elastic job's round ``round_number`` has ``nodes`` node(s), fewer than ``MIN`` (``low``): it does not
    start, on any node of it."""

    def __init__(self, message: str, round_number: int, nodes: int, low: int) -> None:
        super().__init__(message)
        self.round_number, self.nodes, self.low = round_number, nodes, low

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.round_number, self.nodes, self.low)


class AddressError(ConfigError, RendezvousError):
    """Node 0 cannot host the store at the address and port given (not this machine's, or taken): bad input."""


class StoreLost(RendezvousError):
    """Node 0's store server ended while the ranks ran (killed from outside); ``max_restarts`` retries it."""


class RendezvousGone(StoreLost):
    """The backend does not answer (node 0's store: its launcher or store server is gone). ``line``: why, as a
    node's report tells it (core/nodes/settle.py), worded by the client that raised it; else the message."""

    went = "the rendezvous went away"  # what went, for a line: each backend's client raises its own kind
    silent = False  # it stopped answering, its connection open (a machine cut off or frozen): it says no last word

    def __init__(self, message: str, line: str | None = None) -> None:
        super().__init__(message)
        self.line = line or message

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.line)


class WorkerFailed(MpddpError):
    """A rank raised, exited non-zero or died by a signal; the group was stopped.

    ``rank`` is the rank that failed first (the root cause), ``failures``
    holds one :class:`RankFailure` per rank that did not finish, root cause
    first; ``exit_code`` is what the CLI exits with.
    """

    def __init__(self, message: str, rank: int, failures: list[RankFailure] | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = list(failures or [])
        self.exit_code = exit_code  # the failing script's own code, 128+signal for a killed rank, else 1
        # The failing rank's own exception, loaded in the launcher (None if it raised none, or it cannot be
        # loaded here); also this error's __cause__. Wrapped, not re-raised as itself: the report (which rank,
        # where, the others) is the point, and a rank's exception type alone would lose it.
        self.exception: BaseException | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # the default would call cls(message) alone; torch.multiprocessing's errors do the same
        return type(self), (str(self), self.rank, self.failures, self.exit_code)


class HangError(WorkerFailed):
    """No rank made progress for ``timeout`` seconds; the report says where each rank was."""


class CollectiveMismatch(WorkerFailed):
    """Ranks called different collectives (or shapes) at the same number; told as soon as it was seen."""


class RestartsExhausted(WorkerFailed):
    """The group failed again after the last allowed restart."""
