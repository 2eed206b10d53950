"""Watching the collectives: torch's flight recorder in every rank, hangs told by collective, mismatches at once,
stragglers named, output that floods is progress.

Real processes on the CPU with gloo (each under a timeout, nothing left running), and the rules themselves
with recorded flight-recorder dumps (NCCL's states, which a CPU cannot make).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import mpddp
from mpddp.core.launcher import board as board_module
from mpddp.core.launcher import stragglers
from mpddp.core.launcher.board import Board, standing_rows
from mpddp.core.rank import recorder
from mpddp.core.wire.protocol import Call, Collectives

from helpers import told_hung
from runs import Run

pytestmark = pytest.mark.timeout(120)


# ---- real launches -----------------------------------------------------------------------------


def skips_one(ctx):
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    if ctx.rank == 1:
        time.sleep(3600)  # never reaches all_reduce #6
    dist.all_reduce(t)


def test_a_rank_that_never_reaches_the_collective_is_named_by_number(no_leftovers):
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(skips_one, nprocs=3, timeout=3)
    report = str(info.value)
    assert info.value.rank == 1 and info.value.failures[0].outcome is mpddp.Outcome.HUNG
    # the seconds are the watchdog's, at its first look past --timeout: 4 once in CI beside other suites
    told = re.match(r"mpddp: rank 1 made no progress for (\d+) s while ranks 0, 2 waited for it in all_reduce #6 "
                    r"\(float32\[1000\]\) at test_collectives\.py:", report)
    assert told is not None and int(told[1]) >= 3, report
    assert "mpddp: the collectives each rank reached (torch's flight recorder):\n  ranks 0, 2 entered all_reduce #6 " \
           "(float32[1000]) " in report
    assert "; rank 1 is still at #5 (all_reduce): it is the one to look at" in report
    # then the stacks, the odd one out marked
    assert report.index("flight recorder") < report.index("where each rank was")
    assert "rank 1 is elsewhere: skips_one at test_collectives.py:" in report and "<- look here" in report


def calls_differently(ctx, stamp):
    t = torch.ones(1000)
    for _ in range(4):
        dist.all_reduce(t)
    with open(f"{stamp}{ctx.rank}", "w") as f:  # when this rank reached the call that differs
        f.write(str(time.time()))
    if ctx.rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(torch.ones(10), 0)
    time.sleep(3600)


def test_a_mismatch_is_reported_at_once_not_after_the_timeout(no_leftovers, tmp_path):
    with pytest.raises(mpddp.CollectiveMismatch) as info:
        mpddp.launch(calls_differently, nprocs=2, timeout=60, args=(str(tmp_path / "at"),))
    reached = max(float((tmp_path / f"at{rank}").read_text()) for rank in (0, 1))
    took = time.time() - reached
    assert took < 15, took  # from the calls that differ (0.5 s quiet): the timeout is 60 s, seen, not waited out
    report = str(info.value)
    assert report.startswith("mpddp: rank 0 called all_reduce #5 (float32[1000]) while rank 1 called broadcast #5 "
                             "(float32[10]); every rank was stopped at once."), report
    assert info.value.rank == 1 and info.value.failures[0].outcome is mpddp.Outcome.MISMATCH
    assert "rank 1 waits in broadcast at test_collectives.py:" in report


def one_calls_differently(ctx):
    t = torch.ones(8)
    for _ in range(2):
        dist.all_reduce(t)
    if ctx.rank == 2:
        dist.broadcast(t, 0)
    else:
        dist.all_reduce(t)
    time.sleep(3600)


def test_the_odd_one_out_is_the_rank_whose_call_differs_from_the_others(no_leftovers):
    with pytest.raises(mpddp.CollectiveMismatch) as info:
        mpddp.launch(one_calls_differently, nprocs=3, timeout=60)
    assert info.value.rank == 2
    assert str(info.value).startswith("mpddp: ranks 0, 1 called all_reduce #3 (float32[8]) while rank 2 called "
                                      "broadcast #3 (float32[8])")


def train_steps(ctx, slow_ranks, steps):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if ctx.rank in slow_ranks:
            time.sleep(0.03)  # 30 ms late to every backward: the others wait for it in the gradients' all_reduce
        loss.backward()
        opt.step()
        opt.zero_grad()
    return ctx.rank


def _said(caplog, words):
    return [r for r in caplog.records if r.name == "mpddp" and words in r.getMessage()]


def test_a_rank_30_ms_late_is_named_within_200_steps(no_leftovers, caplog, tmp_path):
    picture = tmp_path / "timeline.png"
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(train_steps, nprocs=2, args=((1,), 200), timeline=str(picture)) == [0, 1]
    named = _said(caplog, "is a straggler")
    assert len(named) == 1, caplog.text  # said once
    told = named[0].getMessage()
    assert told.startswith("mpddp: rank 1 is a straggler: it reaches collectives "), told
    assert "while the others wait it is in train_steps at test_collectives.py:" in told and "time.sleep(0.03)" in told
    lag_ms = float(told.split("it reaches collectives ")[1].split(" ms")[0])
    assert 20 <= lag_ms <= 60, told
    summary = _said(caplog, "mpddp: collectives: ")
    assert len(summary) == 1 and "rank 1 was the straggler" in summary[0].getMessage()
    result = summary[0].mpddp_collectives  # launch() also hands it over as data, on the log record
    assert result.straggler == 1 and {r.rank for r in result.ranks} == {0, 1}
    assert next(r for r in result.ranks if r.rank == 1).last_share > 0.9
    width, height = _png_size(picture)
    assert (width, height) == (1000, 450)


def test_a_balanced_run_of_the_same_length_names_no_one(no_leftovers, caplog):
    """Both ranks take the same 30 ms longer: as long a run, as many collectives, no one late."""
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(train_steps, nprocs=2, args=((0, 1), 200)) == [0, 1]
    assert not _said(caplog, "straggler:"), caplog.text
    summary = _said(caplog, "mpddp: collectives: ")
    assert summary and "no straggler" in summary[0].getMessage()
    assert summary[0].mpddp_collectives.straggler is None


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def floods(ctx, seconds):
    """Rank 0 writes 1,000-character lines non-stop; rank 1 one endless line without a newline."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ctx.rank == 0:
            print("x" * 1000)
        else:
            sys.stdout.write("y" * 1000)
    print()
    dist.barrier()
    return ctx.rank


