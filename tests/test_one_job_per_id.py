"""One job per id: launchers that run another script, or other arguments, are never joined into one world, and a
second launcher with a taken ``--node-rank`` at a job's start is told (core/wire/fingerprint.py).

Two 2-node jobs on one id, each with ``--node-rank 0`` and ``1``, all four launchers started at once: under etcd on
one ``--rdzv-id`` (a real 3-member etcd, tests/etcd_cluster.py), under c10d on one ``--master-port``. Whichever job
comes first runs alone, its two ranks in a world of two that only its script joined (each rank checks the world's
scripts and arguments with an all-reduce); the other job's launchers end with one line and exit code 2. Real
launchers of ``mpddp run`` on 127.0.0.1, each in its own session under a timeout; nothing of any may be left.
"""

from __future__ import annotations

import shutil
import textwrap
import time

import pytest
from multinode import free_port

from mpddp.core.launcher.api import _job
from mpddp.core.rank.by_index import ByIndex
from mpddp.core.rank.script import run_script
from mpddp.core.wire.fingerprint import Fingerprint

from runs import Run

pytestmark = pytest.mark.timeout(240)

# Each rank says which job it runs (its script's CODE, and its first argument), and checks that every rank of its
# world runs the same: the lowest and the highest of the world's codes are its own. It steps until STOP exists.
JOB = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    mine = torch.tensor([{code}.0, float(sys.argv[1])])
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    mixed = not (torch.equal(low, mine) and torch.equal(high, mine))
    step = 0
    while True:
        stopping = torch.tensor([float(os.path.exists(os.environ["STOP"]))])
        dist.all_reduce(stopping, op=dist.ReduceOp.MAX)  # the ranks stop together
        if stopping.item():
            break
        step += 1
        print(f"STEP {{step}} world={{dist.get_world_size()}} mixed={{mixed}}", flush=True)
        time.sleep(0.05)
    print(f"DONE world={{dist.get_world_size()}} mixed={{mixed}}", flush=True)
    dist.destroy_process_group()
""")
# The two jobs: (script, argument) each; "scripts": ejob.py and job.py, "arguments": job.py 1 and job.py 2.
JOBS = {"scripts": (("ejob.py", "1"), ("job.py", "1")), "arguments": (("job.py", "1"), ("job.py", "2"))}


def _scripts(tmp_path) -> None:
    for code, name in enumerate(("job.py", "ejob.py"), 1):
        (tmp_path / name).write_text(JOB.format(code=code))


def _launcher(tmp_path, name: str, job: tuple[str, str], node_rank: int, backend: list[str], nnodes: str = "2") -> Run:
    where = tmp_path / name
    where.mkdir()
    return Run(["-m", "mpddp", "run", "--nnodes", nnodes, "--node-rank", str(node_rank), "--nprocs", "1",
                *backend, "--timeout", "30", str(tmp_path / job[0]), job[1]], where,
               env={"STOP": str(tmp_path / "stop")})



def _one_job_runs(tmp_path, jobs: tuple[tuple[str, str], ...], backend: list[str], refused_line) -> None:
    """Both jobs' four launchers at once: one job runs alone, unmixed, and ends 0; each launcher of the other job
    ends with exit code 2 and one line, ``refused_line(run, node_rank, its job, the running job)`` (None: any)."""
    _scripts(tmp_path)
    # job 0's node 0 and job 1's node 1 first: the two that formed one world before
    runs = {(j, n): _launcher(tmp_path, f"job{j}-node{n}", jobs[j], n, backend)
            for j, n in ((0, 0), (1, 1), (0, 1), (1, 0))}
    try:
        deadline = time.monotonic() + 120
        while sum(run.proc.poll() is not None for run in runs.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = {key for key, run in runs.items() if run.proc.poll() is not None}
        everything = "\n".join(f"--- {key} rc={run.proc.poll()}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
                               for key, run in runs.items())
        assert len(ended) == 2 and len({j for j, _ in ended}) == 1, everything  # one job's two launchers
        loser = next(iter(ended))[0]
        winner = 1 - loser
        for node in (0, 1):
            run = runs[(winner, node)]
            run.wait_for(r"STEP 3 ", timeout=90, also=tuple(runs.values()))
        (tmp_path / "stop").write_text("stop")
        for node in (0, 1):
            run = runs[(winner, node)]
            assert run.finish(60) == 0, everything
            assert "DONE world=2 mixed=False" in run.stdout and "mixed=True" not in run.stdout, run.stdout
            assert not run.said, run.stderr
        for node in (0, 1):
            run = runs[(loser, node)]
            said = run.said
            assert run.proc.returncode == 2 and len(said) == 1, everything
            assert "Traceback" not in run.stderr and "STEP" not in run.stdout, run.stderr
            expected = refused_line(run, node, jobs[loser], jobs[winner])
            assert expected is None or said[0] == expected, (said[0], expected)
        for run in runs.values():
            run.assert_nothing_left()
    finally:
        for run in runs.values():
            run.kill()


def _differs(mine: tuple[str, str], standing: tuple[str, str]) -> str:
    return f"it runs `{' '.join(standing)}`, this launcher `{' '.join(mine)}`"


@pytest.mark.skipif(shutil.which("etcd") is None, reason="Debian's etcd-server is not installed")
def test_two_jobs_of_two_scripts_on_one_etcd_id_never_share_a_world(tmp_path, etcd_cluster):
    """Before: job A's node 0 and job B's node 1 formed one world (4 of 4 runs), both ended 0; the two others were
    told that their --node-rank was taken. Now the job whose launcher came first holds the id: the other's two
    launchers are told, whatever their node rank, that the id is another job's, and what differs. Two scripts
    here, two arguments of one script under c10d below: each difference is carried end to end once (what a
    fingerprint holds, and how two differ, are the table rows at the end of this file)."""
    differ = "scripts"
    backend = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", f"one-{differ}",
               "--local-addr", "127.0.0.1"]
    _one_job_runs(tmp_path, JOBS[differ], backend, lambda run, node, mine, standing: (
        f"mpddp: error: --rdzv-id one-{differ} is another job's: {_differs(mine, standing)}; give this job a "
        "--rdzv-id of its own, or start this launcher with that job's script, arguments and --nprocs"))


def test_two_jobs_of_two_arguments_on_one_c10d_port_never_share_a_world(tmp_path):
    """Before: the second job's node 1 raced the first's for --node-rank 1 in node 0's store: the winner ran in the
    first job's world, whatever it ran. Now the job of node 0 (the launcher that bound the port) stands: the other
    job's node 0 cannot bind the port, and its node 1 is told that the store is another job's before it takes a
    node rank, so the first job's own node 1 takes it."""
    differ = "arguments"
    port = free_port()
    backend = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    _one_job_runs(tmp_path, JOBS[differ], backend, lambda run, node, mine, standing: None if node == 0 else (
        f"mpddp: error: the job at 127.0.0.1:{port} (node 0's store) is another job's: {_differs(mine, standing)}; "
        "give this job a --master-port of its own, or start this launcher with that job's script, arguments and "
        "--nprocs"))


