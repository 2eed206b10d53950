"""How a failed round is settled on each node, one state in and one step out: the rules of core/nodes/settle.py and
the c10d backend's liveness carried out over a store in one dict, with injected time (tests/clock.py). A wait of
--timeout or of a record written seconds later runs in milliseconds, and each bound is exact: told at the first look
at or past the moment the other node acted. The same stories across real launchers: tests/test_named_across_nodes.py."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from clock import Steps


class _Beats:
    """A store in one dict, with TCPStore's semantics for the operations the launchers use: every node's beat
    counter, and who ended (as ``end_round`` marks it: its key, and the counters of the nodes done)."""

    def __init__(self, beats: dict[int, int], ended: set[int] = frozenset()) -> None:
        from mpddp.core.wire import protocol

        self.values: dict[str, object] = {protocol.full_key(0, protocol.heartbeat_key(n)): b for n, b in beats.items()}
        for n in ended:
            _mark_ended(self, n)

    def add(self, key: str, amount: int) -> int:
        self.values[key] = int(self.values.get(key, 0)) + amount  # type: ignore[call-overload]
        return int(self.values[key])  # type: ignore[call-overload]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def set(self, key: str, value: str | bytes) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        value = self.values[key]
        return value if isinstance(value, bytes) else str(value).encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        """TCPStore's: a key that is not there is set only when ``expected`` is empty, else ``expected`` comes back."""
        if key not in self.values:
            if expected:
                return expected.encode()
            self.set(key, desired)
        elif self.get(key) == (expected.encode() if isinstance(expected, str) else expected):
            self.set(key, desired)
        return self.get(key)


def _mark_ended(beats: _Beats, node: int) -> None:
    """What node ``node``'s end of the round leaves in the store: its record moved to ENDED, and its counters."""
    _move(beats, node, "ENDED")


def _move(beats: _Beats, node: int, state: str) -> None:
    """Node ``node``'s record in round 0 moved to ``state``, as its own launcher moves it."""
    from mpddp.core.nodes.rules import NodeState

    _link(node, beats).move(0, NodeState[state])


def _mark_returned(beats: _Beats, node: int) -> None:
    """What node ``node``'s finish leaves in the store when its ranks all returned."""
    _move(beats, node, "RETURNED")


def _heard(beats: _Beats, readers: int) -> None:
    """The other nodes' reads of round 0's record, as each counts its first (core/nodes/c10d_keys.py's ``read``):
    here before it is written, where a node that waits for it reads it at its next look (0.05 s)."""
    from mpddp.core.wire import protocol

    beats.add(protocol.full_key(0, protocol.READ), readers)


def _link(node: int, beats: _Beats, timeout: float = 180.0, steps: Steps | None = None) -> object:
    """Node ``node``'s c10d rendezvous over ``beats``; its waits on ``steps``' injected time, where given."""
    import mpddp
    from mpddp.core.nodes.c10d import C10dRendezvous

    config = mpddp.LaunchConfig(nnodes=3, node_rank=node, master_addr="127.0.0.1", master_port=29500, timeout=timeout)
    link = C10dRendezvous(config, 29500, 1)
    link.client._store = beats
    if steps is not None:
        link.clock = steps.clock
    return link


def _stalled(link: object, before: dict[int, int]) -> list[int]:
    """The nodes ``link``'s node finds lost by its beats read now, after a look that read ``before``."""
    from mpddp.core.nodes.c10d_watch import Beats

    heard = Beats(link.config.node)  # type: ignore[attr-defined]
    heard.still(before)
    return link.found_lost(0, heard.still(link.heartbeats(0) or {}))  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(("now", "ended", "lost"), [
    ({0: 22, 1: 10, 2: 22}, set(), [1]),  # node 1 stood still while nodes 0 and 2 beat: gone
    ({0: 22, 1: 10, 2: 22}, {1}, []),  # ... unless it ended its round: its beat stops then, by design
    ({0: 11, 1: 10, 2: 10}, set(), None),  # every beat (this node's too) nearly still: a starved machine, no verdict
    ({0: 10, 1: 10, 2: 10}, set(), None),
    ({0: 22, 1: 22, 2: 22}, set(), []),
    ({0: 16, 1: 10, 2: 16}, set(), None),  # 6 beats elsewhere: 1.5 s; a starved launcher can stand still so long
])
def test_a_node_is_lost_only_when_its_beat_stood_still_while_others_beat(now, ended, lost) -> None:
    before = {0: 10, 1: 10, 2: 10}
    link = _link(0, _Beats(now, ended))
    assert _stalled(link, before) == (lost or [])  # None: no verdict yet, nobody lost
    assert link.gone == set(lost or [])


