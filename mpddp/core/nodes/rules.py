"""The rules of a round as pure functions: what a launcher does next, from what it has seen and now.

Owns a node's life in a round (:class:`NodeState`, moved only by :func:`move`); the membership's rules
(:func:`join_step`, :func:`member_order`, :func:`holder`, :func:`outside`, :func:`door`); and the end's, over a
:class:`RoundView`, one look at the round (:func:`wait_step`, :func:`finish_step`, :func:`unheard`); and who is lost
(:func:`lost_nodes`, on both backends). Each takes plain values (counts, a view, seconds from the caller's clock) and
returns a value: no store, no sleep, so tests/test_rules.py checks them in milliseconds with injected time.
core/nodes/membership.py and core/nodes/settle.py carry them out over a backend.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from ...errors import NeverArrived
from ..wire.protocol import FailureRecord


class NodeState(enum.Enum):
    """A node's life in a round: its record there, moved only by :func:`move`. LOST is no node's own word: its
    lease ran out (etcd), or another node found its beat standing still and wrote it (c10d), before it ENDED."""

    RUNNING = "running"  # joined the round: its ranks run
    WAITING = "waiting"  # its ranks stopped on a failure: it waits for the round's record of the cause
    RETURNED = "returned"  # its ranks all returned: it waits for the other nodes' ends
    ENDED = "ended"  # done with the round
    LOST = "lost"


# The counters a node in each state is entered in (a key a node under each, counted without being read): QUIET,
# every node whose ranks no longer run; DONE, those whose ranks ended. A node is entered in each once, by the
# move that first reaches a state that has it, so that a counter is a count of nodes.
COUNTERS = {NodeState.RUNNING: (), NodeState.WAITING: ("waiting", "quiet"),
            NodeState.RETURNED: ("returned", "quiet", "done"), NodeState.ENDED: ("ended", "quiet", "done"),
            NodeState.LOST: ("lost", "quiet", "done")}
_MOVES = {NodeState.RUNNING: {NodeState.WAITING, NodeState.RETURNED, NodeState.ENDED, NodeState.LOST},
          NodeState.WAITING: {NodeState.ENDED, NodeState.LOST},  # its ranks stopped: they return no more
          NodeState.RETURNED: {NodeState.ENDED, NodeState.LOST},  # a record after its return: it stays quiet
          NodeState.ENDED: set(), NodeState.LOST: set()}


def move(current: NodeState, target: NodeState) -> tuple[str, ...] | None:
    """The counters a node's move from ``current`` to ``target`` newly enters it in; None when it is no move (the
    same state again, or out of ENDED or LOST): nothing is written then. Only another node moves one to LOST."""
    if target not in _MOVES[current]:
        return None
    return tuple(c for c in COUNTERS[target] if c not in COUNTERS[current])


class Step(enum.Enum):
    """What a launcher that waits for a round's member list does next."""

    DECIDE = "decide"  # write the member list, created only if absent: the first writer wins
    LOOK = "look"  # look at the list (and now and then at the arrivals' count) again


class Outside(enum.Enum):
    """A launcher that came to a round already decided without it."""

    ADMIT = "admit"  # the round is below MAX: its nodes restart with this one (no restart count pays for it)
    SPARE = "spare"  # the round is full: wait, and take a lost node's place at the next round


def join_step(*, came: int, seen: int, since: float, now: float, look: float, low: int, high: int,
              last_call: float, expected: int | None = None) -> Step:
    """One launcher decides, by the arrival counter alone: the one whose arrival made ``MAX`` (``high``), or the last
    to come once ``MIN`` (``low``) came and nobody else for ``last_call`` seconds; the others too, once the count
    stood still for two looks, in case the last to come is gone. ``came``: how many had come with this launcher's
    arrival; ``seen``: how many have come, as last counted, ``since`` when that count last changed. ``expected``: a
    restarted round's, the launchers of the round before that live on (spares and newcomers included): once they all
    came, no last call is waited for a newcomer that may never come (one that comes later is admitted then)."""
    latest = came == seen  # the last to come: it times the last call
    if not (latest or now - since >= 2 * look):
        return Step.LOOK
    if seen >= min(high, high if expected is None else max(low, expected)) or (
            seen >= low and now - since >= last_call):
        return Step.DECIDE
    return Step.LOOK


