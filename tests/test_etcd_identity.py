"""A job's identity under ``--rdzv-backend etcd``: each launch of a ``--rdzv-id`` is an incarnation, and a launcher
tells a live one (join it) from a crashed one (start afresh) by asking its launchers, never by waiting out a TTL.

Real launchers on a real 3-member etcd (tests/etcd_cluster.py), and real SIGKILLs and SIGSTOPs; then the pure
readings behind it (core/nodes/etcd_identity.py), in milliseconds.
"""

from __future__ import annotations

import shutil
import signal
import socket
import textwrap
import time

import psutil
import pytest

from runs import Run, marked

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("etcd") is None,
                                                          reason="Debian's etcd-server is not installed")]

JOB = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    step = 0
    stop = os.environ.get("STOP", "")
    while step < int(os.environ["STEPS"]):
        stopping = torch.tensor([float(bool(stop) and os.path.exists(stop))])
        dist.all_reduce(stopping, op=dist.ReduceOp.MAX)  # the ranks stop together: one that saw the file first
        if stopping.item():  # and left would end the other's next all-reduce ("closed by peer"), seen under load
            break
        step += 1
        print(f"STEP {step} restart={restart}", flush=True)
        if rank == 1 and restart == 0 and step == int(os.environ.get("FAIL_ONCE_AT", "0")):
            raise RuntimeError("rank 1 fails once")
        time.sleep(0.05)
    print(f"DONE world={dist.get_world_size()} restart={restart}", flush=True)
    dist.destroy_process_group()
""")
HOST = socket.gethostname()


def _launcher(tmp_path, name, cluster, job_id, node_rank, steps, extra=(), env=None):
    where = tmp_path / name
    where.mkdir()
    rank = [] if node_rank is None else ["--node-rank", str(node_rank)]
    return Run(["-m", "mpddp", "run", "--nnodes", "2", *rank, "--nprocs", "1", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", job_id, "--local-addr", "127.0.0.1",
                "--timeout", "20", *extra, str(tmp_path / "job.py")], where, env={"STEPS": str(steps), **(env or {})})


def _tree(run: Run) -> list[psutil.Process]:
    """Every process of a launcher's machine: the launcher, its children, and those that carry its marker."""
    procs = {p.pid: p for p in marked(run.marker)}
    try:
        root = psutil.Process(run.proc.pid)
        procs.update({p.pid: p for p in (root, *root.children(recursive=True))})
    except psutil.NoSuchProcess:
        pass
    return list(procs.values())


def _signal(runs: list[Run], sig: int) -> None:
    for run in runs:
        if run.proc.poll() is None:
            run.list_tree()
        for proc in _tree(run):
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


def _stepping(runs: list[Run], pattern: str = r"STEP 5 ") -> None:
    """Every run printed ``pattern``; else fail with what every one of them said."""
    try:
        for run in runs:
            run.wait_for(pattern, timeout=120)
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(f"--- {i}: {run.stderr}" for i, run in enumerate(runs))) from None



def _end(runs: list[Run]) -> None:
    _signal(runs, signal.SIGCONT)
    for run in runs:
        run.kill()


