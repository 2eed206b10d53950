"""One look at a round, on either backend: what core/nodes/settle.py's waits read (core/nodes/rules.py's
:class:`~mpddp.core.nodes.rules.RoundView`).

Owns: :class:`Tally`, what a look reads of a backend (the round's record, and core/nodes/rules.py's counters of
nodes: a node's entry under ``<counter>/``, counted without being read), :class:`View`, the look itself (each value
read when first asked, and once), and :class:`Counters`, those counters and a node's record (moved with them: the
KV's swap, atomic in each backend's own way) written once over a backend's :class:`~mpddp.core.stores.kv.KV`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Protocol

from ...config import LaunchConfig
from ...errors import NeverArrived
from ..stores.kv import KV
from ..wire import protocol
from ..wire.protocol import FailureRecord
from . import rules
from .rules import NodeState

_MOVES = itertools.count(1)  # this launcher's moves of a record, for a token of its own


class Tally(Protocol):
    """What :class:`View` reads of a round in a backend's store: its record, and core/nodes/rules.py's counters
    (a key a node, counted without being read; each entry numbered, or under a prefix)."""

    config: LaunchConfig

    def record(self, attempt: int) -> FailureRecord | None: ...
    def counted(self, attempt: int, counter: str) -> int: ...  # its nodes (and the lost that could not enter it)
    def entries(self, attempt: int, counter: str) -> dict[int, float]: ...  # each and when it entered: read once
    def marked(self, attempt: int, counter: str, nodes: set[int]) -> bool: ...  # every one of ``nodes`` is in it
    def arrived(self, attempt: int) -> int: ...  # the launchers that came to the round (elastic: 0 else)
    def never_arrived(self, attempt: int) -> NeverArrived | None: ...  # the nodes whose ranks never came


class View:
    """One look at a round (core/nodes/rules.py's :class:`~mpddp.core.nodes.rules.RoundView`) on either backend:
    each value read when first asked, and once, as a count while no node's key needs reading."""

    def __init__(self, link: Tally, attempt: int) -> None:
        self.link, self.attempt = link, attempt

    @functools.cached_property
    def record(self) -> FailureRecord | None:
        return self.link.record(self.attempt)

    @functools.cached_property
    def busy(self) -> bool:
        return self.link.counted(self.attempt, protocol.QUIET) < self.link.config.nnodes

    @functools.cached_property
    def pending(self) -> bool:
        return self.link.counted(self.attempt, protocol.DONE) < self.link.config.nnodes

    @functools.cached_property
    def returned(self) -> dict[int, float]:
        me = self.link.config.node_rank
        return {n: when for n, when in self.link.entries(self.attempt, protocol.RETURNED).items() if n != me}

    @functools.cached_property
    def never_arrived(self) -> NeverArrived | None:
        return self.link.never_arrived(self.attempt)

    @functools.cached_property
    def arrived(self) -> int:
        return self.link.arrived(self.attempt)

    def waiting(self, nodes: set[int]) -> bool:
        return bool(nodes) and self.link.marked(self.attempt, protocol.WAITING, nodes)


class Counters:
    """:class:`Tally`'s counters on a backend's ``kv``, under its keys of a round (``key(attempt, name)``): a counter's
    nodes are its entries (``<counter>/<node>``, the time it came in), the launchers that came its ``join/``
    (core/nodes/membership.py's :class:`~mpddp.core.nodes.membership.RoundKeys`); and each node's record
    (``state/<node>``: its state, "/", the move's token), which a move enters in the counters."""

    kv: KV
    key: Callable[..., str]
    me: str  # this launcher, for the others

    def view(self, attempt: int) -> View:
        return View(self, attempt)  # type: ignore[arg-type]  # a backend is a Tally

    def state(self, attempt: int, node: int) -> NodeState:
        """Node ``node``'s record in round ``attempt``: one operation (none written: RUNNING)."""
        return _state(self.kv.get(self.key(attempt, f"{protocol.STATE}/{node}")))

    def move_node(self, attempt: int, node: int | None, target: NodeState, kv: KV | None = None) -> bool:
        """Node ``node``'s record in round ``attempt`` moved to ``target`` by compare-and-set (core/nodes/rules.py's
        :func:`~mpddp.core.nodes.rules.move` says whether it may), and the node entered in the counters the move newly
        enters it in, with the same write (``kv``'s swap: this backend's, unless given). False: no move (the record
        was there already, or past it). The token says whose write won, when two find one node lost at once."""
        kv = kv or self.kv
        key, mine = self.key(attempt, f"{protocol.STATE}/{node}"), f"{target.value}/{self.me}-{next(_MOVES)}"
        standing = kv.get(key)
        for _ in range(3):  # a compare that failed: the record as it stands now, once more
            if (counters := rules.move(_state(standing), target)) is None:
                return False
            marks = [(self.key(attempt, counter + "/"), str(node), repr(time.time())) for counter in counters]
            if (standing := kv.swap(key, standing, mine, marks)) == mine.encode():
                return True
        return False

    def counted(self, attempt: int, counter: str) -> int:
        return self.kv.count(self.key(attempt, counter + "/"))  # one operation

    def entries(self, attempt: int, counter: str) -> dict[int, float]:
        return {int(node): float(when) for node, when in self.kv.under(self.key(attempt, counter + "/")).items()}

    def marked(self, attempt: int, counter: str, nodes: set[int]) -> bool:
        return self.kv.has([self.key(attempt, f"{counter}/{n}") for n in sorted(nodes)])

    def arrived(self, attempt: int) -> int:
        return self.kv.count(self.key(attempt, "join/"))  # one operation (0 where --nnodes is fixed: no round joined)


def _state(standing: bytes | None) -> NodeState:
    """A node's record as a store holds it (its state, "/", the move's token); None: it never moved."""
    return NodeState.RUNNING if not standing else NodeState(standing.decode().partition("/")[0])
