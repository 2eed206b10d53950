"""Stragglers: the rank the others wait for, told by the order in which the ranks reach the same collectives.

Owns: each rank's lag at every collective all of this node's ranks reached (its arrival minus the first rank's, from
the flight recorder's times, core/launcher/board.py), the rule that names a straggler while the job runs, the summary
and the ``-v`` table at the end, and the ``--timeline FILE.png`` picture. Why arrival order, not step times: DDP's
all_reduce makes every rank's step equally long (the fast ranks wait inside it); the rank that enters the same
collective last, again and again, is the one the others wait for.

The rule: over its last :data:`WINDOW` collectives (at least :data:`MIN_SAMPLES`), the rank's *median* lag is above
:data:`MIN_LAG` and above :data:`STEP_SHARE` of a step, and it arrived last at :data:`LAST_SHARE` of them. The
median, so that a few hiccups (a garbage collection, a checkpoint) never name a rank; the floor keeps scheduler noise
out; the share of a step keeps out a lag that costs nothing (20 ms in a 10 s step); the share of last arrivals keeps
out two ranks late in turn. A step is estimated from the arrivals: its collectives come in a burst (DDP's buckets).
It is said once per job, with where the straggler's stack was while the others waited.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...log import logger
from ..wire.protocol import Call, Lane
from .board import arrivals as snapshot_arrivals

Arrival = tuple[Lane, int, int, int]  # (lane, number, the last arrival among a node's ranks in ns, its rank)

WINDOW = 100  # collectives per rank the rule looks at
MIN_SAMPLES = 50  # no verdict before this many
MIN_LAG = 0.020  # seconds: a median lag below this is noise
STEP_SHARE = 0.10  # ... and below this share of a step costs too little to tell
LAST_SHARE = 0.75  # ... and the rank must be the last to arrive this often (two ranks late in turn are not)
_BURST_GAP = 0.005  # seconds: a gap this long (and 4 times the typical one) starts a new step's burst
_POINTS = 100_000  # arrivals kept for the timeline (halved, every other one, when full)
SAMPLES = 5  # stack samples of a straggler, taken while the others wait
LOOK = 2.0  # seconds between node 0's reads of every node's arrivals (several nodes)
_POINTS_FED = 1024  # numbers a lane node 0 keeps behind its newest: waiting for every node, or fed
SPAN = 120.0  # seconds of lags a live timeline shows (the dashboard's)
BUCKETS = 240  # a rank's points over SPAN at most: each keeps the largest lag of its half second (the straggler's)
LATE = 30.0  # seconds: a point older than the newest by this much ends the look back (they come in rough order)


@dataclass(frozen=True)
class RankLag:
    """One rank's lags at collectives, for the summary and the table."""

    rank: int
    count: int
    mean: float  # seconds
    median: float
    p90: float
    last_share: float  # the share of collectives it reached last


@dataclass(frozen=True)
class Summary:
    """The run's arrivals at collectives; ``straggler`` is the rank named, if any."""

    collectives: int
    ranks: tuple[RankLag, ...]
    straggler: int | None
    step: float | None  # seconds, estimated
    scope: str = ""  # "" for the whole job; else whose ranks it covers ("node 1's ranks")
    nodes: int = 1  # the nodes it lines up (node 0 of several: each node's last arrival at every collective)