def test_a_twin_node_rank_at_a_c10d_jobs_start_is_told_within_15_s(tmp_path):
    """Node 0, node 1 and a second node 1 started at once: the one of the two that comes second to node 0's store
    is told in one line, exit code 2, and the job runs on, unchanged. The bound is measured from when the job is
    up (node 0's first step: its node 1 came, and the twin's ranks start as that one's do), not from the start:
    on a loaded machine (load 13 to 20) the ranks' start alone took 18 s. Measured at load 12 to 16: told 0.7 to
    1.8 s after the job's first step (the twin's first rank claims its node rank in node 0's store), the margin
    15 s. It passed before this change too: the hostile pass's miss was not reproduced here."""
    _scripts(tmp_path)
    port = free_port()
    backend = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    runs = [_launcher(tmp_path, name, ("job.py", "1"), node, backend)
            for name, node in (("node0", 0), ("node1", 1), ("twin", 1))]
    up = told = None
    try:
        deadline = time.monotonic() + 120
        while (up is None or told is None) and runs[0].proc.poll() is None and time.monotonic() < deadline:
            if up is None and "STEP 1 " in runs[0].stdout:
                up = time.monotonic()
            if told is None and any(run.proc.poll() is not None for run in runs[1:]):
                told = time.monotonic()
            time.sleep(0.05)
        twin = next((run for run in runs[1:] if run.proc.poll() is not None), None)
        assert twin is not None and up is not None and told is not None, [run.stderr for run in runs]
        said = twin.said
        assert twin.proc.returncode == 2 and len(said) == 1, twin.stderr
        assert said[0].startswith("mpddp: error: --node-rank 1 is taken: the launcher "), said
        assert told - up <= 15.0, f"told {told - up:.1f} s after the job's first step"
        node1 = runs[2] if twin is runs[1] else runs[1]
        for run in (runs[0], node1):
            run.wait_for(r"STEP 3 ", timeout=90, also=tuple(runs))
        (tmp_path / "stop").write_text("stop")
        for run in (runs[0], node1):
            assert run.finish(60) == 0, run.stderr
            assert "DONE world=2 mixed=False" in run.stdout and not run.said, run.stderr
        for run in runs:
            run.assert_nothing_left()
    finally:
        for run in runs:
            run.kill()


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_newcomer_of_another_job_is_refused_and_the_running_job_goes_on(tmp_path, backend, request):
    """An elastic job (--nnodes 1:2) that runs on its node 0 alone, then a launcher of another script comes to it:
    refused in one line, exit code 2, before the job restarts to admit it. Before: admitted, the job restarted
    (round 1) with the other script's rank in its world."""
    if backend == "etcd":
        if shutil.which("etcd") is None:
            pytest.skip("Debian's etcd-server is not installed")
        cluster = request.getfixturevalue("etcd_cluster")
        where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "newcomer",
                 "--local-addr", "127.0.0.1"]
        job = "--rdzv-id newcomer"
        fix = "give this job a --rdzv-id of its own"
    else:
        port = free_port()
        where = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        job = f"the job at 127.0.0.1:{port} (node 0's store)"
        fix = "give this job a --master-port of its own"
    _scripts(tmp_path)
    node0 = _launcher(tmp_path, "node0", ("job.py", "1"), 0, where, "1:2")
    runs = [node0]
    try:
        node0.wait_for(r"STEP 3 world=1 ", timeout=90)
        newcomer = _launcher(tmp_path, "newcomer", ("ejob.py", "1"), 1, where, "1:2")
        runs.append(newcomer)
        assert newcomer.finish(90) == 2, newcomer.stderr
        assert newcomer.said == [
            f"mpddp: error: {job} is another job's: it runs `job.py 1`, this launcher `ejob.py 1`; {fix}, or start "
            "this launcher with that job's script, arguments and --nprocs"], newcomer.stderr
        assert "Traceback" not in newcomer.stderr and "STEP" not in newcomer.stdout, newcomer.stderr
        steps = node0.stdout.count("STEP ")
        time.sleep(1.5)  # the job goes on, unchanged: nobody restarted it
        assert node0.proc.poll() is None and node0.stdout.count("STEP ") > steps, node0.stderr
        (tmp_path / "stop").write_text("stop")
        assert node0.finish(60) == 0, node0.stderr
        assert "world=2" not in node0.stdout and "DONE world=1 mixed=False" in node0.stdout, node0.stdout
        assert not node0.said, node0.stderr
        for run in runs:
            run.assert_nothing_left()
    finally:
        for run in runs:
            run.kill()


