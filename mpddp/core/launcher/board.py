"""In the launcher: every rank's collectives lined up by number (what core/rank/recorder.py sends).

Owns: the board that lines the ranks' reports up by collective number: whether a rank moved (progress), whether it
waits for a collective that did not complete, two ranks that called different collectives at the same number (a
:class:`Mismatch`, told at once), and where each rank stands when the group hangs (:class:`Standing`):

    ranks 0, 2, 3 entered all_reduce #57 (float32[1000]) 12 s ago; rank 1 is still at #56 (all_reduce)

On several nodes each node's launcher shares its board's snapshot through the rendezvous, so that a hang report
names a rank on another node by collective too.
"""

from __future__ import annotations

import collections
import json
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..wire.protocol import Call, Collectives, Lane
from ..wire.stacks import ranks_named

_SAME_SHAPE = frozenset({"all_reduce", "allreduce", "broadcast", "reduce"})  # ops whose inputs match on every rank
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
_WINDOW = 512  # collectives per lane (group and backend) the board keeps to line ranks up
ARRIVALS = 32  # the default group's newest collectives whose last arrival on this node a snapshot carries
ARRIVALS_KEY = "~arrivals"  # their place in a snapshot, beside the ranks' numbers
LIVE_KEY = "~live"  # the node's live part while someone watches the job (core/launcher/live_snapshot.py)
_GRACE = 1.0  # seconds a differing row waits for its other members before the mismatch is told
# ... when those it has cannot name the odd one and a missing member said nothing since. The ranks are stuck in calls
# that differ meanwhile, so waiting costs nothing, and a tie told early goes to the highest rank: wrong when the odd
# one is lower. Beside a second suite (load 20 to 25) a rank's report came more than 5 s late, and was told without it.
_GRACE_MAX = 15.0



def render(call: Call) -> str:
    """``all_reduce #57 (float32[1000])``."""
    tensors = [f"{_DTYPES.get(d, d)}[{', '.join(map(str, s))}]" for s, d in zip(call.sizes, call.dtypes)]
    shown = ", ".join(tensors[:2]) + (f" and {len(tensors) - 2} more" if len(tensors) > 2 else "")
    group = "" if call.group == "0" else f" in group {call.group}"
    return f"{call.op} #{call.seq}{group}" + (f" ({shown})" if shown else "")


@dataclass
class Seen:
    """The launcher's copy of one rank's flight recorder."""

    last: dict[Lane, Call] = field(default_factory=dict)  # per lane, the latest collective it entered
    completed: dict[Lane, int] = field(default_factory=dict)  # per lane, the op_id of the last op completed
    reports: int = 0  # one more with every report: the rank entered or completed a collective

    @property
    def pending(self) -> bool:
        """A collective it entered has not completed: its CPU, if it spins, waits for it."""
        return any(self.open(lane) for lane in self.last)

    def open(self, lane: Lane) -> bool:
        """Its last collective in ``lane`` has not completed (op_ids: the status counts point-to-point ops too)."""
        call = self.last.get(lane)
        return call is not None and call.op_id > self.completed.get(lane, -1)


@dataclass(frozen=True)
class Mismatch:
    """Two ranks called different collectives at the same number: every rank must call the same, in order."""

    calls: dict[int, Call]  # rank -> what it called at that number
    odd: int  # the rank whose call differs from the most others' (on a tie, the highest)
    after: float = 0.0  # seen only once the group made no progress for this long (ranks on different nodes)


@dataclass(frozen=True)
class Standing:
    """Where the ranks stand in one process group: the furthest collective, and who is behind it."""

    top: Call  # the furthest collective any rank entered
    ahead: tuple[int, ...]  # ranks that entered it
    behind: dict[int, Call | None]  # rank -> its last collective in the group (None: none yet)
    open: tuple[int, ...]  # ranks of ``ahead`` on which it has not completed