@pytest.mark.parametrize(("now", "ended", "lost"), [
    ({0: 12, 1: 0, 2: 12}, set(), []),  # node 1 never beat: its launcher may still import torch to connect
    ({0: 12, 1: 0, 2: 0}, set(), []),  # only this node beat, the others never did: none lost yet
    ({0: 5, 1: 0, 2: 0}, set(), None),  # too few beats to tell anything
    ({0: 12, 1: 0, 2: 5}, set(), []),  # node 2 beat, then stood still: lost; node 1 never beat: not yet
])
def test_a_node_that_never_beat_is_not_lost_by_a_window_of_beats(now, ended, lost) -> None:
    before = {0: 0, 1: 0, 2: 0}
    link = _link(0, _Beats(now, ended))
    assert _stalled(link, before) == (lost or [])
    assert link.gone == set(lost or [])


@pytest.mark.parametrize(("now", "ended", "silent"), [
    ({0: 12, 1: 0, 2: 12}, set(), [1]),  # asked after --timeout: a node that never beat is lost then
    ({0: 12, 1: 0, 2: 12}, {1}, []),  # ... unless it ended the round (it ended before its first beat)
    ({0: 12, 1: 3, 2: 12}, set(), []),
])
def test_a_node_that_never_beat_is_silent(now, ended, silent) -> None:
    link = _link(0, _Beats(now, ended), steps=Steps())
    found = link.lost(0, -180.0)  # this node began to wait --timeout ago
    assert (found.nodes if found is not None and not found.beat else []) == silent
    assert link.gone == set(silent)


def test_a_node_that_never_beat_is_named_gone_once_its_peers_waited_the_timeout() -> None:
    import mpddp
    from mpddp.core.nodes import settle

    steps = Steps()
    link = _link(0, _Beats({0: 12, 1: 0, 2: 12}, ended={2}), timeout=1.0, steps=steps)  # node 2 ended, 1 never beat
    victim = mpddp.WorkerFailed("mpddp: rank 0 failed in all_reduce: Connection closed by peer", rank=0)
    said = settle.settle(link, 0, victim, mpddp.Outcome.COLLECTIVE, None, lambda record: None, lambda: None)
    assert 1.0 < steps.now <= 1.0 + 2 * link.interval  # the first look past --timeout (not _RECORD_WAIT's 10 s)
    assert str(said).splitlines()[0] == (
        "mpddp: node(s) 1 went away (the launcher never beat in this round within --timeout 1 s, nor ended it: "
        "killed, preempted or its machine lost), taking rank(s) 1; the failures below are consequences")
    assert link.gone == {1}


def test_node_0_does_not_wait_for_a_launcher_another_node_found_lost_to_leave() -> None:
    from mpddp.core.wire import protocol

    beats = _Beats({0: 22, 1: 10, 2: 22})
    finder = _link(2, beats)  # node 2 finds node 1 lost; node 0 never looked
    assert _stalled(finder, {0: 10, 1: 10, 2: 10}) == [1]
    finder.leave()
    steps = Steps()
    host = _link(0, beats, steps=steps)
    host.leave()  # nodes 0 and 2 left; node 1 will not: no wait for it (else 10 s)
    assert steps.now == 0.0
    assert beats.values[protocol.LEFT] == 2


