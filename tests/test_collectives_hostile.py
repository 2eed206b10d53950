"""A hostile pass over the collectives watch (core/rank/recorder.py, core/launcher/board.py, core/launcher/stragglers.py, core/launcher/watchdog.py).

Correct programs must never be stopped as a mismatch, ranks that progress must never be called hung, the
straggler named must be the rank the others wait for, and every report must say only what happened.
Real processes on the CPU with gloo, each under a timeout and with nothing left running; a few rules are
checked directly with recorded flight-recorder dumps and stacks, where a CPU cannot make the case.

Tests that fail here fail on a bug found by this pass: their docstrings say what happens and what should.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mpddp
from mpddp.core.launcher.board import Board
from mpddp.core.rank import recorder
from mpddp.core.wire import stacks
from mpddp.core.wire.protocol import Call, Collectives

from runs import Run

pytestmark = pytest.mark.timeout(120)

_LATE = 0.7  # seconds a rank lingers before it returns: its flight-recorder reader (every 0.5 s) reads the end


def _said(caplog, words):
    return [r for r in caplog.records if r.name == "mpddp" and words in r.getMessage()]


# ---- correct programs are not mismatches ---------------------------------------------------------------------


def many_groups(ctx):
    """Subgroups of every kind, each with collectives of its own, some on one rank only."""
    r, w = ctx.rank, ctx.world_size
    everyone = dist.new_group(list(range(w)))
    same_ranks = dist.new_group(list(range(w)))  # a second group of the very same ranks
    cpu = dist.new_group(list(range(w)), backend="cpu:gloo")
    alone = dist.new_group([0])  # rank 0's own group, for a rank-0-only evaluation
    pair = dist.new_group([0, 1])  # not every rank when there are 3
    mine, _ = dist.new_subgroups(group_size=1)
    for _ in range(3):
        dist.all_reduce(torch.ones(3), group=everyone)
        dist.broadcast(torch.ones(5), 0, group=same_ranks)
        dist.all_reduce(torch.ones(7), group=cpu)
        if r == 0:
            dist.all_reduce(torch.ones(11), group=alone)
            dist.broadcast(torch.ones(2), 0, group=alone)
        if r in (0, 1):
            dist.all_reduce(torch.ones(13), group=pair)
        dist.all_reduce(torch.ones(19), group=mine)
        dist.all_reduce(torch.ones(4))
    time.sleep(_LATE)
    # objects of a different size on every rank
    for i in range(2):
        objs = [None] * w
        dist.all_gather_object(objs, "x" * (10 + 1000 * r + i))
        box = ["a" * 500] if r == 0 else [None]
        dist.broadcast_object_list(box, 0)
        out = [None] * w if r == 0 else None
        dist.gather_object({"r": r, "x": "y" * r * 100}, out, dst=0)
        got = [None]
        dist.scatter_object_list(got, [list(range(k * 50)) for k in range(w)] if r == 0 else None, src=0)
    time.sleep(_LATE)
    # tensors of a different size on every rank, where the op allows it
    for _ in range(2):
        splits = [1 + r + j for j in range(w)]  # rank r sends 1 + r + j to rank j, and receives as much back
        out = torch.empty(sum(splits))
        dist.all_to_all_single(out, torch.arange(float(sum(splits))), splits, splits)
        dist.reduce_scatter(torch.empty(2 + r), [torch.ones(2 + j) for j in range(w)])  # uneven outputs
        dist.all_gather([torch.empty(3) for _ in range(w)], torch.ones(3))
        dist.reduce(torch.ones(4), dst=1)
        dist.gather(torch.ones(3), [torch.empty(3) for _ in range(w)] if r == 1 else None, dst=1)
        dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(w)] if r == 1 else None, src=1)
        dist.all_reduce(torch.ones(3, dtype=torch.complex64))
        sparse = torch.sparse_coo_tensor(torch.tensor([list(range(1 + r))]), torch.ones(1 + r), (5,))
        dist.all_reduce(sparse)  # a different number of values on each rank
    time.sleep(_LATE)
    # point to point, async, barriers
    for i in range(2):
        if r == 0:
            dist.send(torch.ones(3 + i), 1)
            dist.recv(torch.ones(5), 1)
        elif r == 1:
            dist.recv(torch.ones(3 + i), 0)
            dist.send(torch.ones(5), 0)
        if r in (0, 1):
            ops = [dist.P2POp(dist.isend, torch.ones(2) * r, 1 - r), dist.P2POp(dist.irecv, torch.zeros(2), 1 - r)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        works = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(3)]
        dist.broadcast(torch.ones(9), 0, async_op=True)  # never waited for
        works[-1].wait()
        dist.monitored_barrier()
        dist.barrier()
    time.sleep(_LATE)
    return r


@pytest.mark.parametrize("nprocs", [2, 3])
def test_subgroups_objects_uneven_tensors_p2p_and_async_are_no_mismatch(no_leftovers, nprocs):
    assert mpddp.launch(many_groups, nprocs=nprocs, timeout=30) == list(range(nprocs))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.bn = nn.BatchNorm1d(64)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, skip=False):
        h = torch.relu(self.bn(self.a(self.emb(x).mean(1))))
        return self.c(h if skip else torch.relu(self.b(h)))


def ddp_variants(ctx):
    from torch.distributed.algorithms.join import Join

    r = ctx.rank
    torch.manual_seed(r)
    model = DDP(_Net(), bucket_cap_mb=0.005, find_unused_parameters=True)  # several buckets, unused parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        x = torch.randint(0, 50, (8, 5))
        if step % 4 != 3:
            with model.no_sync():  # gradient accumulation
                model(x, skip=step % 2 == 0).sum().backward()
        else:
            model(x, skip=step % 3 == 0).sum().backward()
            opt.step()
            opt.zero_grad()
    time.sleep(_LATE)
    alone = dist.new_group([0])
    if r == 0:  # a rank-0-only evaluation, with collectives in a group of rank 0 alone
        with torch.no_grad():
            model.module.eval()
            model.module(torch.randint(0, 50, (4, 5)))
        dist.all_reduce(torch.ones(1), group=alone)
        dist.broadcast(torch.ones(2), 0, group=alone)
    dist.barrier()
    # uneven inputs under Join: the rank that runs out shadows the others' all_reduces
    joined = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)), bucket_cap_mb=0.001)
    with Join([joined]):
        for _ in range(4 + 3 * r):
            joined(torch.randn(4, 8)).sum().backward()
    # sparse gradients, a different number of rows per rank
    bag = DDP(nn.EmbeddingBag(100, 8, sparse=True))
    for _ in range(3):
        bag(torch.randint(0, 100, (3 + r, 4))).sum().backward()
    # static graph
    static = DDP(_Net(), static_graph=True, bucket_cap_mb=0.005, gradient_as_bucket_view=True)
    for _ in range(4):
        static(torch.randint(0, 50, (8, 5))).sum().backward()
    time.sleep(_LATE)
    return r


def test_ddp_buckets_unused_parameters_no_sync_join_and_sparse_are_no_mismatch(no_leftovers):
    assert mpddp.launch(ddp_variants, nprocs=2, timeout=30) == [0, 1]


def fsdp_and_checkpoint(ctx, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r = ctx.rank
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5))  # 33 rows: uneven shards
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(3 + r, 7)).sum().backward()
        opt.step()
        opt.zero_grad()
    time.sleep(_LATE)
    state = {f"w{r}": torch.randn(10 + r), "step": r, "name": "x" * (1 + 50 * r)}
    dcp.save(state, checkpoint_id=path)
    loaded = {f"w{r}": torch.empty(10 + r), "step": 0, "name": ""}
    dcp.load(loaded, checkpoint_id=path)
    time.sleep(_LATE)
    return r


def test_fsdp2_and_a_distributed_checkpoint_on_cpu_are_no_mismatch(no_leftovers, tmp_path):
    assert mpddp.launch(fsdp_and_checkpoint, nprocs=2, args=(str(tmp_path / "ckpt"),), timeout=30) == [0, 1]


SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
alone = dist.new_group([0])
pair = dist.new_group([0, 1])
for i in range(3):
    if r == 0:
        dist.all_reduce(torch.ones(3), group=alone)
    dist.all_reduce(torch.ones(5), group=pair)
    objs = [None] * w
    dist.all_gather_object(objs, "x" * (1 + 100 * r))
    if r == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.ones(2), 0)
    dist.all_reduce(torch.ones(4), async_op=True)
    dist.barrier()
time.sleep(0.7)
print("DONE", r, flush=True)
dist.destroy_process_group()
"""