class Board:
    """Every local rank's collectives, lined up by number: mismatches at once, complete rows for stragglers."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = tuple(ranks)  # this node's ranks: every one of them is in the default group
        self.seen: dict[int, Seen] = {}
        self.mismatch: Mismatch | None = None
        self._rows: dict[tuple[Lane, int], dict[int, Call]] = {}
        self._members: dict[Lane, set[int]] = {}  # the default group: every rank; others: those seen
        # rows that differ, not yet complete: since when, and the ranks seen in another lane's collective since
        self._suspects: dict[tuple[Lane, int], tuple[float, set[int]]] = {}
        self._done: list[dict[int, Call]] = []  # rows every member has reached, not yet taken
        # the default group's collectives: each rank's arrival at a number until all of this node's came, then
        # the last of them (lane, number, its arrival, its rank), for node 0 to line the nodes up (stragglers.py)
        self._latest: dict[tuple[Lane, int], dict[int, int]] = {}
        self.arrivals: collections.deque[tuple[Lane, int, int, int]] = collections.deque(maxlen=ARRIVALS)
        self._version = self._shared = 0  # reports added; the count at the last snapshot
        # add() runs in the watch (the main thread), snapshot() in the round watch's thread: a snapshot taken
        # inside add() marked the report shared before its call was on the board (the other nodes never saw it)
        self._lock = threading.Lock()

    def add(self, rank: int, report: Collectives) -> None:
        with self._lock:
            self._add(rank, report)

    def _add(self, rank: int, report: Collectives) -> None:
        seen = self.seen.setdefault(rank, Seen())
        seen.reports += 1
        self._version += 1
        seen.completed.update(report.completed)
        for (lane, _), (_, elsewhere) in self._suspects.items():
            if any(call.lane != lane for call in report.calls):
                elsewhere.add(rank)  # it entered a collective of another group (or backend): it is not on its way
        for call in report.calls:
            if call.seq >= getattr(seen.last.get(call.lane), "seq", 0):
                seen.last[call.lane] = call
            members = self._members.setdefault(call.lane, set(self.ranks) if call.group == "0" else set())
            members.add(rank)
            key = (call.lane, call.seq)
            row = self._rows.setdefault(key, {})
            row.setdefault(rank, call)  # a rank's call at a number is what it first said
            if call.group == "0":
                self._arrived(key, rank, call.entered)
            complete = len(row) == len(members) and len(row) > 1
            if self.mismatch is None and (odd := _differs(row)) is not None:
                if complete:  # every member's call is known: the odd one out is the one most others disagree with
                    self.mismatch = Mismatch(dict(row), odd)
                elif key not in self._suspects:
                    self._suspects[key] = (time.monotonic(), set())
            if complete:
                self._done.append(self._rows.pop(key))
                self._suspects.pop(key, None)
        if len(self._rows) > 2 * _WINDOW:
            self._prune()
        if len(self._latest) > 2 * _WINDOW:  # a rank's reader missed some: they never fill
            for key in sorted(self._latest, key=lambda k: k[1])[:_WINDOW]:
                del self._latest[key]

    def _arrived(self, key: tuple[Lane, int], rank: int, entered: int) -> None:
        got = self._latest.setdefault(key, {})
        got.setdefault(rank, entered)
        if len(got) == len(self.ranks):
            del self._latest[key]
            last = max(got, key=lambda r: (got[r], r))
            self.arrivals.append((key[0], key[1], got[last], last))

    def found(self, now: float) -> Mismatch | None:
        """The mismatch, once the row's every member has reported, or once the members it lacks cannot change it.

        A member that never reports the row hangs elsewhere: after :data:`_GRACE` seconds the mismatch is
        told with the ranks there are, when their calls already name the odd one (a majority of all members
        agree) or every missing member has entered a collective of another lane since (it is elsewhere). A
        report of this lane's earlier collectives, entered or completed, is no such sign: the rank may be
        between two calls, on its way to this row (its reader's last report can arrive after the row's first).
        Else a missing member's report may only be late (its reader starved on a loaded machine) and could
        break a tie: it is waited for up to :data:`_GRACE_MAX` seconds.
        """
        if self.mismatch is None:
            for key, (since, elsewhere) in self._suspects.items():
                row = self._rows.get(key)
                if not row or now - since < _GRACE or (odd := _differs(row)) is None:
                    continue
                if now - since >= _GRACE_MAX or self._settled(key, row, elsewhere):
                    self.mismatch = Mismatch(dict(row), odd)
                    break
        return self.mismatch

    def _settled(self, key: tuple[Lane, int], row: dict[int, Call], elsewhere: set[int]) -> bool:
        """Whether the members missing from ``row`` cannot change its odd one out."""
        members = self._members.get(key[0], set())
        signatures = [_signature(call) for call in row.values()]
        if max(signatures.count(s) for s in signatures) * 2 > len(members):
            return True
        return members - row.keys() <= elsewhere

    def snapshot(self, whole: bool = False, live: Any = None) -> bytes | None:
        """This node's ranks' last collective per lane and how far each completed, for the other nodes (JSON);
        None when nothing moved since the last snapshot, unless ``whole``. ``live``: the node's live rows, beside."""
        with self._lock:
            if self._version == self._shared and not whole:
                return None
            self._shared = self._version
            ranks: dict[str, Any] = {
                str(r): {"last": [[*c.lane, c.seq, c.op, c.sizes, c.dtypes, c.entered, c.op_id]
                                  for c in s.last.values()],
                         "completed": [[*lane, n] for lane, n in s.completed.items()]}
                for r, s in self.seen.items()}
            ranks[ARRIVALS_KEY] = [[*lane, seq, entered, rank] for lane, seq, entered, rank in self.arrivals]
            if live is not None:
                ranks[LIVE_KEY] = live
            return json.dumps(ranks, separators=(",", ":")).encode()

    def lasts(self, rank: int) -> tuple[list[Call], bool]:
        """Rank ``rank``'s last collective per lane, and whether one it entered is still open (from any thread)."""
        with self._lock:
            seen = self.seen.get(rank)
            return ([*seen.last.values()], seen.pending) if seen is not None else ([], False)

    def joined(self, snapshots: Iterable[bytes], ranks: Iterable[int]) -> Board:
        """A board of every node's ranks (``ranks``: the whole world): this node's, and the other nodes'
        :meth:`snapshot` (read from node 0's store), for a hang report that covers them all."""
        board = Board(ranks)
        board.seen = dict(self.seen)
        for snapshot in snapshots:
            try:
                ranks_seen = json.loads(snapshot)
                ranks_seen.pop(ARRIVALS_KEY, None)
                ranks_seen.pop(LIVE_KEY, None)
                for rank, data in ranks_seen.items():
                    seen = Seen(completed={(g, b, int(n)): int(c) for g, b, n, c in data["completed"]})
                    for g, b, gen, seq, op, sizes, dtypes, entered, op_id in data["last"]:
                        call = Call(g, int(seq), op, tuple(tuple(s) for s in sizes), tuple(dtypes), int(entered), b,
                                    int(gen), int(op_id))
                        seen.last[call.lane] = call
                    board.seen[int(rank)] = seen
            except (ValueError, KeyError, TypeError):
                continue  # a node's snapshot from another mpddp version: its ranks are left out
        for seen_rank, seen in board.seen.items():
            for lane in seen.last:
                board._members.setdefault(lane, set(board.ranks) if lane[0] == "0" else set()).add(seen_rank)
        return board

    def crossed(self) -> Mismatch | None:
        """Two ranks whose last collectives in one group have the same number but differ, on a board
        :meth:`joined` from every node's: ranks on different nodes are lined up only there, when the group
        stops (each node's own board sees its own ranks' rows as they come)."""
        for lane in {lane for seen in self.seen.values() for lane in seen.last}:
            rows: dict[int, dict[int, Call]] = {}
            for rank, seen in sorted(self.seen.items()):
                if (call := seen.last.get(lane)) is not None:
                    rows.setdefault(call.seq, {})[rank] = call
            for row in rows.values():
                if (odd := _differs(row)) is not None:
                    return Mismatch(row, odd)
        return None

    def take(self) -> list[dict[int, Call]]:
        """Rows (rank -> Call at one number) that every member of their group has reached, once each."""
        done, self._done = self._done, []
        return done

    def _prune(self) -> None:
        """Drop rows far behind the newest: a rank's reader missed them (its buffer turned over), they never fill."""
        newest: dict[Lane, int] = {}
        for seen in self.seen.values():
            for lane, call in seen.last.items():
                newest[lane] = max(newest.get(lane, 0), call.seq)
        for key in [k for k in self._rows if k[1] < newest.get(k[0], 0) - _WINDOW]:
            del self._rows[key]
            self._suspects.pop(key, None)

    def standings(self, ranks: Iterable[int]) -> list[Standing]:
        """Per process group, where ``ranks`` stand (default group first); groups where all agree and completed
        are left out unless no group has anything to say, in which case the default group is told."""
        ranks = list(ranks)
        out = []
        for lane in sorted({g for s in self.seen.values() for g in s.last}, key=lambda g: (g[0] != "0", g)):
            members = [r for r in ranks if r in self._members.get(lane, ())] or ranks
            lasts = {r: self.seen[r].last.get(lane) if r in self.seen else None for r in members}
            top = max((c for c in lasts.values() if c is not None), key=lambda c: (c.seq, -c.entered))
            ahead = tuple(r for r, c in lasts.items() if c is not None and c.seq == top.seq)
            first = min((c for r in ahead if (c := lasts[r]) is not None), key=lambda c: c.entered)
            open_ = tuple(r for r in ahead if self.seen[r].open(lane))
            behind = {r: c for r, c in lasts.items() if r not in ahead}
            out.append(Standing(first, ahead, behind, open_))
        told = [s for s in out if s.behind or s.open]
        return told or out[:1]


