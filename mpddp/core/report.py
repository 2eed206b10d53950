"""Failure reports: how each rank ended, which rank failed first, what the user is told.

Owns: the launcher's view of each rank (:class:`RankState`), its
:class:`~mpddp.errors.Outcome` (from the worker's typed
:class:`~mpddp.core.protocol.Failure` and what the launcher saw: the exit
code, whether it stopped the rank), picking the root cause and writing the
report, down to the plain :class:`~mpddp.errors.RankFailure` records the
error carries. When one rank raises, its peers blocked in a collective fail
within milliseconds; reporting whichever error arrives first would blame a
victim, so reports are ordered by outcome, then time. Never by words in a
message: a user's exception that says "timeout" is still the user's.
A rank's ``@record`` error file (core/errorfile.py) adds the exception as
the rank saw it: its traceback where the worker's own report has none (the
script caught it and called ``sys.exit``), else its line and time.
Leaves watching to core/supervisor.py and deciding which node's failure came first to core/rounds.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CollectiveMismatch, HangError, Outcome, RankFailure, WorkerFailed
from ..ranks import RankSlot
from . import collectives, procs, stacks
from .collectives import Mismatch, Standing
from .errorfile import ErrorRecord
from .protocol import Failure, FailureRecord
from .stacks import ranks_named

_TAIL_LINES = 10
# The root cause is the first rank by this order, then by time.
_CAUSE_ORDER = {Outcome.RAISED: 0, Outcome.EXITED: 0, Outcome.DIED: 1, Outcome.EARLY_EXIT: 2, Outcome.MISMATCH: 2,
                Outcome.HUNG: 3,
                Outcome.COLLECTIVE: 4}


@dataclass
class RankState:
    """What the launcher knows of one local rank while it runs and after."""

    slot: RankSlot
    process: Any
    messages: Any
    started: bool = False
    joined: bool = False  # through init_process_group (protocol.Joined)
    has_result: bool = False
    payload: bytes | None = None  # fn's value, still pickled
    failure: Failure | None = None  # the worker's own report
    exitcode: int | None = None
    failed_at: float | None = None  # monotonic time of the failure
    stopped: bool = False  # the launcher stopped this rank
    hung: bool = False  # the watchdog declared this rank hung
    early_exit: bool = False  # it returned while its peers still waited for it
    left: Any = None  # protocol.Left: it destroyed its process group (and where)
    mismatched: bool = False  # it called another collective than its peers at the same number
    finished_at: float | None = None  # monotonic time its value arrived
    stack_fd: int | None = None  # read end of its stack-dump pipe (core/stacks.py)
    main_thread: int | None = None  # its main thread's ident, from Started
    place: stacks.Place | None = None  # where it was when it was stopped
    error_file: ErrorRecord | None = None  # what its TORCHELASTIC_ERROR_FILE said (@record), read after it ended
    lost_with: int | None = None  # the pid of the forkserver it was lost with (killed under it)
    tail: list[str] = field(default_factory=list)

    pid: int | None = None  # kept apart: the process object is closed once the rank has ended (its fds freed)

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    @property
    def succeeded(self) -> bool:
        return self.exitcode == 0 and self.has_result

    @property
    def outcome(self) -> Outcome:
        if self.failure is not None:
            return self.failure.kind
        if self.early_exit:
            return Outcome.EARLY_EXIT
        if self.mismatched:
            return Outcome.MISMATCH
        if self.hung:
            return Outcome.HUNG
        if self.stopped:
            return Outcome.STOPPED
        if self.failed:
            return Outcome.DIED
        return Outcome.OK

    def record(self) -> RankFailure:
        """This rank as plain data, for the error (no live process in it)."""
        f, recorded = self.failure, self.error_file
        traceback = recorded.traceback if recorded is not None and not _has_traceback(self) else None
        return RankFailure(rank=self.slot.rank, node_rank=self.slot.node_rank, local_rank=self.slot.local_rank,
                           outcome=self.outcome, pid=self.pid, exit_code=self.exitcode,
                           error_type=f.error_type if f else None,
                           message=f.message if f else (recorded.message if recorded else None),
                           traceback=traceback or (f.traceback if f else None),
                           where=self.place.text if self.place else (f.where if f else None))


def _has_traceback(s: RankState) -> bool:
    """The worker reported the exception itself (a sys.exit's traceback says nothing)."""
    return s.failure is not None and s.failure.kind is not Outcome.EXITED


def _recorded(s: RankState) -> list[str]:
    """What rank ``s``'s @record error file adds: its traceback where the worker had none, else its line."""
    rec = s.error_file
    if rec is None:
        return []
    when = f", written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.timestamp))}" if rec.timestamp else ""
    source = f"its error file (torchelastic's @record{when})"
    if rec.traceback and not _has_traceback(s):
        return [f"mpddp: traceback of rank {s.slot.rank}, from {source}:", rec.traceback.rstrip()]
    return [f"mpddp: rank {s.slot.rank}'s error file (torchelastic's @record{when}): {_short(rec.message)}"]


def root_cause(states: list[RankState]) -> RankState:
    """The rank whose failure started it all: outcome first, then time."""
    failed = [s for s in states if s.outcome in _CAUSE_ORDER]
    return min(failed, key=lambda s: (_CAUSE_ORDER[s.outcome], s.failed_at or 0.0))


def _where(s: RankState) -> str:
    return f"rank {s.slot.rank} (node {s.slot.node_rank}, local rank {s.slot.local_rank})"


def _how(s: RankState) -> str:
    f = s.failure
    if f is not None and f.kind is Outcome.EXITED:
        return f"exited with code {f.exit_code} (sys.exit)"
    if f is not None:
        then = f", and while it was handled, {f.then}" if f.then else ""
        return f"raised {f.error_type}: {f.message}{then}"
    if s.lost_with is not None:
        return (f"was lost with mpddp's forkserver (pid {s.lost_with}), which starts every rank and reports its "
                "exit: it was killed from outside (a signal sent to it, or the out-of-memory killer); "
                "no rank of the job is left, and the next launch starts a new one")
    code = s.exitcode
    if code is not None and code < 0:
        name = procs.signal_name(code)
        hint = " — the kernel's out-of-memory killer is a common cause (see `dmesg`; lower the batch size)" \
            if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code} without returning a result"


