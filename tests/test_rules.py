"""The rules of a round (core/nodes/rules.py), one state in and one step out, with injected time: no process, no
store, no sleep."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mpddp.core.nodes import rules
from mpddp.core.nodes.rules import Door, Finish, Lost, NodeState, Outside, Step, Wait, finish_step, move, wait_step
from mpddp.core.wire.protocol import FailureRecord
from mpddp.errors import Outcome

LOOK, LAST_CALL = 0.1, 3.0


@pytest.mark.parametrize("came, seen, waited, low, high, step", [
    (4, 4, 0.0, 2, 4, Step.DECIDE),   # this arrival made MAX: it decides at once
    (2, 2, 0.0, 2, 4, Step.LOOK),     # MIN came: the last call runs
    (2, 2, 2.9, 2, 4, Step.LOOK),
    (2, 2, 3.0, 2, 4, Step.DECIDE),   # MIN, and nobody else for last_call_timeout: the last to come decides
    (3, 3, 3.0, 2, 4, Step.DECIDE),
    (1, 1, 60.0, 2, 4, Step.LOOK),    # below MIN: nobody decides, however long (the caller's --timeout ends it)
    (2, 4, 0.0, 2, 4, Step.LOOK),     # MAX came, but not with this one: the last to come decides ...
    (2, 4, 0.15, 2, 4, Step.LOOK),
    (2, 4, 0.2, 2, 4, Step.DECIDE),   # ... unless the count stood still for two looks (it may be gone)
    (1, 2, 0.5, 2, 4, Step.LOOK),     # not the last, still for two looks, but MIN's last call still runs
    (1, 2, 3.0, 2, 4, Step.DECIDE),
    (5, 5, 0.0, 4, 4, Step.DECIDE),   # more than MAX came: decided, the list takes MAX of them
    (1, 1, 0.0, 1, 1, Step.DECIDE),   # one node
])
def test_who_decides_the_member_list_and_when(came, seen, waited, low, high, step):
    now = 1000.0  # the caller's monotonic clock: only differences count
    assert rules.join_step(came=came, seen=seen, since=now - waited, now=now, look=LOOK, low=low, high=high,
                     last_call=LAST_CALL) is step


@pytest.mark.parametrize("came, seen, waited, low, high, expected, step", [
    (2, 2, 0.0, 2, 3, 2, Step.DECIDE),    # a restart: both launchers of the last round that live on came, at once
    (2, 2, 0.0, 2, 3, 3, Step.LOOK),      # one of the last round's three has not come yet: the last call runs
    (2, 2, 3.0, 2, 3, 3, Step.DECIDE),    # ... and ends as before
    (1, 1, 0.0, 2, 3, 1, Step.LOOK),      # below MIN, however few are expected: never decided by it
    (3, 3, 0.0, 2, 3, 2, Step.DECIDE),    # a newcomer came with them: MAX
    (2, 2, 0.0, 2, 4, 5, Step.LOOK),      # more expected than MAX (a count that includes spares): the last call
    (1, 2, 0.5, 2, 3, 2, Step.DECIDE),    # not the last to come, the count still for two looks: decides too
])
def test_a_restart_decides_once_every_launcher_that_lives_on_came(came, seen, waited, low, high, expected, step):
    """Measured on namespace hosts, etcd, 2:3, one node cut: the survivors' first step 6.4 s after the loss with the
    last call (3 s of it), 3.5 s without."""
    now = 1000.0
    assert rules.join_step(came=came, seen=seen, since=now - waited, now=now, look=LOOK, low=low, high=high,
                           last_call=LAST_CALL, expected=expected) is step


@pytest.mark.parametrize("moved_at, clock, silent", [
    ({0: 100, 1: 100, 2: 100}, 100, []),         # every beat moved at the last look
    ({0: 112, 1: 100, 2: 111}, 112, [1]),        # node 1 stood still for 12 of the looker's beats: lost
    ({0: 111, 1: 100, 2: 111}, 111, []),         # 11: not yet
    ({0: 100, 1: 90, 2: 95}, 100, []),           # the looker's clock is its own beat: starved, it moved no further
    ({0: 130, 1: 100, 2: 100}, 130, [1, 2]),     # two machines lost at once
    ({}, 50, []),                                # nobody has beaten yet
])
def test_a_beat_that_stood_still_while_the_lookers_moved_is_silent(moved_at, clock, silent):
    assert rules.lost_nodes(moved_at, clock, grace=12) == silent


INF = float("inf")


@pytest.mark.parametrize("heard, now, grace, done, lost", [
    ({1: -INF, 2: 100.0}, 100.0, INF, (), [1]),        # etcd: node 1's lease ran out, node 2's holds
    ({1: -INF, 2: 100.0}, 100.0, INF, (1,), []),       # ... unless node 1 ended the round (it left, its lease revoked)
    ({1: 100.0, 2: 100.0}, 1e9, INF, (), []),          # a lease that holds: never lost by time alone
    ({1: 20.0}, 200.0, 180.0, (), [1]),                # c10d: a node that never beat, 180 s of --timeout since the wait
    ({1: 20.0}, 199.9, 180.0, (), []),                 # ... not yet
    ({1: 20.0}, 200.0, 180.0, (1,), []),               # ... it ended the round before its first beat
    ({0: 112, 1: 100, 2: 111}, 112, 12, (1,), []),     # a beat that stands still because its node ended: not lost
])
def test_one_rule_finds_nodes_lost_on_either_backend(heard, now, grace, done, lost):
    assert rules.lost_nodes(heard, now, grace=grace, done=done) == lost


def test_the_last_call_is_timed_from_the_last_arrival_not_the_first():
    """A newcomer every 2 s keeps the round open (last_call 3 s); the step after the last one's 3 s decides."""
    arrivals = [0.0, 2.0, 4.0, 6.0]
    for t in (6.0, 7.0, 8.9):
        assert rules.join_step(came=4, seen=4, since=arrivals[-1], now=t, look=LOOK, low=2, high=8,
                         last_call=LAST_CALL) is Step.LOOK
    assert rules.join_step(came=4, seen=4, since=arrivals[-1], now=9.0, look=LOOK, low=2, high=8,
                     last_call=LAST_CALL) is Step.DECIDE