@dataclass
class Stragglers:
    """Arrival lags per rank, fed with complete rows (rank -> Call at one collective number)."""

    window: dict[int, collections.deque[float]] = field(default_factory=dict)
    lasts: dict[int, collections.deque[bool]] = field(default_factory=dict)  # per rank: was it the last, each row
    all_lags: dict[int, list[float]] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # rank -> collectives it reached last
    rows: int = 0
    points: list[tuple[float, int, float]] = field(default_factory=list)  # (arrival s, rank, lag s), timeline
    told: int | None = None  # the rank named as straggler
    told_at: float | None = None  # wall clock, s
    scope: str = ""  # whose ranks these are where they are not the whole job's: "node 1's ranks" (said in the lines)
    # (lane, number, first arrival in s) of the newest collectives, for the step's estimate
    _arrivals: collections.deque[tuple[Lane, int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=4 * WINDOW))

    def add(self, rows: list[dict[int, Call]], timed: bool = True) -> None:
        """Complete rows; ``timed``: their arrivals also time the step (a caller that sees only some of the
        numbers passes False and gives the step's arrivals to :meth:`arrived`)."""
        for row in rows:
            first = min(c.entered for c in row.values())
            latest = max(row, key=lambda r: (row[r].entered, r))
            self.rows += 1
            self.last[latest] = self.last.get(latest, 0) + 1
            for rank, call in row.items():
                lag = (call.entered - first) / 1e9
                self.window.setdefault(rank, collections.deque(maxlen=WINDOW)).append(lag)
                self.lasts.setdefault(rank, collections.deque(maxlen=WINDOW)).append(rank == latest)
                self.all_lags.setdefault(rank, []).append(lag)
                self.points.append((first / 1e9, rank, lag))
            if timed:
                call = next(iter(row.values()))
                self.arrived(call.lane, call.seq, first / 1e9)
        if len(self.points) > _POINTS:
            self.points = self.points[::2]

    def arrived(self, lane: Lane, seq: int, at: float) -> None:
        """Collective ``seq`` of ``lane`` first reached at ``at`` (s): a point of the step's estimate."""
        self._arrivals.append((lane, seq, at))

    @property
    def step(self) -> float | None:
        """A training step, estimated from the arrivals: a step's collectives come in a burst (DDP's buckets in
        the backward pass), bursts a step apart; the median time between bursts, or between arrivals when they
        come evenly (one collective a step). Only numbers that follow each other count: where some are missing
        (another node's arrivals come in samples), the time across the hole is no gap between two collectives."""
        runs: list[list[float]] = []  # the arrival times of consecutive numbers of one lane
        previous: tuple[Lane, int] | None = None
        for lane, seq, at in sorted(self._arrivals):
            if previous != (lane, seq - 1):
                runs.append([])
            runs[-1].append(at)
            previous = (lane, seq)
        gaps = [[b - a for a, b in zip(times, times[1:])] for times in runs]
        if sum(map(len, gaps)) < 5:
            return None
        typical = statistics.median(g for run_gaps in gaps for g in run_gaps)
        between: list[float] = []  # from one burst's start to the next one's, within a run
        for times, run_gaps in zip(runs, gaps):
            starts = [t for t, gap in zip(times[1:], run_gaps) if gap > max(_BURST_GAP, 4 * typical)]
            between += [b - a for a, b in zip(starts, starts[1:])]
        return statistics.median(between) if len(between) >= 2 else typical

    def suspect(self) -> int | None:
        """The rank the rule names now (see the module's header), or None."""
        step = self.step or 0.0
        late = {rank: statistics.median(lags) for rank, lags in self.window.items() if len(lags) >= MIN_SAMPLES}
        over = {rank: lag for rank, lag in late.items() if lag > MIN_LAG and lag > STEP_SHARE * step
                and sum(self.lasts[rank]) >= LAST_SHARE * len(self.lasts[rank])}
        return max(over, key=lambda r: over[r]) if over else None

    def check(self, where: Callable[[int], list[str]]) -> None:
        """Name a straggler once, with where its stack was sampled (``where(rank)``: locations, one per sample)."""
        if self.told is not None or (rank := self.suspect()) is None:
            return
        self.told, self.told_at = rank, time.time()
        lags = list(self.window[rank])
        locations = [p for p in where(rank) if p]
        common = collections.Counter(locations).most_common(1)
        seen = (f"; while the others wait it is in {common[0][0]} ({common[0][1]} of {len(locations)} samples)"
                if common else "")
        step = f", a step takes about {_ms(self.step)}" if self.step else ""
        among = f" among {self.scope}" if self.scope else ""
        logger.warning("mpddp: rank %d is a straggler%s: it reaches collectives %s after the first rank (median of "
                       "its last %d; p90 %s%s)%s", rank, among, _ms(statistics.median(lags)), len(lags),
                       _ms(_p90(lags)), step, seen)

    def summary(self) -> Summary:
        ranks = tuple(RankLag(rank, len(lags), statistics.fmean(lags), statistics.median(lags), _p90(lags),
                              self.last.get(rank, 0) / max(self.rows, 1))
                      for rank, lags in sorted(self.all_lags.items()))
        return Summary(self.rows, ranks, self.told, self.step, self.scope)