def test_node_0_does_not_wait_for_a_launcher_that_never_arrived_to_leave() -> None:
    beats = _Beats({0: 22, 1: 0, 2: 22})
    _link(2, beats).leave()
    steps = Steps()
    host = _link(0, beats, steps=steps)
    host.absent = {1}  # its ranks never came to round 0 (the roll call): it will not come to leave either
    host.leave()
    assert steps.now == 0.0  # else min(--timeout, 10 s)


def test_node_0_waits_for_a_launcher_nobody_found_lost_to_leave() -> None:
    from mpddp.core.nodes import api

    beats = _Beats({0: 22, 1: 22, 2: 22})
    _link(2, beats).leave()
    steps = Steps()
    host = _link(0, beats, timeout=1.0, steps=steps)  # waits min(--timeout, 10 s) for node 1
    host.leave()
    assert 1.0 <= steps.now <= 1.0 + 2 * api.POLL


def test_a_victim_waits_for_the_record_of_a_node_still_at_work_even_past_a_short_timeout() -> None:
    """A node whose ranks only saw a peer vanish waits at least _RECORD_WAIT for the cause's record while
    another node still works (its teardown, on a loaded machine), whatever --timeout (a hang's, here 1 s)."""
    import mpddp
    from mpddp.core.nodes import c10d, settle
    from mpddp.core.wire.protocol import FailureRecord

    beats, steps = _Beats({0: 12, 1: 12, 2: 12}, ended={2}), Steps()  # node 1 has not ended its round: it tears down
    link = _link(0, beats, timeout=1.0, steps=steps)
    cause = FailureRecord(rank=1, node_rank=1, local_rank=0, outcome=mpddp.Outcome.HUNG, exit_code=1,
                          line="mpddp: rank 1 made no progress for 1 s", wall_time=time.time())
    steps.at(3.0, lambda: _link(1, beats).publish(0, cause))
    victim = mpddp.WorkerFailed("mpddp: rank 0 failed in all_reduce: Connection closed by peer", rank=0)
    said = settle.settle(link, 0, victim, mpddp.Outcome.COLLECTIVE, None, lambda record: record, lambda: None)
    assert 3.0 <= steps.now <= 3.0 + 2 * link.interval + c10d.HEARD_WAIT  # read at 3 s, then told once heard
    # before: after --timeout (1 s) node 0 wrote its own rank 0 as the round's failure
    assert said == replace(cause, writer=1)


@pytest.mark.parametrize("elsewhere", [True, False])
def test_a_hang_that_names_only_another_nodes_ranks_waits_for_that_nodes_record(elsewhere: bool) -> None:
    """Node 0's watchdog blamed rank 1 of node 1 (one rank a node), from node 1's collectives as shared a beat
    ago; node 1, which sees its rank itself, writes its record 2 s later: node 0 names what node 1 found. A hang
    that names node 0's own rank is its own story, written at once (the first record stands)."""
    import mpddp
    from mpddp.core.nodes import c10d, settle
    from mpddp.core.wire.protocol import FailureRecord

    beats, steps = _Beats({0: 12, 1: 12, 2: 12}, ended={2}), Steps()
    link = _link(0, beats, timeout=1.0, steps=steps)
    cause = FailureRecord(rank=1, node_rank=1, local_rank=0, outcome=mpddp.Outcome.HUNG, exit_code=1,
                          line="mpddp: rank 1 made no progress for 4 s", wall_time=time.time())
    steps.at(2.0, lambda: _link(1, beats).publish(0, cause))
    blamed = 1 if elsewhere else 0
    seen_here = mpddp.WorkerFailed(f"mpddp: rank {blamed} made no progress for 4 s (as node 0 saw it)", rank=blamed)
    said = settle.settle(link, 0, seen_here, mpddp.Outcome.HUNG, None, lambda record: record, lambda: None,
                         blame=settle.Blame(frozenset({1}) if elsewhere else frozenset()))
    assert 2.0 <= steps.now <= 2.0 + 2 * link.interval + c10d.HEARD_WAIT  # node 1's record at 2 s, then heard
    assert said == (replace(cause, writer=1) if elsewhere else seen_here)
    assert link.record(0).line == (cause.line if elsewhere else str(seen_here))


