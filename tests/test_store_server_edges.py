"""Edge cases of the store server (core/stores/store_server.py) with real processes.

Each case attacks the store server that serves node 0's TCPStore: stopped, killed
inside ``init_process_group``, its launcher SIGKILLed under every start
method, restarts, many launches in a row, launches from threads next to a
failing launch whose rank leaves an orphan, fresh interpreters that never
import torch (a file, stdin, ``-c``), ``mpddp run`` of an env:// script, and
two "nodes" on 127.0.0.1. The last two found bugs, fixed since: a spawned
store server that took a Ctrl-C while it imported torch, and forked ranks that
each imported torch again on every launch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from multinode import Cluster, free_port

import mpddp

from helpers import gone, leftovers, running, store_server_pid
from runs import Run, port_is_free

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]

BOUND = 15.0  # seconds for processes to be gone after their launcher is: generous, for a loaded 2-core machine

# For the scripts below, run as their own processes: the same store_server_pid(), from tests/helpers.py.
FIND_STORE_SERVER = f"""
import os, sys
import psutil
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from helpers import store_server_pid
"""
store_server_pid = store_server_pid


def listener(pids: list[int], port: int) -> int | None:
    """Which of ``pids`` listens on ``port`` (seen from outside)."""
    for pid in pids:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections("tcp")):
                return pid
        except psutil.NoSuchProcess:
            continue
    return None


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------------------------- a frozen store server


def freeze_then_use_the_store(ctx, tmp):
    store = dist.distributed_c10d._get_default_store()
    Path(tmp, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both ranks are through init_process_group, which reads the store, before it stops
    if ctx.rank == 0:
        pid = store_server_pid()
        Path(tmp, "store_server.pid").write_text(str(pid))
        Path(tmp, "stopped_at").write_text(str(time.time()))  # the bound below is measured from it
        os.kill(pid, signal.SIGSTOP)
        # what the ranks' parent holds now, for the report should the store still answer (seen once, beside a
        # second suite: the launch returned; not reproduced since)
        family = [(p.pid, p.status(),
                   [c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN])
                  for p in psutil.Process(os.getppid()).children()]
        Path(tmp, "family.txt").write_text(f"rank 0 {os.getpid()}, port {os.environ['MASTER_PORT']}: {family}")
    dist.barrier()  # gloo: needs no store, so both ranks are past the SIGSTOP
    store.set(f"key{ctx.rank}", "v")  # blocks: the store server does not answer
    return store.get(f"key{1 - ctx.rank}").decode()


def test_a_stopped_store_server_is_found_as_a_hang_not_waited_on_forever(tmp_path):
    with pytest.raises(mpddp.StoreLost) as caught:  # the store server named, with its state (was: a hang in the ranks)
        returned = mpddp.launch(freeze_then_use_the_store, nprocs=2, args=(str(tmp_path),), timeout=3)
        pytest.fail(f"returned {returned}; the stopped one and its siblings: {(tmp_path / 'family.txt').read_text()}")
    took = time.time() - float((tmp_path / "stopped_at").read_text())
    assert took < 60, took  # from the SIGSTOP: found by the watchdog (3 s), not by torch's 30-minute default
    assert "does not answer: it is stopped (SIGSTOP, or a debugger)" in str(caught.value)
    store = int((tmp_path / "store_server.pid").read_text())
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(ranks) == 2
    assert gone([store, *ranks])  # the stopped store server was killed, not left frozen


def freeze_then_return(ctx, tmp):
    dist.barrier()  # gloo, no store: every rank is past init_process_group (under load rank 1 may still be in it)
    if ctx.rank == 0:
        pid = store_server_pid()
        Path(tmp, "store_server.pid").write_text(str(pid))
        Path(tmp, "stopped_at").write_text(str(time.time()))  # the bound below is measured from it
        os.kill(pid, signal.SIGSTOP)
    t = torch.ones(1)
    dist.all_reduce(t)  # gloo's pairs are up: a stopped store does not matter any more
    return t.item()


def test_a_store_server_frozen_after_init_does_not_hold_the_launch_and_is_killed(tmp_path):
    assert mpddp.launch(freeze_then_return, nprocs=2, args=(str(tmp_path),)) == [2.0, 2.0]
    took = time.time() - float((tmp_path / "stopped_at").read_text())
    assert took < 60, took  # from the SIGSTOP: the frozen store server is killed, not waited for
    assert gone([int((tmp_path / "store_server.pid").read_text())])


# ---------------------------------------------------------------------------- killed inside init_process_group


def test_a_store_server_killed_while_a_rank_is_inside_init_process_group_env_is_named(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    script = write(tmp_path, "join.py", FIND_STORE_SERVER + """
import sys, time, signal
import torch.distributed as dist
flags = sys.argv[1]
if os.environ["RANK"] == "1":
    open(os.path.join(flags, "entering"), "w").close()
    print("ENTER", os.getpid(), flush=True)
    dist.init_process_group("gloo")  # env://: waits for rank 0, which never comes
    print("NEVER", flush=True)