def _differs(row: dict[int, Call]) -> int | None:
    """The odd rank out when the ranks of one row called different collectives, else None."""
    shapes = {rank: _signature(call) for rank, call in row.items()}
    if len(set(shapes.values())) < 2:
        return None
    counts = {s: list(shapes.values()).count(s) for s in shapes.values()}
    return max(shapes, key=lambda r: (-counts[shapes[r]], r))


def _signature(call: Call) -> tuple[Any, ...]:
    """What must be equal on every rank: the op, and for ops whose inputs match everywhere, each input's number
    of elements and type (torch asks no more: a broadcast into a buffer of another shape and as many elements
    works)."""
    if call.op not in _SAME_SHAPE:
        return (call.op,)
    return call.op, tuple(math.prod(s) for s in call.sizes), call.dtypes


def standing_rows(standings: list[Standing], now_ns: int) -> list[str]:
    """One line per group: ``ranks 0, 2 entered all_reduce #57 (float32[1000]) 12 s ago; rank 1 is still at
    #56 (all_reduce)``."""
    rows = []
    for s in standings:
        ago = _ago(now_ns - s.top.entered)
        head = f"{ranks_named(s.ahead)} entered {render(s.top)} {ago} ago"
        if s.behind:
            at = {r: f"is still at #{c.seq} ({c.op})" if c is not None else "has entered none yet"
                  for r, c in s.behind.items()}
            if len(set(at.values())) == 1:
                phrase = next(iter(at.values()))
                if len(at) > 1:
                    phrase = phrase.replace("is still", "are still", 1).replace("has entered", "have entered", 1)
                still = f"{ranks_named(at)} {phrase}"
            else:
                still = ", ".join(f"{ranks_named([r])} {w}" for r, w in at.items())
            rows.append(f"{head}; {still}: {'it is' if len(s.behind) == 1 else 'they are'} the one"
                        f"{'' if len(s.behind) == 1 else 's'} to look at")
        elif s.open:
            rows.append(f"{head}, and it has not completed on {ranks_named(s.open)}")
        else:
            rows.append(f"{head}, and it completed on every rank: what they wait for now is not in the recorder "
                        "(point-to-point ops, monitored_barrier): see where each rank is")
    return rows