def test_a_hang_blamed_on_a_node_that_itself_only_waits_is_told_at_once() -> None:
    """Node 0 blames rank 1 of node 1 (a broadcast against all_reduce, seen through the shared collectives),
    but node 1's rank only saw node 0's teardown break its call: node 1 waits for the record itself and sees no
    better. Before, the two nodes waited for each other's record for _RECORD_WAIT, then raced to write one."""
    import mpddp
    from mpddp.core.nodes import settle

    beats = _Beats({0: 12, 1: 12, 2: 12}, ended={2})
    _move(beats, 1, "WAITING")
    _heard(beats, 2)
    steps = Steps()
    link = _link(0, beats, timeout=30.0, steps=steps)
    seen_here = mpddp.WorkerFailed("mpddp: ranks 0, 2 called all_reduce #41 while rank 1 called broadcast #41", rank=1)
    said = settle.settle(link, 0, seen_here, mpddp.Outcome.MISMATCH, None, lambda record: record, lambda: None,
                         blame=settle.Blame(frozenset({1})))
    assert steps.now == 0.0  # at the first look (before: _RECORD_WAIT, 10 s)
    assert said is seen_here and link.record(0).line == str(seen_here) and link.record(0).writer == 0


def test_a_hang_that_names_ranks_here_and_elsewhere_is_told_again_once_the_other_node_waits() -> None:
    """Node 1's watchdog named its rank 1 and node 2's rank 2 (node 2's collectives, as shared a starved beat
    ago, had not reached the all_reduce yet). Node 2's rank only saw the group stop and node 2 waits: node 1
    tells its report again from what the nodes share by then, which names rank 1 alone. Before, node 1 wrote
    its first words at once, and every node named ranks 1 and 2 (seen with two suites on 2 cores)."""
    import mpddp
    from mpddp.core.nodes import settle

    beats = _Beats({0: 12, 1: 12, 2: 12})
    for node in (0, 2):  # node 0's rank saw the group stop too: both wait, their collectives shared first
        _move(beats, node, "WAITING")
    _heard(beats, 2)
    steps = Steps()
    link = _link(1, beats, timeout=30.0, steps=steps)
    stale = mpddp.WorkerFailed("mpddp: ranks 1, 2 made no progress for 4 s while rank 0 waited", rank=1)
    fresh = mpddp.WorkerFailed("mpddp: rank 1 made no progress for 4 s while ranks 0, 2 waited", rank=1)
    blame = settle.Blame.of([1, 2], here=[1], again=lambda: (fresh, mpddp.Outcome.HUNG))
    assert blame.culprits == {2}
    said = settle.settle(link, 0, stale, mpddp.Outcome.HUNG, None, lambda record: record, lambda: None, blame=blame)
    assert steps.now == 0.0
    assert said is fresh and link.record(0).line == str(fresh) and link.record(0).writer == 1


def test_a_hang_told_again_waits_for_a_node_that_has_not_shared_its_collectives_yet() -> None:
    """As above, but node 0 still runs its round (its rank has not yet seen the group stop, so its collectives
    in the store may be a starved beat old): node 1 waits until node 0 waits too, and only then tells again."""
    import mpddp
    from mpddp.core.nodes import settle

    beats, steps = _Beats({0: 12, 1: 12, 2: 12}), Steps()
    _move(beats, 2, "WAITING")
    told: list[float] = []
    fresh = mpddp.WorkerFailed("mpddp: ranks 0, 2 called all_reduce #41 while rank 1 called broadcast #41", rank=1)
    steps.at(1.5, lambda: _move(beats, 0, "WAITING"))
    link = _link(1, beats, timeout=30.0, steps=steps)
    said = settle.settle(link, 0, mpddp.WorkerFailed("stale", rank=1), mpddp.Outcome.MISMATCH, None,
                         lambda record: record, lambda: None, blame=settle.Blame.of([1, 2], here=[1], again=lambda: (
                             told.append(steps.now) or fresh, mpddp.Outcome.MISMATCH)))
    assert said is fresh and len(told) == 1 and 1.5 <= told[0] <= 1.5 + 2 * link.interval, told