else:
    print("ENTER", os.getpid(), flush=True)
    while not os.path.exists(os.path.join(flags, "entering")):
        time.sleep(0.01)
    time.sleep(1.0)  # rank 1 is inside init, talking to the store
    pid = store_server_pid()
    open(os.path.join(flags, "store_server.pid"), "w").write(str(pid))
    os.kill(pid, signal.SIGKILL)
    time.sleep(60)
""")
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(script), str(flags)], tmp_path)
    try:
        run.wait_for(r"ENTER \d+", count=2)
        pids = run.list_tree()
        rc = run.finish(timeout=60)
        pids = pids | {int((flags / "store_server.pid").read_text())}
        run.all_gone_at(pids)
        run.assert_nothing_left()
    finally:
        run.kill()
    store_server = int((flags / "store_server.pid").read_text())
    assert rc == 1, run.stderr
    assert "NEVER" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mpddp: error: the store server (pid {store_server})") and (
        "was killed by SIGKILL" in last), run.stderr


# --------------------------------------------------------------------------- a SIGKILLed launcher, every method


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_a_sigkilled_launcher_takes_its_store_server_along(tmp_path, method):
    script = write(tmp_path, "sleepy.py", FIND_STORE_SERVER + """
import sys, time
import mpddp

def sleepy(ctx):
    print("STORE_SERVER", store_server_pid(), "RANK", os.getpid(), flush=True)
    time.sleep(100)

if __name__ == "__main__":
    mpddp.launch(sleepy, nprocs=1, start_method=sys.argv[1])
""")
    run = Run([str(script), method], tmp_path)
    try:
        found = run.wait_for(r"STORE_SERVER (\d+) RANK (\d+)")
        store_server, rank = int(found[0].group(1)), int(found[0].group(2))
        pids = run.list_tree() | {store_server, rank}
        assert store_server in pids
        run.proc.kill()  # no handler of the launcher runs
        run.finish(timeout=10)
        run.all_gone_at(pids - {run.proc.pid}, timeout=BOUND)
    finally:
        run.kill()
    assert running([store_server, rank]) == []


def test_a_sigkilled_launcher_takes_its_store_server_when_a_finished_thread_started_the_forkserver(tmp_path):
    """The forkserver's parent-death signal follows the thread that started it; that thread is long gone here."""
    script = write(tmp_path, "threaded.py", FIND_STORE_SERVER + """
import sys, threading, time
import mpddp

def quick(ctx):
    return ctx.rank

def sleepy(ctx):
    print("STORE_SERVER", store_server_pid(), "RANK", os.getpid(), flush=True)
    time.sleep(100)

if __name__ == "__main__":
    t = threading.Thread(target=lambda: print("FIRST", mpddp.launch(quick, nprocs=1), flush=True))
    t.start()
    t.join()
    mpddp.launch(sleepy, nprocs=1)
""")
    run = Run([str(script)], tmp_path)
    try:
        found = run.wait_for(r"STORE_SERVER (\d+) RANK (\d+)")
        store_server, rank = int(found[0].group(1)), int(found[0].group(2))
        assert "FIRST [0]" in run.stdout
        pids = run.list_tree() | {store_server, rank}
        run.proc.kill()
        run.finish(timeout=10)
        run.all_gone_at(pids - {run.proc.pid}, timeout=BOUND)
    finally:
        run.kill()
    assert running([store_server, rank]) == []


# ---------------------------------------------------------------------------------------------------- restarts


