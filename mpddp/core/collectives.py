"""Which collective each rank has reached: torch's flight recorder, on in every rank and read while it runs.

Owns: turning the flight recorder on (``TORCH_FR_BUFFER_SIZE``, unless the
user set it or its older NCCL name), the reader thread in each rank that
sends the launcher every collective the rank entered since its last report
and how far each process group completed
(:class:`~mpddp.core.protocol.Collectives`), and in the launcher the board
that lines the ranks' reports up by collective number: whether a rank moved
(progress), whether it waits for a collective that did not complete, two
ranks that called different collectives at the same number (a mismatch, told
at once), and where each rank stands when the group hangs:

    ranks 0, 2, 3 entered all_reduce #57 (float32[1000]) 12 s ago; rank 1 is still at #56 (all_reduce)

Why the flight recorder: it is PyTorch's own record of the collectives each
rank entered (DDP's bucket all_reduces too), numbered per process group, and
the same collective has the same number on every rank: so "which rank did not
arrive at #N" and "did they call the same thing at #N" are questions of
bookkeeping, not of guessing from stacks. Measured (torch 2.13, CPU, gloo):
reading its entries costs about 11 µs per entry kept, reading its status
(last entered and completed number per group) about 10 µs in all. So the
buffer is small (:data:`BUFFER`), the entries are read only when the status
changed, and no more often than keeps the reader under 0.5 % of a core.
On several nodes each node's launcher shares its board's snapshot through
node 0's store (core/rounds.py), so that a hang report names a rank on
another node by collective too.
Leaves the arrival lags and stragglers to core/stragglers.py, deciding that
the group hangs to core/watchdog.py, and the report's wording to
core/report.py.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .protocol import Call, Collectives

ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the recorder's size; the second is its older name
BUFFER = 64  # entries kept per rank: 0.5 s of 128 collectives/s; more are sampled; reading costs grow with it
_INTERVAL = 0.5  # seconds between two reads, at least (a mismatch is told within about this)
_DUTY = 0.005  # the reader's share of one core, at most
_SAME_SHAPE = frozenset({"all_reduce", "allreduce", "broadcast", "reduce"})  # ops whose inputs match on every rank
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
_WINDOW = 512  # collectives per lane (group and backend) the board keeps to line ranks up


def env_defaults(env: dict[str, str]) -> None:
    """Turn the flight recorder on in the ranks' environment, unless the user chose its size (0: off).

    NCCL writes the recorder to files (``/tmp/nccl_trace_rank_N``) on a timeout or an error when it is on
    and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` allows: a launch must leave no file behind, and the launcher reports
    the same view itself, so mpddp's recorder comes with that off (a user who sets the size decides both).
    """
    if not any(name in env for name in ENV):
        env["TORCH_FR_BUFFER_SIZE"] = str(BUFFER)
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


# ---- in the rank -----------------------------------------------------------------------------

RUNNING: Reader | None = None  # this rank's reader, once started


class Reader:
    """In a rank: a daemon thread that reads the flight recorder and sends what changed.

    A CUDA build of torch keeps NCCL's collectives in a recorder of their own (``_dump_nccl_trace``),
    apart from the one other backends write to (``_dump_fr_trace``): both are read.
    """

    def __init__(self, dumps: list[Callable[..., bytes]], send: Callable[[Collectives], None]) -> None:
        self._dumps, self._send = dumps, send
        self._status: object = None
        self._sent: dict[tuple[str, str], int] = {}  # per lane, the last number sent
        self._backends: dict[tuple[int, str], str] = {}  # (recorder, group) -> the backend its entries name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpddp-collectives", daemon=True)
        self.busy = 0.0  # seconds spent reading and sending: its cost, which scripts/bench_train.py reports
        self.since = time.perf_counter()

    @classmethod
    def start(cls, send: Callable[[Collectives], None], environ: dict[str, str]) -> Reader | None:
        """A running reader, or None where this torch has no flight recorder or the user turned it off."""
        import torch

        c10d = torch._C._distributed_c10d
        dumps = [f for name in ("_dump_nccl_trace", "_dump_fr_trace") if (f := getattr(c10d, name, None)) is not None]
        size = next((environ[name] for name in ENV if name in environ), "0")
        if not dumps or not size.strip().isdigit() or int(size) <= 0:
            return None
        global RUNNING
        reader = RUNNING = cls(dumps, send)
        reader._thread.start()
        return reader

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        wait = _INTERVAL
        while not self._stop.wait(wait):
            started = time.perf_counter()
            try:
                report = self.read()
                if report is not None:
                    self._send(report)
            except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError):
                return  # the channel closed (the rank ends), or this torch's recorder differs: stop quietly
            took = time.perf_counter() - started
            self.busy += took
            wait = max(_INTERVAL, took / _DUTY)

    def read(self) -> Collectives | None:
        """What changed since the last read, or None: the status first (cheap), the entries only if it moved."""
        statuses = [self._load(dump, includeCollectives=False).get("pg_status") or {} for dump in self._dumps]
        if statuses == self._status:
            return None
        self._status = statuses
        calls: list[Call] = []
        completed: list[tuple[tuple[str, str], int]] = []
        for i, (dump, status) in enumerate(zip(self._dumps, statuses)):
            if not status:
                continue
            for entry in self._load(dump, includeCollectives=True).get("entries", ()):
                lane, seq = _lane(entry), entry.get("collective_seq_id") or 0
                if lane is None or seq <= 0:
                    continue  # point-to-point ops are numbered apart
                self._backends[(i, lane[0])] = lane[1]
                if seq > self._sent.get(lane, 0):  # only what is new becomes a Call: the reader runs in the rank
                    calls.append(_call(entry, lane, seq))
            completed += [((str(g), self._backends.get((i, str(g)), "")), int(s.get("last_completed_collective", -1)))
                          for g, s in status.items()]
        for c in calls:
            self._sent[c.lane] = max(self._sent.get(c.lane, 0), c.seq)
        return Collectives(tuple(calls), tuple(completed))

    @staticmethod
    def _load(dump: Callable[..., bytes], **what: bool) -> dict[str, Any]:
        loaded = pickle.loads(dump(includeStackTraces=False, onlyActive=False, **what))
        return loaded if isinstance(loaded, dict) else {}


def _lane(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(process group, backend) of a flight-recorder entry; None for a point-to-point op."""
    if entry.get("is_p2p"):
        return None
    group = entry.get("process_group") or ("?",)
    return str(group[0]), str(entry.get("profiling_name", "?")).rpartition(":")[0]


def _call(entry: dict[str, Any], lane: tuple[str, str], seq: int) -> Call:
    """One flight-recorder entry as a :class:`Call`."""
    return Call(group=lane[0], seq=int(seq), op=str(entry.get("profiling_name", "?")).rpartition(":")[2],
                sizes=tuple(tuple(int(n) for n in s) for s in entry.get("input_sizes") or ()),
                dtypes=tuple(str(d) for d in entry.get("input_dtypes") or ()),
                entered=int(entry.get("time_created_ns") or 0), backend=lane[1])


# ---- in the launcher --------------------------------------------------------------------------


def render(call: Call) -> str:
    """``all_reduce #57 (float32[1000])``."""
    tensors = [f"{_DTYPES.get(d, d)}[{', '.join(map(str, s))}]" for s, d in zip(call.sizes, call.dtypes)]
    shown = ", ".join(tensors[:2]) + (f" and {len(tensors) - 2} more" if len(tensors) > 2 else "")
    group = "" if call.group == "0" else f" in group {call.group}"
    return f"{call.op} #{call.seq}{group}" + (f" ({shown})" if shown else "")


@dataclass
class Seen:
    """The launcher's copy of one rank's flight recorder."""

    last: dict[tuple[str, str], Call] = field(default_factory=dict)  # per lane, the latest collective it entered
    completed: dict[tuple[str, str], int] = field(default_factory=dict)  # per lane, the last number completed
    reports: int = 0  # one more with every report: the rank entered or completed a collective

    @property
    def pending(self) -> bool:
        """A collective it entered has not completed: its CPU, if it spins, waits for it."""
        return any(c.seq > self.completed.get(lane, -1) for lane, c in self.last.items())


@dataclass(frozen=True)
class Mismatch:
    """Two ranks called different collectives at the same number: every rank must call the same, in order."""

    calls: dict[int, Call]  # rank -> what it called at that number
    odd: int  # the rank whose call differs from the most others' (on a tie, the highest)


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
        self._rows: dict[tuple[tuple[str, str], int], dict[int, Call]] = {}
        self._members: dict[tuple[str, str], set[int]] = {}  # the default group: every rank; others: those seen
        self._done: list[dict[int, Call]] = []  # rows every member has reached, not yet taken
        self._version = self._shared = 0  # reports added; the count at the last snapshot

    def add(self, rank: int, report: Collectives) -> None:
        seen = self.seen.setdefault(rank, Seen())
        seen.reports += 1
        self._version += 1
        seen.completed.update(report.completed)
        for call in report.calls:
            if call.seq >= getattr(seen.last.get(call.lane), "seq", 0):
                seen.last[call.lane] = call
            members = self._members.setdefault(call.lane, set(self.ranks) if call.group == "0" else set())
            members.add(rank)
            key = (call.lane, call.seq)
            row = self._rows.setdefault(key, {})
            row[rank] = call
            if self.mismatch is None and (odd := _differs(row)) is not None:
                self.mismatch = Mismatch(dict(row), odd)
            if len(row) == len(members) and len(row) > 1:
                self._done.append(self._rows.pop(key))
        if len(self._rows) > 2 * _WINDOW:
            self._prune()

    def snapshot(self) -> bytes | None:
        """This node's ranks' last collective per lane and how far each completed, for the other nodes (JSON);
        None when nothing moved since the last snapshot."""
        if self._version == self._shared:
            return None
        self._shared = self._version
        return json.dumps({str(r): {"last": [[*c.lane, c.seq, c.op, c.sizes, c.dtypes, c.entered]
                                             for c in s.last.values()],
                                    "completed": [[*lane, n] for lane, n in s.completed.items()]}
                           for r, s in self.seen.items()}, separators=(",", ":")).encode()

    def joined(self, snapshots: Iterable[bytes], ranks: Iterable[int]) -> Board:
        """A board of every node's ranks (``ranks``: the whole world): this node's, and the other nodes'
        :meth:`snapshot` (read from node 0's store), for a hang report that covers them all."""
        board = Board(ranks)
        board.seen = dict(self.seen)
        for snapshot in snapshots:
            try:
                ranks_seen = json.loads(snapshot)
                for rank, data in ranks_seen.items():
                    seen = Seen(completed={(g, b): int(n) for g, b, n in data["completed"]})
                    for g, b, seq, op, sizes, dtypes, entered in data["last"]:
                        seen.last[(g, b)] = Call(g, int(seq), op, tuple(tuple(s) for s in sizes), tuple(dtypes),
                                                 int(entered), b)
                    board.seen[int(rank)] = seen
            except (ValueError, KeyError, TypeError):
                continue  # a node's snapshot from another mpddp version: its ranks are left out
        for seen_rank, seen in board.seen.items():
            for lane in seen.last:
                board._members.setdefault(lane, set(board.ranks) if lane[0] == "0" else set()).add(seen_rank)
        return board

    def take(self) -> list[dict[int, Call]]:
        """Rows (rank -> Call at one number) that every member of their group has reached, once each."""
        done, self._done = self._done, []
        return done

    def _prune(self) -> None:
        """Drop rows far behind the newest: a rank's reader missed them (its buffer turned over), they never fill."""
        newest: dict[tuple[str, str], int] = {}
        for seen in self.seen.values():
            for lane, call in seen.last.items():
                newest[lane] = max(newest.get(lane, 0), call.seq)
        for key in [k for k in self._rows if k[1] < newest.get(k[0], 0) - _WINDOW]:
            del self._rows[key]

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
            open_ = tuple(r for r in ahead if self.seen[r].completed.get(lane, -1) < top.seq)
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
    """What must be equal on every rank: the op, and for ops whose inputs match everywhere, shapes and types."""
    return (call.op, call.sizes, call.dtypes) if call.op in _SAME_SHAPE else (call.op,)


def standing_rows(standings: list[Standing], now_ns: int) -> list[str]:
    """One line per group: ``ranks 0, 2 entered all_reduce #57 (float32[1000]) 12 s ago; rank 1 is still at
    #56 (all_reduce)``."""
    rows = []
    for s in standings:
        ago = _ago(now_ns - s.top.entered)
        head = f"{_ranks(s.ahead)} entered {render(s.top)} {ago} ago"
        if s.behind:
            where = [f"#{c.seq} ({c.op})" if c is not None else "no collective yet" for c in s.behind.values()]
            verb = "is" if len(s.behind) == 1 else "are"
            still = ", ".join(f"{_ranks([r])} at {w}" for r, w in zip(s.behind, where)) if len(set(where)) > 1 \
                else f"{_ranks(list(s.behind))} {verb} still at {where[0]}"
            rows.append(f"{head}; {still}: {'it is' if len(s.behind) == 1 else 'they are'} the one"
                        f"{'' if len(s.behind) == 1 else 's'} to look at")
        elif s.open:
            rows.append(f"{head}, and it has not completed on {_ranks(s.open)}")
        else:
            rows.append(f"{head}, and it completed: no rank is inside a collective")
    return rows


def mismatch_line(m: Mismatch) -> str:
    """``rank 0 called all_reduce #5 (float32[1000]) while rank 1 called broadcast #5 (float32[10])``."""
    odd = m.calls[m.odd]
    others: dict[str, list[int]] = {}
    for rank, call in sorted(m.calls.items()):
        if rank != m.odd and _signature(call) != _signature(odd):
            others.setdefault(render(call), []).append(rank)
    told = " and ".join(f"{_ranks(r)} called {text}" for text, r in others.items())
    return f"{told} while {_ranks([m.odd])} called {render(odd)}"


def _ago(ns: int) -> str:
    seconds = max(ns, 0) / 1e9
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