FLOOD = """
import sys
sys.path.insert(0, {tests!r})
import mpddp
from test_collectives import floods

if __name__ == "__main__":
    print("RESULT", mpddp.launch(floods, nprocs=2, args=(8.0,), timeout=2), file=sys.stderr)
"""


def test_ranks_held_back_by_their_own_output_are_not_hung(tmp_path):
    """The launcher's stdout is read slowly (a terminal, a pipe to a slow reader): the ranks block in write()."""
    script = tmp_path / "flood.py"
    script.write_text(FLOOD.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    received = []

    def slow_reader():
        while chunk := proc.stdout.read1(1 << 16):
            received.append(len(chunk))
            time.sleep(0.005)  # ~13 MB/s at most

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        err = proc.stderr.read().decode()
        rc = proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(10)
    assert rc == 0 and "RESULT [0, 1]" in err, err
    assert "made no progress" not in err
    assert sum(received) > 20e6  # it was held back: tens of MB, slowly read


USR1 = """
import sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print("READY", flush=True)
if dist.get_rank() == 1:
    time.sleep(4)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_sigusr1_shows_the_collective_view_first(tmp_path):
    script = tmp_path / "usr1.py"
    script.write_text(USR1)
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(script)], tmp_path)
    try:
        run.wait_for(r"READY", count=2)
        run.list_tree()
        time.sleep(1.5)  # rank 0 enters all_reduce #2; its reader reports it within half a second
        os.kill(run.proc.pid, signal.SIGUSR1)
        assert run.finish(60) == 0, run.stderr
    finally:
        run.kill()
    err = run.stderr
    view = err.split("mpddp: where every rank is (SIGUSR1; the job goes on):")[1]
    assert view.lstrip().startswith("rank 0 entered all_reduce #2 (float32[4]) "), err
    assert "; rank 1 is still at #1 (all_reduce): it is the one to look at" in view
    assert "rank 0 waits in all_reduce at usr1.py:11" in view
    run.assert_nothing_left()


_NAMES = (*recorder.ENV, "TORCH_NCCL_DUMP_ON_TIMEOUT")


def recorder_env(ctx):
    names = [t.name for t in threading.enumerate()]
    return {k: os.environ.get(k) for k in _NAMES}, "mpddp-collectives" in names


def _env(fr=None, nccl=None, dump=None):
    return dict(zip(_NAMES, (fr, nccl, dump)))


@pytest.mark.parametrize(("env", "expected", "reader"), [
    ((), _env(str(recorder.BUFFER), dump="0"), True),  # on, and NCCL's dump files off: nothing left in /tmp
    ((("TORCH_FR_BUFFER_SIZE", "2000"),), _env("2000"), True),
    ((("TORCH_NCCL_TRACE_BUFFER_SIZE", "5"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")), _env(None, "5", "1"), True),
    ((("TORCH_FR_BUFFER_SIZE", "0"),), _env("0"), False),
])
def test_the_users_flight_recorder_settings_are_kept(no_leftovers, env, expected, reader):
    values, running = mpddp.launch(recorder_env, nprocs=1, env=env)[0]
    assert values == expected
    assert running is reader  # turned off: no reader either


def test_the_users_setting_in_the_launchers_environment_is_kept(no_leftovers, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "300")
    assert mpddp.launch(recorder_env, nprocs=1)[0][0]["TORCH_FR_BUFFER_SIZE"] == "300"


def test_with_the_recorder_off_a_hang_is_still_found_by_the_stacks(no_leftovers):
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(skips_one, nprocs=2, timeout=3, env=(("TORCH_FR_BUFFER_SIZE", "0"),))
    report = str(info.value)
    assert told_hung(
        report, "mpddp: rank 1 made no progress for {s} s while rank 0 waited for it in all_reduce at ", 3), report
    assert "flight recorder" not in report


@pytest.mark.parametrize(("value", "words"), [
    ("t.txt", "timeline='t.txt' is not a picture file: end its name with .png, .svg, .pdf, e.g. timeline.png"),
    ("/proc/t.png", "timeline='/proc' is not writable"),
])
def test_a_bad_timeline_is_one_line_and_exit_2(tmp_path, value, words):
    (tmp_path / "x.py").write_text("print('never runs')\n")
    out = subprocess.run([sys.executable, "-m", "mpddp", "run", "--nprocs", "1", "--timeline", value, "x.py"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.txt").exists() and "never runs" not in out.stdout


def test_without_matplotlib_the_timeline_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(mpddp.ConfigError,
                       match=r"needs matplotlib, which is not installed: pip install 'mpddp\[plot\]'"):
        mpddp.LaunchConfig(nprocs=1, timeline="t.png")


# ---- the rules, with recorded dumps --------------------------------------------------------------


def _entry(seq, op="nccl:all_reduce", sizes=((1000,),), dtypes=("Float",), t=0, state="completed", group="0",
           p2p=False):
    return {"record_id": seq, "pg_id": 0, "process_group": (group, "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "time_created_ns": t, "input_sizes": list(sizes),
            "input_dtypes": list(dtypes), "output_sizes": list(sizes), "output_dtypes": list(dtypes), "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": True,
            "timeout_ms": 600000, "is_p2p": p2p}


class Recorder:
    """An NCCL rank's flight recorder, as _dump_fr_trace gives it (format version 2.10)."""

    def __init__(self):
        self.entries, self.status = [], {}

    def dump(self, includeCollectives, includeStackTraces, onlyActive):
        import pickle

        out = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
               "pg_status": self.status, "comm_lib_version": "2.27.5"}
        if includeCollectives:
            out["entries"] = self.entries
        return pickle.dumps(out)

    def enter(self, seq, **kw):
        self.entries.append(_entry(seq, state="scheduled", **kw))
        self.status = {"0": {"last_enqueued_collective": seq, "last_started_collective": seq - 1,
                             "last_completed_collective": seq - 1}}

    def complete(self, seq):
        self.entries[-1]["state"] = "completed"
        self.status = {"0": dict(self.status["0"], last_started_collective=seq, last_completed_collective=seq)}