def fail_twice(ctx, tmp):
    if ctx.rank == 0:
        mine = store_server_pid()
        Path(tmp, f"store_server{ctx.restart}.pid").write_text(str(mine))
        earlier = [int(Path(tmp, f"store_server{k}.pid").read_text()) for k in range(ctx.restart)]
        still = running(earlier)
    else:
        mine, earlier, still = None, [], []
    if ctx.rank == 1 and ctx.restart < 2:
        raise ValueError(f"attempt {ctx.restart} fails")
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"restart": ctx.restart, "store server": mine, "earlier": earlier, "still_running": still, "sum": t.item()}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_every_restart_finds_the_one_store_server_of_the_job_and_it_is_gone_after_it(tmp_path):
    said = _Lines()
    logging.getLogger("mpddp").addHandler(said)
    try:
        got = mpddp.launch(fail_twice, nprocs=2, args=(str(tmp_path),), max_restarts=2)
    finally:
        logging.getLogger("mpddp").removeHandler(said)
    text = "\n".join(said.lines)
    assert [g["restart"] for g in got] == [2, 2] and [g["sum"] for g in got] == [2.0, 2.0]
    store_servers = [int((tmp_path / f"store_server{k}.pid").read_text()) for k in range(3)]
    # one store for the whole job, from the first attempt to the last
    assert len(set(store_servers)) == 1, store_servers
    assert got[0]["store server"] == store_servers[2] and got[0]["earlier"] == store_servers[:2]
    assert got[0]["still_running"] == store_servers[:2]  # the same process, still serving in the last attempt
    assert gone(store_servers)  # and gone with the job
    assert "ValueError: attempt 0 fails" in text and "ValueError: attempt 1 fails" in text, text
    assert "restarting the group (2 of 2)" in text
    assert "store server" not in text  # a failing rank is the story, never the store server


def fail_always(ctx):
    if ctx.rank == 1:
        raise ValueError(f"attempt {ctx.restart} fails")
    time.sleep(30)


def test_restarts_exhausted_still_name_the_rank_not_the_store_server():
    with pytest.raises(mpddp.RestartsExhausted) as caught:
        mpddp.launch(fail_always, nprocs=2, max_restarts=1)
    message = str(caught.value)
    assert caught.value.rank == 1 and "ValueError: attempt 1 fails" in message, message
    assert "store server" not in message
    assert not leftovers(wait=3)


# ---------------------------------------------------------------------------------------- many launches in a row


def rank_only(ctx):
    return ctx.rank


def test_ten_launches_in_a_row_leak_no_store_server_fd_or_thread():
    me = psutil.Process()
    assert mpddp.launch(rank_only, nprocs=2) == [0, 1]  # the forkserver is up
    fds, threads, children = me.num_fds(), threading.active_count(), {p.pid for p in me.children()}
    for _ in range(10):
        assert mpddp.launch(rank_only, nprocs=2) == [0, 1]
    assert me.num_fds() <= fds + 2, (fds, me.num_fds())  # a leak of one fd a launch would show 10
    assert threading.active_count() == threads
    assert {p.pid for p in me.children()} == children  # the helpers only: no store server stays behind
    assert not leftovers(wait=0)


# ------------------------------------------------------------------ threads, next to a failure that leaves an orphan


def orphan_then_die(ctx, tmp):
    if ctx.rank == 1:
        child = subprocess.Popen(["sleep", "100"], start_new_session=True)  # re-parented to the forkserver
        Path(tmp, "orphan.pid").write_text(str(child.pid))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def use_the_store_late(ctx):
    time.sleep(2.0)  # still running when the other launch sweeps the forkserver's orphans
    store = dist.distributed_c10d._get_default_store()
    store.set(f"late{ctx.rank}", str(ctx.rank))
    other = store.get(f"late{1 - ctx.rank}").decode()
    t = torch.ones(1)
    dist.all_reduce(t)
    return [other, t.item()]


