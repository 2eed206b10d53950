"""What a watcher sees of a job: one look, as plain typed values that cross processes and machines.

Owns: :class:`RankRow` (a rank now), :class:`Header` (the job), :class:`Snapshot` (one look: a header and a row a
rank, with ``to_json`` / ``from_json``; the JSON of ``mpddp top --json`` and of the dashboard), and :func:`part`,
:func:`read_part`: a node's part of the look as its beat shares it with the other nodes (its rows, when they were
computed, and its ranks' lags over the last minutes). Whatever is read from outside is validated at the door
(core/wire/typed.py). Leaves what a row says to core/launcher/live.py and its words to core/launcher/live_table.py.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..wire import typed
from .board import LIVE_KEY


@dataclass(frozen=True)
class RankRow:
    """One rank, as a watcher sees it now."""

    rank: int
    node: int
    local_rank: int
    pid: int | None
    state: str  # starting, running, waiting (in a collective), done, failed, exited
    collectives: int  # collectives entered so far, every group
    per_second: float | None  # collectives a second since the last look
    last: str | None  # the last collective entered: ``#57 all_reduce``
    lag_ms: float | None  # the median of its arrival lags behind the first rank, at this node's last collectives
    straggler: bool
    cpu: float | None  # percent of one core
    rss: int | None  # bytes
    gpu: int | None = None  # physical id
    gpu_util: int | None = None  # percent
    gpu_mib: int | None = None  # memory used by its process (else the whole GPU's)
    line: str = ""  # the last line it wrote
    age: float = 0.0  # seconds from its node's computing it to the look (another node's: its share's age)


@dataclass(frozen=True)
class Header:
    """The job, as the launcher that answered sees it."""

    job: str
    round: int
    world_size: int
    nnodes: int
    max_nnodes: int  # an elastic job's MAX; the same as nnodes for a fixed one
    restarts: int
    elapsed: float  # seconds since this launcher started the job
    failure: str | None  # the job's first failure, once there is one
    node: int | None  # the node that answered (None: not placed yet)
    host: str
    spares: int | None = None  # launchers that came to the round without a place in it: spares, or newcomers
    # that its restart will admit (an elastic job; 0 on one node; None: not placed yet, or its store did not answer)


@dataclass(frozen=True)
class Snapshot:
    """One look at the job: every rank heard from, and the nodes not heard from yet (their rows come a second or
    two after the first look, with the next beats)."""

    header: Header
    ranks: tuple[RankRow, ...]
    missing: tuple[int, ...] = ()  # nodes of the round whose rows have not come
    taken: float = field(default_factory=time.time)

    @property
    def whole(self) -> bool:
        """Every node's rows are in, and every running rank's rates (a rate needs two looks a second apart)."""
        return not self.missing and all(r.per_second is not None and r.cpu is not None for r in self.ranks
                                        if r.state in ("running", "waiting"))

    def to_json(self) -> str:
        return json.dumps({"header": asdict(self.header), "ranks": [asdict(r) for r in self.ranks],
                           "missing": list(self.missing), "taken": self.taken})

    @classmethod
    def from_json(cls, text: str | bytes) -> Snapshot:
        """A launcher's answer, validated field by field (core/wire/typed.py): :class:`~mpddp.core.wire.typed.Malformed`
        in one line for any other shape; the fields this version does not know are left out (a newer mpddp's)."""
        data = typed.loads(text)
        if not isinstance(data, dict):
            raise typed.Malformed(f"a snapshot is a JSON object, not {type(data).__name__}")
        ranks, missing, taken = data.get("ranks"), data.get("missing", []), data.get("taken")
        if not isinstance(ranks, list) or not isinstance(missing, list):
            raise typed.Malformed("a snapshot's ranks and missing are lists")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in missing):
            raise typed.Malformed("a snapshot's missing are node ranks")
        if not isinstance(taken, (int, float)) or isinstance(taken, bool) or not math.isfinite(taken):
            raise typed.Malformed(f"taken={taken!r} is not a time")
        try:
            header = typed.fill(Header, data.get("header"))
        except typed.Malformed as e:
            raise typed.Malformed(f"header: {e}") from None
        return cls(header, tuple(_row(r) for r in ranks), tuple(missing), float(taken))


def _row(data: Any) -> RankRow:
    """A row from JSON, validated, keeping only the fields this version knows (another node may run a newer mpddp)."""
    try:
        return typed.fill(RankRow, data)
    except typed.Malformed as e:
        rank = data.get("rank") if isinstance(data, dict) else None
        raise typed.Malformed(f"rank {rank!r}'s row: {e}" if isinstance(rank, int) else f"a row: {e}") from None


@dataclass(frozen=True)
class Part:
    """A node's part of the job's look, as its beat shares it while someone watches: its rows, when they were
    computed (wall clock, s), and its ranks' lags over the last minutes, each as
    core/launcher/stragglers.py's :func:`~mpddp.core.launcher.stragglers.timeline` (node 0 of several: the nodes
    lined up too, marked ``"nodes": true``)."""

    taken: float
    rows: tuple[RankRow, ...]
    lags: tuple[dict[str, Any], ...] = ()

    def shared(self) -> dict[str, Any]:
        """The value under the board snapshot's :data:`~mpddp.core.launcher.board.LIVE_KEY`."""
        return {"taken": self.taken, "rows": [asdict(r) for r in self.rows], "lags": list(self.lags)}


def read_part(snapshot: bytes) -> Part | None:
    """A node's part from its board snapshot (another node's, read from the round's store): None where it has none
    (nobody watched it yet); :class:`~mpddp.core.wire.typed.Malformed` for any other shape (another mpddp's)."""
    data = typed.loads(snapshot)
    live = data.get(LIVE_KEY) if isinstance(data, dict) else None
    if live is None:
        return None
    if not isinstance(live, dict) or not isinstance(live.get("rows"), list) or not isinstance(live.get("lags"), list):
        raise typed.Malformed("a node's live part is an object of rows and lags")
    taken = live.get("taken")
    if not isinstance(taken, (int, float)) or isinstance(taken, bool) or not math.isfinite(taken):
        raise typed.Malformed(f"taken={taken!r} is not a time")
    return Part(float(taken), tuple(_row(r) for r in live["rows"]), tuple(_lags(t) for t in live["lags"]))


def _lags(data: Any) -> dict[str, Any]:
    """A timeline as stragglers.timeline makes it, checked: ranks of [seconds before, lag ms] points, the rank named."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def rank(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31

    ok = (isinstance(data, dict) and isinstance(data.get("ranks"), list) and number(data.get("span"))
          and all(isinstance(r, dict) and rank(r.get("rank")) and isinstance(r.get("points"), list)
                  and all(isinstance(p, list) and len(p) == 2 and all(map(number, p)) for p in r["points"])
                  for r in data["ranks"])
          and (data.get("named") is None or isinstance(data["named"], dict) and rank(data["named"].get("rank"))
               and number(data["named"].get("ago"))))
    if not ok:
        raise typed.Malformed("a node's lags are not a timeline")
    return {"span": data["span"], "ranks": data["ranks"], "named": data.get("named"),
            "nodes": data.get("nodes") is True}