def test_the_reader_sends_only_what_changed():
    fake, sent = Recorder(), []
    reader = recorder.Reader([fake.dump], sent.append)
    assert reader.read() == Collectives((), ())  # a first status, no collective yet
    fake.enter(1, t=10)
    fake.entries.append(_entry(0, op="nccl:send", p2p=True))  # point-to-point: numbered apart, left out
    first = reader.read()
    assert [c.seq for c in first.calls] == [1] and first.completed == ((("0", "nccl", 0), 0),)
    assert first.calls[0] == Call("0", 1, "all_reduce", ((1000,),), ("Float",), 10, "nccl", 0, 1)
    assert reader.read() is None  # nothing moved: nothing sent
    fake.complete(1)
    second = reader.read()
    assert second.calls == () and second.completed == ((("0", "nccl", 0), 1),)


def test_nccls_own_recorder_and_the_other_backends_are_two_lanes():
    """A CUDA build keeps NCCL's collectives apart (_dump_nccl_trace): a group with gloo for CPU tensors and NCCL
    for CUDA ones numbers each backend's collectives from 1, and they are never lined up against each other."""
    nccl, gloo = Recorder(), Recorder()
    nccl.enter(1, t=5)
    gloo.enter(1, op="gloo:broadcast", sizes=((3,),), t=7)
    gloo.enter(2, op="gloo:broadcast", sizes=((3,),), t=8)
    report = recorder.Reader([nccl.dump, gloo.dump], lambda r: None).read()
    assert sorted((c.lane, c.seq) for c in report.calls) == [(("0", "gloo", 0), 1), (("0", "gloo", 0), 2),
                                                            (("0", "nccl", 0), 1)]
    assert dict(report.completed) == {("0", "nccl", 0): 0, ("0", "gloo", 0): 1}
    board = Board([0, 1])
    board.add(0, report)
    board.add(1, Collectives((_c(1, t=6, backend="nccl"), _c(1, "broadcast", ((3,),), backend="gloo")),
                                         ()))
    assert board.mismatch is None and len(board.take()) == 2


