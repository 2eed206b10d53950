"""``mpddp top``: a live look at a running job, from any of its nodes (core/launcher/live.py, runtime_dir.py).

Real launchers in subprocesses (tests/scripts/live_job.py: 2 ranks a node, gloo, until a STOP file appears), each
with its own XDG_RUNTIME_DIR (the runtime folder of this test alone, never the user's), and ``mpddp top`` run as a
command, as a user runs it from another terminal.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from multinode import Cluster, free_port

from mpddp.core.launcher import live_display, live_table, runtime_dir
from mpddp.core.launcher.live import Header, RankRow, Snapshot
from mpddp.errors import ConfigError

JOB = Path(__file__).parent / "scripts" / "live_job.py"


def _top(xdg: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpddp", "top", *args], capture_output=True, text=True,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)}, timeout=timeout)


def _start(cluster: Cluster, xdg: Path, nnodes: int, node: int | str, port: int, *rdzv: str, env: dict | None = None):
    return cluster.start([], command=[sys.executable, str(JOB), str(nnodes), str(node), str(port),
                                      str(cluster.tmp / "STOP"), *rdzv],
                         env={"XDG_RUNTIME_DIR": str(xdg), **(env or {})})


def _entries(xdg: Path, count: int, timeout: float = 60) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted((xdg / "mpddp").glob("*.json")) if (xdg / "mpddp").is_dir() else []
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{count} launcher entries did not appear in {xdg}")


def _wait_for(node, text: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while text not in node.stdout:
        assert time.monotonic() < deadline and node.proc.poll() is None, f"no {text!r}:\n{node.stdout}\n{node.stderr}"
        time.sleep(0.1)


def _xdg(tmp_path: Path) -> Path:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    return xdg


# ---- pure: the choice of a launcher, the table, the JSON -------------------------------------------------------

def _entry(pid: int, job: str, node: int | None) -> runtime_dir.Entry:
    return runtime_dir.Entry(pid, float(pid), job, node, "h", [], f"/x/{pid}.sock")


@pytest.mark.parametrize("found, job, picked", [
    ([_entry(10, "a", 1), _entry(11, "a", 0)], None, 11),  # one job, two nodes here: the lowest node
    ([_entry(10, "a", 0), _entry(11, "b", 0)], "b", 11),  # by id
    ([_entry(10, "a", 0), _entry(11, "a", 1)], "11", 11),  # by a launcher's pid
])
def test_pick(found, job, picked):
    assert runtime_dir.pick(found, job).pid == picked


def test_pick_refuses_what_it_cannot_choose(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"2 jobs run here: a \(pid 10\); b \(pid 11\); pick one with --job"):
        runtime_dir.pick([_entry(10, "a", 0), _entry(11, "b", 0)], None)
    with pytest.raises(ConfigError, match="--job c: no launcher of that job"):
        runtime_dir.pick([_entry(10, "a", 0)], "c")
    with pytest.raises(runtime_dir.NoJob, match="no mpddp job of yours runs on this machine"):
        runtime_dir.pick([], None)


def _snapshot(**header) -> Snapshot:
    rows = (RankRow(0, 0, 0, 100, "running", 57, 20.0, "#57 all_reduce", 0.0, False, 99.0, 300 << 20, line="step 5"),
            RankRow(1, 0, 1, 101, "waiting", 56, 20.0, "#56 all_reduce", 52.0, True, 3.0, 310 << 20, line="step 5"))
    h = {"job": "j", "round": 1, "world_size": 4, "nnodes": 2, "max_nnodes": 2, "restarts": 1, "elapsed": 75.0,
         "failure": "rank 3 failed", "node": 0, "host": "h"} | header
    return Snapshot(Header(**h), rows, missing=(1,))


def test_snapshot_round_trips_through_json():
    snapshot = _snapshot()
    assert Snapshot.from_json(snapshot.to_json()) == snapshot
    newer = json.loads(snapshot.to_json())
    newer["ranks"][0]["a_newer_field"] = 1  # another node's newer mpddp: what this one knows is kept
    assert Snapshot.from_json(json.dumps(newer)).ranks == snapshot.ranks


def test_table_says_every_column():
    text = live_table.table(_snapshot())
    lines = text.splitlines()
    assert lines[0] == (
        "mpddp top  job j  round 1  4 rank(s) on 2 node(s)  restarts 1  up 0:01:15  seen from node 0 (h)")
    assert lines[1] == "first failure: rank 3 failed"
    assert lines[2].split() == ["RANK", "NODE", "LOCAL", "STATE", "COLL/S", "LAST", "COLLECTIVE", "LAG", "CPU", "RSS",
                                "LAST", "LINE"]  # no GPU column on a CPU job
    assert lines[3].split() == ["0", "0", "0", "running", "20.0", "#57", "all_reduce", "+0.0", "ms", "99%", "300",
                                "MiB", "step", "5"]
    assert "+52.0 ms *" in lines[4]
    assert lines[5].startswith("not heard from yet: node(s) 1")
    assert lines[6].startswith("* the straggler")
    assert all(len(line) <= 40 for line in live_table.table(_snapshot(), width=40).splitlines()[2:5])


def test_the_header_fits_80_columns_and_each_nodes_rows_say_their_age():
    """The header was one line of 104 characters here, wrapped by an 80-column terminal into the table."""
    long = _snapshot(job="10.0.0.1:29500", host="gpu-node-b.example.org", elapsed=45296.0)
    rows = (*long.ranks, RankRow(2, 1, 0, 102, "running", 57, 20.0, "#57 all_reduce", 0.5, False, 9.0, 300 << 20,
                                 age=0.8))
    lines = live_table.table(Snapshot(long.header, rows, ()), width=80).splitlines()
    assert lines[:2] == ["mpddp top  job 10.0.0.1:29500  round 1  4 rank(s) on 2 node(s)  restarts 1",
                         "up 12:34:56  seen from node 0 (gpu-node-b.example.org)"]
    assert all(len(line) <= 80 for line in lines), lines
    assert "rows' age: node 0 0.0 s, node 1 0.8 s" in lines
    assert live_table.table(long, width=1 << 16).splitlines()[0].endswith("seen from node 0 (gpu-node-b.example.org)")


def test_the_table_is_text_only_whatever_a_rank_printed():
    """A rank's escape sequences (or a hostile launcher's answer) reached the terminal as they were."""
    base = _snapshot(host="h\x1b]0;title\x07")
    rows = (RankRow(0, 0, 0, 100, "running", 57, 20.0, "#57 all_reduce", 0.0, False, 9.0, 1 << 20,
                    line="\x1b[31mred\x1b[0m 50%\r"),)
    text = live_table.table(Snapshot(base.header, rows, ()))
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "?[31mred?[0m 50%" in text and "(h?]0;title?)" in text


def test_html_says_what_the_table_says():
    snapshot = _snapshot(failure="rank 3 failed: <ValueError> & more")
    page = live_table.html(snapshot)
    assert page.count("<tr") == 3 and page.count("<th") == 10  # the columns' names, and a row a rank; no GPU column
    assert '<tr style="font-weight:bold">' in page and page.count("font-weight:bold") == 1  # the straggler's row
    assert "rank 3 failed: &lt;ValueError&gt; &amp; more" in page and "<ValueError>" not in page
    assert ">#56 all_reduce<" in page and ">+52.0 ms *<" in page
    assert "not heard from yet: node(s) 1" in page and "* the straggler" in page


# ---- the runtime folder ----------------------------------------------------------------------------------------

def test_folder_is_refused_unless_ours_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = runtime_dir.folder()
    assert made == tmp_path / "mpddp" and stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)
    with pytest.raises(runtime_dir.RuntimeDirRefused, match=r"is not yours alone .* mode drwxr-xr-x"):
        runtime_dir.folder()
    if os.getuid() == 0:  # root can give it away: another user's folder
        made.chmod(0o700)
        os.chown(made, 12345, -1)
        with pytest.raises(runtime_dir.RuntimeDirRefused, match="owner uid 12345"):
            runtime_dir.folder()


def test_two_launches_of_one_process_have_an_entry_each(monkeypatch, tmp_path):
    """launch() from two threads at once: each launch its own entry and socket (they were named by the pid alone,
    and the second's write crashed the first's launch)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with runtime_dir.serving("a", 0, lambda: "A"), runtime_dir.serving("b", None, lambda: "B"):
        found = runtime_dir.entries()
        assert sorted(e.job for e in found) == ["a", "b"] and {e.pid for e in found} == {os.getpid()}
        assert sorted(runtime_dir.ask(e) for e in found) == ["A", "B"]
    assert list((tmp_path / "mpddp").iterdir()) == []