def _short(message: str, width: int = 160) -> str:
    """The first sentence (or line) of a long error message, cut at a word, never inside one."""
    line = message.splitlines()[0] if message else ""
    if len(line) <= width:
        return line
    cut = line.rfind(". ", 0, width)
    if cut > 40:
        return line[: cut + 1]
    space = line.rfind(" ", 0, width)
    return (line[:space] if space > 40 else line[:width]).rstrip(",;:") + "…"


def _others(states: list[RankState], root: RankState | None, cause: int | None = None) -> list[str]:
    """A line for each rank but ``root``, told against the rank that failed first (``cause``: on another node)."""
    first = root.slot.rank if root is not None else cause
    lines = []
    for s in states:
        if s is root:
            continue
        outcome = s.outcome
        if outcome is Outcome.STOPPED:
            where = f", in {s.place.text}" if s.place is not None else ""
            lines.append(f"  rank {s.slot.rank}: stopped by mpddp after rank {first} failed{where}")
        elif outcome is Outcome.COLLECTIVE and s.failure is not None:
            lines.append(f"  rank {s.slot.rank}: failed after rank {first} ({s.failure.error_type}: "
                         f"{_short(s.failure.message)}) — a consequence, not the cause")
        elif outcome in (Outcome.RAISED, Outcome.EXITED, Outcome.DIED):
            said = f" (its error file: {_short(s.error_file.message)})" if s.error_file and not _has_traceback(s) else ""
            lines.append(f"  rank {s.slot.rank}: also {_how(s)}{said}")
        else:
            lines.append(f"  rank {s.slot.rank}: {_ENDED.get(outcome, 'finished')}")
    return lines


_ENDED = {Outcome.HUNG: "made no progress either", Outcome.MISMATCH: "called another collective than its peers",
          Outcome.EARLY_EXIT: "returned while its peers still waited for it"}  # how _others tells the rest