def _board(*reports):
    board = Board([0, 1])
    for rank, calls, completed in reports:
        board.add(rank, Collectives(tuple(calls), ((("0", "", 0), completed),)))
    return board


def _c(seq, op="all_reduce", sizes=((1000,),), t=0, group="0", backend=""):
    return Call(group, seq, op, sizes, ("Float",), t, backend, 0, seq)


def test_an_nccl_rank_whose_all_reduce_did_not_complete_is_open():
    board = _board((0, [_c(1), _c(2)], 1), (1, [_c(1)], 1))
    assert board.seen[0].pending and not board.seen[1].pending
    (standing,) = board.standings([0, 1])
    assert standing.ahead == (0,) and list(standing.behind) == [1] and standing.open == (0,)
    assert standing_rows([standing], 12 * 10**9) == [
        "rank 0 entered all_reduce #2 (float32[1000]) 12 s ago; rank 1 is still at #1 (all_reduce): it is the one to "
        "look at"]


def test_every_rank_in_a_collective_that_does_not_complete():
    board = _board((0, [_c(3, t=0)], 2), (1, [_c(3, t=5 * 10**8)], 2))
    assert standing_rows(board.standings([0, 1]), 2 * 10**9) == [
        "ranks 0, 1 entered all_reduce #3 (float32[1000]) 2.0 s ago, and it has not completed on ranks 0, 1"]