def test_a_launch_removes_the_entries_of_launchers_killed_outright(monkeypatch, tmp_path):
    """A SIGKILLed launcher leaves its entry; the next launch's serving thread removes it, no watcher needed."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = runtime_dir.folder() / "999999999-0.json"
    dead.write_text(json.dumps({"pid": 999999999, "created": 1.0, "job": "gone", "node": 0, "host": "h", "argv": [],
                                "socket": str(tmp_path / "mpddp" / "999999999-0.sock")}))
    with runtime_dir.serving("a", 0, lambda: "A"):
        deadline = time.monotonic() + 10
        while dead.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not dead.exists()


def test_the_serving_thread_is_gone_when_the_block_ends(monkeypatch, tmp_path):
    """Its thread ends before ``serving`` returns, even mid-sweep: a launch with start_method='fork' right after
    counts the process's threads and was refused (CI saw it under load: a sweep of 2,000 entries outlived the
    block's wait for the thread)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = runtime_dir.folder()
    for pid in range(999_000_000, 999_002_000):  # a long sweep: 2,000 entries of dead launchers
        (where / f"{pid}-0.json").write_text(json.dumps({"pid": pid, "created": 1.0, "job": "gone", "node": 0,
                                                         "host": "h", "argv": [], "socket": str(where / "x")}))
    read, swept = runtime_dir._read_entry, []

    def slow(info, where):  # 10 ms an entry: a sweep of 20 s, longer than the block's wait for its thread (5 s)
        swept.append(info)
        time.sleep(0.01)
        return read(info, where)

    monkeypatch.setattr(runtime_dir, "_read_entry", slow)
    before = set(threading.enumerate())
    with runtime_dir.serving("a", 0, lambda: "A"):
        live = [t for t in threading.enumerate() if t not in before and t.name == "mpddp-live"]
        assert len(live) == 1
        deadline = time.monotonic() + 30
        while not swept and time.monotonic() < deadline:  # mid-sweep: it began (a glob of 2,000 entries first)
            time.sleep(0.01)
    assert not live[0].is_alive()  # it stopped at its next entry
    assert 0 < len(swept) < 2_000  # the rest is left to the next launcher's sweep