def member_order(arrival: dict[str, object]) -> tuple[float, float, float]:
    """A launcher's place in the member list: its old node rank first (the last round's nodes keep their order, so the
    ranks are compacted when a node is gone), then its --node-rank (none: after those given), then when it came."""
    old, rank, since = arrival.get("old"), arrival.get("rank"), arrival.get("since")
    return (float(old) if isinstance(old, int) else float("inf"),
            float(rank) if isinstance(rank, int) else float("inf"),
            float(since) if isinstance(since, (int, float)) else 0.0)


def holder(members: list[str], arrivals: dict[str, dict[str, object]], node_rank: int) -> int | None:
    """The place (node rank) in a decided round of the member that came to the job with ``--node-rank node_rank``,
    if one did: it holds that rank in every round after, until found lost. A member goes on to the next round without
    claiming again, so a twin that comes after a restart is told by the members' arrivals, each with its --node-rank."""
    return next((n for n, m in enumerate(members) if arrivals.get(m, {}).get("rank") == node_rank), None)


def outside(members: int, high: int) -> Outside:
    """A round of ``members`` nodes decided without this launcher, under ``--nnodes MIN:high``."""
    return Outside.ADMIT if members < high else Outside.SPARE


class Door(enum.Enum):
    """What becomes of a newcomer's admission (:data:`Outside.ADMIT`) to a round."""

    OPEN = "open"  # the admission is the round's record: its nodes restart with the newcomer
    RECORD = "record"  # the round has a record already: it ends anyway, and the newcomer comes to the next one
    FAILING = "failing"  # a node's ranks stopped on a failure: its record ends the round, the newcomer comes next
    CLOSED = "closed"  # a node's ranks had all returned: the job is ending, and the newcomer is not needed


def door(*, record: bool, waiting: bool, returned: bool) -> Door:
    """A newcomer's admission to a round with a ``record`` or not, a node ``waiting`` for the record of a failure or
    not, and a node whose ranks ``returned`` (its exit barrier) or not. The record comes first: the round ends with it
    whoever returned. A failure whose record is on its way comes next: an admission written first would stand as the
    round's record, and the failure would restart the group unreported, its restart not counted. Else a node that
    returned closes the door: a restart would run a finished job again. A backend decides it in one compare-and-set
    with the nodes' moves to WAITING and RETURNED, so that no node ends the job while another restarts it."""
    if record:
        return Door.RECORD
    if waiting:
        return Door.FAILING
    return Door.CLOSED if returned else Door.OPEN


@dataclass(frozen=True)
class Lost:
    """Nodes of a round found lost: ``beat``, they had beaten in it (their beat stood still, or their lease ran
    out); else they never beat in it within --timeout, nor ended it."""

    nodes: list[int]
    beat: bool = True


class RoundView(Protocol):
    """One look at a round, as the rules read it. A backend reads each value when it is first asked, and once: a
    rule that stops at the record costs one read, and a table test passes plain values."""

    @property
    def record(self) -> FailureRecord | None: ...  # the round's first failure, once written
    @property
    def busy(self) -> bool: ...  # another node still runs the round (neither waits, returned, ended nor is lost)
    @property
    def pending(self) -> bool: ...  # another node's ranks have not all returned, nor did it end or get lost
    @property
    def returned(self) -> dict[int, float]: ...  # the other nodes whose ranks all returned, and when (wall clock)
    @property
    def never_arrived(self) -> NeverArrived | None: ...  # the nodes whose ranks never came (round 0, node 0 asks)
    @property
    def arrived(self) -> int: ...  # the launchers that came to the round, spares and newcomers too (elastic)
    def waiting(self, nodes: set[int]) -> bool: ...  # every one of ``nodes`` waits for the record itself


class Wait(enum.Enum):
    """What a node whose ranks stopped on a failure does next, while it waits for the round's record."""

    RECORD = "record"  # the round's record is written: it stands
    EARLY_EXIT = "early exit"  # another node's ranks returned while ours waited for them: the record names one
    OURS = "ours"  # no node can tell better now: this node's report is the record (told again first, if it can)
    LOST = "lost"  # nodes were found lost: the record names them
    LOOK = "look"  # look again after a pause