@pytest.mark.parametrize(("a", "b", "odd"), [
    (_c(5), _c(5, "broadcast", ((10,),)), 1),  # another op
    (_c(5), _c(5, sizes=((999,),)), 1),  # all_reduce of another size
    (_c(5, "all_gather", ((4,),)), _c(5, "all_gather", ((4,),)), None),  # the same
    (_c(5, "scatter", ((8,),)), _c(5, "scatter", ((0,),)), None),  # scatter: only the source's input counts
    (_c(5, group="1"), _c(5, "broadcast", group="2"), None),  # two groups, each its own numbers
])
def test_a_mismatch_is_two_calls_that_differ_at_one_number(a, b, odd):
    board = _board((0, [a], 0), (1, [b], 0))
    assert (board.mismatch.odd if board.mismatch else None) == odd


def _three(*reports):
    board = Board([0, 1, 2])
    for rank, calls in reports:
        board.add(rank, Collectives(tuple(calls), ((("0", "", 0), 0),)))
    return board


def test_a_tie_waits_for_a_late_member_that_breaks_it():
    """Ranks 0 and 1 differ at #3 and rank 2 has not said: its report may only be late (a starved reader)."""
    start = time.monotonic()
    board = _three((0, [_c(3)]), (1, [_c(3, "broadcast")]))
    assert board.found(start + 2.0) is None  # after the grace, still: rank 2 could side with either
    board.add(2, Collectives((_c(3, "broadcast"),), ()))  # late, and it sides with rank 1
    assert board.found(start + 2.0).odd == 0


def test_a_tie_is_told_once_the_missing_member_entered_another_collective_or_after_the_longest_wait():
    start = time.monotonic()
    board = _three((0, [_c(3)]), (1, [_c(3, "broadcast")]))
    board.add(2, Collectives((_c(1, group="1"),), ()))  # it entered a collective of another group: it is elsewhere
    assert board.found(start + 0.5) is None and board.found(start + 1.5).odd == 1  # the grace, then the tie's
    silent = _three((0, [_c(3)]), (1, [_c(3, "broadcast")]))
    longest = board_module._GRACE_MAX
    assert silent.found(start + longest - 1.0) is None and silent.found(start + longest + 1.0).odd == 1


def test_a_member_that_only_reached_the_collective_before_may_still_come_to_the_row():
    """Rank 2's report that it entered and completed #2 can arrive after ranks 0 and 1 entered #3: it is between
    two calls (tests/test_no_false_mismatch.py: rank 2 sleeps 1 s there), and the tie waits for it."""
    start = time.monotonic()
    board = _three((0, [_c(3)]), (1, [_c(3, "broadcast")]))
    board.add(2, Collectives((_c(2),), ((("0", "", 0), 2),)))
    assert board.found(start + 2.0) is None
    board.add(2, Collectives((_c(3, "broadcast"),), ()))
    assert board.found(start + 2.0).odd == 0


def test_a_majority_names_the_odd_one_without_the_missing_members():
    start = time.monotonic()
    board = Board([0, 1, 2, 3, 4])
    for rank, op in ((0, "all_reduce"), (1, "broadcast"), (2, "broadcast"), (3, "broadcast")):
        board.add(rank, Collectives((_c(3, op),), ()))
    assert board.found(start + 0.5) is None and board.found(start + 1.5).odd == 0


def test_rows_every_rank_reached_go_to_the_straggler_count_once():
    board = _board((0, [_c(1, t=0), _c(2, t=100)], 2), (1, [_c(1, t=30)], 1))
    rows = board.take()
    assert [sorted(r) for r in rows] == [[0, 1]] and rows[0][1].entered == 30
    assert board.take() == []