@dataclass
class AcrossNodes:
    """Node 0 of several: the nodes lined up at the default group's collectives, a straggler named across them.

    Each node's snapshot (core/launcher/board.py, shared every beat) carries the last arrival among its ranks
    at each of its newest :data:`~mpddp.core.launcher.board.ARRIVALS` collectives, and which rank it was.
    Node 0 takes its own at every pass of its watch (it sees every number, and times the step with them) and
    every :data:`LOOK` seconds reads the others' (one batch), which come in samples a beat or a reader's read
    behind its own. A number every node reached is a row for :class:`Stragglers`, one arrival a node: the
    rank that arrives last on the last node, again and again, is the one the whole job waits for. Each node's
    own board names a straggler among its own ranks; this one names a rank of any node, from the wall clocks
    of their machines (NTP keeps them within a millisecond or two, below :data:`MIN_LAG`).
    """

    nnodes: int
    lags: Stragglers = field(default_factory=Stragglers)
    looked: float = 0.0  # time.monotonic() of the last look
    # (lane, number) -> rank -> its call: the numbers not every node was seen at yet, the newest _POINTS_FED
    _waiting: dict[tuple[Lane, int], dict[int, Call]] = field(default_factory=dict)
    _fed: set[tuple[Lane, int]] = field(default_factory=set)  # rows fed, the newest ones
    _own: dict[Lane, int] = field(default_factory=dict)  # this node's newest number taken, a lane

    def watch(self, mine: Iterable[Arrival], others: Callable[[], list[bytes]], now: float) -> None:
        """Every pass of node 0's watch: this node's arrivals; once every :data:`LOOK` s, the others' too
        (``others``: their last snapshots, read from the store)."""
        for lane, seq, entered, rank in mine:
            if seq > self._own.get(lane, -1):  # a node's arrivals come in order, each once
                self._own[lane] = seq
                self._waiting.setdefault((lane, seq), {})[rank] = _call(lane, seq, entered)
                self.lags.arrived(lane, seq, entered / 1e9)
        if now - self.looked < LOOK:
            return
        self.looked = now
        samples = [snapshot_arrivals(snapshot) for snapshot in others()]
        for lane, seq, entered, rank in (a for sample in samples for a in sample):
            if (lane, seq) not in self._fed:
                self._waiting.setdefault((lane, seq), {}).setdefault(rank, _call(lane, seq, entered))
        complete = sorted((key for key, row in self._waiting.items() if len(row) == self.nnodes), key=lambda k: k[1])
        rows = [self._waiting.pop(key) for key in complete]
        self._fed.update(complete)
        self._forget(samples)
        self.lags.add(rows, timed=False)
        self.lags.check(lambda rank: [])  # another node's rank: no stacks of it here

    def _forget(self, samples: list[list[Arrival]]) -> None:
        """Drop the numbers that can no longer complete: :data:`_POINTS_FED` behind their lane's newest, or below
        every other node's sample (a node's sample only moves on, and node 0 takes its own once)."""
        newest: dict[Lane, int] = {}
        for lane, seq in (*self._waiting, *self._fed):
            newest[lane] = max(seq, newest.get(lane, seq))
        keep = {lane: n - _POINTS_FED for lane, n in newest.items()}  # numbers above these stay
        for lane in keep:
            lowest = [min(seq for at, seq, _, _ in sample if at == lane) for sample in samples
                      if any(at == lane for at, _, _, _ in sample)]
            if len(lowest) == self.nnodes - 1:  # every other node sampled this lane
                keep[lane] = max(keep[lane], min(lowest) - 1)
        self._waiting = {key: row for key, row in self._waiting.items() if key[1] > keep[key[0]]}
        self._fed = {key for key in self._fed if key[1] > keep[key[0]]}


def _call(lane: Lane, seq: int, entered: int) -> Call:
    return Call(lane[0], seq, "", (), (), entered, lane[1], lane[2])


