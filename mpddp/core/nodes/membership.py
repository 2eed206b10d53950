"""Who is in a round of an elastic job (``--nnodes MIN:MAX``), decided the same way on every backend.

Owns: :func:`join_round`, the rule, over a backend's few keys (:class:`Keys`): every launcher puts its
arrival; once ``MAX`` have arrived, or ``MIN`` and no newcomer came for ``last_call_timeout``, the first
launcher to see it writes the round's member list, created only if absent (the first writer wins), and its
order is the round's node ranks: the last round's nodes first, in their old order, then ``--node-rank``, then
arrival, so the ranks are compacted when a node is gone. A launcher that comes to a round already decided
without it has the group restart to admit it (below ``MAX``: a record of :data:`~mpddp.errors.Outcome.RESIZED`,
which no restart count pays for) or waits as a spare for the next round.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Protocol

from ...errors import ConfigError, RendezvousError
from ...log import logger
from ..wire.protocol import FailureRecord
from .api import NotNeeded, Round, resized_record


class Keys(Protocol):
    """What the rule needs of a backend's keys (etcd's, or node 0's store's)."""

    def arrive(self, attempt: int, me: str, arrival: str) -> None: ...
    def arrivals(self, attempt: int) -> dict[str, str]: ...  # launcher id -> its arrival, for those still there
    def decided(self, attempt: int) -> str | None: ...  # the member list, once written
    def decide(self, attempt: int, members: str) -> bool: ...  # write it unless written: True if this one stands
    def latest(self) -> int: ...  # the round the job is in now (0: a new job)
    def admit(self, attempt: int, record: FailureRecord) -> None: ...  # the round's record, unless written
    def record(self, attempt: int) -> FailureRecord | None: ...
    def over(self, attempt: int, members: list[str]) -> bool: ...  # the job ended well without this launcher
    def alive(self, attempt: int, members: list[str]) -> bool: ...  # a member of the round is still there
    def pause(self, attempt: int) -> None: ...  # until the round's keys change, or a moment


def join_round(keys: Keys, attempt: int, me: str, *, low: int, high: int, node_rank: int, last_call: float,
               timeout: float, previous: Round | None, start_them: str,
               zero_is_a_claim: bool = False) -> tuple[Round, list[str]]:
    """This launcher's round from ``attempt`` on (later, if it comes to a job that runs without it) and the
    round's launchers by node rank. ``start_them`` ends the line that names missing nodes: how to start them.
    ``zero_is_a_claim``: --node-rank 0 is given, not the default (c10d: node 0 hosts the store)."""
    while True:
        arrival = {"old": previous.node_rank if previous is not None and previous.number == attempt - 1 else None,
                   "rank": node_rank, "since": time.time(), "host": socket.gethostname()}
        if previous is None and (node_rank or zero_is_a_claim):  # before arriving: a refused one is never counted
            _check_claim(keys.arrivals(attempt), node_rank, arrival["host"])
        keys.arrive(attempt, me, json.dumps(arrival))
        members = _members(keys, attempt, low, high, last_call, timeout, start_them)
        if me in members:
            break
        _wait_outside(keys, attempt, members, high, _size(low, high))
        attempt += 1
    before = json.loads(keys.decided(attempt - 1) or "[]") if attempt else []
    old = tuple(before.index(m) if m in before else None for m in members)
    return Round(attempt, len(members), members.index(me), old), members


def _check_claim(arrivals: dict[str, str], node_rank: int, host: object) -> None:
    """Bad input: another launcher came first to this round with this --node-rank."""
    for other, text in arrivals.items():
        theirs = json.loads(text)
        if theirs.get("rank") == node_rank:
            raise ConfigError(f"--node-rank {node_rank} is taken: the launcher {other} on {theirs.get('host')} came "
                              f"first with it; pass another --node-rank on this machine ({host})")


def _size(low: int, high: int) -> str:
    return f"{low}:{high}" if low != high else str(high)


def _members(keys: Keys, attempt: int, low: int, high: int, last_call: float, timeout: float,
             start_them: str) -> list[str]:
    """The round's launchers once decided: by this one, if it is the first to see enough of them."""
    deadline = time.monotonic() + timeout
    seen, since = 0, time.monotonic()  # how many had come, and since when (this machine's clock)
    while True:
        if (decided := keys.decided(attempt)) is not None:
            return list(json.loads(decided))
        arrivals = {m: json.loads(a) for m, a in keys.arrivals(attempt).items()}
        if len(arrivals) != seen:
            seen, since = len(arrivals), time.monotonic()
        if len(arrivals) >= high or (len(arrivals) >= low and time.monotonic() - since >= last_call):
            keys.decide(attempt, json.dumps(sorted(arrivals, key=lambda m: _order(arrivals[m]))[:high]))
            continue
        if time.monotonic() > deadline:
            raise RendezvousError(f"round {attempt}: {len(arrivals)} node(s) joined within --timeout {timeout:g} s, "
                                  f"but --nnodes {_size(low, high)} needs at least {low}: {start_them}")
        keys.pause(attempt)


def _order(arrival: dict[str, object]) -> tuple[float, float, float]:
    """A launcher's place: its old node rank first, then its --node-rank, then when it came."""
    old, rank, since = arrival.get("old"), arrival.get("rank"), arrival.get("since")
    return (float(old) if isinstance(old, int) else float("inf"), float(rank) if isinstance(rank, int) else 0.0,
            float(since) if isinstance(since, (int, float)) else 0.0)


def _wait_outside(keys: Keys, attempt: int, members: list[str], high: int, size: str) -> None:
    """Round ``attempt`` runs without this launcher: have it restart to admit this one (below MAX), or wait as a
    spare; return once the round has ended (its record is written, or none of its members is left)."""
    if len(members) < high:
        keys.admit(attempt, resized_record(socket.gethostname(), len(members)))
    else:
        logger.warning("mpddp: the job runs on %d node(s), its --nnodes %s allows no more: this node waits as a "
                       "spare, and takes a lost node's place at the next round", len(members), size)
    while keys.record(attempt) is None:
        if keys.over(attempt, members):
            raise NotNeeded(f"mpddp: the job ended while this node waited as a spare (--nnodes {size} was full): "
                            "it was not needed")
        if not keys.alive(attempt, members):
            return
        keys.pause(attempt)
