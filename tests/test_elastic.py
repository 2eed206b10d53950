"""Elastic jobs and the loss of any node: real launchers as the nodes of one job, on a real 3-member etcd
cluster (``--rdzv-backend etcd``) or on node 0's store (c10d).

A node's machine is "lost" by SIGKILLing every process it runs at once (launcher, store server, forkserver,
ranks), at a random step; the etcd leader is SIGKILLed the same way. Every launcher runs in its own session,
under a timeout, and nothing of any node may be left afterwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from runs import Run, alive_or_zombie, marked

pytestmark = pytest.mark.timeout(240)

JOB = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(os.environ["CKPT"], "step.json")
    step = 0
    if os.path.exists(path):
        step = json.load(open(path))["step"]
        print(f"RESUMED step={step} world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    total = torch.zeros(1)

    def held():  # on while the file $HOLD exists, read on every rank at the same step: they stop together
        if "HOLD" not in os.environ:
            return False
        flag = torch.tensor([float(os.path.exists(os.environ["HOLD"]))])
        dist.all_reduce(flag)
        return flag.item() > 0

    while step < int(os.environ["STEPS"]) or world < int(os.environ.get("UNTIL_WORLD", "0")) or held():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        step += 1
        if rank == 0 and step % 5 == 0:
            with open(path + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(path + ".tmp", path)
        print(f"STEP {step} at {time.time():.3f}", flush=True)
        time.sleep(0.05)
    dist.barrier()  # a round that starts past STEPS (a newcomer's) steps none: no rank leaves while another connects
    print(f"DONE world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    dist.destroy_process_group()
""")


def _nodes(tmp_path, cluster, count, nnodes, steps, job_id, extra=(), until_world=0):
    """``count`` etcd launchers: node ranks 0, 1, ... up to MAX - 1, those beyond numbered as they join."""
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "ckpt").mkdir()
    runs = []
    for node in range(count):
        where = tmp_path / f"node{node}"
        where.mkdir()
        rank = ["--node-rank", str(node)] if node < int(nnodes.split(":")[-1]) else []
        runs.append(Run(["-m", "mpddp", "run", "--nnodes", nnodes, *rank, "--nprocs", "1",
                         "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", job_id,
                         "--local-addr", "127.0.0.1", "--timeout", "20", *extra, str(tmp_path / "job.py")],
                        where, env=_job_env(tmp_path, steps, until_world)))
    return runs


def _job_env(tmp_path, steps, until_world=0):
    """The job's variables: it saves to ``ckpt``, and runs ``steps`` steps, and beyond them until its world size is
    ``until_world`` (a newcomer's admission, however late a loaded machine starts it, comes before the end)."""
    return {"CKPT": str(tmp_path / "ckpt"), "STEPS": str(steps), "UNTIL_WORLD": str(until_world)}


def _c10d_nodes(tmp_path, count, steps, extra=(), until_world=0, hold=None):
    from multinode import free_port

    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    port, runs = free_port(), []
    for node in range(count):
        runs.append(_c10d_node(tmp_path, node, port, steps, extra, until_world, hold))
    return runs


def _c10d_node(tmp_path, node, port, steps, extra=(), until_world=0, hold=None, name="node-new"):
    """A launcher of the 2:3 job; ``node`` None: no --node-rank, numbered as it joins (torchrun's line), in folder
    ``name``. ``hold``: a file whose presence keeps the job stepping past ``steps`` (every node's, or none's)."""
    where = tmp_path / (name if node is None else f"node{node}")
    where.mkdir()
    rank = [] if node is None else ["--node-rank", str(node)]
    return Run(["-m", "mpddp", "run", "--nnodes", "2:3", *rank, "--nprocs", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--timeout", "20", *extra, str(tmp_path / "job.py")], where,
               env={**_job_env(tmp_path, steps, until_world), **({"HOLD": str(hold)} if hold else {})})


def _lose(run: Run) -> None:
    """The node's machine is lost: every process of it SIGKILLed at once."""
    procs = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True),
             *marked(run.marker)]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    run.proc.wait(10)