class _Slot:
    def __init__(self, rank, device):
        self.rank, self.device, self.node_rank, self.local_rank = rank, device, 0, rank


class _State:
    """What the watchdog reads of a rank: a real process that burns a core, on a GPU slot or not."""

    def __init__(self, rank, proc, device):
        self.slot, self.process, self.exitcode, self.succeeded = _Slot(rank, device), proc, None, False
        self.stack_fd, self.started, self.main_thread = None, True, None


def _spinners(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _watch_spinners(device):
    """What the watchdog makes of two ranks that spin with collective #2 open everywhere, and the least share of a
    core either spinner got meanwhile."""
    from mpddp.core.launcher.watchdog import Watchdog

    board = _board((0, [_c(1), _c(2)], 1), (1, [_c(1), _c(2)], 1))  # #2 entered everywhere, completed nowhere
    procs = _spinners(2)
    try:
        states = [_State(r, p, device) for r, p in enumerate(procs)]
        dog = Watchdog(timeout=3.0, board=board, interval=0.2)
        start, hang = time.monotonic(), None
        while hang is None and time.monotonic() - start < 6.0:
            hang = dog.check(states, time.monotonic())
            time.sleep(0.05)
        used = [sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs]
        return hang, min(used) / (time.monotonic() - start)
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("device", "hangs"), [("cuda:0", True), ("cpu", False)])
def test_a_gpu_rank_spinning_while_its_collective_is_open_is_waiting(device, hangs):
    """NCCL returns at once; the rank spins at its next sync (loss.item()): CPU, but waiting."""
    for _ in range(4):
        hang, share = _watch_spinners(device)
        # the CPU case's premise is that the ranks use the CPU: beside other suites on 2 cores, both spinners got
        # less than a tenth of a core for 3 s (CI, 3 suites at once), and a hang was told: the load's, not the rule's
        if hangs or hang is None or share >= 0.6:
            break
    else:
        pytest.skip(f"the spinners got {share:.0%} of a core at most, four times: too loaded to tell spinning")
    assert (hang is not None) is hangs, share
    if hangs:
        assert [s.open for s in hang.standings] == [(0, 1)]


def test_a_gpu_rank_in_cuda_synchronize_with_no_open_collective_computes():
    """A long evaluation on rank 0's GPU: its CPU spins in torch.cuda.synchronize, the GPU works: no hang."""
    from mpddp.core.launcher.watchdog import Watchdog
    from mpddp.core.wire import stacks

    board = _board((0, [_c(1)], 1), (1, [_c(1)], 1))  # every collective completed
    dump = ("Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "{os.path.dirname(torch.__file__)}/cuda/__init__.py", line 1083 in synchronize\n'
            '  File "/home/u/train.py", line 40 in evaluate\n')
    place = stacks.locate(dump, 0x7F0000000001)
    assert place.spinning and place.at_sync and (
        place.text == "evaluate at train.py:40, waiting in torch.cuda.synchronize")
    proc = _spinners(1)[0]
    try:
        state = _State(0, proc, "cuda:0")
        dog = Watchdog(timeout=1.0, board=board, interval=0.2)
        assert not dog._waits_at(state, place)  # the GPU computes
        dog._ranks[0] = type("R", (), {"spinning": True})()  # even when the stack was seen there before
        board.seen[0].completed[("0", "", 0)] = 0  # ... but with #1 open, the same place is waiting
        assert dog._waits_at(state, place)
    finally:
        proc.kill()
        proc.wait()


def _rows(lags_ms, n, step_ms=100.0, jitter=None):
    """``n`` rows of two ranks, one a step apart; rank 1 late by ``lags_ms`` (a value, or one per row)."""
    rows = []
    for i in range(n):
        t = int(i * step_ms * 1e6)
        lag = lags_ms[i] if isinstance(lags_ms, list) else lags_ms
        rows.append({0: _c(i + 1, t=t), 1: _c(i + 1, t=t + int(lag * 1e6))})
    return rows