def test_the_member_order_keeps_the_old_nodes_then_the_given_ranks_then_arrival():
    arrivals = {
        "late-given-1": {"old": None, "rank": 1, "since": 50.0},
        "old-2": {"old": 2, "rank": None, "since": 40.0},
        "new-early": {"old": None, "rank": None, "since": 10.0},
        "old-0": {"old": 0, "rank": 5, "since": 30.0},
        "new-late": {"old": None, "rank": None, "since": 20.0},
        "garbled": {"old": "x", "rank": "y", "since": "z"},  # a value of another type sorts last, never raises
    }
    assert sorted(arrivals, key=lambda m: rules.member_order(arrivals[m])) == [
        "old-0", "old-2", "late-given-1", "garbled", "new-early", "new-late"]


@pytest.mark.parametrize("members, arrivals, node_rank, place", [
    (["a", "b"], {"a": {"rank": 0}, "b": {"rank": 1}}, 1, 1),
    (["b", "a"], {"a": {"rank": 0}, "b": {"rank": 1}}, 1, 0),  # compacted after a loss: its place is not its rank
    (["a", "b"], {"a": {"rank": 0}, "b": {"rank": None}}, 1, None),  # numbered as it came: it holds no --node-rank
    (["a", "b"], {"a": {"rank": 0}, "b": {"rank": 1}, "c": {"rank": 2}}, 2, None),  # arrived, not a member: a spare
    (["a", "b"], {"a": {"rank": 0}}, 1, None),  # an arrival not read (gone with its lease): no holder
    ([], {}, 0, None),
])
def test_the_holder_of_a_node_rank_is_the_member_that_came_with_it(members, arrivals, node_rank, place):
    assert rules.holder(members, arrivals, node_rank) == place


@pytest.mark.parametrize("members, high, verdict", [
    (1, 2, Outside.ADMIT), (3, 4, Outside.ADMIT), (4, 4, Outside.SPARE), (2, 2, Outside.SPARE),
])
def test_a_launcher_outside_a_decided_round_is_admitted_below_max_else_a_spare(members, high, verdict):
    assert rules.outside(members, high) is verdict


@pytest.mark.parametrize("record, waiting, returned, verdict", [
    (False, False, False, Door.OPEN),  # the round runs: the admission restarts it
    (False, False, True, Door.CLOSED),  # a node's ranks returned (the exit barrier): a restart would rerun a
                                        # finished job
    (True, False, False, Door.RECORD),  # a failure's record came first: the round restarts anyway, the newcomer with it
    (True, False, True, Door.RECORD),  # a rank failed after another node returned: the record stands, not the door
    (False, True, False, Door.FAILING),  # a node waits for a failure's record: it must not be the admission's
    (False, True, True, Door.FAILING),  # ... also where another node returned: the failure restarts the job
    (True, True, True, Door.RECORD),
])
def test_a_newcomers_admission_waits_for_a_failure_and_is_refused_once_a_node_returned(record, waiting, returned,
                                                                                       verdict):
    assert rules.door(record=record, waiting=waiting, returned=returned) is verdict


