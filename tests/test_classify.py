"""classify(): every rank's outcome from the launcher's facts, one pure function (core/launcher/classify.py).

The end-to-end reports are tested with real processes (tests/test_failure_model.py,
tests/test_rank_errors.py, tests/test_collectives.py); here the rule itself, as a table of
facts, and that deciding changes nothing: the report only renders the verdict.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import fields
from pathlib import Path

import pytest

from mpddp.core.launcher import classify as verdicts
from mpddp.core.launcher.board import Mismatch, Standing
from mpddp.core.launcher.classify import Hang, RankState, classify, root_cause
from mpddp.core.wire.protocol import Call, Failure, Left
from mpddp.core.wire.stacks import Location
from mpddp.errors import Outcome
from mpddp.rank_math import layout

Out = Outcome


def ranks(n: int = 3) -> list[RankState]:
    return [RankState(slot=slot, process=None, messages=None) for slot in layout(1, n)]


def raised(s: RankState, at: float, kind: Outcome = Out.RAISED) -> None:
    s.failure = Failure(rank=s.slot.rank, kind=kind, error_type="ValueError", message="m", traceback="", time=at,
                        where="all_reduce at t.py:3" if kind is Out.COLLECTIVE else None)
    s.failed_at, s.exitcode = at, 1


def returned(s: RankState, at: float) -> None:
    s.has_result, s.exitcode, s.finished_at = True, 0, at


def stopped(s: RankState) -> None:
    s.stopped, s.exitcode, s.failed_at = True, -15, 99.0


def test_the_user_error_is_the_cause_whatever_arrived_first() -> None:
    states = ranks()
    raised(states[0], 2.0, Out.COLLECTIVE)  # a victim, first
    raised(states[1], 3.0)  # the cause, later
    stopped(states[2])
    verdict = classify(states)
    assert verdict.outcomes == {0: Out.COLLECTIVE, 1: Out.RAISED, 2: Out.STOPPED}
    assert (verdict.case, root_cause(states, verdict).slot.rank) == ("failed", 1)


def test_a_rank_that_returned_before_the_collective_broke_is_the_cause() -> None:
    states = ranks(2)
    returned(states[0], 1.0)
    raised(states[1], 2.0, Out.COLLECTIVE)
    verdict = classify(states)
    assert (verdict.case, verdict.culprits, verdict.outcomes) == (
        "returned", (0,), {0: Out.EARLY_EXIT, 1: Out.COLLECTIVE})
    returned(states[0], 3.0)  # it returned after: not the cause
    assert classify(states).outcomes == {0: Out.OK, 1: Out.COLLECTIVE}


def test_a_collective_that_timed_out_blames_the_ranks_still_running() -> None:
    """classify() decides the "stuck" case (the report only words it): rank 0's collective timed out while rank 2
    computed elsewhere, and was stopped."""
    states = ranks()
    raised(states[0], 2.0, Out.COLLECTIVE)
    stopped(states[2])
    verdict = classify(states)
    assert (verdict.case, verdict.culprits) == ("stuck", (2,))
    assert verdict.outcomes == {0: Out.COLLECTIVE, 1: Out.OK, 2: Out.STOPPED}


def test_a_rank_that_left_the_group_is_the_cause() -> None:
    states = ranks(2)
    states[0].left = Left(where="destroy_process_group at t.py:9", time=1.0)
    stopped(states[0])
    raised(states[1], 2.0, Out.COLLECTIVE)
    verdict = classify(states)
    assert (verdict.case, verdict.outcomes) == ("left", {0: Out.EARLY_EXIT, 1: Out.COLLECTIVE})


def locate(waiting: bool) -> Location:
    return Location(text="all_reduce at t.py:3" if waiting else "compute at t.py:5", waiting=waiting, dump="")


@pytest.mark.parametrize(("locations", "finished", "case", "culprits", "outcome"), [
    ({0: locate(True), 1: locate(False), 2: locate(True)}, (), "idle", (1,), Out.HUNG),
    ({0: locate(True), 1: locate(True)}, (2,), "returned", (2,), Out.EARLY_EXIT),
    ({0: locate(True), 1: locate(True), 2: locate(True)}, (), "nowhere", (0, 1, 2), Out.HUNG),
])
def test_a_hang_is_blamed_by_where_the_ranks_were(locations: dict, finished: tuple, case: str, culprits: tuple,
                                                  outcome: Outcome) -> None:
    states = ranks()
    for s in states:
        stopped(s)
    verdict = classify(states, Hang(60.0, locations, finished))
    assert (verdict.case, verdict.hang and verdict.hang.case, verdict.culprits) == ("hang", case, culprits)
    assert [r for r, o in verdict.outcomes.items() if o is outcome] == list(culprits)


def test_a_mismatch_names_the_odd_rank_and_a_rank_s_own_report_wins() -> None:
    states = ranks()
    raised(states[0], 1.0)
    verdict = classify(states, mismatch=Mismatch(calls={}, odd=2))
    assert verdict.outcomes == {0: Out.RAISED, 1: Out.OK, 2: Out.MISMATCH}
    assert classify(states, mismatch=Mismatch(calls={}, odd=0)).outcomes[0] is Out.RAISED  # its own report wins


def test_a_blamed_rank_whose_own_report_is_a_broken_collective_gets_the_verdict() -> None:
    # seen under load: the teardown stopped rank 0 first, and the odd rank's broadcast failed before its SIGTERM
    states = ranks(2)
    stopped(states[0])
    raised(states[1], 1.0, Out.COLLECTIVE)
    assert classify(states, mismatch=Mismatch(calls={}, odd=1)).outcomes[1] is Out.MISMATCH


def _behind(rank: int) -> Hang:
    """A hang in which ``rank`` is behind everyone else at all_reduce #7 (six ranks, as the nodes' shared boards
    show them)."""
    top, before = (Call("0", seq, "all_reduce", ((1,),), ("Float",), 0) for seq in (7, 6))
    ahead = tuple(r for r in range(6) if r != rank)
    return Hang(60.0, {0: None, 1: None}, (), (Standing(top, ahead, {rank: before}, ahead),))


@pytest.mark.parametrize(("verdict_of", "case", "culprits"), [
    (lambda states: classify(states, mismatch=Mismatch(calls={}, odd=4)), "mismatch", (4,)),
    (lambda states: classify(states, _behind(5)), "hang", (5,)),
])
def test_a_culprit_on_another_node_leaves_this_node_s_ranks_their_own_outcome(verdict_of, case, culprits) -> None:
    """On several nodes the culprit may be a rank this launcher does not run (seen through the collectives the
    nodes share): classify() raised a KeyError for it. Its outcome is its own node's to tell."""
    states = [RankState(slot=slot, process=None, messages=None) for slot in layout(3, 2) if slot.node_rank == 0]
    stopped(states[0])
    raised(states[1], 1.0, Out.COLLECTIVE)
    verdict = verdict_of(states)
    assert (verdict.outcomes, verdict.case, verdict.culprits) == ({0: Out.STOPPED, 1: Out.COLLECTIVE}, case, culprits)