def exit_code(s: RankState) -> int:
    """What the CLI exits with for root cause ``s``: its own code, 128+signal when killed, else 1.

    Never 0 for a failure: ``sys.exit(256)`` would wrap around to 0 in the shell, so it becomes 1.
    """
    if s.lost_with is not None:
        return 1  # its 255 is multiprocessing's "no status", not the rank's
    code = s.failure.exit_code if s.failure is not None else s.exitcode
    if s.failure is None and code is not None and code < 0:
        return 128 - code  # a shell's convention: SIGKILL -> 137, what schedulers read as "killed"
    return code if code is not None and 0 < code < 256 else 1


def failure_error(states: list[RankState]) -> WorkerFailed:
    """The exception the parent raises, with the whole report as its message."""
    root = root_cause(states)
    early = [s for s in states if s.succeeded and root.failed_at is not None and (s.finished_at or 0) < root.failed_at]
    if root.outcome is Outcome.COLLECTIVE and early:  # its peers' collectives broke when it left
        return _early_exit_error(states, early, {s.slot.rank: s.failure.where if s.failure else None
                                                 for s in states if s.outcome is Outcome.COLLECTIVE})
    gone = [s for s in states if s.left is not None and s.outcome in (Outcome.STOPPED, Outcome.OK)]
    if root.outcome is Outcome.COLLECTIVE and gone:  # it destroyed its process group; its peers' collectives broke
        return _left_error(states, gone, root)
    stuck = [s for s in states if s.outcome is Outcome.STOPPED] if root.outcome is Outcome.COLLECTIVE else []
    if stuck:  # the others timed out in a collective, waiting for ranks that were still running
        names = ", ".join(str(s.slot.rank) for s in stuck)
        waiting = ", ".join(str(s.slot.rank) for s in states if s.outcome is Outcome.COLLECTIVE)
        first = _short(root.failure.message, 200) if root.failure and root.failure.message else ""
        failed = root.failure.where if root.failure and root.failure.where else "a collective"
        kind = root.failure.error_type if root.failure else "an error"
        lines = [f"mpddp: rank {names} had not arrived when rank {waiting}'s {failed} failed ({kind}: {first}); "
                 "every rank was stopped. Rank " + names + " is the one to look at: where it was is below."]
        lines += _tail_block(stuck[0])
        ordered = [*stuck, *[s for s in states if s not in stuck]]
        return HangError("\n".join(lines), stuck[0].slot.rank, [s.record() for s in ordered])
    lines = [f"mpddp: {_where(root)} failed first: it {_how(root)}"]
    if root.failure is not None and root.failure.hint:
        lines.append(f"mpddp: {root.failure.hint}")
    lines += _tail_block(root)
    if root.failure is not None and root.failure.kind is not Outcome.EXITED and root.failure.traceback.strip():
        lines += [f"mpddp: traceback of rank {root.slot.rank}:", root.failure.traceback.rstrip()]
    lines += _recorded(root)
    others = _others(states, root)
    if others:
        lines += ["mpddp: the other ranks:", *others]
    rest = sorted((s for s in states if s is not root and s.outcome is not Outcome.OK), key=lambda s: s.failed_at or 0.0)
    error = WorkerFailed("\n".join(lines), root.slot.rank, [s.record() for s in (root, *rest)], exit_code=exit_code(root))
    error.exception = error.__cause__ = _exception(root)
    return error


def _exception(s: RankState) -> BaseException | None:
    """The rank's own exception, loaded here when it can be (its classes importable in the launcher)."""
    if s.failure is None or s.failure.pickled is None:
        return None
    try:
        import cloudpickle

        loaded = cloudpickle.loads(s.failure.pickled)
    except Exception:  # noqa: BLE001 - a class only the worker had: the report's text stands alone
        return None
    return loaded if isinstance(loaded, BaseException) else None