@pytest.mark.parametrize("current, target, counters", [
    (NodeState.RUNNING, NodeState.WAITING, ("waiting", "quiet")),
    (NodeState.RUNNING, NodeState.RETURNED, ("returned", "quiet", "done")),
    (NodeState.RUNNING, NodeState.ENDED, ("ended", "quiet", "done")),
    (NodeState.WAITING, NodeState.ENDED, ("ended", "done")),  # quiet once: a counter counts nodes
    (NodeState.RETURNED, NodeState.WAITING, None),  # the round's record came after its ranks returned: quiet already
    (NodeState.RETURNED, NodeState.ENDED, ("ended",)),
    (NodeState.RUNNING, NodeState.LOST, ("lost", "quiet", "done")),  # another node found it lost (c10d)
    (NodeState.WAITING, NodeState.LOST, ("lost", "done")),
    (NodeState.WAITING, NodeState.RETURNED, None),  # its ranks stopped on a failure: they return no more
    (NodeState.RUNNING, NodeState.RUNNING, None),  # the same state again: nothing written
    (NodeState.ENDED, NodeState.ENDED, None),
    (NodeState.ENDED, NodeState.WAITING, None),  # out of ENDED: the round is over for this node
    (NodeState.ENDED, NodeState.LOST, None),  # a node that ended is not lost: its beat stops by design
    (NodeState.LOST, NodeState.ENDED, None),  # a node called lost never comes back into the round
])
def test_every_move_of_a_node_in_a_round_goes_through_one_function(current, target, counters):
    assert move(current, target) == counters


def test_each_node_is_counted_once_in_each_counter_whatever_its_path():
    """What the other nodes count: QUIET (its ranks no longer run) and DONE (its ranks ended), each node once.
    Every path of moves from RUNNING enters a node in QUIET once, and in DONE once when it ends, returns or is
    lost: a counter of nodes compared with the round's size."""
    def paths(been, entered):
        yield been, entered
        for target in NodeState:
            counters = move(been[-1], target)
            if counters is not None:
                assert not set(counters) & set(entered), (been, target, counters)  # never counted twice
                yield from paths(been + (target,), entered + counters)

    ends = {NodeState.RETURNED, NodeState.ENDED, NodeState.LOST}
    for been, entered in paths((NodeState.RUNNING,), ()):
        assert ("quiet" in entered) == (len(been) > 1)
        assert ("done" in entered) == bool(ends & set(been)), (been, entered)  # its ranks ended on the way
        assert {s.value for s in been[1:]} <= set(entered)


@dataclass
class View:
    """A look at a round, in plain values (what a backend's view reads from its store)."""

    record: FailureRecord | None = None
    busy: bool = True
    pending: bool = True
    returned: dict[int, float] = field(default_factory=dict)
    never_arrived: None = None
    waits: frozenset[int] = frozenset()

    def waiting(self, nodes: set[int]) -> bool:
        return bool(nodes) and nodes <= self.waits


RECORD = FailureRecord(2, 2, 0, Outcome.RAISED, 1, "mpddp: rank 2 failed first", 0.0)


@pytest.mark.parametrize("view, lost, culprits, early_exit, retell, waited, step", [
    (View(record=RECORD), Lost([1]), {1}, True, False, 99.0, Wait.RECORD),  # a record stands over all else
    (View(returned={1: 5.0}), None, set(), True, False, 0.1, Wait.EARLY_EXIT),  # node 1 returned as ours waited
    (View(returned={1: 5.0}), None, set(), False, False, 0.1, Wait.LOOK),  # ... not a cause of a rank that raised
    (View(waits=frozenset({1})), None, {1}, False, False, 0.1, Wait.OURS),  # the culprit's node waits: no better
    (View(waits=frozenset({1})), None, {1}, False, True, 0.1, Wait.LOOK),  # ... told again once nobody is busy
    (View(waits=frozenset({1}), busy=False), None, {1}, False, True, 0.1, Wait.OURS),
    (View(waits=frozenset({1})), None, {1, 2}, False, False, 0.1, Wait.LOOK),  # node 2, also blamed, still works
    (View(), Lost([2]), set(), True, False, 0.1, Wait.LOST),  # found lost: named at once
    (View(), None, set(), True, False, 9.9, Wait.LOOK),  # another node still tears down: its record may come
    (View(busy=False), None, set(), True, False, 9.9, Wait.LOOK),  # nobody busy, but not _RECORD_WAIT yet
    (View(busy=False), None, set(), True, False, 10.1, Wait.OURS),  # nobody else can tell better
    (View(), None, set(), True, False, 10.1, Wait.LOOK),  # still busy, within --timeout
    (View(), None, set(), True, False, 30.1, Wait.OURS),  # never past --timeout
])
def test_a_node_waiting_for_the_record_looks_until_one_step_says_otherwise(view, lost, culprits, early_exit, retell,
                                                                          waited, step):
    assert wait_step(view, lost, culprits=culprits, early_exit=early_exit, retell=retell, waited=waited,
                     timeout=30.0, least=10.0) is step