def test_a_torchrun_style_script_with_subgroups_objects_and_p2p_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", "--timeout", "30", str(script)], tmp_path)
    try:
        assert run.finish(90) == 0, run.stderr
    finally:
        run.kill()
    assert run.stdout.count("DONE") == 2 and "called" not in run.stderr, run.stderr
    run.assert_nothing_left()


def reinitialized(ctx):
    """Short sessions of the default group, one after the other, as a script that sets up twice does."""
    store = dist.distributed_c10d._get_default_store()
    for k, op in enumerate(["barrier", "all_reduce", "broadcast", "all_reduce"]):
        if op == "barrier":
            dist.barrier()
        elif op == "all_reduce":
            dist.all_reduce(torch.ones(10))
        else:
            dist.broadcast(torch.ones(3), 0)
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"session{k}", store), rank=ctx.rank,
                                world_size=ctx.world_size)
    for _ in range(3):
        dist.all_reduce(torch.ones(10))
    time.sleep(1.2)
    return ctx.rank


def test_a_default_group_set_up_again_is_not_a_mismatch(no_leftovers):
    """Every rank destroys the default group and sets it up again, doing the same collectives in the
    same order: a correct program (it runs to the end under torchrun and without the recorder).

    Was, before the fix: ``CollectiveMismatch`` ("rank 0 called all_reduce #1 (float32[10]) while rank 1 called
    barrier #1"), every time. The new group is named "0" again and numbers its collectives from 1 again,
    while the destroyed group's entries are still in the recorder's buffer: one read of a rank carries
    barrier #1 *and* all_reduce #1 of the same lane, ``Board.add`` overwrites that rank's call in the row
    with the second, and the other rank's first is then compared with it. (Also, ``Reader._sent`` keeps the
    old maximum, so the new group's first numbers are never sent.)

    Should: run to the end. A group's entries must be told apart from an earlier group of the same name
    (the entries' ``pg_id``/``record_id``, or a number going back down starts a new lane), and a rank's two
    calls at one number must never be lined up as if they were one.
    """
    assert mpddp.launch(reinitialized, nprocs=2, timeout=30) == [0, 1]