def test_classify_changes_nothing() -> None:
    states = ranks(2)
    returned(states[0], 1.0)
    raised(states[1], 2.0, Out.COLLECTIVE)
    before = copy.deepcopy(states)
    classify(states)
    classify(states, Hang(60.0, {1: locate(True)}, (0,)))
    assert states == before


def _assigned_attributes(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        found |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
    return found


def test_the_report_only_renders() -> None:
    """No message builder of core/launcher/report.py (nor classify itself) assigns to a rank's state."""
    state_fields = {f.name for f in fields(RankState)}
    for module in ("report.py", "classify.py"):
        path = Path(verdicts.__file__).parent / module
        assert not (_assigned_attributes(path) & state_fields), module


def test_the_rule_is_checked_on_real_assignments(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("def f(s):\n    s.stopped = True\n    s.tail += []\n")
    assert _assigned_attributes(sample) == {"stopped", "tail"}


def test_the_culprits_own_node_shows_where_it_was_when_another_node_told_the_hang() -> None:
    """A hang told first by another node (through the collectives the nodes share): only the culprit's node can
    take its stack. CI, 8 nodes: rank 14's node named it 'the one to look at', and no place."""
    from mpddp.core.launcher.report import remote_error
    from mpddp.core.wire.protocol import FailureRecord

    states = [RankState(slot=slot, process=None, messages=None) for slot in layout(8, 2) if slot.node_rank == 7]
    for s in states:
        stopped(s)
    states[0].location = Location("wait_for_nfs at train.py:12 (os.stat(path))", False, "")
    line = "mpddp: rank 14 made no progress for 21 s while ranks 0-13, 15 waited for it in all_gather #1"
    record = FailureRecord(14, 7, 0, Out.HUNG, 1, line, 0.0, writer=5)
    report = str(remote_error(record, states, classify(states), 7)).splitlines()
    assert report[:4] == [line, "mpddp: node 5 saw it through the collectives the nodes share; rank 14 is this "
                          "node's, and the one to look at", "mpddp: where rank 14 was:",
                          "  rank 14 is at wait_for_nfs at train.py:12 (os.stat(path))"], report
