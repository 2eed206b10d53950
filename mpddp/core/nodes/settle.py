"""How a failed round of several nodes is settled: the same first failure, named on every node.

Owns: :func:`settle`, which decides what this node reports once its round failed, from its own report, the round's
record in the store, and what it knows of the other nodes (:class:`Blame`); and :func:`finish`, the wait of a node
whose ranks returned. The rule, so that every node names the same rank:

* a node whose own rank failed by itself (raised, exited, died, hung) writes a
  :class:`~mpddp.core.wire.protocol.FailureRecord` into the store; the first node to write one wins, and every node's
  report starts with its line and exits with its code;
* a node whose ranks only saw a peer vanish (an error inside a collective) writes nothing at first: it waits for the
  record of the node where the failure started, and says "node N went away" only when node N's launcher stopped
  beating without ending its round (killed, machine lost), or never beat in it for --timeout; when another node's
  ranks all returned while its own waited for them, it names one of those as the cause (it returned early);
* so does a node whose watchdog found a hang or a mismatch that names other nodes' ranks, with or without its own
  (seen through the collectives the nodes share every beat): their own node sees them better (their stacks, a flight
  recorder not a beat old), and its record stands unless it never comes, or that node waits for the record itself;
  then this node tells its report again from the collectives shared by then (those it named may have been entered
  while the snapshot it read was old: a starved launcher's).

core/nodes/rules.py decides each step; the one-node half of blame is core/launcher/classify.py's ``classify``. Leaves
the store's client, the beat and the other nodes' liveness to the backend (core/nodes/api.py), and the words of a
report to core/launcher/report.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ... import rank_math
from ...errors import NeverArrived, Outcome, RendezvousError, RendezvousGone, StoreLost, WorkerFailed
from ...log import logger
from ..wire.protocol import ERROR_LINE, FailureRecord
from . import rules
from .api import Lost, Rendezvous, is_lost_node, names, went_away
from .rules import Finish, NodeState, Unheard, Wait

_RECORD_WAIT = 10.0  # seconds a node whose ranks only saw a peer vanish waits for the record of the cause, at least

@dataclass(frozen=True)
class Blame:
    """What this node's report blames, for :func:`settle`: ``culprits``, the ranks of other nodes that a hang or a
    mismatch names (seen through the collectives the nodes share); ``early_exit``, the first line that names a rank of
    another node that returned while this node's ranks still waited for it; ``again``, this node's report told once more
    from the other nodes' collectives as they are now, and its cause."""

    culprits: frozenset[int] = frozenset()
    early_exit: Callable[[int], str] | None = None
    again: Callable[[], tuple[WorkerFailed, Outcome | None]] | None = None

    @classmethod
    def of(cls, culprits: Iterable[int], here: Iterable[int], early_exit: Callable[[int], str] | None = None,
           again: Callable[[], tuple[WorkerFailed, Outcome | None]] | None = None) -> Blame:
        """A verdict's ``culprits`` that are not this node's ranks (``here``): their node tells them better, also when
        some of this node's are named beside them (the snapshot they were seen in may be old)."""
        return cls(frozenset(culprits) - set(here), early_exit, again)


@dataclass(frozen=True)
class Retold:
    """This node's report as the round's record (told again once the culprits' nodes waited, where ``Blame.again``),
    and the record that stands (another node's, if it wrote first)."""

    error: WorkerFailed
    record: FailureRecord


def settle(link: Rendezvous, attempt: int, local: WorkerFailed | None, cause: Outcome | None,
           remote: FailureRecord | None, remote_error: Callable[[FailureRecord], WorkerFailed],
           missing: Callable[[], NeverArrived | None], blame: Blame = Blame()) -> WorkerFailed | RendezvousError:
    """What this node reports for a failed round of several nodes, the same first failure on every node.

    ``local``: this node's own report (None when only another node failed), ``cause`` the outcome of its first failure;
    ``remote``: the round's record as this node's beat read it, if it did (the store may be gone by now: node 0's
    launcher interrupted twice leaves once the others read it); ``remote_error`` turns a record into this node's report;
    ``missing``: the error that names the ranks that never arrived, if any (node 0 asks); ``blame``: what this node's
    report blames on other nodes."""
    told: WorkerFailed | RendezvousError | None = None
    try:
        if local is None:
            assert remote is not None  # the watch returns without a local failure only for another node's
            told = _told(remote, remote_error)
        else:
            told = _settle_local(link, attempt, local, cause, remote_error, missing, blame)
        link.until_heard(attempt)  # told only once every node can tell it too
        return told
    except RendezvousGone as gone:  # node 0's store: gone with its launcher, or lost while its launcher says so last
        return _unheard(link, attempt, local, cause, remote, remote_error, blame, told, gone.line)