def reshaped_broadcast(ctx):
    if ctx.rank == 0:
        weights = torch.arange(6.0).view(2, 3)
        dist.broadcast(weights, 0)
    else:
        flat = torch.empty(6)  # a receiver's flat buffer, viewed as the weights once received
        dist.broadcast(flat, 0)
        weights = flat.view(2, 3)
    time.sleep(1.2)
    return weights.sum().item()


def test_a_broadcast_into_a_buffer_of_the_same_size_but_another_shape_is_not_a_mismatch(no_leftovers):
    """torch documents broadcast as "tensor must have the same number of elements in all processes"
    (``torch.distributed.broadcast``'s docstring): rank 0 sends float32[2, 3], rank 1 receives into a
    float32[6] buffer, and the data arrives (gloo and NCCL move bytes).

    Was, before the fix: ``CollectiveMismatch``: "rank 0 called broadcast #1 (float32[2, 3]) while rank 1 called
    broadcast #1 (float32[6])", while both ranks had already passed the broadcast (both stacks are at the
    sleep after it).

    Should: return [15.0, 15.0]. For broadcast (and reduce/all_reduce, which are element-wise) compare the
    number of elements and the dtype, not the shape (``_signature`` in core/launcher/board.py).
    """
    assert mpddp.launch(reshaped_broadcast, nprocs=2, timeout=30) == [15.0, 15.0]


def rank_0_differs(ctx):
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.all_reduce(t)
    if ctx.rank == 2:
        time.sleep(1.0)  # the third rank comes a moment later, to the same broadcast as rank 1
    if ctx.rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 1)
    time.sleep(3600)