def test_a_node_whose_ranks_returned_while_ours_waited_is_named_at_once() -> None:
    """Node 2's ranks returned (it waits for the others to end the round); node 0's rank then saw its all_reduce
    break: node 0 names node 2's first rank as the cause, in the line node 0 words, for every node."""
    import mpddp
    from mpddp.core.nodes import settle

    beats = _Beats({0: 12, 1: 12, 2: 12})
    _mark_returned(beats, 2)
    _heard(beats, 2)
    steps = Steps()
    link = _link(0, beats, timeout=30.0, steps=steps)
    victim = mpddp.WorkerFailed("mpddp: rank 0 failed in all_reduce: Connection closed by peer", rank=0)
    said = settle.settle(link, 0, victim, mpddp.Outcome.COLLECTIVE, None, lambda record: record, lambda: None,
                         blame=settle.Blame(early_exit=lambda rank: f"mpddp: rank {rank} exited (code 0) while ..."))
    assert steps.now == 0.0
    assert (said.rank, said.node_rank, said.outcome, said.exit_code, said.line, said.writer) == (
        2, 2, mpddp.Outcome.EARLY_EXIT, 1, "mpddp: rank 2 exited (code 0) while ...", 0)


def test_a_record_is_told_once_every_other_node_read_it_and_the_stores_loss_if_it_went_first() -> None:
    """Node 1's rank raised; nodes 0 and 2 read its record 0.5 s later: node 1 tells its rank then. Node 0's store
    gone before they read it: nodes 1 and 2 both lead with node 0's loss (node 2 could not hear of the raise), node
    1 says what it knew after it (before, node 1 named its rank and node 2 node 0's loss)."""
    import mpddp
    from mpddp.core.nodes import settle

    beats, steps = _Beats({0: 12, 1: 12, 2: 12}), Steps()
    raised = mpddp.WorkerFailed("mpddp: rank 1 (node 1, local rank 0) failed first: it raised RuntimeError", rank=1)
    steps.at(0.5, lambda: [_link(n, beats).record(0) for n in (0, 2)])
    said = settle.settle(_link(1, beats, steps=steps), 0, raised, mpddp.Outcome.RAISED, None, lambda r: r,
                         lambda: None)
    assert said is raised and 0.5 <= steps.now <= 0.52  # the first look after both read it (a look each 0.01 s)

    class Gone:  # node 0's store, gone once the record is written: torch's client raises its own error
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("Connection reset by peer")

    beats = _Beats({0: 12, 1: 12, 2: 12})
    writer = _link(1, beats)
    writer.reached = True  # its ranks met in node 0's store
    call = writer.client.call  # the client's own: it words the loss (RendezvousGone's line)
    writer.client.call = lambda op, connect_timeout=None: call(  # type: ignore[method-assign]
        op if not any(k.endswith("/failure") for k in beats.values) else lambda s: op(Gone()), connect_timeout)
    writer.last_word = lambda attempt: None  # type: ignore[method-assign]  # nobody listens at node 0's port
    said = settle.settle(writer, 0, raised, mpddp.Outcome.RAISED, None, lambda r: r, lambda: None)
    assert str(said).startswith("node 0, which hosts the rendezvous at 127.0.0.1:29500, is gone (its launcher was "
                                "killed, or its machine lost); before it went, rank 1 of this node failed by itself")
    assert said.__cause__ is raised