def _train(ctx, lr):  # a function a user launches
    return lr


@pytest.mark.parametrize("fn, args, expected", [
    (run_script, ("/home/a/exp/train.py", ("--lr", "0.1"), False), "train.py --lr 0.1"),
    (run_script, ("./train.py", (), False), "train.py"),  # the folder is left out: each machine keeps it elsewhere
    (run_script, ("train.py", ("--name", "a b"), False), "train.py --name 'a b'"),  # quoted as a shell would
    (run_script, ("pkg.train", ("--lr", "1"), True), "-m pkg.train --lr 1"),
    (_train, (0.1,), f"{__name__}._train"),  # a function's arguments are not compared (see the module's header)
    (ByIndex(_train), (), f"{__name__}._train"),  # mpddp.spawn's: the user's function, not its wrapper
])
def test_a_launch_says_what_it_runs(fn, args, expected):
    assert _job(fn, args) == expected


@pytest.mark.parametrize("mine, standing, expected", [
    (("job.py 1", 2), ("job.py 1", 2), None),
    (("job.py 1", 2), ("job.py 2", 2), "it runs `job.py 2`, this launcher `job.py 1`"),
    (("job.py 1", 1), ("job.py 1", 2), "its nodes run --nprocs 2, this launcher --nprocs 1"),
    (("a.py", 1), ("b.py", 2),
     "it runs `b.py`, this launcher `a.py`; its nodes run --nprocs 2, this launcher --nprocs 1"),
    (("a.py", 1), ("x" * 300, 1), f"it runs `{'x' * 200}…`, this launcher `a.py`"),  # a long one shown in part
])
def test_two_fingerprints_differ_in_what_the_line_says(mine, standing, expected):
    assert Fingerprint(*mine).differs(Fingerprint(*standing)) == expected


@pytest.mark.parametrize("text", [None, b"", b"not json", b"[]", b"{}", b'{"job": 1, "nprocs": 2}',
                                  b'{"job": "a.py", "nprocs": "2"}', b'{"job": "a.py"}'])
def test_a_fingerprint_read_from_a_store_that_is_not_one_is_none(text):
    """What another launcher wrote is read as untrusted: anything but a fingerprint is none (not compared)."""
    assert Fingerprint.decode(text) is None


def test_a_fingerprint_crosses_a_store_unchanged():
    fingerprint = Fingerprint("train.py --name 'a b' é", 8)
    assert Fingerprint.decode(fingerprint.encode().encode()) == fingerprint