def test_three_threads_at_once_the_sweep_of_one_failure_spares_the_others_store_servers(tmp_path):
    results: dict[str, object] = {}

    def run(name, fn, args, delay):
        time.sleep(delay)
        try:
            results[name] = mpddp.launch(fn, nprocs=2, args=args)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[name] = e

    threads = [threading.Thread(target=run, args=("a", use_the_store_late, (), 0.0)),
               threading.Thread(target=run, args=("bad", orphan_then_die, (str(tmp_path),), 0.2)),
               threading.Thread(target=run, args=("b", use_the_store_late, (), 0.4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results["a"] == [["1", 2.0], ["0", 2.0]], results["a"]
    assert results["b"] == [["1", 2.0], ["0", 2.0]], results["b"]
    bad = results["bad"]
    assert isinstance(bad, mpddp.WorkerFailed) and not isinstance(bad, mpddp.RendezvousError), repr(bad)
    assert bad.rank == 1 and "SIGKILL" in str(bad) and "store server" not in str(bad), str(bad)
    assert gone([int((tmp_path / "orphan.pid").read_text())])


# ----------------------------------------------------------------------- fresh interpreters that never import torch


TOP_SCRIPT = FIND_STORE_SERVER + """
import json, sys
import mpddp

os.write(1, f"TOP {os.getpid()}\\n".encode())  # a side effect of the script's top level; one write: never interleaved

def where(ctx):
    return {"rank": ctx.rank, "store server": store_server_pid() if ctx.rank == 0 else None}

def a_tensor(ctx):
    import torch
    return torch.full((2,), float(ctx.rank))

if __name__ == "__main__":
    import psutil
    report = {}
    for method in sys.argv[1].split(","):
        got = mpddp.launch(where, nprocs=2, start_method=method)
        left = [p.pid for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())
                and "forkserver" not in " ".join(p.cmdline())]
        report[method] = {"ranks": [g["rank"] for g in got], "store server": got[0]["store server"],
                          "torch": "torch" in sys.modules, "children_left": left}
    tensors = mpddp.launch(a_tensor, nprocs=2)  # loading a tensor imports torch, as pickle does
    report["tensors"] = [t.tolist() for t in tensors]
    print("REPORT " + json.dumps(report), flush=True)
"""


@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_a_fresh_interpreter_never_imports_torch_and_the_store_server_runs_no_top_level(tmp_path, how):
    script = write(tmp_path, "top.py", TOP_SCRIPT)
    # fork last: a fork launcher imports torch on purpose, for its children to inherit (core/launcher/startup.py)
    methods = {"file": "forkserver,spawn,fork", "stdin": "spawn,forkserver", "-c": "forkserver,fork"}[how]
    argv = {"file": [str(script), methods], "stdin": ["-", methods], "-c": ["-c", script.read_text(), methods]}[how]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                         stdin=script.open() if how == "stdin" else subprocess.DEVNULL, start_new_session=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("REPORT "))
    for method in methods.split(","):
        assert report[method]["ranks"] == [0, 1], report
        assert report[method]["torch"] is (method == "fork"), (method, report)  # else never imported torch
        assert report[method]["children_left"] == [], (method, report)  # no store server outlived its launch
    assert report["tensors"] == [[0.0, 0.0], [1.0, 1.0]]
    tops = [int(pid) for pid in re.findall(r"^TOP (\d+)$", out.stdout, re.M)]
    store_servers = {report[m]["store server"] for m in methods.split(",")}
    assert not store_servers & set(tops), (store_servers, tops)  # no store server ran the script's top level
    # the launcher once; with a file, each forkserver or spawned rank imports it too (multiprocessing's rule)
    imports = {"forkserver": 2, "spawn": 2, "fork": 0} if how == "file" else {"forkserver": 0, "spawn": 0, "fork": 0}
    expected = 1 + sum(imports[m] for m in methods.split(",")) + imports["forkserver"]  # + the tensor launch
    assert len(tops) == expected, out.stdout
    assert "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------------------------------------ mpddp run, env://


def test_mpddp_run_of_an_env_script_joins_the_store_servers_store_from_a_launcher_without_torch(tmp_path):
    script = write(tmp_path, "envjob.py", """
import os, json, psutil
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
launcher = psutil.Process(os.getppid()).parent()  # the forkserver's parent
maps = open(f"/proc/{launcher.pid}/maps").read()
print("RESULT " + json.dumps({"rank": dist.get_rank(), "sum": t.item(), "launcher_torch": "libtorch" in maps}),
      flush=True)
dist.destroy_process_group()
""")
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(script)], tmp_path)
    try:
        rc = run.finish(timeout=60)
        run.assert_nothing_left()
    finally:
        run.kill()
    assert rc == 0, run.stderr
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line),
                     key=lambda r: r["rank"])
    assert results == [{"rank": 0, "sum": 3.0, "launcher_torch": False},
                       {"rank": 1, "sum": 3.0, "launcher_torch": False}]


# ------------------------------------------------------------------------------------- two nodes on 127.0.0.1


def test_a_sigkilled_node0_launcher_takes_its_store_server_and_node1_says_node0_is_gone(tmp_path):
    cluster = Cluster(tmp_path)
    port = free_port()
    try:
        node0 = cluster.start(["0", str(port), "127.0.0.1", "10", "120"])
        node1 = cluster.start(["1", str(port), "127.0.0.1", "10", "120"])
        cluster.wait_for("READY rank", 4, timeout=60)
        tree = [p.pid for p in psutil.Process(node0.proc.pid).children(recursive=True)]
        store_server = listener(tree, port)
        assert store_server is not None, tree
        node0.proc.kill()
        node0.wait(10)
        assert gone([store_server, *tree], wait=BOUND)
        code = node1.wait(10 + 30)
        assert code != 0
        assert f"node 0, which hosts the rendezvous at 127.0.0.1:{port}, is gone" in node1.stderr, node1.stderr
        assert cluster.leftovers(wait=5) == []
    finally:
        cluster.kill_all()


