"""Who is in a round of an elastic job (``--nnodes MIN:MAX``), decided the same way on every backend.

Owns: :func:`join_round`, core/nodes/rules.py's membership rules carried out over a backend's few keys (:class:`Keys`):
every launcher puts its arrival, the first to see the round complete writes its member list, created only if absent
(the first writer wins), and the list's order is the round's node ranks. A launcher that comes to a round already
decided without it has the group restart to admit it (below ``MAX``: a record of :data:`~mpddp.errors.Outcome.RESIZED`,
which no restart count pays for) or waits as a spare for the next round. Also :class:`RoundKeys`, those keys written
once over a backend's :class:`~mpddp.core.stores.kv.KV`; each backend's subclass adds what truly differs.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Protocol

from ...errors import ConfigError, TooFewNodes
from ...log import logger
from ..stores.clock import MACHINE, Clock
from ..stores.kv import KV
from ..wire.protocol import FailureRecord
from .api import NotNeeded, Records, Round, resized_record
from .rules import Outside, Step, join_step, member_order, outside

GAVE_UP = "gave_up"  # a round's "member list" written by the first launcher that waited --timeout: how many came


class Keys(Protocol):
    """What the rule needs of a backend's keys (etcd's, or node 0's store's)."""

    def arrive(self, attempt: int, me: str, arrival: str) -> int: ...  # how many had come, this one included
    def count(self, attempt: int) -> int: ...  # how many have come (one cheap operation: no arrival is read)
    def lived(self, attempt: int) -> int: ...  # how many came and were not found lost: one or two operations
    def arrivals(self, attempt: int) -> dict[str, str]: ...  # launcher id -> its arrival, for those still there
    def claim(self, attempt: int, node_rank: int, me: str) -> str | None: ...  # None, or who came first with it
    def decided(self, attempt: int) -> str | None: ...  # the member list, once written
    def await_decided(self, attempt: int, timeout: float) -> str | None: ...  # ... after a look of timeout
    def look(self, nodes: int) -> float: ...  # seconds between two looks of a waiting launcher
    def decide(self, attempt: int, members: str) -> bool: ...  # write it unless written: True if this one stands
    def admit(self, attempt: int, record: FailureRecord) -> None: ...  # the round's record, unless written
    def record(self, attempt: int) -> FailureRecord | None: ...
    def over(self, attempt: int, members: list[str]) -> bool: ...  # the job ended well without this launcher
    def alive(self, attempt: int, members: list[str]) -> bool: ...  # a member of the round is still there


class RoundKeys(Keys):
    """:class:`Keys` on a backend's ``kv``: a round's arrivals are entries under ``join/`` (put with the launcher's
    lease: etcd drops a lost one's), its member list is created only if absent, and the job's latest round is put
    beside it (``job``: a job-wide key's name in full). What differs is each backend's subclass: liveness
    (:meth:`lived`, :meth:`alive`, :meth:`over`), a ``--node-rank``'s claim, a newcomer's admission against the
    round's door (atomic in the backend's own way), and how often a waiting launcher looks: the Protocol's methods
    it leaves, which mypy asks of a subclass before it may be made."""

    link: Records  # the backend: the round's record is its own

    def __init__(self, kv: KV, key: Callable[[int, str], str], job: Callable[[str], str], clock: Clock) -> None:
        self.kv, self.key, self.job, self.clock = kv, key, job, clock

    def record(self, attempt: int) -> FailureRecord | None:
        return self.link.record(attempt)

    def arrive(self, attempt: int, me: str, arrival: str) -> int:
        return self.kv.enter(self.key(attempt, "join/"), me, arrival, leased=True)

    def count(self, attempt: int) -> int:
        return self.kv.count(self.key(attempt, "join/"))

    def arrivals(self, attempt: int) -> dict[str, str]:
        return {m: v.decode() for m, v in self.kv.under(self.key(attempt, "join/")).items()}

    def decided(self, attempt: int) -> str | None:
        found = self.kv.get(self.key(attempt, "members"))
        return None if found is None else found.decode()

    def await_decided(self, attempt: int, timeout: float) -> str | None:
        """The member list, once written: a look after ``timeout``. Not a wait on the key: a store's wait prints
        torch's warning when it times out, and etcd's HTTP gateway serves a few hundred watches at once (with a
        watch a waiting launcher, the leases' refreshes queued behind them: 256 simulated nodes, three ran out)."""
        self.clock.sleep(timeout)
        return self.decided(attempt)

    def decide(self, attempt: int, members: str) -> bool:
        if won := (self.kv.create(self.key(attempt, "members"), members) is None):
            self.kv.put(self.job("round"), str(attempt))
        return won

    def latest(self) -> int:
        found = self.kv.get(self.job("round"))
        return int(found) if found else 0


def join_round(keys: Keys, attempt: int, me: str, *, low: int, high: int, node_rank: int | None, last_call: float,
               timeout: float, previous: Round | None, start_them: str, job: str = "the job",
               apart: str = "", decides: bool = True, clock: Clock = MACHINE) -> tuple[Round, list[str]]:
    """This launcher's round from ``attempt`` on (later, if it comes to a job that runs without it) and the
    round's launchers by node rank. ``node_rank``: the launcher's --node-rank, claimed (c10d: node 0's, the
    store's host); None: numbered as it comes. ``start_them`` ends the line that names missing nodes: how to
    start them. ``job`` names the job in a spare's lines, ``apart`` how a second job keeps apart from it (two
    launches of one job are one job with spares to the backend: a spare's line says so). ``decides``: this launcher
    may write the member list (c10d: only node 0, the store's host, which every round needs first, whichever
    launcher came first: measured, a 1:2 job whose other launcher came first ran without the store's host). ``clock``:
    what the waits read (the keys' own looks sleep on the backend's)."""
    while True:
        arrival = {"old": previous.node_rank if previous is not None and previous.number == attempt - 1 else None,
                   "rank": node_rank, "since": time.time(), "host": socket.gethostname()}
        if previous is None and node_rank is not None:  # before arriving: a refused one is never counted
            if (other := keys.claim(attempt, node_rank, f"{me} on {arrival['host']}")) is not None:
                raise ConfigError(f"--node-rank {node_rank} is taken: the launcher {other} came first with it; pass "
                                  f"another --node-rank on this machine ({arrival['host']})")
        # a restart: the launchers of the round before that live on, spares and newcomers included; None: the first
        expected = keys.lived(attempt - 1) if previous is not None and previous.number == attempt - 1 else None
        number = keys.arrive(attempt, me, json.dumps(arrival))
        members = _members(keys, attempt, number, low, high, last_call, timeout, start_them, expected, decides, clock)
        if me in members:
            break
        _wait_outside(keys, attempt, members, high, _size(low, high), job, apart, clock)
        attempt += 1
    if len(members) < low:  # decided from the arrivals still there: one lost since it was counted is not
        raise _too_few(attempt, len(members), "remained in it", low, high, start_them)
    before = {m: n for n, m in enumerate(json.loads(keys.decided(attempt - 1) or "[]") if attempt else [])}
    old = tuple(before.get(m) for m in members)  # a dict: a list's index() is O(N) a member, O(N^2) a node
    return Round(attempt, len(members), members.index(me), old), members


def _size(low: int, high: int) -> str:
    return f"{low}:{high}" if low != high else str(high)


def _members(keys: Keys, attempt: int, number: int, low: int, high: int, last_call: float, timeout: float,
             start_them: str, expected: int | None = None, decides: bool = True, clock: Clock = MACHINE) -> list[str]:
    """The round's launchers once decided (who decides when: core/nodes/rules.py's :func:`join_step`). Only the
    one that decides reads the arrivals, once; the others look at the member list and count the arrivals every
    fourth look, less often the more launchers there are: flat per node."""
    deadline = clock.now() + timeout
    seen = number  # how many had come, as last counted
    since = counted = clock.now()  # when that count last changed, and when it was read (this machine's clock)
    while True:
        look, now = keys.look(seen), clock.now()
        latest = number == seen  # the last to come: it counts as often as it looks
        if decides and join_step(came=number, seen=seen, since=since, now=now, look=look, low=low, high=high,
                                 last_call=last_call, expected=expected) is Step.DECIDE:
            _decide(keys, attempt, high)
        if (decided := keys.await_decided(attempt, look)) is not None:
            return _decided(decided, attempt, timeout, low, high, start_them)
        if clock.now() - counted >= (look if latest else 4 * look):  # the others count seldom
            counted = clock.now()
            if (count := keys.count(attempt)) != seen:
                seen, since = count, counted
        if clock.now() > deadline:  # counted once more (a count seldom read is stale)
            if (count := keys.count(attempt)) < low:
                # written in the member list's place unless one is there: every node tells the first count, or
                # runs the round decided
                keys.decide(attempt, json.dumps({GAVE_UP: count}))
                return _decided(keys.decided(attempt) or "[]", attempt, timeout, low, high, start_them)
            if decides:
                # MIN came, its last call not over: the round starts with those that came (before, it gave up:
                # "2 node(s) joined ... needs at least 2"); one that does not decide looks on, for the list that
                # one writes by its own deadline at the latest
                _decide(keys, attempt, high)


def _decide(keys: Keys, attempt: int, high: int) -> None:
    """Write the round's member list, unless one is there: the launchers that came, in their order, up to MAX."""
    arrivals = {m: json.loads(a) for m, a in keys.arrivals(attempt).items()}
    keys.decide(attempt, json.dumps(sorted(arrivals, key=lambda m: member_order(arrivals[m]))[:high]))


def _decided(decided: str, attempt: int, timeout: float, low: int, high: int, start_them: str) -> list[str]:
    """The round's member list as written; :class:`TooFewNodes` where the first launcher to give up wrote its
    count instead (each launcher's own deadline would have it tell what it alone saw)."""
    members = json.loads(decided)
    if isinstance(members, dict):
        raise _too_few(attempt, members[GAVE_UP], f"joined within --timeout {timeout:g} s", low, high, start_them)
    return list(members)


def _too_few(attempt: int, nodes: int, how: str, low: int, high: int, start_them: str) -> TooFewNodes:
    """A round below ``MIN``, whichever way it came about, in one line: the same words on every node."""
    return TooFewNodes(f"round {attempt}: {nodes} node(s) {how}, but --nnodes {_size(low, high)} needs at least "
                       f"{low}: {start_them}", attempt, nodes, low)


def poll_interval(nodes: int) -> float:
    """Seconds between two looks of a launcher that waits for the others: 0.1 s up to 100 nodes, then longer,
    so that all of them together look about a thousand times a second at most (1 s at 1,000 nodes)."""
    return min(1.0, max(0.1, nodes / 1000))


def _wait_outside(keys: Keys, attempt: int, members: list[str], high: int, size: str, job: str, apart: str,
                  clock: Clock = MACHINE) -> None:
    """Round ``attempt`` runs without this launcher: have it restart to admit this one (below MAX), or wait as a
    spare; return once the round has ended (its record is written, or none of its members is left)."""
    if outside(len(members), high) is Outside.ADMIT:
        keys.admit(attempt, resized_record(socket.gethostname(), len(members)))
    else:
        named = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
        logger.warning("mpddp: %s runs on %d node(s) (launchers %s), and its --nnodes %s allows no more: this node "
                       "waits as a spare, and takes a lost node's place at the next round%s", job, len(members),
                       named, size, f"; {apart}" if apart else "")
    while keys.record(attempt) is None:
        if not keys.over(attempt, members):
            if keys.alive(attempt, members):
                clock.sleep(keys.look(len(members)))
                continue
            if not keys.over(attempt, members):  # asked again: its last members may have left between the looks
                return  # a member lost: this spare takes its place in the next round
        raise NotNeeded(f"mpddp: {job} ended while this node waited as a spare (--nnodes {size} was full): "
                        "this node ran nothing, it was not needed")