def test_a_taken_node_rank_is_refused_in_any_round_and_while_the_job_is_frozen_and_its_id_is_free_once_it_died(
        tmp_path, etcd_cluster):
    """One job of node ranks, three stories (each was a job of its own):

    1. it restarted once (round 1), then a second launcher with node 0's --node-rank comes: refused in one line.
       Before, main claimed a node rank in round 0 only, so the twin came in as a newcomer (a restart of the job);
    2. every process of the job SIGSTOPped (its leases held): its launchers still answer a probe (the kernel
       does), so a second launch with its id and node ranks is refused, naming them; the job goes on once it is
       continued;
    3. its launchers SIGKILLed with their leases alive (a TTL past the test's end), a second launch with the same
       id runs at once. Before: refused ('--node-rank 0 is taken: the launcher ... came first'); it must run now:
       the dead launchers refuse its probe, they are gone."""
    (tmp_path / "job.py").write_text(JOB)
    job, ttl = "twin", ["--rdzv-conf", "ttl=600"]  # a wait for the dead leases: past the test's end
    runs = [_launcher(tmp_path, f"node{n}", etcd_cluster, job, n, 10**6, ["--max-restarts", "1", *ttl],
                      {"FAIL_ONCE_AT": "5"}) for n in range(2)]
    others: list[Run] = []
    try:
        _stepping(runs, r"STEP 5 restart=1")
        twin = _launcher(tmp_path, "twin", etcd_cluster, job, 0, 10**6, ["--max-restarts", "1", *ttl])
        others.append(twin)
        assert twin.finish(60) == 2, twin.stderr
        said = twin.said
        assert len(said) == 1 and "Traceback" not in twin.stderr and "STEP" not in twin.stdout, twin.stderr
        assert said[0].startswith(f"mpddp: error: --node-rank 0 of --rdzv-id {job} is taken: the launcher "
                                  f"{HOST}-{runs[0].proc.pid}-"), said  # node 0's launcher, by its id
        assert "pass another --node-rank" in said[0] and "--rdzv-id of its own" in said[0], said
        steps = [run.stdout.count("STEP ") for run in runs]
        time.sleep(1.0)
        assert all(run.proc.poll() is None for run in runs), [run.stderr for run in runs]
        assert all(run.stdout.count("STEP ") > n for run, n in zip(runs, steps))  # the job goes on, unchanged
        assert "arrived" not in runs[0].stderr and "restart=2" not in runs[0].stdout, runs[0].stderr
        twin.assert_nothing_left()

        _signal(runs, signal.SIGSTOP)  # 2. frozen
        second = [_launcher(tmp_path, f"second{n}", etcd_cluster, job, n, 20, ttl) for n in range(2)]
        others += second
        assert [run.finish(60) for run in second] == [2, 2], [run.stderr for run in second]
        for n, run in enumerate(second):
            said = run.said
            assert len(said) == 1 and f"the launcher {HOST}-{runs[n].proc.pid}-" in said[0], said
            assert "STEP" not in run.stdout
            run.assert_nothing_left()
        steps = [run.stdout.count("STEP ") for run in runs]
        _signal(runs, signal.SIGCONT)
        runs[0].wait_for(r"STEP ", count=steps[0] + 5, timeout=60)
        assert all(run.proc.poll() is None for run in runs), [run.stderr for run in runs]

        _signal(runs, signal.SIGKILL)  # 3. both machines' every process: the launch crashed
        for run in runs:
            run.proc.wait(10)
        third = [_launcher(tmp_path, f"third{n}", etcd_cluster, job, n, 20, ttl) for n in range(2)]
        others += third
        assert [run.finish(120) for run in third] == [0, 0], [run.stderr for run in third]  # not the TTL's 600 s
        for run in third:
            assert "DONE world=2 restart=0" in run.stdout, run.stdout + run.stderr
            assert "Traceback" not in run.stderr, run.stderr
            run.assert_nothing_left()
    finally:
        _end(runs + others)


def test_an_id_reused_after_every_launcher_was_killed_runs_at_once_without_node_ranks(tmp_path, etcd_cluster):
    """Job 1's launchers, numbered as they join, SIGKILLed with their leases of 600 s alive, job 2 started at once
    with the same id: main had it wait out the dead launchers' TTL as newcomers. It must run now: job 1's
    launchers refuse its probe, they are gone (with node ranks: the test above, story 3)."""
    (tmp_path / "job.py").write_text(JOB)
    job, ttl = "reused", ["--rdzv-conf", "ttl=600"]  # a wait for the dead leases: past the test's end
    first = [_launcher(tmp_path, f"first{n}", etcd_cluster, job, None, 10**6, ttl) for n in range(2)]
    second: list[Run] = []
    try:
        _stepping(first)
        _signal(first, signal.SIGKILL)  # both machines' every process: the launch crashed
        for run in first:
            run.proc.wait(10)
        second = [_launcher(tmp_path, f"second{n}", etcd_cluster, job, None, 20, ttl) for n in range(2)]
        assert [run.finish(120) for run in second] == [0, 0], [run.stderr for run in second]  # not the TTL's 600 s
        for run in second:
            assert "DONE world=2 restart=0" in run.stdout, run.stdout + run.stderr
            assert "Traceback" not in run.stderr, run.stderr
            run.assert_nothing_left()
    finally:
        _end(first + second)


def test_two_launches_of_one_id_without_node_ranks_tell_the_spares_the_truth(tmp_path, etcd_cluster):
    """Two launches of a 2-node job, started together with one id and no --node-rank, are one job of four
    launchers to etcd (nothing tells them apart): two run it, two wait as spares. A spare says which job it
    waits for (the id, and the launchers that run it) and that a second job needs an id of its own; when the job
    ends, it says it ran nothing, and exits 0."""
    (tmp_path / "job.py").write_text(JOB)
    job = "together"
    stop = tmp_path / "stop"
    runs = [_launcher(tmp_path, f"node{n}", etcd_cluster, job, None, 10**6, env={"STOP": str(stop)})
            for n in range(4)]
    try:
        deadline = time.monotonic() + 120  # all four came (however late a loaded machine starts one): then it ends
        while sum("STEP 5 " in run.stdout for run in runs) < 2 or sum("spare" in run.stderr for run in runs) < 2:
            assert time.monotonic() < deadline and all(run.proc.poll() is None for run in runs), [
                run.stderr for run in runs]
            time.sleep(0.1)
        stop.write_text("now")
        codes = [run.finish(120) for run in runs]
        assert codes == [0, 0, 0, 0], [run.stderr for run in runs]
        ran = [run for run in runs if "DONE world=2" in run.stdout]
        spares = [run for run in runs if run not in ran]
        assert len(ran) == 2 and len(spares) == 2, [run.stderr for run in runs]
        for run in spares:
            assert "STEP" not in run.stdout, run.stdout
            waits = next(line for line in run.said if "waits as a spare" in line)
            assert f"--rdzv-id {job} runs on 2 node(s)" in waits, waits
            for other in ran:
                assert f"{HOST}-{other.proc.pid}-" in waits, waits
            assert "a second job needs a --rdzv-id of its own" in waits, waits
            assert any(f"--rdzv-id {job} ended while this node waited as a spare" in line and "ran nothing" in line
                       for line in run.said), run.stderr
        for run in runs:
            run.assert_nothing_left()
    finally:
        _end(runs)