RESTART_JOB = FIND_STORE_SERVER + """
import json, sys
import mpddp

def work(ctx):
    import torch, torch.distributed as dist
    store_server = store_server_pid() if ctx.rank == 0 else None
    if ctx.rank == 1 and ctx.restart == 0:
        raise ValueError("attempt 0 fails on node 0")
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "restart": ctx.restart, "store server": store_server, "sum": t.item()}

if __name__ == "__main__":
    node, port = int(sys.argv[1]), int(sys.argv[2])
    got = mpddp.launch(work, nprocs=2, nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=port,
                       timeout=20, max_restarts=1, backend="gloo")
    print("RESULT " + json.dumps(got), flush=True)
"""


def test_two_nodes_restart_on_the_same_fixed_port_with_a_fresh_store_server(tmp_path):
    job = write(tmp_path, "restart_job.py", RESTART_JOB)
    cluster = Cluster(tmp_path)
    port = free_port()
    try:
        nodes = [cluster.start([], command=[sys.executable, str(job), str(n), str(port)]) for n in (0, 1)]
        codes = [n.wait(90) for n in nodes]
        assert codes == [0, 0], "\n".join(n.stdout + n.stderr for n in nodes)
        r0, r1 = nodes[0].results(), nodes[1].results()
        assert [r["rank"] for r in r0 + r1] == [0, 1, 2, 3]
        assert {r["restart"] for r in r0 + r1} == {1} and {r["sum"] for r in r0 + r1} == {6.0}
        assert "attempt 0 fails on node 0" in nodes[0].stderr
        assert "store server" not in nodes[0].stderr + nodes[1].stderr
        assert running([r0[0]["store server"]]) == []
        assert cluster.leftovers(wait=5) == []
        assert port_is_free(port)  # nothing listens on it any more
    finally:
        cluster.kill_all()


# ----------------------------------------------------------------- found by this pass, fixed since


def _cmdline(proc: psutil.Process) -> str:
    """A child's command line; "" for one that just ended (a zombie until its parent reaps it) or is gone."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def test_ctrl_c_while_the_spawned_store_server_imports_torch_is_the_launchers_alone(tmp_path):
    script = write(tmp_path, "block.py", """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
print("READY", flush=True)
time.sleep(100)
""")
    run = Run(["-m", "mpddp", "run", "--nprocs", "1", "--start-method", "spawn", str(script)], tmp_path)
    try:
        deadline = time.monotonic() + 60
        store_server = None
        while time.monotonic() < deadline:  # the first spawned child is the store server (the ranks start after it)
            spawned = [p for p in psutil.Process(run.proc.pid).children() if "spawn_main" in _cmdline(p)]
            if spawned:
                store_server = min(spawned, key=lambda p: (p.create_time(), p.pid))
                break
            time.sleep(0.01)
        assert store_server is not None, run.stderr
        while time.monotonic() < deadline:  # it is importing torch now (about a second of it is left)
            try:
                if "libtorch" in Path(f"/proc/{store_server.pid}/maps").read_text():
                    break
            except OSError:
                break
            time.sleep(0.005)
        pids = run.list_tree()
        os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        rc = run.finish(timeout=60)
        run.all_gone_at(pids)
    finally:
        run.kill()
    assert rc == 130, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "mpddp: interrupted (SIGINT); every worker was stopped"
    assert "Process mpddp-store" not in run.stderr and "store_server.py" not in run.stderr, run.stderr


def test_fork_ranks_of_a_torch_free_launcher_do_not_pay_a_torch_import_each_launch(tmp_path):
    script = write(tmp_path, "forked.py", """
import json, sys, time
import mpddp

def cpu_before_fn(ctx):
    return time.process_time()  # CPU time of this forked rank so far: a torch import is about a second of it

if __name__ == "__main__":
    mpddp.launch(cpu_before_fn, nprocs=2, start_method="fork")
    again = mpddp.launch(cpu_before_fn, nprocs=2, start_method="fork")  # launches in a row
    print("CPU " + json.dumps(again), flush=True)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr
    cpu = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("CPU "))
    assert max(cpu) < 0.5, cpu