def test_top_without_a_job_says_so(tmp_path):
    xdg = _xdg(tmp_path)
    done = _top(xdg, "--once")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("mpddp: error: no mpddp job of yours runs on this machine")
    bad = _top(xdg, "--interval", "0")
    assert bad.returncode == 2 and "--interval" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(180)
def test_one_node_top_once_and_the_entry_removed_at_exit(no_leftovers, cluster, tmp_path):
    xdg = _xdg(tmp_path)
    node = _start(cluster, xdg, 1, 0, 0, env={"SLOW_RANK": "1"})
    info = _entries(xdg, 1)[0]
    assert stat.S_IMODE((xdg / "mpddp").stat().st_mode) == 0o700
    entry = json.loads(info.read_text())
    assert entry["pid"] == node.proc.pid and Path(entry["socket"]).exists()
    cluster.wait_for("step 3", 2, timeout=90)
    done = _top(xdg, "--once")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"mpddp top  job {entry['job']}  round 0  2 rank(s) on 1 node(s)")
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "0", "1"]]
    assert all(r[3] in ("running", "waiting") and "all_reduce" in r for r in rows), done.stdout
    assert all(r[-2] == "step" for r in rows), done.stdout  # the last line each rank wrote
    assert _header(xdg, node.proc.pid)["spares"] == 0  # was null on one node, 0 on two
    (tmp_path / "STOP").write_text("")
    assert node.wait(60) == 0, node.stderr
    assert "mpddp top" not in node.stderr  # live=False: the launcher shows no table of its own
    assert not list((xdg / "mpddp").iterdir())  # its entry and its socket are gone
    assert _top(xdg, "--once").returncode == 1