def lost_nodes(heard: dict[int, float], now: float, *, grace: float, done: Collection[int] = ()) -> list[int]:
    """The one rule that finds nodes lost, on either backend: those not heard for ``grace`` or more on the looker's
    clock (``now``), that did not end the round (``done``). ``heard[n]``: when the looker last heard node ``n``. c10d:
    its beat moved, on a clock of beats (core/nodes/c10d_watch.py's ``Beats``: a looker or a store starved of CPU sees
    no beat move, and finds nobody lost), ``grace`` a few seconds of beats; or, for a node that never beat, when the
    looker began to wait, ``grace`` --timeout. etcd: ``now`` while its lease holds, ``-inf`` once it ran out (etcd
    applied the lease's TTL), and ``grace`` infinite: no timing alone finds a node lost there."""
    return sorted(n for n, at in heard.items() if now - at >= grace and n not in done)


def wait_step(view: RoundView, lost: Lost | None, *, culprits: set[int], early_exit: bool, retell: bool,
              waited: float, timeout: float, least: float) -> Wait:
    """The next step of a node whose ranks stopped on a failure, ``waited`` seconds into its wait.

    ``culprits``: the other nodes whose ranks this node's report blames (a hang or a mismatch seen through the
    collectives the nodes share): their own nodes tell them better, unless they wait too (then they see no better; with
    ``retell``, this node tells its report again once no node is busy, since each shared its collectives before it
    waited). ``early_exit``: this node's ranks waited in a collective for other nodes' ranks, so a node whose ranks
    returned meanwhile is the cause. A node whose ranks failed by itself writes the record after its teardown, which
    takes seconds on a loaded machine: so this node waits ``least`` seconds while any node is busy, and never past
    ``timeout`` (and ``lost``, the nodes found lost, ends it at once)."""
    if view.record is not None:
        return Wait.RECORD
    if early_exit and view.returned:
        return Wait.EARLY_EXIT
    if culprits and view.waiting(culprits) and not (retell and view.busy):
        return Wait.OURS
    if lost is not None:
        return Wait.LOST
    if waited > least and (waited > timeout or not view.busy):
        return Wait.OURS
    return Wait.LOOK


class Finish(enum.Enum):
    """What a node whose ranks all returned does next, while it waits for the other nodes' ends."""

    RECORD = "record"  # a record is written meanwhile: the round failed, on this node too
    DONE = "done"  # every other node's ranks returned, or it ended the round or was lost: the round went well
    LOOK = "look"


def finish_step(view: RoundView) -> Finish:
    """torchrun's exit barrier: ``pending`` is read before the record, since a node writes its record, then ends."""
    pending = view.pending
    if view.record is not None:
        return Finish.RECORD
    return Finish.LOOK if pending else Finish.DONE


class Unheard(enum.Enum):
    """What a node tells when the store that serves every round (c10d: node 0's) went before every node still in the
    round had read its record (or before one was written)."""

    KNOWN = "known"  # what this node settled on before the store went: no other node is left to tell otherwise
    RECORD = "record"  # the record its beat read: likewise
    OURS = "ours"  # its own failure, by itself, told first: likewise
    GONE = "gone"  # the store's loss first, the one line every node that could not hear the record tells alike


def unheard(*, others: bool, knew: bool, read: bool, by_itself: bool) -> Unheard:
    """``others``: another node lives (not the store's host, not found lost) that may not have heard the record, and
    tells the store's loss then, having nothing else to tell: so does this one, whatever it knows (what it saw
    follows that line). Alone, it tells what it knows: what it settled on (``knew``: the store went as it waited
    for the others to read the record), the record its beat ``read`` (unless its own rank failed ``by_itself``: the
    record was another node's word on it), else its own failure, else the store's loss."""
    if others:
        return Unheard.GONE
    if knew:
        return Unheard.KNOWN
    if read and not by_itself:
        return Unheard.RECORD
    return Unheard.OURS if by_itself else Unheard.GONE