def test_the_odd_one_out_is_rank_0_when_ranks_1_and_2_agree(no_leftovers):
    """Three ranks; ranks 1 and 2 call broadcast #3, rank 0 calls all_reduce #3: rank 0 is "the rank
    whose call differs from most others'" (docs/failures.rst).

    Was, before the fix: ``CollectiveMismatch`` with ``rank`` 1: "rank 0 called all_reduce #3 (float32[8]) while rank 1
    called broadcast #3 (float32[8])". ``Board.add`` decides as soon as a row holds two different calls; with two
    ranks in the row it is a tie, and a tie goes to the highest rank, so rank 0 is never the odd one unless its
    report happens to come last. Here rank 2 comes 1 s later, so that it never does; without that delay the same
    happens in most runs (8 of 9 here). (The existing test's odd rank is rank 2, which wins every tie.)

    Should: name rank 0 ("ranks 1, 2 called broadcast #3 ... while rank 0 called all_reduce #3 ..."): with a tie in
    a row not yet full, wait (a couple of seconds at most) for the rest of the row before naming the odd one.
    """
    with pytest.raises(mpddp.CollectiveMismatch) as info:
        mpddp.launch(rank_0_differs, nprocs=3, timeout=60)
    assert info.value.rank == 0, str(info.value)
    assert str(info.value).startswith("mpddp: ranks 1, 2 called broadcast #3 (float32[8]) while rank 0 called "
                                      "all_reduce #3 (float32[8])"), str(info.value)


# ---- ranks that progress are not hung; a hang is told as it was -----------------------------------------------


def progress_on_screen(ctx):
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 0:  # waits for something without the CPU, but says so
        for i in range(6):
            time.sleep(0.5)
            print(f"still loading {i}", flush=True)
        for i in range(6):  # a progress bar: carriage returns, no newline
            time.sleep(0.5)
            sys.stderr.write(f"\rdownloading {i}/6")
            sys.stderr.flush()
        sys.stderr.write("\n")
    dist.barrier()
    return ctx.rank


def test_a_rank_that_writes_output_while_the_others_wait_is_not_hung(no_leftovers):
    assert mpddp.launch(progress_on_screen, nprocs=2, timeout=2) == [0, 1]


def async_pending_while_computing(ctx):
    work = dist.all_reduce(torch.ones(4), async_op=True) if ctx.rank == 0 else None
    x = torch.randn(200, 200)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        x = (x @ x).tanh()
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(4))
    else:
        work.wait()
    return ctx.rank


def test_an_async_collective_open_for_long_while_ranks_compute_is_not_hung(no_leftovers):
    assert mpddp.launch(async_pending_while_computing, nprocs=2, timeout=2) == [0, 1]


def writes_a_file(ctx, path):
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 0:
        with open(path, "w") as f:
            for _ in range(240):
                time.sleep(0.25)  # a checkpoint written slowly, nothing on screen
                f.write("x\n")
                f.flush()
    dist.barrier()


def test_a_rank_writing_a_file_silently_is_a_hang_told_as_it_is(no_leftovers, tmp_path):
    """By design (docs/failures.rst, "When it is wrong"): output to a file is not progress. The report must name rank 0."""
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(writes_a_file, nprocs=2, args=(str(tmp_path / "ckpt.txt"),), timeout=2)
    report = str(info.value)
    assert info.value.rank == 0
    assert report.startswith("mpddp: rank 0 made no progress for 2 s while rank 1 waited for it in barrier #2 at "
                             "test_collectives_hostile.py:"), report
    assert "\n  rank 1 entered barrier #2 " in report
    assert "; rank 0 is still at #1 (all_reduce): it is the one to look at" in report
    assert "rank 0 is elsewhere: writes_a_file at test_collectives_hostile.py:" in report


def subgroup_then_hang(ctx):
    dist.new_group([0])  # a group without rank 1: on rank 1, the next group's name ("2") and its id (1) differ
    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(5), group=pair)  # completes on both ranks
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 0:
        time.sleep(3600)
    dist.barrier()


def test_a_subgroup_collective_that_completed_is_not_told_as_open(no_leftovers):
    """Rank 0 hangs in a sleep after an all_reduce in a subgroup [0, 1] that completed on both ranks.

    Was, before the fix: the report adds "ranks 0, 1 entered all_reduce #1 in group 2 (float32[5]) ..., and it has not
    completed on rank 1". The recorder's ``pg_status`` is keyed by the group's *id* in this process (its
    ``pg_id``: 1 on rank 1, which is not in group [0] and so made one group fewer), while its entries carry the
    group's *name* ("2" on every rank). ``Reader.read`` pairs the status with the entries by that key, so rank 1's
    completion lands on lane ("1", "") and lane ("2", "gloo") never completes there (also with
    ``use_local_synchronization=True``, whose names are hashes). On a GPU rank ``Seen.pending`` then stays true
    for good, so its CPU counts as waiting (``Watchdog._open``): a rank computing on the CPU after such a group
    collective can be declared hung.

    Should: map ``pg_status`` to names through the entries' ``pg_id``; the group's row then has nothing to say.
    """
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(subgroup_then_hang, nprocs=2, timeout=2)
    report = str(info.value)
    assert report.startswith("mpddp: rank 0 made no progress for 2 s while rank 1 waited for it in barrier #2"), report
    assert "has not completed" not in report, report


