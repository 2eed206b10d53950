"""Ranks that progress are never called hung, and a hang is told as it was (core/launcher/watchdog.py).

Real processes on the CPU with gloo, and a few rules checked with recorded flight-recorder dumps and stacks
where a CPU cannot make the case; the SIGUSR1 view of a running job, too. Each case is one a hostile pass
found: its docstring says what happened before its fix.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import mpddp
from mpddp.core.launcher.board import Board
from mpddp.core.rank import recorder
from mpddp.core.wire import stacks
from mpddp.core.wire.protocol import Call, Collectives

from helpers import told_hung
from runs import Run

pytestmark = pytest.mark.timeout(120)


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
    """By design (docs/failures.rst, "When it is wrong"): output to a file is not progress.
    The report must name rank 0."""
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(writes_a_file, nprocs=2, args=(str(tmp_path / "ckpt.txt"),), timeout=2)
    report = str(info.value)
    assert info.value.rank == 0
    assert told_hung(report, "mpddp: rank 0 made no progress for {s} s while rank 1 waited for it in barrier #2 at "
                             "test_hangs_told.py:", 2), report
    assert "\n  rank 1 entered barrier #2 " in report
    assert "; rank 0 is still at #1 (all_reduce): it is the one to look at" in report
    assert "rank 0 is elsewhere: writes_a_file at test_hangs_told.py:" in report


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
    assert told_hung(
        report, "mpddp: rank 0 made no progress for {s} s while rank 1 waited for it in barrier #2", 2), report
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
    assert "ranks 0, 1 wait together in broadcast at test_hangs_told.py:" in report, report
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
    assert told_hung(report, "mpddp: rank 1 made no progress for {s} s while rank 0 waited for it in "
                             "monitored_barrier at test_hangs_told.py:", 2), report
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