def timeline(points: Sequence[tuple[float, int, float]], told: int | None, told_at: float | None, now: float,
             span: float = SPAN, buckets: int = BUCKETS) -> dict[str, Any]:
    """Each rank's arrival lags (ms) over the last ``span`` s, as ``[seconds before now, lag]``, at most ``buckets``
    a rank: the largest of each slice, so that a straggler stays on top; and the straggler named, if in the span.
    Reads the newest points first and stops :data:`LATE` s before the span (pure; ``points`` as
    :class:`Stragglers` keeps them: (arrival s, rank, lag s), in rough time order). The live form of
    ``--timeline``'s picture, for the dashboard (core/launcher/dashboard.py)."""
    start, width = now - span, span / buckets
    kept: dict[int, dict[int, float]] = {}
    for i in range(len(points) - 1, -1, -1):
        try:
            at, rank, lag = points[i]
        except IndexError:  # halved meanwhile (another thread keeps the list): what was read is the look
            break
        if at < start - LATE:
            break
        if start <= at <= now:
            slot = kept.setdefault(rank, {})
            b = min(int((at - start) / width), buckets - 1)
            slot[b] = max(slot.get(b, 0.0), lag * 1e3)
    ranks = [{"rank": rank, "points": [[round(start + (b + 0.5) * width - now, 2), round(lag, 3)]
                                       for b, lag in sorted(slots.items())]} for rank, slots in sorted(kept.items())]
    named = told is not None and told_at is not None and told_at >= start
    return {"span": span, "ranks": ranks,
            "named": {"rank": told, "ago": round((told_at or now) - now, 2)} if named else None}


def merged(parts: Sequence[tuple[float, dict[str, Any]]], now: float, span: float = SPAN) -> dict[str, Any]:
    """One timeline of the job from several (pure): ``parts`` as (wall time it was taken, :func:`timeline`), each
    node's, node 0's lined-up nodes first. Points are moved to ``now`` and kept within ``span``; a rank's points of
    two parts are joined; the straggler named is the first part's that names one (node 0's of the whole job)."""
    ranks: dict[int, list[list[float]]] = {}
    named = None
    for taken, part in parts:
        shift = min(0.0, taken - now)  # a part taken before now; a clock ahead of ours moves nothing
        for rank in part["ranks"]:
            kept = [[round(ago + shift, 2), lag] for ago, lag in rank["points"] if ago + shift >= -span]
            ranks.setdefault(rank["rank"], []).extend(kept)
        if named is None and part["named"] is not None and part["named"]["ago"] + shift >= -span:
            named = {"rank": part["named"]["rank"], "ago": round(part["named"]["ago"] + shift, 2)}
    return {"span": span, "ranks": [{"rank": r, "points": sorted(p)} for r, p in sorted(ranks.items()) if p],
            "named": named}


def summary_lines(summary: Summary, verbose: bool) -> list[str]:
    """The one line at the end of a run, and with ``verbose`` the table per rank."""
    if not summary.ranks:
        return []
    worst = max(summary.ranks, key=lambda r: r.median)
    across = (f"{summary.nodes} nodes (the last rank of each to arrive)" if summary.nodes > 1 else
              f"{summary.scope} only ({len(summary.ranks)} ranks)" if summary.scope else
              f"{len(summary.ranks)} ranks")
    head = f"mpddp: collectives: {summary.collectives:,} lined up across {across}; "
    if summary.straggler is not None:
        lag = next(r for r in summary.ranks if r.rank == summary.straggler)
        head += (f"rank {lag.rank} was the straggler: it arrived last at {lag.last_share:.0%} of them, median lag "
                 f"{_ms(lag.median)} (p90 {_ms(lag.p90)})")
    else:
        head += f"no straggler (the largest median lag: {_ms(worst.median)}, rank {worst.rank})"
    lines = [head]
    if verbose:
        lines.append("  rank  collectives  mean lag  median  p90     arrived last")
        lines += [f"  {r.rank:<4}  {r.count:<11,}  {_ms(r.mean):<8}  {_ms(r.median):<6}  {_ms(r.p90):<6}  "
                  f"{r.last_share:.0%}" for r in summary.ranks]
    return lines


def draw_timeline(stragglers: Stragglers, path: str) -> None:
    """Each rank's arrival lag at every collective over time, one colour per rank (matplotlib, off screen)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    start = min((p[0] for p in stragglers.points), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    for rank in sorted({p[1] for p in stragglers.points}):
        xs = [t - start for t, r, _ in stragglers.points if r == rank]
        ys = [lag * 1e3 for _, r, lag in stragglers.points if r == rank]
        ax.plot(xs, ys, ".", markersize=3, alpha=0.6, label=f"rank {rank}")
    if stragglers.told_at is not None:
        ax.axvline(stragglers.told_at - start, color="black", linestyle="--", linewidth=1,
                   label=f"rank {stragglers.told} named")
    ax.set_xlabel("seconds since the first collective")
    ax.set_ylabel("arrival lag (ms) after the first rank")
    ax.set_title("Arrival at each collective (torch's flight recorder): the straggler is the rank on top")
    ax.legend(loc="upper right", markerscale=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"
