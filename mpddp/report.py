"""Failure reports: which rank failed first, and what the user is told.

Owns: the parent's view of each rank (:class:`RankState`), classifying a
rank's failure (its own exception, a death by signal, a victim of another
rank, a timeout in a collective), picking the root cause and writing the
report. When one rank raises, its peers blocked in a collective fail within
milliseconds ("Connection closed by peer"); reporting whichever error
arrives first blames a victim, so reports are ordered by cause, then time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import procs
from .errors import HangError, WorkerFailed
from .ranks import RankSlot

_PEER_WORDS = ("closed by peer", "reset by peer", "broken pipe", "connection closed", "connection refused",
               "socket closed", "connection reset", "ECONNRESET", "EPIPE")
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded")
_TAIL_LINES = 10


@dataclass
class RankState:
    """What the launcher knows of one local rank while it runs and after."""

    slot: RankSlot
    process: Any
    messages: Any
    started: bool = False
    has_result: bool = False
    result: Any = None
    error: dict[str, Any] | None = None
    exitcode: int | None = None
    failed_at: float | None = None  # monotonic time of the failure
    stopped: bool = False  # the launcher stopped this rank
    tail: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    @property
    def kind(self) -> str:
        """own | died | timeout | peer | stopped | ok."""
        if self.error is not None:
            text = f"{self.error['type']}: {self.error['message']}"
            if any(w in text.lower() for w in _TIMEOUT_WORDS):
                return "timeout"
            if any(w.lower() in text.lower() for w in _PEER_WORDS):
                return "peer"
            return "own"
        if self.stopped:
            return "stopped"
        if self.failed:
            return "died"
        return "ok"


_CAUSE_ORDER = {"own": 0, "died": 1, "timeout": 2, "peer": 3}


def root_cause(states: list[RankState]) -> RankState:
    """The rank whose failure started it all: cause first, then time."""
    failed = [s for s in states if s.kind in _CAUSE_ORDER]
    return min(failed, key=lambda s: (_CAUSE_ORDER[s.kind], s.failed_at or 0.0))


def _where(s: RankState) -> str:
    return f"rank {s.slot.rank} (node {s.slot.node_rank}, local rank {s.slot.local_rank})"


def _how(s: RankState) -> str:
    if s.error is not None and s.error.get("exit_code") is not None:
        return f"exited with code {s.error['exit_code']} (sys.exit)"
    if s.error is not None:
        return f"raised {s.error['type']}: {s.error['message']}"
    code = s.exitcode
    if code is not None and code < 0:
        name = procs.signal_name(code)
        hint = " — the kernel's out-of-memory killer is a common cause (see `dmesg`; lower the batch size)" \
            if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code} without returning a result"


def _short(message: str, width: int = 160) -> str:
    """The first sentence (or line) of a long error message."""
    line = message.splitlines()[0] if message else ""
    if len(line) <= width:
        return line
    cut = line.rfind(". ", 0, width)
    return line[: cut + 1] if cut > 40 else line[:width] + "…"


def _others(states: list[RankState], root: RankState) -> list[str]:
    lines = []
    for s in states:
        if s is root:
            continue
        if s.kind == "stopped":
            lines.append(f"  rank {s.slot.rank}: stopped by mpddp after rank {root.slot.rank} failed")
        elif s.kind in ("peer", "timeout") and s.error is not None:
            lines.append(f"  rank {s.slot.rank}: failed after rank {root.slot.rank} ({s.error['type']}: "
                         f"{_short(s.error['message'])}) — a consequence, not the cause")
        elif s.kind in ("own", "died"):
            lines.append(f"  rank {s.slot.rank}: also {_how(s)}")
        else:
            lines.append(f"  rank {s.slot.rank}: finished")
    return lines


def failure_error(states: list[RankState]) -> WorkerFailed:
    """The exception the parent raises, with the whole report as its message."""
    root = root_cause(states)
    hung = [s for s in states if s.kind == "stopped"] if root.kind == "timeout" else []
    if hung:
        names = ", ".join(str(s.slot.rank) for s in hung)
        waiting = ", ".join(str(s.slot.rank) for s in states if s.kind == "timeout")
        lines = [f"mpddp: rank {names} made no progress: rank {waiting} timed out waiting for it in a collective "
                 f"({root.error['message'].splitlines()[0][:200] if root.error else ''}); every rank was stopped. "
                 "Raise --timeout if a step legitimately takes longer."]
        lines += _tail_block(hung[0])
        return HangError("\n".join(lines), hung[0].slot.rank, [*hung, *[s for s in states if s not in hung]])
    lines = [f"mpddp: {_where(root)} failed first: it {_how(root)}"]
    lines += _tail_block(root)
    if root.error is not None and root.error.get("exit_code") is None:
        lines += [f"mpddp: traceback of rank {root.slot.rank}:", root.error["traceback"].rstrip()]
    others = _others(states, root)
    if others:
        lines += ["mpddp: the other ranks:", *others]
    rest = sorted((s for s in states if s is not root and s.kind != "ok"), key=lambda s: s.failed_at or 0.0)
    code = (root.error or {}).get("exit_code") or 1
    if root.error is None and root.exitcode is not None and root.exitcode < 0:
        code = 128 - root.exitcode  # a shell's convention: SIGKILL -> 137, what schedulers read as "killed"
    return WorkerFailed("\n".join(lines), root.slot.rank, [root, *rest], exit_code=code)


def _tail_block(s: RankState) -> list[str]:
    if not s.tail:
        return []
    return [f"mpddp: last lines of rank {s.slot.rank}:", *(f"  {line}" for line in s.tail[-_TAIL_LINES:])]
