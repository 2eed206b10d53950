"""Several nodes as one job: the same first failure named on every node, whoever failed and however.

Two launchers on 127.0.0.1 with node ranks, each running ``tests/scripts/rounds_job.py`` (a small DDP model, 2 ranks a
node, gloo). A rank (killed, raised, exited, hung), a launcher (SIGKILL, Ctrl-C) or node 0's store server is really
stopped, at a random step; every node's report is read from its stderr and compared; every test checks that nothing
of its launchers is left running.
"""

from __future__ import annotations

import random
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from multinode import Cluster, free_port
from test_rounds import KILLED_3, REPORT, finish, first_report_line, start

from runs import rounds_told


@pytest.mark.timeout(120)
def test_a_rank_hung_on_node_1_is_named_by_collective_on_both_nodes(cluster: Cluster) -> None:
    """Each node sees its own ranks' flight recorders and, through node 0's store, the other node's."""
    nodes = start(cluster, 2, free_port(), "--fail", "3", "--at", "2", "--how", "hang", "--timeout", "4")
    codes = finish(nodes, 90)
    lines = [first_report_line(n) for n in nodes]
    assert lines[0] == lines[1] and codes == [1, 1], "\n\n".join(n.stderr for n in nodes)
    # step 2's backward all-reduces DDP's one bucket as collective #5 (#1 and #2: DDP's own at its start)
    assert re.match(r"mpddp: rank 3 made no progress for \d+ s while ranks 0, 1, 2 waited for it in all_reduce #\d+ "
                    r"\(float32\[5\]\)", lines[0]), "\n\n".join(n.stderr for n in nodes)
    hung = next(n for n in nodes if "the collectives each rank reached" in n.stderr)  # the node that told it first
    assert re.search(r"  ranks 0, 1, 2 entered all_reduce #(\d+) \(float32\[5\]\) [0-9.]+ s ago; rank 3 is still at "
                     r"#\d+ \(all_reduce\): it is the one to look at", hung.stderr), hung.stderr
    # where rank 3 was: its node shows it, whichever node told the hang first (else: rank 3's node only named it)
    assert re.search(r"rank 3 is (at|elsewhere:) work at rounds_job\.py:\d+ \(time\.sleep", nodes[1].stderr), \
        nodes[1].stderr