def _lose_at(runs: list[Run], step: int, victim: Run, watched: Run) -> None:
    """Once ``watched`` printed ``step``: every run's tree listed (for the leftover check), ``victim`` lost."""
    watched.wait_for(rf"STEP {step} ", timeout=90)
    for run in runs:
        run.list_tree()
    _lose(victim)


def _end(runs: list[Run]) -> None:
    for run in runs:
        run.kill()


def test_node_0_lost_is_survived_by_the_others_from_their_checkpoint(tmp_path, etcd_cluster):
    """A 2:3 job whose node 0 machine is lost mid-run finishes on the two others, which both name node 0."""
    # 60 steps: past the loss (at step 40 at most), the survivors step on from their checkpoint to the end
    runs = _nodes(tmp_path, etcd_cluster, 3, "2:3", 60, "lose0", ["--max-restarts", "1", "-v"])
    try:
        at = random.randint(15, 40)
        runs[0].wait_for(rf"STEP {at} ", timeout=90)
        for run in runs:
            run.list_tree()
        _lose(runs[0])
        lost_at = time.time()
        codes = [run.finish(120) for run in runs[1:]]
        for run in runs[1:]:
            assert "mpddp: node(s) 0 went away" in run.stderr, run.stderr
            assert "node 1 -> 0: ranks 1 -> 0" in run.stderr and "node 2 -> 1: ranks 2 -> 1" in run.stderr
            assert "DONE world=2 restart=1" in run.stdout, run.stdout + run.stderr
        assert codes == [0, 0], [run.stderr for run in runs]
        resumed = re.search(r"RESUMED step=(\d+) world=2 restart=1", runs[1].stdout)
        assert resumed, runs[1].stdout
        # Rank 0 saves every 5 steps; the ranks step in lockstep, so rank 0 was at most one step past rank 1's last
        # print when it was lost (how late the loss came after step ``at`` is the test's timing, not the launcher's).
        last = max(int(step) for step in re.findall(r"STEP (\d+) ", runs[1].stdout[:resumed.start()]))
        assert at - 5 <= int(resumed.group(1)) and last - 5 <= int(resumed.group(1)) <= last + 1, runs[1].stdout
        after = runs[1].stdout[resumed.end():]
        first = float(re.search(r"STEP \d+ at ([0-9.]+)", after).group(1))  # type: ignore[union-attr]
        print(f"node 0 lost at step {at}: the survivors' first new step {first - lost_at:.1f} s later")
        for run in runs[1:]:
            run.assert_nothing_left()
        assert not alive_or_zombie(runs[0].pids)  # a lost machine's files are its own: only its processes count
    finally:
        _end(runs)


# A node that arrives below MAX, admitted by a restart that is not counted, and an etcd endpoint that does not
# answer: tests/test_rendezvous_input.py tells each story once (the first on both backends).


def test_a_spare_beyond_max_takes_a_lost_nodes_place(tmp_path, etcd_cluster):
    runs = _nodes(tmp_path, etcd_cluster, 3, "2", 50, "spare", ["--max-restarts", "1"])  # lost at step 15 or later
    try:
        deadline = time.monotonic() + 90
        while not (any("STEP 15 " in run.stdout for run in runs) and any("a spare" in run.stderr for run in runs)):
            assert time.monotonic() < deadline and all(run.proc.poll() is None for run in runs), [
                run.stderr for run in runs]
            time.sleep(0.05)
        spare = next(run for run in runs if "this node waits as a spare" in run.stderr)
        lost = next(run for run in runs if run is not spare)
        for run in runs:
            run.list_tree()
        _lose(lost)
        others = [run for run in runs if run is not lost]
        assert [run.finish(120) for run in others] == [0, 0], [run.stderr for run in others]
        for run in others:
            assert "DONE world=2 restart=1" in run.stdout, run.stdout + run.stderr
            run.assert_nothing_left()
        assert "went away" in next(run for run in others if run is not spare).stderr
    finally:
        _end(runs)