def _unheard(link: Rendezvous, attempt: int, local: WorkerFailed | None, cause: Outcome | None,
             remote: FailureRecord | None, remote_error: Callable[[FailureRecord], WorkerFailed],
             blame: Blame, told: WorkerFailed | RendezvousError | None, went: str) -> WorkerFailed | RendezvousError:
    """This node's report when the backend went before every node had the round's record (core/nodes/rules.py's
    :func:`~mpddp.core.nodes.rules.unheard` decides; node 0's last word, where its launcher lives to say it, is heard
    alike on every node). A node that knows the cause (its rank failed by itself, or it read the record) while another
    live node may not have heard of it tells the store's loss first, as that node must: one story, and what it knew
    follows (measured: node 0's launcher killed 0.1 s after a rank of node 1 raised, node 1 named its rank and node 2
    node 0's loss)."""
    config, by_itself = link.config, local is not None and _by_itself(cause, blame)
    others = not link.hosts_round_store and bool(set(range(config.nnodes)) - {config.node, 0} - link.gone)
    step = rules.unheard(others=others, knew=told is not None, read=remote is not None, by_itself=by_itself)
    if step is Unheard.KNOWN:
        assert told is not None
        return told
    if step is Unheard.RECORD:
        assert remote is not None
        return _told(remote, remote_error)
    if (word := link.last_word(attempt)) is not None:
        return _told(word, remote_error)
    if step is Unheard.OURS:
        assert local is not None
        local.args = (f"{local}\nmpddp: then {went}: the other nodes may not have heard of this failure",)
        return local
    if by_itself:
        assert local is not None
        return gone_error(link, went, local, f"before it went, rank {local.rank} of this node failed by itself "
                                             "(below), which the other nodes may not have heard of")
    if remote is not None:
        return gone_error(link, went, local or _told(remote, remote_error),
                          f"before it went, the round's record named rank {remote.rank} (node {remote.node_rank}), "
                          "which the other nodes may not have heard of; below, what this node saw")
    assert local is not None
    return gone_error(link, went, local)


def gone_while_running(link: Rendezvous, attempt: int, gone: RendezvousGone, ranks: list[int],
                       remote_error: Callable[[FailureRecord], WorkerFailed]) -> WorkerFailed | RendezvousError:
    """This node's report when the backend stopped answering while its ranks ran and none had failed: node 0's store
    (c10d) closed, cut off or frozen, found by the beat within a deadline (core/stores/deadline.py), where the ranks
    would have waited in gloo for --timeout. Node 0's last word where its launcher lives to say it; else its loss."""
    if (word := link.last_word(attempt)) is not None:  # node 0's own; or, silent, the record once it answers again
        return _told(word, remote_error)
    line = (f"{gone.line}; node {link.config.node} stopped its rank(s) {names(ranks)}, which could not go on "
            "without it")
    return (StoreLost if link.reached else RendezvousError)(line)


def gone_error(link: Rendezvous, went: str, local: WorkerFailed | RendezvousError,
               why: str = "the failures below are consequences") -> RendezvousError:
    """This node's report when the backend went away (``went``: why, as its client worded it) before it learned what
    the others saw: node 0's store (which it reached: its loss, :class:`StoreLost`), or etcd."""
    if link.hosts_round_store:
        error = RendezvousError(f"{went}; the failures below are what this node saw\n{local}")
    else:
        error = (StoreLost if link.reached else RendezvousError)(f"{went}; {why}\n{local}")
    error.__cause__ = local
    return error


def _told(record: FailureRecord,
          remote_error: Callable[[FailureRecord], WorkerFailed]) -> WorkerFailed | RendezvousError:
    """Another node's record as this node's report: ranks that never arrived, or a store lost, as its writer told."""
    kind = {Outcome.ABSENT: RendezvousError, Outcome.STORE_LOST: StoreLost}.get(record.outcome)
    return remote_error(record) if kind is None else kind(record.line.removeprefix(ERROR_LINE))


def _settle_local(link: Rendezvous, attempt: int, local: WorkerFailed, cause: Outcome | None,
                  remote_error: Callable[[FailureRecord], WorkerFailed],
                  missing: Callable[[], NeverArrived | None], blame: Blame) -> WorkerFailed | RendezvousError:
    config = link.config
    if attempt == 0 and (never := missing()) is not None:  # ranks that waited for them timed out, or hung
        return _absent(link, attempt, never, remote_error)
    if _by_itself(cause, blame):
        winner = link.publish(attempt, _record_of(local, cause, link))
        return local if winner.writer == config.node_rank else _told(winner, remote_error)  # another node was first
    found = _wait_for(link, attempt, local, cause if blame.culprits else Outcome.COLLECTIVE, blame)
    if isinstance(found, Retold):
        local, found = found.error, found.record
    if isinstance(found, FailureRecord):  # ours stands, unless it names another node's rank that returned early,
        # or a node this node's liveness look found lost (the same line on every node: went_away's)
        mine = found.writer == config.node_rank and found.outcome is not Outcome.EARLY_EXIT and \
            not is_lost_node(found)
        return local if mine else _told(found, remote_error)
    if not found.beat and attempt == 0 and (never := link.view(attempt).never_arrived) is not None and \
            set(found.nodes) == {rank_math.split_rank(r, link.nprocs)[0] for r in never.ranks}:
        return _absent(link, attempt, never, remote_error)  # they never came: node 0's story, told by whoever is first
    line = (record := went_away(config, link.nprocs, found)).line
    winner = link.publish(attempt, record)
    if winner.line != line:
        return _told(winner, remote_error)
    local.args = (f"{line}; the failures below are consequences\n{local}",)
    local.exit_code = 1
    return local