def unseen(mismatch: Mismatch, world_size: int) -> frozenset[int]:
    """The default group's ranks whose call at the mismatch's number was not seen (another node's, in a snapshot
    older than their call): what they called could outvote the rank named odd."""
    calls = mismatch.calls
    group = next(iter(calls.values())).group if calls else ""
    return frozenset(range(world_size)) - set(calls) if group == "0" else frozenset()


def mismatch_line(m: Mismatch) -> str:
    """``rank 0 called all_reduce #5 (float32[1000]) while rank 1 called broadcast #5 (float32[10])``."""
    odd = m.calls[m.odd]
    others: dict[str, list[int]] = {}
    for rank, call in sorted(m.calls.items()):
        if rank != m.odd and _signature(call) != _signature(odd):
            others.setdefault(render(call), []).append(rank)
    told = " and ".join(f"{ranks_named(r)} called {text}" for text, r in others.items())
    return f"{told} while {ranks_named([m.odd])} called {render(odd)}"


def _ago(ns: int) -> str:
    seconds = max(ns, 0) / 1e9
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def arrivals(snapshot: bytes) -> list[tuple[Lane, int, int, int]]:
    """A node's :meth:`Board.snapshot`'s last arrivals (lane, number, arrival, rank); [] from another version."""
    try:
        return [((g, b, int(gen)), int(seq), int(entered), int(rank))
                for g, b, gen, seq, entered, rank in json.loads(snapshot).get(ARRIVALS_KEY, [])]
    except (ValueError, TypeError, AttributeError):
        return []