def test_the_status_of_a_group_is_found_by_its_id_not_its_name():
    """The same case as above, with the dump torch 2.13 gives on rank 1 (recorded): entries carry the
    name ("2") and the ``pg_id`` (1); ``pg_status`` is keyed "1". After the all_reduce completed, a GPU rank is
    still ``pending``: its CPU would count as waiting."""
    entry = {"record_id": 0, "pg_id": 1, "process_group": ("2", "undefined"), "collective_seq_id": 1,
             "p2p_seq_id": 0, "op_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 10,
             "input_sizes": [[5]], "input_dtypes": ["Float"], "output_sizes": [[5]], "output_dtypes": ["Float"],
             "state": "scheduled", "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
             "retired": False, "timeout_ms": 1800000, "is_p2p": False}
    status = {"1": {"last_enqueued_collective": 1, "last_started_collective": -1, "last_completed_collective": 1}}

    def dump(includeCollectives, includeStackTraces, onlyActive):
        out = {"version": "2.10", "pg_status": status}
        if includeCollectives:
            out["entries"] = [entry]
        return pickle.dumps(out)

    report = recorder.Reader([dump], lambda r: None).read()
    board = Board([0, 1])
    board.add(1, report)
    assert [c.lane for c in report.calls] == [("2", "gloo", 0)]
    assert not board.seen[1].pending, report.completed


def swapped_broadcast(ctx, p2p):
    dist.all_reduce(torch.ones(4))
    if p2p:
        if ctx.rank == 0:
            dist.send(torch.ones(2), 1)
        else:
            dist.recv(torch.ones(2), 0)
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(3), 1 - ctx.rank)  # each rank takes the other for the source: both wait for good


def test_a_collective_every_rank_waits_in_is_not_told_as_completed_after_a_send(no_leftovers):
    """Both ranks wait inside broadcast #3 (an invalid program: each names the other as source);
    before it, one send/recv pair.

    Was, before the fix: "ranks 0, 1 entered broadcast #3 (float32[3]) 3.8 s ago, and it completed: no rank is inside a
    collective", while the stacks below show both ranks in broadcast. gloo's ``pg_status`` numbers every
    operation of the group, point-to-point ones included (2 sends/recvs + 3 collectives: last completed 4),
    while the entries' ``collective_seq_id`` numbers collectives only (broadcast is #3): completed 4 >= 3.
    Without the send, the same report rightly says "it has not completed on ranks 0, 1".

    Should: compare the entries' own numbers (their state, or ``pg_status`` translated into the same numbering);
    the line must say "and it has not completed on ranks 0, 1".
    """
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(swapped_broadcast, nprocs=2, args=(True,), timeout=2)
    report = str(info.value)
    assert "ranks 0, 1 wait together in broadcast at test_collectives_hostile.py:" in report, report
    assert "no rank is inside a collective" not in report, report
    assert "broadcast #3 (float32[3])" in report and ", and it has not completed on ranks 0, 1" in report, report


def test_ranks_that_all_entered_the_same_collective_are_not_said_to_wait_for_one_their_peers_do_not_reach(
        no_leftovers):
    """Both ranks entered broadcast #3, the flight recorder shows it, and it never completes.

    Was, before the fix: the first line says "no rank made progress for 2 s: every rank waits in a collective that its
    peers do not reach", and the next lines say "ranks 0, 1 entered broadcast #3 (float32[3]) ..., and it has not
    completed on ranks 0, 1" and "ranks 0, 1 wait together in broadcast": the peers did reach it. ``hang_error``
    (core/launcher/report.py) picks that sentence from the stacks alone (every rank waiting, none behind).

    Should: when the standings show every rank in the same collective, say so (e.g. "every rank waits in
    broadcast #3, which does not complete"), not that the peers do not reach it.
    """
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(swapped_broadcast, nprocs=2, args=(False,), timeout=2)
    report = str(info.value)
    assert ", and it has not completed on ranks 0, 1" in report, report
    assert "that its peers do not reach" not in report, report