def test_fewer_than_min_nodes_is_one_line_naming_min(tmp_path, etcd_cluster):
    (tmp_path / "hi.py").write_text("print('ran')\n")
    out = subprocess.run([sys.executable, "-m", "mpddp", "run", "--nnodes", "2:3", "--rdzv-backend", "etcd",
                          "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", "alone", "--timeout", "3",
                          "hi.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "1 node(s) joined within --timeout 3 s, but --nnodes 2:3 needs at least 2" in out.stderr, out.stderr
    assert "ran" not in out.stdout


def test_c10d_a_lost_node_other_than_0_is_survived_a_newcomer_admitted_and_a_spare_told_it_was_not_needed(
        tmp_path):
    """c10d, 2:3: node 1's machine lost at step 15, the two others go on at world size 2; then a new launcher
    arrives (no --node-rank: 3 would be beyond MAX, refused) and the job grows back to 3 (a free restart), and
    every node ends at 0. A last call of 10 s: on a
    loaded machine a launcher can start more than the default 3 s after the others (then round 0 runs without it,
    which is not this test's story).

    Once the job is back at 3, a fourth launcher without --node-rank waits as a spare; the job ends well. Before,
    node 0 kept its store only until the members had left: the spare, looking every 0.1 s, mostly found it gone
    first and said "node 0's launcher was killed, or its machine lost". Node 0 had finished. (test_door.py's story
    before, on a job of three launchers of its own.)"""
    hold = tmp_path / "hold"  # the job steps on while it exists: the spare comes before the end, however loaded
    hold.write_text("")  # the machine (400 steps were once over before a spare started at load 15 came)
    conf = ["--rdzv-conf", "last_call_timeout=10"]
    # 40 steps, and on until the newcomer made the world 3 (UNTIL_WORLD) and the spare waits (HOLD)
    runs = _c10d_nodes(tmp_path, 3, 40, ["--max-restarts", "1", *conf], until_world=3, hold=hold)
    try:
        _lose_at(runs, 15, victim=runs[1], watched=runs[0])
        runs[0].wait_for(r"RESUMED step=\d+ world=2 restart=1", timeout=90)
        runs.append(_c10d_node(tmp_path, None, _port(runs[0]), 40, conf, until_world=3, hold=hold))
        runs[0].wait_for(r"RESUMED step=\d+ world=3 restart=1", timeout=90)
        spare = _c10d_node(tmp_path, None, _port(runs[0]), 40, conf, until_world=3, hold=hold, name="spare")
        runs.append(spare)
        deadline = time.monotonic() + 120
        while "waits as a spare" not in spare.stderr:
            assert time.monotonic() < deadline and spare.proc.poll() is None, spare.stderr
            time.sleep(0.1)
        spare.list_tree()
        hold.unlink()  # the job ends well now, with the spare waiting
        survivors = [runs[0], runs[2], runs[3]]
        assert [run.finish(120) for run in survivors] == [0, 0, 0], [run.stderr for run in survivors]
        ended = time.monotonic()
        assert "mpddp: node(s) 1 went away" in runs[0].stderr and "node 2 -> 1: ranks 2 -> 1" in runs[0].stderr
        for run in survivors:
            assert "DONE world=3 restart=1" in run.stdout, run.stdout + run.stderr  # the admission is none
            run.assert_nothing_left()
        code = spare.finish(20 + 60)
        said = [line for line in spare.stderr.splitlines() if line.startswith("mpddp:")]
        assert code == 0 and "killed" not in spare.stderr, spare.stderr
        assert said[-1].startswith("mpddp: the job ended while this node waited as a spare"), said
        assert time.monotonic() - ended < 20 + 15  # its --timeout, and a margin
        assert "STEP" not in spare.stdout
        spare.assert_no_launcher_frame()
        spare.assert_nothing_left()
    finally:
        _end(runs)


def test_c10d_a_twin_node_rank_is_refused_and_node_0_lost_ends_the_job_with_a_line_that_names_etcd(tmp_path):
    """c10d, 2:3 on three nodes. First a second launcher with node 1's --node-rank comes: it is refused in one line
    (exit 2, no rank run) and the job goes on unchanged. Then node 0's machine is lost: the two others end 1, with a
    line that names etcd. (Two stories that started launchers of their own before: the twin's claim is read before
    the round's size, core/nodes/membership.py's join_round, so a job at MAX refuses it as one below MAX does.)"""
    # The first round waits for all three (its last call outlasts a loaded machine's late start): node 0 is lost
    # from a job of three, not while a late third is admitted (a true story too, but another one). The job steps
    # on until node 0 is lost, however slow the twin.
    runs = _c10d_nodes(tmp_path, 3, 10**6, ["--max-restarts", "1", "--rdzv-conf", "last_call_timeout=60"])
    try:
        runs[1].wait_for(r"STEP 5 ", timeout=90)
        where = tmp_path / "twin"
        where.mkdir()
        twin = Run(["-m", "mpddp", "run", "--nnodes", "2:3", "--node-rank", "1", "--nprocs", "1", "--master-addr",
                    "127.0.0.1", "--master-port", str(_port(runs[0])), "--timeout", "20", str(tmp_path / "job.py")],
                   where, env={"CKPT": str(tmp_path / "ckpt"), "STEPS": "80"})
        assert twin.finish(60) == 2, twin.stderr
        # mpddp's one line; on a loaded machine torch's store client may print its own retries before it
        said = [line for line in twin.stderr.splitlines() if line.startswith("mpddp:")]
        assert len(said) == 1 and said[0].startswith("mpddp: error: --node-rank 1 is taken: the launcher "), said
        assert "Traceback" not in twin.stderr and "STEP" not in twin.stdout
        twin.assert_nothing_left()
        steps = [run.stdout.count("STEP ") for run in runs]
        time.sleep(1.0)
        assert all(run.proc.poll() is None for run in runs), [run.stderr for run in runs]
        assert all(run.stdout.count("STEP ") > n for run, n in zip(runs, steps))  # the job goes on, unchanged
        assert "restart" not in runs[0].stderr and "arrived" not in runs[0].stderr, runs[0].stderr

        _lose_at(runs, 15, victim=runs[0], watched=runs[1])
        assert [run.finish(120) for run in runs[1:]] == [1, 1]
        for run in runs[1:]:
            assert "node 0, which hosts the rendezvous at 127.0.0.1:" in run.stderr, run.stderr
            assert run.stderr.rstrip().endswith("with --rdzv-backend etcd the job survives the loss of any node, "
                                                "node 0 included"), run.stderr
            run.assert_nothing_left()
    finally:
        _end(runs)


def _port(run: Run) -> int:
    return int(run.proc.args[run.proc.args.index("--master-port") + 1])  # type: ignore[union-attr]


def test_a_lease_that_ran_out_under_a_starved_launcher_is_taken_again(etcd_cluster):
    """etcd deletes a launcher's keys when its lease runs out (here: revoked under it); its next arrival must
    not be refused for the dead lease, it takes a new one (and its old keys stay gone: that is the loss)."""
    from etcd3gw.lease import Lease

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous

    config = LaunchConfig(nnodes=2, rdzv_backend="etcd", rdzv_endpoint=etcd_cluster.endpoints, rdzv_id="starved")
    link = EtcdRendezvous(config, 0, 1)
    try:
        link.put(link.key(0, "join", "a"), "1", leased=True)
        kept = link.kept
        first = kept.id  # type: ignore[union-attr]
        link.client.call(lambda c: Lease(first, client=c).revoke())
        assert link.get(link.key(0, "join", "a")) is None
        link.put(link.key(1, "join", "a"), "1", leased=True)
        assert link.kept.id != first and link.get(link.key(1, "join", "a")) == b"1"  # type: ignore[union-attr]
        # the dead lease's thread ends with it (it refreshed on, and outlived the test: an unhandled exception later)
        assert not kept._thread.is_alive()  # type: ignore[union-attr]
    finally:
        link.leave()
        link.client.call(lambda c: c.delete_prefix(link.prefix))


def test_a_launcher_whose_lease_ran_out_leaves_without_a_traceback(etcd_cluster):
    """Its lease gone under it (a starved machine: 256 simulated nodes on 2 cores), the launcher's leave()
    revoked it again and raised etcd's "Not Found" as a traceback; a lease already gone is what leave() wants."""
    from etcd3gw.lease import Lease

    from mpddp.config import LaunchConfig
    from mpddp.core.nodes.etcd import EtcdRendezvous

    config = LaunchConfig(nnodes=2, rdzv_backend="etcd", rdzv_endpoint=etcd_cluster.endpoints, rdzv_id="ran-out")
    link = EtcdRendezvous(config, 0, 1)
    try:
        link._first_contact()  # as join() does: the lease is this launcher's from its first request
        kept = link.kept
        link.client.call(lambda c: Lease(kept.id, client=c).revoke())  # type: ignore[union-attr]
        link.leave()
        assert not kept._thread.is_alive()  # type: ignore[union-attr]
    finally:
        link.client.call(lambda c: c.delete_prefix(link.prefix))


GIL_HELD = Path(__file__).parent / "scripts" / "gil_held"  # its sitecustomize holds the GIL at torch's first import

GIL_STEPS = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(1, 101):
    dist.all_reduce(torch.ones(1))
    print(f"STEP {step} ", flush=True)
    time.sleep(0.1)
print(f"DONE rank {rank} world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
"""


def _alive_keys(cluster, prefix: str) -> list[bytes] | None:
    """The keys under ``prefix``, read through the first live member that answers; None while none does (an
    election after the leader's death)."""
    from etcd3gw.exceptions import Etcd3Exception

    for index, proc in enumerate(cluster.procs):
        if proc.poll() is None:
            with contextlib.suppress(Etcd3Exception):
                return [meta["key"] for _, meta in cluster.client(index).get_prefix(prefix)]
    return None


def test_a_launcher_whose_first_torch_import_holds_the_gil_keeps_its_lease_and_the_etcd_leader_is_no_restart(
        tmp_path):
    """A launcher's first import of torch holds the GIL for seconds on a starved machine, and no thread refreshes
    its lease meanwhile. Here node 1's import holds it 8 s, longer than the lease's 3 s TTL: main imported torch
    after it took its lease, as its first round started, and etcd revoked the lease of a launcher alive and well
    (its ``alive`` key, which the other nodes read, gone 4 s in, the job still training; CI: a node named lost
    before a step was taken). The key must stay from the round's start until the ranks are done.

    Then, at step 20, the etcd leader is SIGKILLed mid-job: an election, no restart, the key still there, and
    both nodes end 0 at world 2 (a story of its own before, on two launchers of its own: the same job shares them,
    its two phases one after the other)."""
    pytest.importorskip("etcd3gw")
    from etcd_cluster import EtcdCluster

    (tmp_path / "steps.py").write_text(GIL_STEPS)
    runs: list[Run] = []
    with EtcdCluster() as cluster:  # its own: its leader is killed
        try:
            for node in range(2):
                (tmp_path / f"node{node}").mkdir()
                held = {"PYTHONPATH": f"{GIL_HELD}:{os.environ.get('PYTHONPATH', '')}", "MPDDP_TEST_HOLD_GIL": "8"}
                runs.append(Run(["-m", "mpddp", "run", "--nnodes", "2", "--node-rank", str(node), "--nprocs", "1",
                                 "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "gil",
                                 "--local-addr", "127.0.0.1", "--timeout", "30", str(tmp_path / "steps.py")],
                                tmp_path / f"node{node}", env=held if node == 1 else None))
            seen, lapsed, killed = False, [], None
            started = time.monotonic()
            while "DONE rank 1" not in runs[1].stdout and runs[1].proc.poll() is None and \
                    time.monotonic() - started < 90:
                if killed is None and "STEP 20 " in runs[0].stdout:
                    killed = cluster.leader_index()
                    cluster.kill(killed)
                keys = _alive_keys(cluster, "/mpddp/gil/")
                if keys is not None:  # None: no member answers now (an election), nothing seen either way
                    alive = any(key.endswith(b"/alive/1") for key in keys)
                    if seen and not alive and "DONE rank 1" not in runs[1].stdout:
                        lapsed.append(round(time.monotonic() - started, 1))
                    seen |= alive
                time.sleep(0.2)
            codes = [run.finish(90) for run in runs]
            told = "\n".join(f"--- node {node}:\n{run.stderr}" for node, run in enumerate(runs))
            assert seen and not lapsed, f"node 1's alive key gone at {lapsed[:3]} s, the job running\n{told}"
            assert killed is not None, told  # the leader died mid-job
            assert codes == [0, 0], told
            for node, run in enumerate(runs):
                assert f"DONE rank {node} world=2 restart=0" in run.stdout and "restarting" not in run.stderr, told
                run.assert_nothing_left()
        finally:
            for run in runs:
                run.kill()
