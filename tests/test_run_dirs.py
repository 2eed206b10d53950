"""One run per directory: a new run's name is its own, a live run's directory is refused, a resume records each
epoch once.

Pure pieces first (the lock: taken, refused, a dead holder's taken over, not kept by a forked child; the names;
who takes the lock; the metrics file's trim), then real ``python -m mpddp train`` launches.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from mpddp.config import LaunchConfig
from mpddp.errors import ConfigError
from mpddp.trainer import rundir
from mpddp.trainer.output import keep_records_until
from mpddp.trainer.run import TakenBy, taken_by

from helpers import short_dir
from runs import marked

REPO = Path(__file__).resolve().parent.parent
QUICK = ["--nprocs", "1", "--dataset", "synthetic", "--samples", "64", "--features", "4"]  # 2 steps an epoch
HOLD = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from mpddp.trainer import rundir
    lock = rundir.take(Path(sys.argv[1]), "holder")  # as train()'s launcher takes it
    print("held", flush=True)
    sys.stdin.read()  # until the test closes the pipe, or kills this process
""")


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(short_dir()))


def epochs(run_dir: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def holder(tmp_path):
    """A live process holding ``tmp_path/held`` the way a launcher does; killed (SIGKILL) by the test or at
    its end."""
    run_dir = tmp_path / "held"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc, run_dir
    finally:
        proc.kill()
        proc.wait()


# ---- the lock, in this process ----------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_a_lock_is_refused_while_held_and_free_once_released(tmp_path):
    lock = rundir.take(tmp_path, "mine")
    record = json.loads((tmp_path / ".lock").read_text())
    assert (record["pid"], record["host"], record["token"]) == (os.getpid(), socket.gethostname(), "mine")
    with pytest.raises(ConfigError) as e:
        rundir.take(tmp_path)
    assert str(e.value).startswith(f"run_dir={str(tmp_path)!r} is in use by pid {os.getpid()} on host "
                                   f"{socket.gethostname()} (since ")
    assert "\n" not in str(e.value) and sorted(os.listdir(tmp_path)) == [".lock"]  # the refused left nothing
    lock.release()
    assert os.listdir(tmp_path) == []
    again = rundir.take(tmp_path)
    assert not again.took_over  # released: nothing to take over
    again.release()


@pytest.mark.timeout(30)
def test_a_dead_holders_lock_is_taken_over_with_a_note(tmp_path, caplog):
    gone = dead_pid()
    (tmp_path / ".lock").write_text(json.dumps({"pid": gone, "host": "n7", "since": 0.0, "token": "old"}))
    with caplog.at_level(logging.WARNING, logger="mpddp"), rundir.held(str(tmp_path), False, "new") as path:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert path == str(tmp_path) and not (tmp_path / ".lock").exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"mpddp: run_dir {str(tmp_path)!r}: pid {gone} on host n7 "
        f"(since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(0))}) "
        "held it and is gone; lock taken over"]
    (tmp_path / ".lock").write_text("not a record")  # unreadable, and nobody holds it: taken over too
    lock = rundir.take(tmp_path)
    assert lock.took_over and lock.previous is None
    lock.release()