@pytest.mark.parametrize("then", ["returned", "ended", "failed"])
def test_a_node_whose_ranks_returned_waits_for_the_others_to_end_the_round(then: str) -> None:
    """torchrun's exit barrier: node 1's ranks returned; node 2's still run. It waits until they return or end
    their round (None: the round went well), or until a record is written: then the round's failure is node 1's."""
    import mpddp
    from mpddp.core.nodes import settle
    from mpddp.core.wire import protocol
    from mpddp.core.wire.protocol import FailureRecord

    beats, steps = _Beats({0: 12, 1: 12, 2: 12}, ended={0}), Steps()
    link, other = _link(1, beats, steps=steps), _link(2, beats)
    cause = FailureRecord(rank=2, node_rank=2, local_rank=0, outcome=mpddp.Outcome.RAISED, exit_code=3,
                          line="mpddp: rank 2 (node 2, local rank 0) failed first", wall_time=time.time())
    steps.at(1.0, {
        "returned": lambda: _mark_returned(beats, 2),
        "ended": lambda: _mark_ended(beats, 2),
        "failed": lambda: (other.publish(0, cause), _mark_ended(beats, 2)),
    }[then])
    found = settle.finish(link, 0)
    assert 1.0 <= steps.now <= 1.0 + 2 * link.interval
    assert found == (replace(cause, writer=2) if then == "failed" else None)
    assert beats.values[protocol.full_key(0, protocol.RETURNED)] == 1 + (then == "returned")


def test_a_mismatch_that_saw_only_some_ranks_calls_names_the_others_in_doubt() -> None:
    """Rank 0's all_reduce #41 against rank 1's broadcast #41 is a tie while rank 2's call (node 2's, in a
    snapshot a starved beat old) is unseen: rank 2 could outvote either, so its node's word is waited for."""
    from mpddp.core.launcher import board
    from mpddp.core.wire.protocol import Call

    calls = {r: Call("0", 41, op, ((1,),), ("float32",), 1, "gloo", 0, 41) for r, op in ((0, "all_reduce"),
                                                                                        (1, "broadcast"))}
    assert board.unseen(board.Mismatch(calls, odd=1), world_size=3) == {2}
    assert board.unseen(board.Mismatch({**calls, 2: calls[0]}, odd=1), world_size=3) == frozenset()
    subgroup = {r: replace(c, group="1") for r, c in calls.items()}  # a subgroup's members are not known here
    assert board.unseen(board.Mismatch(subgroup, odd=1), world_size=3) == frozenset()


@pytest.mark.parametrize("then", ["WAITING", "RETURNED", "ENDED"])
def test_a_node_found_lost_that_comes_back_writes_nothing_into_the_round(then: str) -> None:
    """Node 1 frozen (or cut off), found lost by node 0, which wrote the round's record; node 1 thaws, its ranks
    see the group broken: its move and its record change nothing (its record stands at LOST, a move out of LOST is
    none, the first record stands), so the round's counters stay what the others settle by."""
    import mpddp
    from mpddp.core.nodes.api import went_away
    from mpddp.core.nodes.rules import Lost, NodeState
    from mpddp.core.wire import protocol
    from mpddp.core.wire.protocol import FailureRecord

    beats = _Beats({0: 22, 1: 10, 2: 22})
    finder = _link(0, beats)
    assert finder.found_lost(0, [1]) == [1]
    told = finder.publish(0, went_away(finder.config, 1, Lost([1])))
    read = protocol.full_key(0, protocol.READ)  # node 1 reading the record is counted: node 0 waits for that
    counters = {k: v for k, v in beats.values.items() if k != read}
    back = _link(1, beats)
    back.move(0, NodeState[then])
    mine = FailureRecord(rank=1, node_rank=1, local_rank=0, outcome=mpddp.Outcome.COLLECTIVE, exit_code=1,
                         line="mpddp: rank 1 failed in all_reduce: Connection closed by peer", wall_time=time.time())
    assert back.publish(0, mine) == told  # the first record stands: node 0's word
    assert back.state(0, 1) is NodeState.LOST
    assert {k: v for k, v in beats.values.items() if k != read} == counters
    assert beats.values[protocol.full_key(0, protocol.LOST)] == 1