# ---- the readings behind it: one launcher's answer, an incarnation's standing, in-process on a real etcd ------


@pytest.mark.parametrize(("answers", "expected"), [
    ([], "gone"),  # no launcher left: their leases ran out, or they left
    (["gone", "gone"], "gone"),
    (["gone", "live"], "live"),
    (["unknown", "gone"], "unknown"),  # a machine lost, or out of reach: its lease decides
    (["unknown", "live"], "live"),
])
def test_an_incarnation_stands_while_one_launcher_lives(answers, expected):
    from mpddp.core.nodes.etcd_identity import Liveness, standing

    assert standing(Liveness(a) for a in answers) is Liveness(expected)


def test_a_launcher_is_live_while_its_port_answers_and_gone_once_refused():
    from mpddp.core.nodes.etcd_identity import Liveness, Probe, reach

    probe = Probe("127.0.0.1")
    assert reach(probe.where, HOST, HOST) is Liveness.LIVE
    assert reach(probe.where, HOST, HOST) is Liveness.LIVE  # answered each time (accepted, then closed)
    probe.close()
    assert reach(probe.where, HOST, HOST) is Liveness.GONE
    assert reach(probe.where, "another-machine", HOST) is Liveness.UNKNOWN  # its loopback is not this one's
    assert reach("not an address", HOST, HOST) is Liveness.UNKNOWN


def _identity(cluster, job, me, high=2):
    from mpddp.core.nodes.etcd_identity import Identity
    from mpddp.core.stores.etcd_client import EtcdClient, KeptLease
    from mpddp.core.stores.etcd_kv import EtcdKV

    kv = EtcdKV(EtcdClient(cluster.endpoints), 30)
    kv.kept = lease = KeptLease(kv.client, 30)
    return Identity(kv, job, me, "127.0.0.1", high), lease


@pytest.mark.timeout(60)
def test_a_launch_joins_a_live_incarnation_and_replaces_a_gone_one_at_once(etcd_cluster):
    """Three launchers in turn: the second joins the first's incarnation (it answers); once the first two are
    gone (their ports closed, their leases of 30 s alive) the third starts a new one, and claims a node rank a gone
    launcher held; the old incarnation's keys go once no lease holds them."""
    from mpddp.core.nodes.etcd_identity import Liveness, reach

    job, made = "in-process", []
    try:
        for n in range(3):
            made.append(_identity(etcd_cluster, job, f"launcher{n}"))
        (a, lease_a), (b, lease_b), (c, lease_c) = made
        first = a.take()
        a.claim(0)
        a.claim(0)  # again (a spare claims at each round it comes to): its own
        assert b.take() == first
        from mpddp.errors import ConfigError

        with pytest.raises(ConfigError, match=f"--node-rank 0 of --rdzv-id {job} is taken: the launcher launcher0"):
            b.claim(0)
        a.close()
        b.close()
        assert reach(a.probe.where, HOST, HOST) is Liveness.GONE
        started = time.monotonic()
        third = c.take()
        c.claim(0)
        assert third != first and time.monotonic() - started < 5  # not the leases' 30 s
        client = etcd_cluster.client(0)
        assert client.get(f"/mpddp/{job}/incarnation") == [third.split("/")[-2].encode()]
        assert client.get_prefix(first)  # the gone launchers' keys: their leases hold them, for now
        lease_a.revoke()
        lease_b.revoke()
        c.sweep()
        assert not client.get_prefix(first) and not client.get_prefix(f"/mpddp/{job}/old/")
        c.forget()  # the last launcher of the job leaves
        client.delete_prefix(third)
        assert client.get_prefix(f"/mpddp/{job}/") == []
    finally:
        for identity, lease in made:
            identity.close()
            lease.revoke()


@pytest.mark.timeout(60)
def test_launchers_that_come_together_take_one_incarnation(etcd_cluster):
    """Eight launchers of a new job at once: one creates the incarnation, the seven others find it live and join
    it (a create that lost the race once counted as won: each took an incarnation of its own)."""
    import threading

    made = [_identity(etcd_cluster, "together-in-process", f"launcher{n}", high=8) for n in range(8)]
    taken: list[str] = []
    try:
        threads = [threading.Thread(target=lambda i=i: taken.append(i.take())) for i, _ in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(taken) == 8 and len(set(taken)) == 1, taken
    finally:
        for identity, lease in made:
            identity.close()
            lease.revoke()