@pytest.mark.parametrize(("lags", "named"), [
    (30.0, 1),  # 30 ms late every step of 100 ms
    (5.0, None),  # under the 20 ms floor
    ([200.0 if i % 10 == 0 else 0.0 for i in range(100)], None),  # a hiccup every tenth step: the median is 0
    ([25.0 if i % 2 else -25.0 for i in range(100)], None),  # late every other step, early the next: balanced
])
def test_the_straggler_rule(lags, named):
    count = stragglers.Stragglers()
    count.add(_rows(lags, 100))
    assert count.suspect() == named


def test_no_verdict_before_enough_collectives_and_a_lag_small_against_the_step_is_not_told():
    early = stragglers.Stragglers()
    early.add(_rows(30.0, stragglers.MIN_SAMPLES - 1))
    assert early.suspect() is None
    slow_steps = stragglers.Stragglers()
    slow_steps.add(_rows(30.0, 100, step_ms=1000.0))  # 30 ms of a 1 s step: 3 %
    assert slow_steps.step == pytest.approx(1.0) and slow_steps.suspect() is None


def test_the_summary_and_the_table():
    count = stragglers.Stragglers()
    count.add(_rows(30.0, 100))
    count.check(lambda rank: ["load_batch at data.py:12"] * 4 + [""])
    assert count.told == 1
    lines = stragglers.summary_lines(count.summary(), verbose=True)
    assert lines[0] == ("mpddp: collectives: 100 lined up across 2 ranks; rank 1 was the straggler: it arrived last "
                        "at 100% of them, median lag 30 ms (p90 30 ms)")
    assert lines[1].split() == ["rank", "collectives", "mean", "lag", "median", "p90", "arrived", "last"]
    assert lines[3].split() == ["1", "100", "30", "ms", "30", "ms", "30", "ms", "100%"]


def quick_collectives(ctx):
    for _ in range(60):
        dist.all_reduce(torch.ones(4))
    return ctx.rank


def test_a_run_shorter_than_one_read_still_reports_its_collectives(no_leftovers, caplog):
    """The reader reads once more as the rank ends: 60 all_reduces done within its first half second count."""
    with caplog.at_level(logging.INFO, logger="mpddp"):
        assert mpddp.launch(quick_collectives, nprocs=2) == [0, 1]
    summary = _said(caplog, "mpddp: collectives: ")
    assert summary and summary[0].mpddp_collectives.collectives >= 50, caplog.text


def test_a_snapshot_taken_from_another_thread_never_misses_a_report():
    """The round watch's thread shares the board's snapshot while the main thread adds reports to it: the last
    snapshot shared must hold the last report (before: a snapshot taken inside add() marked a report as shared
    before its call was on the board, which another node then never saw; or it raised, changing dict sizes)."""
    board = Board([0, 1])
    shared: list[bytes] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def watch() -> None:
        try:
            while not done.is_set():
                if (snapshot := board.snapshot()) is not None:
                    shared.append(snapshot)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a race shows within a second
    thread = threading.Thread(target=watch)
    thread.start()
    lost = []
    try:
        for seq in range(1, 1001):
            lanes = [_c(seq, group=str(g)) for g in range(1 + seq % 7)]  # new lanes now and then: dicts grow
            board.add(seq % 2, Collectives(tuple(lanes), ((("0", "", 0), seq - 1),)))
            deadline = time.monotonic() + 10.0  # the watch shares it at once, unless it was marked shared
            while not (shared and _last_seq(shared[-1], seq % 2) == seq) and not errors and not lost:
                if time.monotonic() > deadline:
                    lost.append(seq)
            if lost or errors:
                break
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert not lost, f"report {lost} was never shared"


def _last_seq(snapshot: bytes, rank: int) -> int:
    data = json.loads(snapshot).get(str(rank))
    return max(call[3] for call in data["last"]) if data else 0
