"""The straggler named is the rank the others wait for, and ranks late in turn name no one
(core/launcher/stragglers.py); real processes on the CPU with gloo.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mpddp
from mpddp.core.launcher import stragglers
from mpddp.core.launcher.board import ARRIVALS, ARRIVALS_KEY, Board
from mpddp.core.wire.protocol import Call, Collectives

pytestmark = pytest.mark.timeout(120)

_LATE = 0.7  # seconds a rank lingers before it returns: its flight-recorder reader (every 0.5 s) reads the end


def _said(caplog, words):
    return [r for r in caplog.records if r.name == "mpddp" and words in r.getMessage()]


def one_late(ctx, slow, steps):
    t = torch.ones(100)
    for _ in range(steps):
        time.sleep(0.01)
        if ctx.rank == slow:
            time.sleep(0.03)
        dist.all_reduce(t)
    time.sleep(_LATE)
    return ctx.rank


def test_with_three_ranks_the_late_one_is_named(no_leftovers, caplog):
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(one_late, nprocs=3, args=(2, 90)) == [0, 1, 2]
    named = _said(caplog, "is a straggler")
    assert len(named) == 1 and named[0].getMessage().startswith("mpddp: rank 2 is a straggler"), caplog.text
    assert _said(caplog, "mpddp: collectives: ")[0].mpddp_collectives.straggler == 2


def taking_turns(ctx, steps):
    t = torch.ones(1)
    for i in range(steps):
        if i % ctx.world_size == ctx.rank:
            time.sleep(0.05)  # the ranks take turns being late: neither is the one the others wait for
        dist.all_reduce(t)
    time.sleep(_LATE)
    return ctx.rank


def test_two_ranks_late_in_turn_name_no_straggler(no_leftovers, caplog):
    """Two ranks late in turn, 50 ms every other step: perfectly symmetric.

    Was, before the fix: "rank 0 is a straggler: it reaches collectives 50 ms after the first rank (median of its last
    59 ...)", and the summary "rank 0 was the straggler: it arrived last at 50% of them, median lag 24 ms" above
    a table where rank 1's median lag is 25 ms. Whichever rank was late first has one late arrival more in an
    odd window (30 of 59), so its median is the late value; in an even window the median is the mean of a late
    and an on-time arrival (25 ms > 20 ms). Rank 1 would be named by the same numbers a step later.

    Should: name no one, as with three ranks taking turns (checked below): a straggler is a rank the others wait
    for more than the others wait for anyone else, not one of two equal halves (e.g. compare its lag with the
    other ranks', or require clearly more than half of its arrivals late).
    """
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(taking_turns, nprocs=2, args=(80,)) == [0, 1]
    assert not _said(caplog, "is a straggler"), caplog.text
    assert _said(caplog, "mpddp: collectives: ")[0].mpddp_collectives.straggler is None


def test_three_ranks_late_in_turn_name_no_straggler(no_leftovers, caplog):
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(taking_turns, nprocs=3, args=(75,)) == [0, 1, 2]
    assert not _said(caplog, "is a straggler"), caplog.text


def equal_buckets(ctx, steps, step, lag):
    torch.manual_seed(0)
    # 16 layers of 64 x 64, 20 KB buckets: 8 buckets of the very same size, all_reduced at every step
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)]), bucket_cap_mb=0.02)
    x = torch.randn(8, 64)
    for _ in range(steps):
        time.sleep(step - lag)  # both ranks: loading a batch
        loss = model(x).sum()
        if ctx.rank == 1:
            time.sleep(lag)
        loss.backward()
    time.sleep(_LATE)
    return ctx.rank


def test_a_lag_small_against_a_long_step_is_not_named_when_buckets_have_one_size(no_leftovers, caplog):
    """DDP with 8 gradient buckets of one size (equal layers, a small ``bucket_cap_mb``); a step takes
    400 ms; rank 1 is 25 ms late at each: 6 % of a step, under the rule's tenth ("a lag that costs nothing is not
    told").

    Was, before the fix: "rank 1 is a straggler: it reaches collectives 25 ms after the first rank (...; a step takes
    about 0.1 ms)". The step is estimated as the median time between two arrivals at "the same kind of
    collective" (group, op, shapes), assumed to recur once a step; 8 buckets of one shape recur 8 times a step,
    7 of them a fraction of a millisecond apart, so the step comes out at 0.1 ms and the share of a step never
    protects (``Stragglers.add``/``step``).

    Should: estimate a step of about 400 ms (e.g. by the same collective number modulo the collectives per step,
    or the gaps between bursts), and not name rank 1.
    """
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(equal_buckets, nprocs=2, args=(8, 0.4, 0.025)) == [0, 1]
    assert not _said(caplog, "is a straggler"), caplog.text
    summary = _said(caplog, "mpddp: collectives: ")[0].mpddp_collectives
    assert summary.step is not None and 0.2 < summary.step < 1.0, summary.step


def late_then_together(ctx, steps):
    ts = [torch.ones(n) for n in (10, 20, 30, 40)]
    for _ in range(steps):
        time.sleep(0.17)  # both ranks: nobody waits for anybody here
        if ctx.rank == 1:
            time.sleep(0.03)  # only rank 1: rank 0 waits for it
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for work in works:
            work.wait()
    time.sleep(1.0)  # both ranks, after the loop: nobody waits
    return ctx.rank


def test_where_the_straggler_is_while_the_others_wait_is_sampled_while_they_wait(no_leftovers, caplog):
    """Rank 1 is 30 ms late at each of a step's 4 collectives (a step: 200 ms, 170 of them a sleep on
    both ranks): rightly named.

    Was, before the fix: the message ends "while the others wait it is in late_then_together at
    test_stragglers.py:N (time.sleep(0.17)  # both ranks: nobody waits for anybody here) (k of 5
    samples)" (or the sleep after the loop, when the rows that tip the rule come in last). ``_sample`` in
    core/launcher/attempt.py takes 5 stacks of the straggler 50 ms apart whenever the rule fires, without looking
    at whether the others wait then; the most common place is wherever the rank spends most of its time.

    Should: sample (or keep) only the straggler's locations taken while another rank waits in a collective, here
    the line marked "only rank 1"; else leave the "while the others wait" part out.
    """
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(late_then_together, nprocs=2, args=(16,)) == [0, 1]
    named = _said(caplog, "is a straggler")
    assert len(named) == 1 and named[0].getMessage().startswith("mpddp: rank 1 is a straggler"), caplog.text
    told = named[0].getMessage()
    assert "nobody waits" not in told, told
    assert "while the others wait" not in told or "# only rank 1" in told, told


ACROSS = """
import sys, time
import torch, torch.distributed as dist
import mpddp