@pytest.mark.timeout(180)
def test_live_without_a_display_writes_a_table_now_and_then_and_the_last(no_leftovers, cluster, tmp_path):
    """``launch(..., live=True)`` in a script whose stderr is a file: no redraw, no flood; the last look stays."""
    node = _start(cluster, _xdg(tmp_path), 1, 0, 0, env={"LIVE": "1"})
    deadline = time.monotonic() + 90
    while "mpddp top  job" not in node.stderr:  # the first table, once every rank's row is in
        assert time.monotonic() < deadline and node.proc.poll() is None, f"no table:\n{node.stdout}\n{node.stderr}"
        time.sleep(0.1)
    seen = time.monotonic()
    (tmp_path / "STOP").write_text("")
    assert node.wait(60) == 0, node.stderr
    tables = [t.splitlines() for t in node.stderr.split("mpddp top  job ")[1:]]
    assert len(tables) == 2 or time.monotonic() - seen >= live_display.TEXT_EVERY[False], node.stderr
    for table, states in ((tables[0], ("running", "waiting")), (tables[-1], ("done",))):
        rows = [line.split() for line in table[2:4]]
        assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "0", "1"]], table
        assert all(r[3] in states and "all_reduce" in r for r in rows), table
    assert "\x1b[" not in node.stderr  # no terminal control in a file


@pytest.mark.timeout(180)
def test_entry_removed_after_ctrl_c_and_a_killed_launchers_cleaned_by_top(no_leftovers, cluster, tmp_path):
    xdg = _xdg(tmp_path)
    node = _start(cluster, xdg, 1, 0, 0)
    _entries(xdg, 1)
    cluster.wait_for("step 3", 2, timeout=90)
    node.proc.send_signal(signal.SIGINT)
    assert node.wait(60) != 0
    assert not list((xdg / "mpddp").iterdir())
    killed = _start(cluster, xdg, 1, 0, 0)
    _entries(xdg, 1)
    _wait_for(killed, "step 3")
    killed.proc.kill()  # SIGKILL: nothing of the launcher's runs; its entry stays until a watcher finds it dead
    killed.wait(30)
    assert list((xdg / "mpddp").glob("*.json"))
    done = _top(xdg, "--once")
    assert done.returncode == 1 and "no mpddp job of yours" in done.stderr
    assert not list((xdg / "mpddp").iterdir())
    cluster.kill_all()  # the ranks of the launcher killed


def _header(xdg: Path, pid: int) -> dict:
    done = _top(xdg, "--once", "--json", "--job", str(pid), "--wait", "0")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["header"]


def _ranks_seen(xdg: Path, pid: int) -> dict[int, dict]:
    done = _top(xdg, "--once", "--json", "--job", str(pid), "--wait", "60")  # whole within a second or two
    assert done.returncode == 0, done.stderr
    return {r["rank"]: r for r in json.loads(done.stdout)["ranks"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rdzv", ["c10d", "etcd"])
def test_two_nodes_top_on_each_lists_every_rank(cluster, tmp_path, rdzv, request):
    xdg = _xdg(tmp_path)
    port = free_port()
    args: tuple[str, ...] = ()
    if rdzv == "etcd":
        etcd = request.getfixturevalue("etcd_cluster")
        args = ("etcd", etcd.endpoints, f"live-{port}")
    nodes = [_start(cluster, xdg, 2, n, port, *args) for n in (0, 1)]
    _entries(xdg, 2)
    cluster.wait_for("step 3", 4, timeout=120)
    for node in nodes:
        seen = _ranks_seen(xdg, node.proc.pid)
        assert sorted(seen) == [0, 1, 2, 3], seen
        assert [seen[r]["node"] for r in range(4)] == [0, 0, 1, 1]
        assert all(seen[r]["last"] is not None and seen[r]["last"].endswith("all_reduce") for r in range(4)), seen
        assert all(seen[r]["pid"] for r in range(4))
    if rdzv == "etcd":  # a third launcher of the full job waits as a spare: the header counts it
        nodes.append(_start(cluster, xdg, 2, "-", port, *args))
        deadline = time.monotonic() + 90
        while (spares := _header(xdg, nodes[0].proc.pid)["spares"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert spares == 1
    (tmp_path / "STOP").write_text("")
    for node in nodes:
        assert node.wait(90) == 0, node.stderr
    assert not list((xdg / "mpddp").iterdir())
    assert cluster.leftovers(wait=10) == []  # the launchers' own processes (etcd's members are the module's)