def monitored_barrier_hang(ctx):
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 1:
        time.sleep(3600)
    dist.monitored_barrier()


def test_a_rank_waiting_in_monitored_barrier_is_not_said_to_be_outside_any_collective(no_leftovers):
    """Rank 1 hangs in a sleep; rank 0 waits in ``dist.monitored_barrier()`` (a collective of
    torch.distributed, which gloo runs as sends and receives the flight recorder does not record).

    Was, before the fix: "ranks 0, 1 entered all_reduce #1 (float32[4]) 3.0 s ago, and it completed: no rank is inside a
    collective", and two lines below "rank 0 waits in monitored_barrier". The same with a rank waiting in
    ``recv``. ``standing_rows`` states as a fact what the recorder cannot know: it sees no point-to-point op
    and no monitored_barrier.

    Should: say only what the recorder saw (e.g. "and it completed; the recorder saw no later collective"), never
    that no rank is inside a collective while a rank's stack waits in torch.distributed.
    """
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(monitored_barrier_hang, nprocs=2, timeout=2)
    report = str(info.value)
    assert report.startswith("mpddp: rank 1 made no progress for 2 s while rank 0 waited for it in "
                             "monitored_barrier at test_collectives_hostile.py:"), report
    assert "no rank is inside a collective" not in report, report


def alone_in_a_group(ctx):
    dist.all_reduce(torch.ones(4))
    alone = dist.new_group([0])
    if ctx.rank == 0:  # an evaluation that waits on I/O and syncs in its own group: collectives, no CPU, no output
        for _ in range(8):
            time.sleep(0.5)
            dist.all_reduce(torch.ones(3), group=alone)
    dist.barrier()
    return ctx.rank


def test_collectives_in_a_group_of_one_rank_are_progress(no_leftovers):
    """Was (half the runs on a quiet machine): a hang, because the reader waited took/0.5 % after a read, and
    its first read (about 10 ms) meant 2 s without a report while --timeout was 2 s."""
    assert mpddp.launch(alone_in_a_group, nprocs=2, timeout=2) == [0, 1]


def test_the_reader_reads_four_times_per_timeout_however_slow_a_read():
    import pickle

    from mpddp.core.rank.recorder import Reader

    reads = []

    def slow_dump(**what):  # 20 ms a read: at 0.5 % of a core the next read would come 4 s later
        time.sleep(0.02)
        reads.append(time.monotonic())
        return pickle.dumps({"pg_status": {"0": {"last_completed_collective": len(reads)}}, "entries": []})

    reader = Reader([slow_dump], lambda report: None, timeout=2.0)
    reader._thread.start()
    time.sleep(2.0)
    reader._stop.set()
    reader._thread.join(2.0)
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert len(reads) >= 4 and max(gaps) < 0.5 + 0.2, gaps  # a read every 0.5 s (a quarter of 2 s), two dumps each


def test_a_rank_computing_in_torch_distributed_code_outside_any_collective_is_not_waiting():
    """Rank 0 writes a distributed checkpoint alone (``dcp.save(..., no_dist=True)``, or converts one
    with ``dcp_to_torch_save``) while rank 1 waits in a barrier: rank 0 computes, for many seconds, mostly in
    torch/distributed/checkpoint's Python code (about 70 % of stack samples of a 20,000-entry save). Its
    collectives have all completed (the flight recorder knows it).

    Was, before the fix: ``stacks.location`` marks any stack whose innermost frame is under torch/distributed/ as
    ``spinning`` and ``Watchdog._waits_at`` takes that as waiting on a CPU rank, whatever the recorder says. The
    watchdog's sample at the moment of its "has computed for N s" check decides: when it lands in the planner the
    rank is marked spinning and no longer counts as progress, and the group can be declared hung while rank 0
    computes (a real run of that case is a matter of chance, so here the rule itself is checked).

    Should: on a rank whose every collective completed (the recorder is on and knows the rank), busy in
    torch.distributed code outside a collective is computing, as a CUDA sync is on a GPU rank.
    """
    from mpddp.core.launcher.watchdog import Watchdog

    root = os.path.dirname(torch.__file__)
    dump = ("Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "{root}/distributed/checkpoint/default_planner.py", line 300 in create_local_plan\n'
            f'  File "{root}/distributed/checkpoint/state_dict_saver.py", line 196 in save\n'
            '  File "/home/u/train.py", line 40 in save_checkpoint\n')
    place = stacks.locate(dump, 0x7F0000000001)
    assert place is not None and place.text == "save at train.py:40"
    board = Board([0, 1])
    call = Call("0", 1, "all_reduce", ((4,),), ("Float",), 0, "gloo", 0, 1)
    for rank in (0, 1):
        board.add(rank, Collectives((call,), ((("0", "gloo", 0), 1),)))  # #1 entered and completed on both ranks

    class Slot:
        rank, device, node_rank, local_rank = 0, "cpu", 0, 0

    class State:
        slot, exitcode, succeeded, stack_fd, started, main_thread = Slot(), None, False, None, True, None

    dog = Watchdog(timeout=1.0, board=board, interval=0.2)
    assert not dog._waits_at(State(), place)