def _left_error(states: list[RankState], gone: list[RankState], root: RankState) -> WorkerFailed:
    """A rank destroyed its process group (protocol.Left) while its peers still called collectives in it."""
    for s in gone:
        s.early_exit = True
    left = gone[0]
    assert left.left is not None
    waiting = [s for s in states if s.outcome is Outcome.COLLECTIVE]
    where = "; ".join(f"rank {s.slot.rank} was in {s.failure.where or 'a collective'}" for s in waiting if s.failure)
    lines = [f"mpddp: {_where(left)} left the process group ({left.left.where}) while {where or 'its peers waited'}, "
             "which then failed; every rank was stopped. Every rank must call the same collectives before it leaves "
             "the group: look for a destroy_process_group (or a return) that only some ranks reach."]
    lines += _tail_block(left)
    others = _others(states, left)
    if others:
        lines += ["mpddp: the other ranks:", *others]
    ordered = [*gone, *[s for s in states if s not in gone and s.outcome is not Outcome.OK]]
    return WorkerFailed("\n".join(lines), left.slot.rank, [s.record() for s in ordered], exit_code=1)


def _tail_block(s: RankState) -> list[str]:
    if not s.tail:
        return []
    return [f"mpddp: last lines of rank {s.slot.rank}:", *(f"  {line}" for line in s.tail[-_TAIL_LINES:])]


def _early_exit_error(states: list[RankState], early: list[RankState], waits: dict[int, str | None]) -> WorkerFailed:
    """A rank returned (or exited 0) while its peers still waited for it in a collective: it is the cause."""
    for s in early:
        s.early_exit = True
    code = ", ".join(f"code {s.exitcode or 0}" for s in early[:1])
    where = "; ".join(f"rank {rank} still waited in {text}" if text else f"rank {rank} still waited for it"
                      for rank, text in waits.items())
    lines = [f"mpddp: {_where(early[0])} exited ({code}) while {where or 'its peers still waited for it'}; "
             "every rank was stopped. Every rank must reach the same collectives: look for a return, "
             "break or sys.exit that only some ranks take."]
    lines += _tail_block(early[0])
    others = _others(states, early[0])
    if others:
        lines += ["mpddp: the other ranks:", *others]
    ordered = [*early, *[s for s in states if s not in early and s.outcome is not Outcome.OK]]
    return WorkerFailed("\n".join(lines), early[0].slot.rank, [s.record() for s in ordered], exit_code=1)


def hang_error(states: list[RankState], seconds_idle: float, places: dict[int, stacks.Place | None],
               finished: tuple[int, ...], standings: tuple[Standing, ...] = ()) -> HangError:
    """No rank made progress for ``seconds_idle`` (core/watchdog.py): who, where each rank stands in its
    collectives (the flight recorder, when there is one), and where every rank's stack was."""
    waiting = [r for r, p in places.items() if p is not None and p.waiting]
    idle = [r for r in places if r not in waiting]
    by_rank = {s.slot.rank: s for s in states}
    seconds = f"{seconds_idle:.0f} s"
    wait_text = next((p.text for r in waiting if (p := places[r]) is not None), "a collective")
    lagging = next((st for st in standings if [r for r in st.behind if r not in finished]), None)
    if lagging is not None and not (finished and not idle):
        culprits = [r for r in lagging.behind if r not in finished]
        line = next((p.line for r in lagging.ahead if (p := places.get(r)) is not None and p.waiting), "")
        first = (f"mpddp: {ranks_named(culprits)} made no progress for {seconds} while {ranks_named(lagging.ahead)} waited "
                 f"for it in {collectives.render(lagging.top)}{f' at {line}' if line else ''}; every rank was stopped")
        outcome = Outcome.HUNG
    elif finished and not idle:
        culprits = list(finished)
        first = (f"mpddp: {ranks_named(culprits)} exited (code 0) while {ranks_named(waiting)} still waited in "
                 f"{wait_text}; every rank was stopped after {seconds} with no progress")
        outcome = Outcome.EARLY_EXIT
    elif (stalled := next((st for st in standings if st.open and not st.behind), None)) is not None and not idle:
        culprits = list(stalled.open)
        first = (f"mpddp: no rank made progress for {seconds}: {ranks_named(stalled.ahead)} entered "
                 f"{collectives.render(stalled.top)} and it did not complete on {ranks_named(stalled.open)}, although no "
                 "rank is missing from it (a backend or network stall); every rank was stopped")
        outcome = Outcome.HUNG
    elif waiting and idle:
        culprits = idle
        first = (f"mpddp: {ranks_named(idle)} made no progress for {seconds} while {ranks_named(waiting)} waited for it in "
                 f"{wait_text}; every rank was stopped")
        outcome = Outcome.HUNG
    else:
        culprits = idle or waiting
        what = ("every rank waits in torch.distributed" if waiting
                else "no rank uses the CPU and none waits in a collective")
        first = f"mpddp: no rank made progress for {seconds}: {what}; every rank was stopped"
        outcome = Outcome.HUNG
    for rank in culprits:
        if rank in by_rank:
            by_rank[rank].hung = outcome is Outcome.HUNG
            by_rank[rank].early_exit = outcome is Outcome.EARLY_EXIT
    lines = [first + ". The watchdog (--timeout) saw no progress: no collective entered or completed, no output, "
             "no CPU use outside a wait; raise --timeout if a rank legitimately waits this long (slow storage, "
             "a lock)."]
    if standings:
        lines.append("mpddp: the collectives each rank reached (torch's flight recorder):")
        lines += [f"  {row}" for row in collectives.standing_rows(list(standings), time.time_ns())]
    lines.append("mpddp: where each rank was:")
    lines += [f"  {row}" for row in stacks.grouped(places, finished=finished)]
    if culprits[0] in by_rank:
        lines += _tail_block(by_rank[culprits[0]])
    ordered = [by_rank[r] for r in culprits if r in by_rank]
    ordered += [s for s in states if s not in ordered and s.outcome is not Outcome.OK]
    return HangError("\n".join(lines), culprits[0], [s.record() for s in ordered], exit_code=1)