_LATE = %(late)r

%(one_late)s

if __name__ == "__main__":
    node, port = int(sys.argv[1]), int(sys.argv[2])
    mpddp.launch(one_late, nprocs=1, nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=port,
                 backend="gloo", args=(1, 240), timeout=60)
"""


def test_a_straggler_on_another_node_is_named_by_node_0(tmp_path):
    """One rank a node: no node has two of its own to compare (node 1's board lines up no row at all), so the
    straggler was named nowhere; node 0 now lines the nodes up from the arrivals they share every beat."""
    from multinode import Cluster, free_port

    script = tmp_path / "across.py"
    script.write_text(ACROSS % {"late": _LATE, "one_late": inspect.getsource(one_late)})  # the same rank code
    cluster, port = Cluster(tmp_path), free_port()
    try:
        nodes = [cluster.start([], command=[sys.executable, str(script), str(n), str(port)]) for n in (0, 1)]
        codes = [node.wait(100) for node in nodes]
        assert codes == [0, 0], "\n\n".join(n.stderr for n in nodes)
        named = [line for line in nodes[0].stderr.splitlines() if "is a straggler" in line]
        assert len(named) == 1 and named[0].startswith("mpddp: rank 1 is a straggler: it reaches collectives"), \
            nodes[0].stderr
        assert "is a straggler" not in nodes[1].stderr  # one node reads them all
        assert cluster.leftovers(wait=5) == []
    finally:
        cluster.kill_all()


def _arrival(seq: int, at: float) -> Call:
    return Call("0", seq, "all_reduce", ((100,),), ("Float",), int((1.8e9 + at) * 1e9), "gloo", 0, seq)


def test_the_step_is_timed_across_the_holes_of_rows_that_come_in_samples():
    """Node 0 sees another node's arrivals in samples, every few seconds: the time across a hole between two
    samples is no step. A collective every 40 ms, rank 1 late by 30 ms; 19 rows of each 2 s.

    Was: the gaps between the samples read as bursts 2 s apart, the step as 2 s, and 30 ms as under a tenth of it,
    so the straggler was never named (node 0 under load, with a node's snapshots a read behind its own)."""
    lags = stragglers.Stragglers()
    for look in range(6):
        numbers = range(look * 50 + 31, look * 50 + 50)
        lags.add([{0: _arrival(n, n * 0.04), 1: _arrival(n, n * 0.04 + 0.03)} for n in numbers])
    assert lags.step == pytest.approx(0.04)
    assert lags.suspect() == 1


def test_node_0_lines_up_every_sample_of_a_node_whose_snapshots_come_behind_its_own():
    """Real boards: node 1's reader reports its rank's collectives every 0.6 s and its beat shares them at once;
    node 0 looks every LOOK seconds. Every number of node 1's snapshot is a row, though node 0's own newest
    arrivals are ahead of it by up to 15 numbers: node 0 keeps its own from every pass of its watch.

    Was: node 0 lined up its own last 32 with node 1's last 32 at each look: 17 rows of 32 here."""
    mine, theirs = Board([0]), Board([1])
    across = stragglers.AcrossNodes(nnodes=2)
    shared: list[bytes] = []
    looks = reported = 0
    for tick in range(1, 60):  # the watch's passes, 0.2 s apart: 12 s
        now = tick * 0.2
        seqs = range(int((now - 0.2) / 0.04) + 1, int(now / 0.04) + 1)
        mine.add(0, Collectives(tuple(_arrival(n, n * 0.04) for n in seqs), ()))
        if tick % 3 == 0:  # node 1's reader, then its beat
            upto = int(now / 0.04)
            theirs.add(1, Collectives(tuple(_arrival(n, n * 0.04 + 0.03) for n in range(reported + 1, upto + 1)), ()))
            reported = upto
            shared[:] = [theirs.snapshot(whole=True) or b""]
        before = across.looked
        across.watch(mine.arrivals, lambda: shared, now)
        looks += across.looked != before
    assert across.lags.rows == looks * ARRIVALS
    assert across.lags.step == pytest.approx(0.04)
    assert across.lags.suspect() == 1


def test_node_0_of_1024_keeps_only_the_numbers_that_can_still_complete():
    """1,024 nodes, each one's sample of 32 some numbers behind node 0 (0 to 15, as their beats and readers fall):
    a number below every node's sample never completes, and is dropped at once instead of 1,024 numbers later
    (about 100 MB of calls at 1,024 nodes)."""
    nodes, rng = 1024, random.Random(0)
    across = stragglers.AcrossNodes(nnodes=nodes)
    behind = [0] + [rng.randrange(16) for _ in range(nodes - 1)]
    assert min(behind[1:]) == 0 and max(behind) == 15
    samples: list[bytes] = []
    most = 0
    for look in range(1, 16):
        newest = look * 50  # a collective every 40 ms, a look every 2 s
        mine = [(("0", "gloo", 0), n, int((1.8e9 + n * 0.04) * 1e9), 0) for n in range(newest - 31, newest + 1)]
        samples[:] = [json.dumps({ARRIVALS_KEY: [["0", "gloo", 0, n, int((1.8e9 + n * 0.04) * 1e9), node]
                                                 for n in range(newest - behind[node] - 31,
                                                                newest - behind[node] + 1)]})
                      .encode() for node in range(1, nodes)]
        across.watch(mine, lambda: samples, look * stragglers.LOOK)
        most = max(most, sum(map(len, across._waiting.values())))
    assert across.lags.rows == 15 * (32 - 15)  # at each look, the numbers every node's sample held
    assert most < 33 * nodes  # about one sample a node


def test_a_summary_says_whose_ranks_it_covers():
    """Node 0 of two said "rank 3 is a straggler", then closed with "no straggler (... rank 0)": its summary was of
    its own ranks, and did not say so. Now node 0's covers the nodes lined up; another node's says it is its own."""
    from dataclasses import replace

    from mpddp.core.launcher.stragglers import RankLag, Summary, summary_lines

    own = Summary(100, (RankLag(2, 100, 0.0, 0.0, 0.0, 0.02), RankLag(3, 100, 0.15, 0.15, 0.16, 0.98)), 3, 0.1,
                  scope="node 1's ranks")
    assert summary_lines(own, False) == [
        "mpddp: collectives: 100 lined up across node 1's ranks only (2 ranks); rank 3 was the straggler: it arrived "
        "last at 98% of them, median lag 150 ms (p90 160 ms)"]
    lined = replace(own, scope="", nodes=2)
    assert summary_lines(lined, False)[0].startswith(
        "mpddp: collectives: 100 lined up across 2 nodes (the last rank of each to arrive); rank 3 was the straggler")
    assert summary_lines(replace(own, scope=""), False)[0].startswith(
        "mpddp: collectives: 100 lined up across 2 ranks;")