@pytest.mark.timeout(30)
def test_a_forked_child_does_not_keep_its_dead_parents_lock(tmp_path):
    """flock stays while any copy of the descriptor is open: a rank forked from the launcher (``--start-method
    fork``) that outlives it must not keep the directory locked."""
    script = textwrap.dedent(f"""\
        import os, sys, time
        from pathlib import Path
        from mpddp.trainer import rundir
        lock = rundir.take(Path({str(tmp_path)!r}))
        child = os.fork()
        if child == 0:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # the test reads its parent's stdout to its end
            os.dup2(devnull, 2)
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        os._exit(0)  # the holder dies, without releasing; its child lives on
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), timeout=20)
    child = int(out.stdout)
    try:
        os.kill(child, 0)  # alive
        lock = rundir.take(tmp_path)
        assert lock.took_over and lock.previous is not None and lock.previous.pid != child
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_held_removes_the_new_directory_a_run_left_empty(tmp_path):
    with rundir.held(str(tmp_path / "runs" / "t" / "20261205-101112"), True) as first:
        with rundir.held(str(tmp_path / "runs" / "t" / "20261205-101112"), True) as second:
            assert (Path(first).name, Path(second).name) == ("20261205-101112", "20261205-101112-2")
            (Path(second) / "metrics.jsonl").write_text("")
    assert os.listdir(tmp_path / "runs" / "t") == ["20261205-101112-2"]  # the empty one went, with runs/t kept


def test_new_names_sort_by_time_then_number():
    names = ["20261205-101113", "20261205-101112-10", "20261205-101112", "20261205-101112-2", "20261205-101112-9"]
    assert sorted(names, key=rundir.order) == [
        "20261205-101112", "20261205-101112-2", "20261205-101112-9", "20261205-101112-10", "20261205-101113"]


@pytest.mark.timeout(60)
def test_resume_auto_takes_the_last_run_of_a_second_by_its_number(tmp_path, monkeypatch):
    from tiny_task import TINY

    from mpddp.trainer.config import TrainConfig
    from mpddp.trainer.loop import Trainer
    from mpddp.trainer.prepare import resolve

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "runs" / "tiny_task"
    Trainer(resolve(TrainConfig(task=TINY, epochs=1, batch_size=32, run_dir=str(base / "20261205-101112-9")))).fit()
    for name in ("20261205-101112", "20261205-101112-10"):
        shutil.copytree(base / "20261205-101112-9", base / name)
    assert Path(resolve(TrainConfig(task=TINY, resume="auto")).run_dir).name == "20261205-101112-10"  # was -9


@pytest.mark.parametrize("launch_config, options, taker", [
    (LaunchConfig(nprocs=2), {}, TakenBy.LAUNCHER),  # the command line: its config holds the scheduler's layout
    (LaunchConfig(nnodes=2, node_rank=0, master_port=29500), {}, TakenBy.LAUNCHER),
    (LaunchConfig(nnodes=2, node_rank=1, master_port=29500), {}, TakenBy.NODE_0),
    (LaunchConfig(nprocs=2), {"node_rank": 1, "nnodes": 2}, TakenBy.NODE_0),  # options over the config
    (None, {"nprocs": 2}, TakenBy.RANK_0),  # launch() reads a scheduler's layout, unseen here
    (None, {"nprocs": 2, "nnodes": 1}, TakenBy.LAUNCHER),
    (None, {"nnodes": 2, "node_rank": 1}, TakenBy.NODE_0),
    (None, {"hosts": ("a", "b")}, TakenBy.RANK_0),  # node 0 starts on host a, over ssh
    (LaunchConfig(rdzv_backend="etcd", rdzv_endpoint="e:2379", rdzv_id="j", nnodes="1:2"), {}, TakenBy.RANK_0),
])
def test_who_takes_the_run_directory(launch_config, options, taker):
    assert taken_by(launch_config, options) is taker


def test_the_records_after_the_start_go_and_a_torn_line_with_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"epoch": e, "step": 2 * e}) for e in (1, 2, 3)]
    path.write_text("\n".join(records) + '\n{"epoch": 4, "st')
    assert keep_records_until(path, 4) == 2
    assert path.read_text() == records[0] + "\n" + records[1] + "\n"
    before = os.stat(path)
    assert keep_records_until(path, 4) == 0 and os.stat(path).st_ino == before.st_ino  # nothing to drop: untouched
    assert keep_records_until(tmp_path / "none.jsonl", 0) == 0
    assert keep_records_until(path, 0) == 2 and path.read_text() == ""  # a fresh start keeps none


# ---- real runs ----------------------------------------------------------------------------------------------------

LAUNCHER = textwrap.dedent("""\
    import os, sys, time
    if __name__ == "__main__":  # the ranks import this file too
        # Both runs see the same second, however long each takes to start: the clash the name must survive.
        real = time.strftime
        time.strftime = lambda fmt, *t: os.environ["STAMP"] if fmt == "%Y%m%d-%H%M%S" else real(fmt, *t)
        while not os.path.exists("go"):  # and both start at once
            time.sleep(0.005)
        sys.argv = ["mpddp", *sys.argv[1:]]
        from mpddp.__main__ import main
        main()
""")


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leftovers")
def test_two_runs_started_in_the_same_second_get_a_directory_each(tmp_path):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    runs = [subprocess.Popen([sys.executable, "launcher.py", "train", *QUICK, "--epochs", "2"], cwd=tmp_path,
                             env=dict(env(), STAMP="20261205-101112"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    (tmp_path / "go").write_text("")
    outs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    base = tmp_path / "runs" / "synthetic"
    assert sorted(os.listdir(base)) == ["20261205-101112", "20261205-101112-2"]
    for run_dir in base.iterdir():
        assert epochs(run_dir) == [1, 2], run_dir
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
        assert not (run_dir / ".lock").exists()
    said = {out.strip().splitlines()[-1].split()[1] for out, _ in outs}  # each run names its own
    assert said == {f"runs/synthetic/{name}/checkpoints/ckpt-000000004.pt" for name in os.listdir(base)}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
def test_a_run_dir_in_use_is_refused_a_dead_runs_is_taken_over_and_a_resumed_run_records_each_epoch_once(
        tmp_path, holder):
    """The run that takes the dead run's directory over is the one resumed after (they were two tests' runs):
    resumed from the end of its epoch 1, it records epochs 2 and 3 once (was 1, 2, 3, 2, 3)."""
    proc, run_dir = holder
    train = [sys.executable, "-m", "mpddp", "train", *QUICK, "--epochs", "3", "--run-dir", "held"]
    marker, started = uuid.uuid4().hex, time.monotonic()
    refused = subprocess.run(train, cwd=tmp_path, env=dict(env(), MPDDP_TEST_RUN=marker), capture_output=True,
                             text=True, timeout=60)
    took = time.monotonic() - started
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr.startswith(f"mpddp: error: run_dir='held' is in use by pid {proc.pid} on host "
                                     f"{socket.gethostname()} (since ") and refused.stderr.count("\n") == 1
    assert os.listdir(run_dir) == [".lock"]
    deadline = time.monotonic() + 3  # its forkserver, started first thing, goes with it
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marked(marker)
    print(f"refused in {took:.2f} s")

    proc.kill()  # dies holding it: the kernel drops its flock, the file stays
    proc.wait()
    taken = subprocess.run(train, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=60)
    assert taken.returncode == 0, taken.stderr
    assert f"mpddp: run_dir 'held': pid {proc.pid} on host {socket.gethostname()}" in taken.stderr
    assert "held it and is gone; lock taken over" in taken.stderr
    assert epochs(run_dir) == [1, 2, 3] and not (run_dir / ".lock").exists()

    ckpt = run_dir / "checkpoints" / "ckpt-000000002.pt"  # the end of epoch 1
    again = subprocess.run([*train, "--resume", str(ckpt)], cwd=tmp_path, env=env(), capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 2), (2, 4), (3, 6)]  # was 1, 2, 3, 2, 3
    assert "[rank 0] note: held/metrics.jsonl held 2 record(s) after step 2, where this run starts" in again.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("end", ["failure", "ctrl-c"])
def test_the_lock_goes_with_a_run_that_fails_or_is_interrupted(tmp_path, end):
    from runs import Run

    fault = ["--inject-fault", "raise:0:40"] if end == "failure" else []  # at epoch 20 (a second or more)
    run = Run(["-m", "mpddp", "train", *QUICK, "--epochs", "100", "--run-dir", "r", *fault], tmp_path,
              env={"PYTHONPATH": str(REPO)})
    try:
        run.wait_for(r"epoch   1/100")
        assert (tmp_path / "r" / ".lock").is_file()  # held while it trains
        run.list_tree()
        if end == "ctrl-c":
            run.proc.send_signal(signal.SIGINT)
        assert run.finish(60) == (1 if end == "failure" else 130), run.stderr
        run.assert_nothing_left()
    finally:
        run.kill()
    assert not (tmp_path / "r" / ".lock").exists(), run.stderr