@pytest.mark.parametrize("view, step", [
    (View(), Finish.LOOK),  # another node's ranks still run
    (View(pending=False), Finish.DONE),  # all returned, ended or lost: the round went well
    (View(record=RECORD), Finish.RECORD),  # a node wrote the round's record (then ended): it failed here too
    (View(record=RECORD, pending=False), Finish.RECORD),
])
def test_a_node_whose_ranks_returned_waits_for_the_others_ends(view, step):
    assert finish_step(view) is step


def test_finish_reads_pending_before_the_record():
    """A node writes its record, then ends: read the other way round, the end could be seen without the record."""
    order: list[str] = []

    class Watched(View):
        def __getattribute__(self, name: str) -> object:
            if name in ("record", "pending"):
                order.append(name)
            return object.__getattribute__(self, name)

    finish_step(Watched(pending=False))
    assert order == ["pending", "record"]


@pytest.mark.parametrize("others, knew, read, by_itself, step", [
    # another live node may not have heard the record: the store's loss first, whatever this node knows
    (True, True, True, False, rules.Unheard.GONE),
    (True, False, False, True, rules.Unheard.GONE),  # node 1's rank raised, node 0 killed before its record went
    (True, False, True, False, rules.Unheard.GONE),
    # alone (the store's host gone, the others found lost): what this node knows
    (False, True, False, True, rules.Unheard.KNOWN),  # settled before the store went, as it waited for readers
    (False, False, True, False, rules.Unheard.RECORD),  # its beat read the record
    (False, False, True, True, rules.Unheard.OURS),  # its own rank failed by itself: first, before another's word
    (False, False, False, True, rules.Unheard.OURS),
    (False, False, False, False, rules.Unheard.GONE),  # nothing known: its ranks' failures are consequences
])
def test_a_node_whose_store_went_before_every_node_heard_tells_one_story(others, knew, read, by_itself, step):
    assert rules.unheard(others=others, knew=knew, read=read, by_itself=by_itself) is step


@pytest.mark.parametrize("outcome, node, writer, lost", [
    (Outcome.DIED, 1, 0, True),       # node 0's look found node 1 lost (api.went_away's record)
    (Outcome.DIED, 1, 1, False),      # node 1 told its own rank's death (killed by a signal)
    (Outcome.DIED, 1, -1, False),     # no writer recorded: never taken for a lost node
    (Outcome.STOPPED, 1, 0, False),   # a launcher stopped by a signal
    (Outcome.RAISED, 1, 0, False),
])
def test_a_record_names_a_lost_node_when_another_node_found_it(outcome, node, writer, lost):
    from mpddp.core.nodes.api import is_lost_node

    record = FailureRecord(rank=2 * node, node_rank=node, local_rank=0, outcome=outcome, exit_code=1, line="x",
                           wall_time=0.0, writer=writer)
    assert is_lost_node(record) is lost


def test_the_lost_nodes_record_names_their_first_rank_and_every_rank_in_one_line():
    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.api import is_lost_node, went_away

    config = LaunchConfig(nnodes=4, node_rank=0, master_addr="127.0.0.1", master_port=29500)
    record = went_away(config, 2, Lost([1, 2]))
    assert (record.rank, record.node_rank, record.outcome, record.exit_code) == (2, 1, Outcome.DIED, 1)
    assert record.line == ("mpddp: node(s) 1, 2 went away (the launcher stopped beating without ending its round: "
                           "killed, preempted or its machine lost), taking rank(s) 2-5")
    assert not is_lost_node(record)  # not until a node publishes it (its writer)