def _absent(link: Rendezvous, attempt: int, never: NeverArrived,
            remote_error: Callable[[FailureRecord], WorkerFailed]) -> WorkerFailed | RendezvousError:
    """The nodes whose ranks never arrived, as the round's record: every node tells it, one that comes late too."""
    line, (node, local_rank) = f"{ERROR_LINE}{never}", rank_math.split_rank(never.ranks[0], link.nprocs)
    winner = link.publish(attempt, FailureRecord(never.ranks[0], node, local_rank, Outcome.ABSENT, 1, line,
                                                 time.time()))
    return never if winner.line == line else _told(winner, remote_error)


def _by_itself(cause: Outcome | None, blame: Blame) -> bool:
    """A rank of this node failed by itself (raised, exited, died, hung), not because a peer went away."""
    return cause not in (Outcome.COLLECTIVE, Outcome.STOPPED) and not blame.culprits


def _wait_for(link: Rendezvous, attempt: int, local: WorkerFailed, outcome: Outcome | None,
              blame: Blame) -> FailureRecord | Lost | Retold:
    """The round's record, once another node writes it; or the nodes found lost; or ours, once no other node can
    still write a better one: core/nodes/rules.py's :func:`~mpddp.core.nodes.rules.wait_step` decides each look, and
    this loop carries its steps out. While another node is busy it waits :data:`_RECORD_WAIT` at least, whatever
    --timeout (a hang's of a few seconds): the node whose rank failed by itself writes the record after its teardown
    (measured: more than 10 s with 8 launchers and 16 ranks on 2 loaded cores, and a victim's own record then won)."""
    nprocs = link.nprocs
    link.move(attempt, NodeState.WAITING)
    start = link.clock.now()
    culprit_nodes = {rank_math.split_rank(r, nprocs)[0] for r in blame.culprits}
    early_exit = blame.early_exit is not None and outcome in (Outcome.COLLECTIVE, Outcome.HUNG)
    while True:
        view = link.view(attempt)  # each value read once, when first asked
        lost = link.lost(attempt, start)
        step = rules.wait_step(view, lost, culprits=culprit_nodes, early_exit=early_exit,
                               retell=blame.again is not None, waited=link.clock.now() - start,
                               timeout=link.config.timeout, least=_RECORD_WAIT)
        if step is Wait.RECORD:
            assert view.record is not None
            return view.record
        if step is Wait.EARLY_EXIT:
            assert blame.early_exit is not None
            returned = view.returned
            node = min(returned, key=lambda n: (n not in culprit_nodes, returned[n]))  # a culprit's, else the first
            rank = min(blame.culprits & set(range(node * nprocs, (node + 1) * nprocs)), default=node * nprocs)
            return link.publish(attempt, FailureRecord(rank, node, rank - node * nprocs, Outcome.EARLY_EXIT, 1,
                                                       blame.early_exit(rank), time.time()))
        if step is Wait.OURS:  # their nodes see no better, and every node shared; or nobody has a better cause
            error, cause = blame.again() if blame.again is not None else (local, outcome)
            return Retold(error, link.publish(attempt, _record_of(error, cause or outcome, link)))
        if step is Wait.LOST:
            assert lost is not None
            return lost
        link.clock.sleep(link.interval)


def finish(link: Rendezvous, attempt: int) -> FailureRecord | None:
    """This node's ranks all returned: say so, and wait until every other node's ranks returned too, or it ended the
    round (or was found lost). The round's record if one is written meanwhile: a node whose ranks still waited for ours
    in a collective names one of ours (they returned too early), or its own failure is the round's. None: the round
    ended well on every node. torchrun's agents wait so too (their exit barrier): a rank of node 0 that saves the
    checkpoint alone after the others returned keeps them waiting, and its failure is still every node's."""
    try:
        link.move(attempt, NodeState.RETURNED)
        start = link.clock.now()  # after the move: a first connection to the store (torch's import) is no wait
        while (step := rules.finish_step(view := link.view(attempt))) is Finish.LOOK:
            link.lost(attempt, start)  # a node found lost is done from now on
            link.clock.sleep(link.interval)
        return view.record if step is Finish.RECORD else None
    except RendezvousGone as e:  # after our ranks returned: nothing more to learn, and nothing went wrong here
        logger.warning("mpddp: %s before every node ended round %d; node %d's ranks had all returned", e.went,
                       attempt, link.config.node)
        return None


def _record_of(error: WorkerFailed, cause: Outcome | None, link: Rendezvous) -> FailureRecord:
    node, local_rank = rank_math.split_rank(error.rank, link.nprocs)
    return FailureRecord(rank=error.rank, node_rank=node, local_rank=local_rank, outcome=cause or Outcome.RAISED,
                         exit_code=error.exit_code, line=str(error).splitlines()[0], wall_time=time.time())
