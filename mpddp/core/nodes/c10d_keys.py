"""What the ``c10d`` backend keeps in node 0's store beyond the round's own keys: core/nodes/membership.py's, for
an elastic job, and a round's door (a newcomer is admitted until a node waits for a failure or returned); a
fixed-size job's numbers for the launchers that come without ``--node-rank``; a restarted round's barrier; the
ranks that never came; and what node 0's launcher runs, which an elastic job's newcomer must run too. Also
:class:`C10dLink`, what this module and core/nodes/c10d_watch.py use of the backend (core/nodes/c10d.py), which
imports them."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Protocol

from ...config import LaunchConfig
from ..stores.c10d_client import C10dClient, C10dKV
from ..stores.clock import Clock
from ..stores.store_beat import first_record, read_all
from ..wire import protocol
from ..wire.protocol import FailureRecord, full_key
from .api import ending
from .membership import RoundKeys, poll_interval
from .rules import Door, NodeState, door, holder

_CLAIMS = "claims"  # an elastic job's round: the --node-rank each newcomer came with (its arrivals: RoundKeys')
_ADMISSION = "admission"  # a round's door: a newcomer's record of admission, or a node's mark (FAILING, CLOSED)
_FAILING, _CLOSED = b"failing", b"closed"  # a node waits for a failure's record; a node's ranks returned
_DOOR_MARKS = {NodeState.WAITING: _FAILING, NodeState.RETURNED: _CLOSED}  # the moves that shut a round's door, and how
_NUMBERED = "mpddp/job/numbered"  # a counter: the launchers of a fixed-size job numbered as they came (1, 2, ...)
_RUNS = "mpddp/job/runs"  # what node 0's launcher runs (core/wire/fingerprint.py): a newcomer's must be the same


class C10dLink(Protocol):
    """The backend, as its helpers see it: node 0's store, and this node's place in the round."""

    client: C10dClient  # node 0's store
    config: LaunchConfig  # this round's: nnodes and node_rank may change from round to round
    elastic: bool  # --nnodes MIN:MAX
    clock: Clock  # what its waits sleep on

    def record(self, attempt: int) -> FailureRecord | None: ...
    def state(self, attempt: int, node: int) -> NodeState: ...
    def heartbeats(self, attempt: int, nodes: list[int] | None = None,
                   every: bool = False) -> dict[int, int] | None: ...
    def found_lost(self, attempt: int, nodes: list[int]) -> list[int]: ...  # those that did not end it, moved to LOST


def missing_ranks(s: Any, attempt: int, world_size: int) -> list[int]:
    """The ranks whose arrival core/rank/worker.py did not mark in round ``attempt``: one operation when every
    rank came; two, whatever the size, else."""
    count = s.add(full_key(attempt, protocol.ARRIVED), 0)
    if count >= world_size:
        return []
    keys = [full_key(attempt, protocol.arrived_entry(n)) for n in range(1, count + 1)]
    if not s.check(keys):  # a rank counted, its entry not yet written (or never: killed between)
        keys = [k for k in keys if s.check([k])]
    came = {int(v) for v in read_all(s, keys)}
    return [r for r in range(world_size) if r not in came]


def arrived(s: Any, attempt: int) -> int:
    """How many launchers came to round ``attempt`` of an elastic job, its spares too (0: a fixed-size job)."""
    return int(s.add(full_key(attempt, "join"), 0))  # RoundKeys' entries under join/, counted (C10dKV.count)


def admitted(s: Any, attempt: int, record: bytes) -> Door:
    """A newcomer's admission to round ``attempt``, which its nodes restart for (``record``, of RESIZED): OPEN once it
    is the round's record; else what stood at the round's door first, as core/nodes/rules.py's :func:`door` reads
    it: another newcomer's admission, or a node's mark (:func:`close_door`)."""
    standing = bytes(s.compare_set(full_key(attempt, _ADMISSION), "", record))
    if standing == record:
        first_record(s, attempt, record)
        return Door.OPEN
    return door(record=standing not in (_FAILING, _CLOSED), waiting=standing == _FAILING, returned=standing == _CLOSED)


def close_door(s: Any, attempt: int, state: NodeState) -> None:
    """Before a node is counted as waiting for a failure's record or as returned in round ``attempt`` (its move to
    ``state``): no newcomer's admission is the round's record from now on. A newcomer that came first has its
    admission made the round's record here too (it writes the record after the door): every node sees the
    restart, none ends the job or tells a failure without it."""
    standing = bytes(s.compare_set(full_key(attempt, _ADMISSION), "", _DOOR_MARKS[state]))
    if standing not in (_FAILING, _CLOSED):
        first_record(s, attempt, standing)


def join_barrier(s: Any, attempt: int, node: int, nnodes: int, timeout: float) -> list[int]:
    """A restarted round's barrier: the last launcher to arrive says so, the others wait for that key (no poll).
    The nodes that did not join within ``timeout``; none once every one did."""
    everyone = full_key(attempt, protocol.ALL_JOINED)
    s.set(full_key(attempt, protocol.joined_key(node)), "1")
    if s.add(full_key(attempt, protocol.JOINED), 1) >= nnodes:
        s.set(everyone, "1")
        return []
    try:
        s.wait([everyone], timedelta(seconds=timeout))
        return []
    except Exception:  # noqa: BLE001 - torch's timeout; a store that is gone fails the next operation
        return [n for n in range(nnodes) if not s.check([full_key(attempt, protocol.joined_key(n))])]


def take_number(s: Any, me: str, nnodes: int) -> int | None:
    """A node rank for launcher ``me`` of a fixed-size job, numbered as it comes (node 0 hosts the store):
    the next of a counter, claimed with the key each rank's roll call claims in round 0
    (core/rank/worker.py's ``_roll_call``), so a number another launcher came with (``--node-rank``) is
    skipped, and this launcher's ranks find it theirs. None: the job has ``nnodes`` nodes already."""
    while (number := int(s.add(_NUMBERED, 1))) < nnodes:
        key = full_key(0, protocol.claim_key(number))
        if s.compare_set(key, "", me).decode() == me:
            return number
    return None


def standing_job(s: Any, mine: str, host: bool) -> bytes | None:
    """The job's fingerprint: ``mine``, set by the store's host (node 0's launcher, as it joins), else the one it set;
    None while it has not (the job's start: each rank's roll call compares then, core/rank/worker.py)."""
    if host:
        return bytes(s.compare_set(_RUNS, "", mine))
    return bytes(s.get(_RUNS)) if s.check([_RUNS]) else None


class C10dKeys(RoundKeys):
    """core/nodes/membership.py's keys in node 0's store (:class:`~mpddp.core.nodes.membership.RoundKeys`), and what
    only this backend does: liveness counted (a node found lost is moved to LOST by the node that found it), a
    ``--node-rank`` claimed in the round, a newcomer admitted at the round's door (:func:`admitted`)."""

    link: C10dLink

    def __init__(self, link: C10dLink) -> None:
        super().__init__(C10dKV(link.client), full_key, lambda name: f"mpddp/job/{name}", link.clock)
        self.link = link

    def lived(self, attempt: int) -> int:
        """Two operations: the arrivals, less the nodes found lost (moved to LOST by the node that found them)."""
        return self.count(attempt) - self.kv.count(full_key(attempt, protocol.LOST + "/"))

    def claim(self, attempt: int, node_rank: int, me: str) -> str | None:
        """A launcher's first round: its --node-rank is taken by a member of the job's last decided round that came
        with it (:func:`~mpddp.core.nodes.rules.holder`) and was not found lost there, or by another newcomer to
        this round; None: this launcher holds it now."""
        if (held := self._held(attempt, node_rank)) is not None:
            return held
        standing = self.kv.create(full_key(attempt, f"{_CLAIMS}/{node_rank}"), me)
        return None if standing is None else standing.decode()

    def _held(self, attempt: int, node_rank: int) -> str | None:
        """The member of round ``attempt`` (the job's latest, as a newcomer reads it) that holds ``node_rank``, as
        "launcher on host"; None when the round is not decided yet, nobody came with it, or its holder was lost."""
        if (decided := self.decided(attempt)) is None:
            return None
        arrivals = {m: json.loads(a) for m, a in self.arrivals(attempt).items()}
        members = list(json.loads(decided))
        if (node := holder(members, arrivals, node_rank)) is None or self.link.state(attempt, node) is NodeState.LOST:
            return None  # a holder found lost: its replacement takes its rank
        return f"{members[node]} on {arrivals[members[node]].get('host')}"

    def look(self, nodes: int) -> float:
        return poll_interval(nodes)

    def admit(self, attempt: int, record: FailureRecord) -> None:
        """The round restarts for this newcomer (:func:`admitted`), unless it ends anyway (RECORD, FAILING: this
        launcher comes to the next round) or the job is ending (CLOSED: this launcher is not needed)."""
        client = self.link.client
        if client.call(lambda s: admitted(s, attempt, record.encode())) is Door.CLOSED:
            raise ending(f"the job at {client.config.master_addr}:{client.port}", attempt)

    def over(self, attempt: int, members: list[str]) -> bool:
        return self.kv.count(protocol.LEFT) >= len(members)

    def alive(self, attempt: int, members: list[str]) -> bool:
        return True  # a member lost is named in the round's record by the others: the wait ends there
