"""How a rank's failure is classified: :func:`classify`, one pure function, next to the cause order.

Owns: :class:`RankState` (the facts the launcher observed of a local rank, never a verdict), :class:`Hang` (what
the watchdog found), :data:`CAUSE_ORDER`, and :func:`classify`, which turns the facts into an
:class:`~mpddp.errors.Outcome` for every rank and names the case the report tells. Nothing here writes text or
changes a rank's state: core/launcher/report.py only renders the :class:`Verdict`.

The rule, in order. A rank's own report wins: its worker decided from its frames whether it raised, called
``sys.exit``, or failed inside a collective (COLLECTIVE: a consequence of a peer); else what the launcher saw
(stopped by mpddp, or died). For the others, the job's verdict: the odd rank of a mismatch is MISMATCH; a hang's
culprits (:func:`judge_hang`) are HUNG, or EARLY_EXIT when they had returned while the others waited; after a
broken collective, the rank that left it (returned before it failed, else destroyed its process group) is
EARLY_EXIT, else the ranks still running when it timed out are the ones it waited for. The root cause is the first
rank by :data:`CAUSE_ORDER`, then by time. Never by words in a message: a user's "timeout" is still the user's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import Outcome, RankFailure
from ...rank_math import RankSlot
from ..wire import stacks
from ..wire.errorfile import ErrorRecord
from ..wire.protocol import Failure
from .board import Mismatch, Standing

# The root cause is the first rank by this order, then by time; an outcome missing here is no cause.
CAUSE_ORDER = {Outcome.RAISED: 0, Outcome.EXITED: 0, Outcome.DIED: 1, Outcome.EARLY_EXIT: 2, Outcome.MISMATCH: 2,
               Outcome.HUNG: 3, Outcome.COLLECTIVE: 4}


@dataclass
class RankState:
    """What the launcher knows of one local rank while it runs and after: facts only (see :func:`classify`)."""

    slot: RankSlot
    process: Any
    messages: Any
    started: bool = False
    joined: bool = False  # through the roll call or init_process_group: the store answered (protocol.Joined)
    has_result: bool = False
    payload: bytes | None = None  # fn's value, still pickled
    failure: Failure | None = None  # the worker's own report
    exitcode: int | None = None
    failed_at: float | None = None  # monotonic time of the failure
    stopped: bool = False  # the launcher stopped this rank
    left: Any = None  # protocol.Left: it destroyed its process group (and where)
    finished_at: float | None = None  # monotonic time its value arrived
    stack_fd: int | None = None  # read end of its stack-dump pipe (core/wire/stacks.py)
    main_thread: int | None = None  # its main thread's ident, from Started
    location: stacks.Location | None = None  # where it was when it was stopped
    error_file: ErrorRecord | None = None  # what its TORCHELASTIC_ERROR_FILE said (@record), read after it ended
    lost_with: int | None = None  # the pid of the forkserver it was lost with (killed under it)
    refused: Any = None  # protocol.Refused: it did not join (a taken node rank, nodes of different shapes)
    tail: list[str] = field(default_factory=list)

    pid: int | None = None  # kept apart: the process object is closed once the rank has ended (its fds freed)

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    @property
    def succeeded(self) -> bool:
        return self.exitcode == 0 and self.has_result

    def record(self, outcome: Outcome) -> RankFailure:
        """This rank as plain data, for the error (no live process in it), with the outcome it was given."""
        f, recorded = self.failure, self.error_file
        traceback = recorded.traceback if recorded is not None and not has_traceback(self) else None
        return RankFailure(rank=self.slot.rank, node_rank=self.slot.node_rank, local_rank=self.slot.local_rank,
                           outcome=outcome, pid=self.pid, exit_code=self.exitcode,
                           error_type=f.error_type if f else None,
                           message=f.message if f else (recorded.message if recorded else None),
                           traceback=traceback or (f.traceback if f else None),
                           where=self.location.text if self.location else (f.where if f else None))


def has_traceback(s: RankState) -> bool:
    """The worker reported the exception itself (a sys.exit's traceback says nothing)."""
    return s.failure is not None and s.failure.kind is not Outcome.EXITED


@dataclass(frozen=True)
class Hang:
    """No progress for ``seconds``: where each running rank was, and which ranks had already exited."""

    seconds: float
    locations: dict[int, stacks.Location | None]
    finished: tuple[int, ...]
    standings: tuple[Standing, ...] = ()  # where the ranks stand in their collectives (flight recorder)
    # ranks on different nodes that called different collectives at the same number: what stopped the group
    mismatch: Mismatch | None = None


@dataclass(frozen=True)
class HangVerdict:
    """Who a hang is blamed on, and why (``case``):

    * ``behind``: the flight recorder shows ``culprits`` behind the others in ``standing``;
    * ``returned``: ``culprits`` had exited (code 0) while every running rank waited;
    * ``stalled``: every rank entered ``standing``'s collective and it did not complete on ``culprits``;
    * ``idle``: ``culprits`` were outside torch.distributed while the ``waiting`` ranks waited in it;
    * ``nowhere``: no rank made progress, and none is behind another.
    """

    case: str
    culprits: tuple[int, ...]
    waiting: tuple[int, ...]
    idle: tuple[int, ...]
    standing: Standing | None = None

    @property
    def outcome(self) -> Outcome:
        return Outcome.EARLY_EXIT if self.case == "returned" else Outcome.HUNG


def judge_hang(hang: Hang) -> HangVerdict:
    """The culprits of a hang, from where each rank was and where each stands in its collectives."""
    locations, finished = hang.locations, hang.finished
    waiting = tuple(r for r, p in locations.items() if p is not None and p.waiting)
    idle = tuple(r for r in locations if r not in waiting)
    lagging = next((st for st in hang.standings if [r for r in st.behind if r not in finished]), None)
    if lagging is not None and not (finished and not idle):
        return HangVerdict("behind", tuple(r for r in lagging.behind if r not in finished), waiting, idle, lagging)
    if finished and not idle:
        return HangVerdict("returned", tuple(finished), waiting, idle)
    stalled = next((st for st in hang.standings if st.open and not st.behind), None)
    if stalled is not None and not idle:
        return HangVerdict("stalled", tuple(stalled.open), waiting, idle, stalled)
    if waiting and idle:
        return HangVerdict("idle", idle, waiting, idle)
    return HangVerdict("nowhere", idle or waiting, waiting, idle)


@dataclass(frozen=True)
class Verdict:
    """Every rank's outcome, and the case the report tells (see :func:`classify`).

    ``case``: ``mismatch``, ``hang`` (then ``hang`` is the watchdog's
    verdict), ``returned`` or ``left`` (``culprits`` broke their peers'
    collective by leaving), ``stuck`` (the first failure is a collective that
    timed out while ``culprits`` had not arrived: they were still running, and
    were stopped), ``failed`` (a rank failed: the root cause is the first by
    :data:`CAUSE_ORDER`), or ``none`` (no rank here failed).
    """

    outcomes: dict[int, Outcome]
    case: str
    culprits: tuple[int, ...] = ()
    hang: HangVerdict | None = None

    def __getitem__(self, rank: int) -> Outcome:
        return self.outcomes[rank]


def own_outcome(s: RankState) -> Outcome:
    """What rank ``s`` itself says, or what the launcher saw of it; no verdict of the job's."""
    if s.failure is not None:
        return s.failure.kind
    if s.stopped:
        return Outcome.STOPPED
    return Outcome.DIED if s.failed else Outcome.OK


def classify(states: list[RankState], hang: Hang | None = None, mismatch: Mismatch | None = None) -> Verdict:
    """Every local rank's :class:`~mpddp.errors.Outcome` and the report's case: the one place that decides.

    Pure: it reads the ranks' facts, the watchdog's ``hang`` and the
    collectives' ``mismatch``, and changes nothing (see the module's rule).
    """
    outcomes = {s.slot.rank: own_outcome(s) for s in states}
    unreported = {s.slot.rank for s in states if s.failure is None}

    def blamed(ranks: tuple[int, ...], outcome: Outcome) -> dict[int, Outcome]:
        # a rank blamed whose own report is a broken collective: that came after (the teardown closed its peers).
        # On several nodes the culprits may be other nodes' ranks (seen through the collectives the nodes share):
        # only this node's ranks get an outcome here; the others' is their own node's to tell.
        return outcomes | {r: outcome for r in ranks
                           if r in outcomes and (r in unreported or outcomes[r] is Outcome.COLLECTIVE)}

    if mismatch is not None:
        return Verdict(blamed((mismatch.odd,), Outcome.MISMATCH), "mismatch", (mismatch.odd,))
    if hang is not None:
        judged = judge_hang(hang)
        return Verdict(blamed(judged.culprits, judged.outcome), "hang", judged.culprits, judged)
    if not any(o in CAUSE_ORDER for o in outcomes.values()):
        return Verdict(outcomes, "none")
    root = _first(states, outcomes)
    if outcomes[root.slot.rank] is Outcome.COLLECTIVE and root.failed_at is not None:
        returned = tuple(s.slot.rank for s in states if s.succeeded and (s.finished_at or 0) < root.failed_at)
        if returned:  # its peers' collectives broke when it left
            return Verdict(blamed(returned, Outcome.EARLY_EXIT), "returned", returned)
        left = tuple(s.slot.rank for s in states if s.left is not None
                     and outcomes[s.slot.rank] in (Outcome.STOPPED, Outcome.OK))
        if left:  # it destroyed its process group; its peers' collectives broke
            return Verdict(blamed(left, Outcome.EARLY_EXIT), "left", left)
    if outcomes[root.slot.rank] is Outcome.COLLECTIVE:  # the others timed out waiting for ranks still running
        stuck = tuple(s.slot.rank for s in states if outcomes[s.slot.rank] is Outcome.STOPPED)
        if stuck:
            return Verdict(outcomes, "stuck", stuck)
    return Verdict(outcomes, "failed", (root.slot.rank,))


def node_cause(states: list[RankState], verdict: Verdict) -> Outcome:
    """The outcome of this node's first failure, for the nodes' settlement (core/nodes/settle.py): a hang or a
    mismatch as such, else the root cause's. From the ranks' outcomes, not from the report's type: "rank 3 made
    no progress while rank 2 timed out in a collective" is still a collective error here, which a peer on
    another node may have caused."""
    told = {"hang": Outcome.HUNG, "mismatch": Outcome.MISMATCH}.get(verdict.case)
    return told or verdict[root_cause(states, verdict).slot.rank]


def root_cause(states: list[RankState], verdict: Verdict) -> RankState:
    """The rank whose failure started it all: outcome first, then time."""
    return _first(states, verdict.outcomes)


def _first(states: list[RankState], outcomes: dict[int, Outcome]) -> RankState:
    failed = [s for s in states if outcomes[s.slot.rank] in CAUSE_ORDER]
    return min(failed, key=lambda s: (CAUSE_ORDER[outcomes[s.slot.rank]], s.failed_at or 0.0))
