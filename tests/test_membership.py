"""core/nodes/membership.py's join over an in-memory store of keys: the rule itself, with no backend and no process.

The backends' own keys are tested with real launchers (test_elastic.py, test_rendezvous_input.py); here the
launchers are threads and the keys a dict, so that the order of events is the test's, not the machine's load.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from clock import Steps

from mpddp.core.nodes import membership
from mpddp.errors import TooFewNodes


class MemoryKeys:
    """membership.Keys over a dict, with a lock: what node 0's store or etcd would keep."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joined: dict[int, dict[str, str]] = {}
        self.members: dict[int, str] = {}
        self.records: dict[int, object] = {}

    def arrive(self, attempt, me, arrival):
        with self.lock:
            self.joined.setdefault(attempt, {})[me] = arrival
            return len(self.joined[attempt])

    def count(self, attempt):
        with self.lock:
            return len(self.joined.get(attempt, {}))

    def lived(self, attempt):  # nobody is lost here: a restart expects every launcher of the round before
        return self.count(attempt)

    def arrivals(self, attempt):
        with self.lock:
            return dict(self.joined.get(attempt, {}))

    def claim(self, attempt, node_rank, me):
        return None

    def decided(self, attempt):
        with self.lock:
            return self.members.get(attempt)

    def await_decided(self, attempt, timeout):
        time.sleep(timeout)
        return self.decided(attempt)

    def look(self, nodes):
        return 0.01

    def decide(self, attempt, members):
        with self.lock:
            return self.members.setdefault(attempt, members) == members

    def latest(self):
        return max(self.members, default=0)

    def admit(self, attempt, record):
        self.records.setdefault(attempt, record)

    def record(self, attempt):
        return self.records.get(attempt)

    def over(self, attempt, members):
        return False

    def alive(self, attempt, members):
        return True


def _join(keys: MemoryKeys, me: str, *, low: int = 3, high: int = 3, timeout: float = 0.3):
    return membership.join_round(keys, 0, me, low=low, high=high, node_rank=None, last_call=0.05, timeout=timeout,
                                 previous=None, start_them="start them")


@pytest.mark.timeout(30)
def test_launchers_that_give_up_at_different_moments_tell_the_same_count() -> None:
    """--nnodes 3: one launcher gives up alone; another comes after that and gives up too. Before, each told
    what it counted at its own deadline (1, then 2); now both tell the first count written."""
    keys = MemoryKeys()
    with pytest.raises(TooFewNodes) as first:
        _join(keys, "a")
    with pytest.raises(TooFewNodes) as second:
        _join(keys, "b")
    assert (first.value.nodes, second.value.nodes) == (1, 1)
    assert str(first.value) == str(second.value)
    assert keys.count(0) == 2  # the second did come: the story is the round's, as first given up


@pytest.mark.timeout(30)
def test_a_member_list_written_before_a_launcher_gives_up_is_the_round() -> None:
    """A launcher whose deadline passes while another decides the round runs in it, never tells too few."""
    keys = MemoryKeys()
    keys.arrive(0, "b", json.dumps({"old": None, "rank": None, "since": 0.0, "host": "h"}))
    keys.decide(0, json.dumps(["b", "a"]))
    here, members = _join(keys, "a", low=2, high=2, timeout=0.0)
    assert members == ["b", "a"] and here.node_rank == 1


@pytest.mark.timeout(30)
def test_launchers_that_give_up_together_all_tell_one_count() -> None:
    """Two launchers of --nnodes 3 wait at once and give up: both name 2 nodes, the same line."""
    keys = MemoryKeys()
    told: dict[str, TooFewNodes] = {}

    def node(me: str) -> None:
        try:
            _join(keys, me)
        except TooFewNodes as e:
            told[me] = e

    threads = [threading.Thread(target=node, args=(me,)) for me in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(told) == ["a", "b"]
    assert {e.nodes for e in told.values()} == {2} and len({str(e) for e in told.values()}) == 1


def test_a_spare_whose_job_ends_between_two_looks_is_not_needed() -> None:
    """A spare looked (not over: a member had not left yet), then the last members left and their keys went before
    its next look (none alive): the job ended, it was not needed. Before, it went on to a next round alone, and
    ended --timeout later in "1 node(s) joined ... needs at least 2" (seen under load on etcd)."""
    from mpddp.core.nodes.api import NotNeeded

    keys, over = MemoryKeys(), iter([False, True])
    keys.over = lambda attempt, members: next(over)  # type: ignore[method-assign]
    keys.alive = lambda attempt, members: False  # type: ignore[method-assign]
    with pytest.raises(NotNeeded, match="it was not needed"):
        membership._wait_outside(keys, 0, ["a", "b"], 2, "2", "the job", "")


def test_a_spare_whose_member_was_lost_comes_to_the_next_round() -> None:
    """No member left alive and the job not over (a member lost, it never said it left): the spare goes on."""
    keys = MemoryKeys()
    keys.alive = lambda attempt, members: False  # type: ignore[method-assign]
    assert membership._wait_outside(keys, 0, ["a", "b"], 2, "2", "the job", "") is None


class ClockedKeys(MemoryKeys):
    """MemoryKeys whose looks sleep on injected time (tests/clock.py): a wait of --timeout runs in microseconds."""

    def __init__(self, steps) -> None:
        super().__init__()
        self.steps = steps

    def await_decided(self, attempt, timeout):
        self.steps.sleep(timeout)
        return self.decided(attempt)

    def look(self, nodes):
        return 0.1


def _arrival() -> str:
    return json.dumps({"old": None, "rank": None, "since": time.time() + 1.0, "host": "h"})


@pytest.mark.parametrize("decides", [True, False])
def test_a_round_whose_min_came_in_its_last_call_starts_at_the_deadline_with_those_that_came(decides) -> None:
    """--nnodes 2:3, --timeout 8, a last call of 3 s: launcher b comes at 6 s, so the last call would end at 9 s,
    past a's deadline. Before: a wrote that it gave up, and both told "round 0: 2 node(s) joined within --timeout
    8 s, but --nnodes 2:3 needs at least 2" (seen under load, c10d). Now the one that decides starts the round at
    its deadline with the two that came; one that does not decide (c10d's nodes other than 0) runs in the list
    the other writes (here at 9.5 s), and tells no count of its own."""
    steps = Steps()
    keys = ClockedKeys(steps)
    steps.at(6.0, lambda: keys.arrive(0, "b", _arrival()))
    if not decides:
        steps.at(9.5, lambda: keys.decide(0, json.dumps(["a", "b"])))
    here, members = membership.join_round(keys, 0, "a", low=2, high=3, node_rank=None, last_call=3.0, timeout=8.0,
                                          previous=None, start_them="start them", decides=decides, clock=steps.clock)
    assert members == ["a", "b"] and here.node_rank == 0 and here.number == 0
    assert 8.0 < steps.now <= (8.3 if decides else 9.7), steps.now  # the first look past the deadline, or the list


def test_a_round_whose_min_never_came_is_given_up_at_the_deadline_with_its_count() -> None:
    """The other side of the rule above: one launcher of 2:3 alone at its deadline tells the count it gave up on."""
    steps = Steps()
    keys = ClockedKeys(steps)
    with pytest.raises(TooFewNodes) as told:
        membership.join_round(keys, 0, "a", low=2, high=3, node_rank=None, last_call=3.0, timeout=8.0, previous=None,
                              start_them="start them", clock=steps.clock)
    assert told.value.nodes == 1 and str(told.value).startswith("round 0: 1 node(s) joined within --timeout 8 s")
    assert 8.0 < steps.now <= 8.3, steps.now