def mismatch_error(states: list[RankState], mismatch: Mismatch) -> CollectiveMismatch:
    """Ranks called different collectives at the same number (core/collectives.py): told as soon as it was seen."""
    by_rank = {s.slot.rank: s for s in states}
    odd = by_rank.get(mismatch.odd)
    if odd is not None:
        odd.mismatched = True
    lines = [f"mpddp: {collectives.mismatch_line(mismatch)}; every rank was stopped at once. Every rank must call "
             "the same collectives in the same order, with the same shapes: look for a branch that only some ranks "
             "take (if rank == 0: ...) or inputs of different sizes on different ranks."]
    places: dict[int, stacks.Place | None] = {s.slot.rank: s.place for s in states if s.place is not None}
    if places:
        lines += ["mpddp: where each rank was:", *(f"  {row}" for row in stacks.grouped(places))]
    if odd is not None:
        lines += _tail_block(odd)
    ordered = [s for s in states if s is odd] + [s for s in states if s is not odd and s.outcome is not Outcome.OK]
    return CollectiveMismatch("\n".join(lines), mismatch.odd, [s.record() for s in ordered], exit_code=1)



def remote_error(record: FailureRecord, states: list[RankState], node_rank: int) -> WorkerFailed:
    """This node's report when the round's first failure happened on another node (core/rounds.py).

    It starts with the very line that node's report starts with, and exits with the failing rank's code;
    that node's report has the traceback and the last lines.
    """
    ranks = [s.slot.rank for s in states]
    lines = [record.line, f"mpddp: node {node_rank} stopped its rank(s) {', '.join(map(str, ranks))} because of it "
             f"(node {record.node_rank}'s own report has the rest: traceback, last lines)"]
    others = _others(states, None, record.rank)
    if others:
        lines += [f"mpddp: the ranks on node {node_rank}:", *others]
    cause = RankFailure(rank=record.rank, node_rank=record.node_rank, local_rank=record.local_rank,
                        outcome=record.outcome, exit_code=record.exit_code, message=record.line)
    local = [s.record() for s in states if s.outcome is not Outcome.OK]
    kind = {Outcome.HUNG: HangError, Outcome.MISMATCH: CollectiveMismatch}.get(record.outcome, WorkerFailed)
    return kind("\n".join(lines), record.rank, [cause, *local], exit_code=record.exit_code)