def reinit_from_env(ctx):
    dist.destroy_process_group()
    dist.init_process_group("gloo")  # env://, as a torchrun script does: MASTER_PORT is the launcher's store
    dist.barrier()
    return ctx.rank


def test_a_failed_init_in_fn_is_not_reported_as_a_hang(no_leftovers):
    """FAILS NOW (outside the recorder, in the report). ``fn`` sets the default group up again from the
    environment, as a torchrun script would: rank 0 fails at once in ``init_process_group`` with
    DistNetworkError EADDRINUSE (MASTER_PORT is mpddp's store and TORCHELASTIC_USE_AGENT_STORE is not set
    under ``launch``, as it is under ``mpddp run``).

    What happens (after about 1 s, with timeout=30): ``HangError``: "rank 1 made no progress: rank 0 timed out
    waiting for it in a collective (The server socket has failed to listen ... EADDRINUSE ...)". Nothing timed
    out and rank 1 was not stuck: ``failure_error`` takes any DistError as a collective's timeout.

    Should: either work (as under ``mpddp run``) or report rank 0's failure in init_process_group as what it is.
    """
    try:
        assert mpddp.launch(reinit_from_env, nprocs=2, timeout=30) == [0, 1]
    except mpddp.WorkerFailed as e:
        report = str(e)
        assert not isinstance(e, mpddp.HangError), report
        assert "made no progress" not in report and "timed out" not in report, report
        assert "EADDRINUSE" in report, report


# ---- stragglers ---------------------------------------------------------------------------------------------


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
    test_collectives_hostile.py:N (time.sleep(0.17)  # both ranks: nobody waits for anybody here) (k of 5
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


# ---- leftovers --------------------------------------------------------------------------------------------------


def test_the_sigusr1_view_with_subgroups_and_point_to_point_answers_and_the_job_goes_on(tmp_path):
    script = tmp_path / "usr1.py"
    script.write_text(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        r = dist.get_rank()
        alone = dist.new_group([0])
        pair = dist.new_group([0, 1])
        if r == 0:
            dist.all_reduce(torch.ones(2), group=alone)
        if r in (0, 1):
            dist.all_reduce(torch.ones(5), group=pair)
        dist.all_reduce(torch.ones(4))
        print("READY", flush=True)
        if r == 0:
            dist.recv(torch.ones(2), 2)
        elif r == 2:
            time.sleep(4)
            dist.send(torch.ones(2), 0)
        dist.barrier()
        dist.destroy_process_group()
    """))
    run = Run(["-m", "mpddp", "run", "--nprocs", "3", str(script)], tmp_path)
    try:
        run.wait_for(r"READY", count=3)
        run.list_tree()
        time.sleep(1.5)
        os.kill(run.proc.pid, signal.SIGUSR1)
        assert run.finish(60) == 0, run.stderr
    finally:
        run.kill()
    err = run.stderr
    assert "Traceback" not in err, err
    view = err.split("mpddp: where every rank is (SIGUSR1; the job goes on):")[1]
    assert "rank 1 entered barrier #2 " in view and "ranks 0, 2 are still at #1 (all_reduce)" in view, err
    assert "rank 0 waits in recv at usr1.py:" in view and "rank 2 is elsewhere: <module> at usr1.py:" in view, err
    run.assert_nothing_left()