@pytest.mark.timeout(180)
def test_a_rank_that_fails_on_either_node_is_named_first_on_both_and_no_launcher_thread_runs_lower(
        cluster: Cluster) -> None:
    """One job, a failure a round (--max-restarts 2): rank 3 on node 1 SIGKILLed, then raising, then rank 0 on
    node 0 exiting with code 7; each told with the same first line on both nodes, the last one the job's end with
    the rank's exit code on every node. Was three jobs.

    Also: no thread of either launcher runs at a lower priority, from its start to its end (a story of its own
    before, on a launch of its own). A launcher's thread at a lower priority stalls the whole launcher on a busy
    machine: starved, it keeps the GIL and torch's import lock, and the watch waits for it. Measured before: a link
    thread at nice 19 importing torch for its connection to node 0's store, beside four CPU-bound processes of the
    same session, had not finished after 150 s, and a rank that hung meanwhile was never reported."""
    nodes = start(cluster, 2, free_port(), "--rounds", "3:sigkill,3:raise,0:exit", "--at", str(random.randint(1, 4)),
                  "--max-restarts", "2", "--timeout", "30")
    seen: dict[int, set[int]] = {n.proc.pid: set() for n in nodes}
    deadline = time.monotonic() + 150
    while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:  # start, READY, failure, end
        for pid, nices in seen.items():
            nices.update(_thread_nices(pid))
        time.sleep(0.01)
    codes = finish(nodes, 90)
    assert all(len(nices) == 1 for nices in seen.values()), seen  # every thread at its launcher's nice
    told = "\n\n".join(n.stderr for n in nodes)
    rounds = [rounds_told(node.stderr)[0] for node in nodes]
    assert rounds[0] == rounds[1] and [n for _, n in rounds[0]] == [1, 2], told
    assert rounds[0][0][0].startswith(KILLED_3), told
    assert rounds[0][1][0] == "mpddp: rank 3 (node 1, local rank 1) failed first: it raised RuntimeError: rank 3 " \
        "fails on purpose", told
    lines = [first_report_line(n) for n in nodes]
    assert lines == ["mpddp: rank 0 (node 0, local rank 0) failed first: it exited with code 7 (sys.exit)"] * 2, told
    assert codes == [7, 7]  # every node exits with the failing rank's code
    assert "mpddp: node 1 stopped its rank(s) 2, 3 because of it" in nodes[1].stderr
    assert "went away" not in told
    for node in nodes:  # no traceback of the launcher's own before the report (the ranks' raise is theirs)
        assert not any(line.startswith("Traceback") for line in node.stderr.split(REPORT)[0].splitlines()
                       if not line.startswith("[rank")), node.stderr
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_killed_launcher_is_named_lost_on_the_other_node(cluster: Cluster, restarts: int) -> None:
    timeout = 10.0
    port = free_port()
    # steps for 200 s or more: under load, READY and the beats came after 400 steps' 20 s, the job ended well
    # before the kill, and node 0 rightly exited 0
    nodes = start(cluster, 2, port, "--steps", "4000", "--pause", "0.05", "--timeout", str(timeout),
                  "--max-restarts", str(restarts))
    cluster.wait_for("READY rank", 4, timeout=60)
    cluster.wait_for_beats(port, 2, timeout=60)  # lost while it beat (a launcher that never beat: --timeout)
    time.sleep(random.uniform(0.0, 1.0))
    nodes[1].proc.send_signal(signal.SIGKILL)
    code = nodes[0].wait(2 * timeout + 30)
    assert code != 0
    first = first_report_line(nodes[0])
    assert first.startswith("mpddp: node(s) 1 went away") and "rank(s) 2, 3" in first, nodes[0].stderr
    if restarts:  # the round after it cannot start without node 1: that is said too, in the end
        assert "node(s) 1 did not join round 1" in nodes[0].stderr, nodes[0].stderr
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(120)
def test_a_killed_store_server_ends_the_job_on_both_nodes(cluster: Cluster) -> None:
    nodes = start(cluster, 2, free_port(), "--steps", "4000", "--pause", "0.05", "--timeout", "10",
                  "--max-restarts", "1")
    cluster.wait_for("READY rank", 4, timeout=60)
    time.sleep(random.uniform(0.0, 1.0))
    launcher = psutil.Process(nodes[0].proc.pid)
    port = int(nodes[0].proc.args[4])
    store_server = next(p for p in launcher.children(recursive=True) if any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")))
    store_server.send_signal(signal.SIGKILL)
    codes = finish(nodes, 60)
    assert codes[0] == codes[1] != 0
    # one story on both nodes (node 1 said "node 0 ... is gone"): node 0's launcher lives, and says so last
    lines = [first_report_line(n) for n in nodes]
    assert lines[0] == lines[1], "\n\n".join(n.stderr for n in nodes)
    assert lines[0].startswith(f"mpddp: error: node 0's store server (pid {store_server.pid}), the process that "
                               "serves this job's rendezvous store, was killed by SIGKILL while the ranks ran"), lines
    for node in nodes:
        assert "not restarted: node 0 hosted the job's store (--rdzv-backend c10d)" in node.stderr, node.stderr
        assert "is gone" not in node.stderr, node.stderr
    assert cluster.leftovers(wait=5) == []


@pytest.mark.timeout(120)
def test_a_launcher_stopped_by_ctrl_c_is_named_by_the_other_node(cluster: Cluster) -> None:
    nodes = start(cluster, 2, free_port(), "--steps", "400", "--pause", "0.05", "--timeout", "40")
    cluster.wait_for("READY rank", 4, timeout=60)
    time.sleep(random.uniform(0.0, 1.0))
    nodes[1].proc.send_signal(signal.SIGINT)
    started, told = time.monotonic(), None
    while nodes[0].proc.poll() is None and time.monotonic() - started < 60:  # when node 0 tells it, not when it
        if told is None and "interrupted (SIGINT)" in nodes[0].stderr:  # ends: it then keeps its store a while
            told = time.monotonic() - started  # for node 1 (quiet: told 0.7 s, ended 1.1 s; 10 busy sessions:
        time.sleep(0.05)  # told 10-12 s, ended 16-17 s; the ends were 30.5 s in a suite, 40.7 and 45.5 s in two)
    codes = [nodes[0].wait(60), nodes[1].wait(60)]
    assert codes[0] == 130 and codes[1] != 0, (codes, nodes[0].stderr)
    assert first_report_line(nodes[0]) == ("mpddp: node 1's launcher was interrupted (SIGINT) while its ranks ran, "
                                           "taking rank(s) 2, 3 with it"), nodes[0].stderr
    assert told is not None and told < 30, (told, "\n\n".join(n.stderr for n in nodes))  # not after --timeout 40
    assert cluster.leftovers(wait=5) == []


def _thread_nices(pid: int) -> set[int]:
    """The nice value of each thread of ``pid`` now (Linux: field 19 of /proc/PID/task/TID/stat)."""
    nices = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread or the process ended meanwhile
            continue
        nices.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return nices
