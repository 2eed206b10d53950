"""A rendezvous's bad input and its edges, each with real launchers (and a real 3-member etcd): an endpoint
that is not etcd, an etcd with authentication on, an impossible ``--nnodes``/``--node-rank``, a newcomer's
admission that is no restart, and a round below ``MIN`` (the last two: one job).

Bad input is one line, ``mpddp: error: ...`` naming the value and the fix, exit 2, before any rank starts,
no traceback, and nothing of the launch left behind (no process, no temporary file, no lease in etcd).
"""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator

import pytest
import requests
from multinode import free_port
from test_elastic import _lose

from runs import Run

pytestmark = pytest.mark.timeout(180)

HI = "print('ran', flush=True)\n"


LONG = 600  # the launches' --timeout: refused within WITHIN, they did not wait for it (a structural check: no bound
WITHIN = 120  # measured from the launch's start, whose torch import took 20 s and more beside a second suite)


def _refused_at_once(tmp_path, argv: list[str]) -> str:
    """Run ``python -m mpddp *argv`` (``mpddp run``: with hi.py; its --timeout :data:`LONG`): exit 2 with one line
    on stderr, well before that timeout, no rank ran, nothing left; the line."""
    assert argv[argv.index("--timeout") + 1] == str(LONG)
    (tmp_path / "hi.py").write_text(HI)
    run = Run(["-m", "mpddp", *argv, *(["hi.py"] if argv[0] == "run" else [])], tmp_path)
    try:
        rc = run.finish(WITHIN)  # it raises past WITHIN: the launcher waited for --timeout, or would have
    finally:
        run.kill()
    lines = run.stderr.strip().splitlines()
    assert rc == 2, run.stderr
    assert len(lines) == 1 and lines[0].startswith("mpddp: error: "), run.stderr
    assert "Traceback" not in run.stderr and "ran" not in run.stdout, run.stdout + run.stderr
    run.assert_nothing_left()
    return lines[0]


# ---- 1. an --rdzv-endpoint that answers HTTP but is not etcd; an etcd with authentication on ---------------------


class _NotEtcd(http.server.BaseHTTPRequestHandler):
    """Answers everything with ``status`` and a page of HTML, as a web server on the wrong port does."""

    status = 404

    def _answer(self) -> None:
        body = b"<html><body><h1>Not here</h1></body></html>"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_etcd(request) -> Iterator[str]:
    """An HTTP server on loopback that is not etcd: 404 to everything, or 200 with HTML (the test's parameter)."""
    handler = type("Handler", (_NotEtcd,), {"status": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _etcd_run(endpoint: str, command: str = "run") -> list[str]:
    procs = ["--nproc-per-node", "1"] if command == "run" else ["--nprocs", "1"]
    return [command, "--nnodes", "2", *procs, "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "probe", "--timeout", str(LONG)]


# One real launch a command, each on one of the two answers: read_version's table below reads both statuses, and
# past that reading the launcher's path is the same for either (the two answers times the two commands were four
# launches of one story).
@pytest.mark.parametrize("not_etcd", [404], indirect=True)
def test_an_endpoint_that_answers_http_but_is_not_etcd_is_one_line_exit_2(tmp_path, not_etcd):
    line = _refused_at_once(tmp_path, _etcd_run(not_etcd))
    assert f"{not_etcd} answers HTTP, but not as etcd does" in line, line
    assert "pass the client address of the etcd members, host:port (2379 by default)" in line, line


@pytest.mark.parametrize("not_etcd", [200], indirect=True)
def test_mpddp_train_on_an_endpoint_that_is_not_etcd_is_one_line_exit_2(tmp_path, not_etcd):
    line = _refused_at_once(tmp_path, _etcd_run(not_etcd, "train"))
    assert f"{not_etcd} answers HTTP, but not as etcd does" in line, line


def test_an_endpoint_with_nothing_listening_stays_one_line_exit_2(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    line = _refused_at_once(tmp_path, _etcd_run(endpoint))
    assert f"no etcd member answers at --rdzv-endpoint {endpoint}" in line, line


def _gateway(cluster, index: int, path: str, body: dict, token: str | None = None) -> requests.Response:
    session = requests.Session()
    session.trust_env = False  # loopback: no proxy
    headers = {"Authorization": token} if token else {}
    return session.post(f"http://127.0.0.1:{cluster.client_ports[index]}{path}", json=body, headers=headers,
                        timeout=5)


@pytest.fixture(scope="module")
def etcd_with_auth() -> Iterator[tuple[object, str]]:
    """A real 3-member etcd with authentication on (``etcdctl user add root:pw; etcdctl auth enable``, through
    the gateway: Debian ships no etcdctl), and a token of its root user to look inside."""
    import shutil

    if shutil.which("etcd") is None:
        pytest.skip("Debian's etcd-server is not installed: apt-get install etcd-server")
    from etcd_cluster import EtcdCluster

    with EtcdCluster() as cluster:
        for path, body in [("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": "pw"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}), ("/v3/auth/enable", {})]:
            assert _gateway(cluster, 0, path, body).status_code == 200, path
        token = _gateway(cluster, 0, "/v3/auth/authenticate", {"name": "root", "password": "pw"}).json()["token"]
        yield cluster, token


def test_an_etcd_with_authentication_and_no_credentials_is_one_line_exit_2(tmp_path, etcd_with_auth):
    cluster, token = etcd_with_auth
    line = _refused_at_once(tmp_path, _etcd_run(cluster.endpoints))
    assert f"--rdzv-endpoint {cluster.endpoints}: the etcd at 127.0.0.1:{cluster.client_ports[0]} has " \
           "authentication on" in line, line
    assert "run the job on an etcd without authentication (etcdctl auth disable)" in line, line
    # nothing of the launch in etcd: no key under /mpddp/, no lease
    everything = {"key": base64.b64encode(b"/mpddp/").decode(), "range_end": base64.b64encode(b"/mpddp0").decode(),
                  "count_only": True}
    assert "count" not in _gateway(cluster, 0, "/v3/kv/range", everything, token).json()
    assert not _gateway(cluster, 0, "/v3/lease/leases", {}, token).json().get("leases")


# ---- the pure readings behind it: the HTTP status and the JSON's shape, never its words ---------------------------


@pytest.mark.parametrize(("status", "body", "answer"), [
    (200, {"etcdserver": "3.4.23", "etcdcluster": "3.4.0"}, "etcd"),
    (200, {"etcdserver": "3.5.9", "etcdcluster": "3.5.0"}, "etcd"),
    (404, None, "not-etcd"),
    (200, None, "not-etcd"),  # HTML
    (200, {"version": "1.2"}, "not-etcd"),  # JSON, another server's
    (200, {"etcdserver": "x.y"}, "not-etcd"),
    (503, {"etcdserver": "3.4.23"}, "not-etcd"),
])
def test_a_version_answer_is_read_by_status_and_shape(status, body, answer):
    from mpddp.core.stores.etcd_probe import read_version

    assert read_version(status, body).answer.value == answer


@pytest.mark.parametrize(("status", "body", "answer"), [
    (200, {"header": {"revision": "2"}}, "etcd"),
    (200, {"header": {"revision": "2"}, "count": "3"}, "etcd"),
    (400, {"error": "etcdserver: user name is empty", "message": "...", "code": 3}, "auth"),
    (400, {"error": "whatever words", "code": 3}, "auth"),  # the code decides, not the words
    (403, {"code": 7}, "auth"),
    (401, {"code": 16}, "auth"),
    (503, {"code": 14}, "silent"),  # no leader now: another member, or later
    (504, {"code": 4}, "silent"),
    (400, {"code": 11}, "etcd"),  # etcd, refusing something else: told later, not here
    (404, None, "not-etcd"),
    (200, {"ok": True}, "not-etcd"),
])
def test_a_read_answer_is_read_by_status_and_grpc_code(status, body, answer):
    from mpddp.core.stores.etcd_probe import read_range

    assert read_range(status, body).answer.value == answer


# ---- 2. an --nnodes or --node-rank no job can have: refused at once, not after --timeout ------------------------


# One real launch a command: both build their config in make_config (cli/options.py), whose refusals
# test_torchrun_elastic.py proves as a table (test_the_api_refuses_the_same, and every `mpddp run` line in
# test_a_combination_that_cannot_work_is_one_line_exit_2); each size still meets one command end to end here.
@pytest.mark.parametrize(("command", "size", "words"), [
    ("run", ["--nnodes", "0:2"], "nnodes=0:2: the smallest size must be from 1 to the largest; pass e.g. --nnodes 1:2"),
    ("train", ["--nnodes", "2:3", "--node-rank", "7"], "node_rank=7 with nnodes=2:3: node ranks run from 0 to 2 "
                                                       "(MAX - 1); pass --node-rank 2 or less"),
])
def test_an_impossible_size_or_node_rank_is_refused_at_once(tmp_path, command, size, words):
    procs = ["--nproc-per-node", "1"] if command == "run" else ["--nprocs", "1"]
    argv = [command, *size, *procs, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--timeout",
            str(LONG)]
    line = _refused_at_once(tmp_path, argv)  # not after --timeout
    assert words in line, line


# ---- 3. a newcomer's admission is no restart (TORCHELASTIC_RESTART_COUNT stays as torchrun's agent keeps it), and a
# ---- round below MIN ends in the one line that names MIN, never in a configuration error from the join ----------

STEPS = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
world, count = dist.get_world_size(), os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"ROUND world={world} restart={count}", flush=True)
for step in range(1, 10**6):
    dist.all_reduce(torch.ones(1))
    print(f"STEP {step} world={world}", flush=True)
    time.sleep(0.05)
"""


def _the_min_story(run: Run, low: int = 2) -> str:
    """The launcher's last line: the round's size and MIN, no traceback, no configuration error."""
    last = run.stderr.strip().splitlines()[-1]
    assert f"but --nnodes {low}:3 needs at least {low}" in last, run.stderr
    assert "Traceback" not in run.stderr and "nnodes=" not in run.stderr, run.stderr
    return last


# The survivor's --timeout, which its round after the loss waits out (told 10.8 and 11.4 s after the loss at load 11,
# etcd and c10d, with 8; 15 before): the bound below keeps its margin of 15 s past it
BELOW_MIN_TIMEOUT = 8.0


@pytest.mark.parametrize("backend", ["etcd", "c10d"])
def test_a_newcomers_admission_is_no_restart_and_a_survivor_below_min_tells_the_min_story(tmp_path, backend, request):
    """2:3 on two nodes, --max-restarts 1; a third launcher, numbered as it joins, is admitted while the job runs:
    no restart counted (every rank of the round of three sees TORCHELASTIC_RESTART_COUNT 0, and nobody says it
    restarts). Then the machines of nodes 1 and 2 are lost: node 0's next round cannot reach MIN, and it says so
    within its --timeout. Was two jobs: the admission's (which then ended) and the loss's."""
    (tmp_path / "steps.py").write_text(STEPS)
    if backend == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "grow-below-min",
                 "--local-addr", "127.0.0.1"]
    else:
        where = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    runs: list[Run] = []

    def node(name: str, rank: list[str]) -> Run:
        (tmp_path / name).mkdir()
        return Run(["-m", "mpddp", "run", "--nnodes", "2:3", *rank, "--nproc-per-node", "1", "--max-restarts", "1",
                    *where, "--timeout", f"{BELOW_MIN_TIMEOUT:g}", str(tmp_path / "steps.py")], tmp_path / name)

    try:
        runs += [node("node0", ["--node-rank", "0"]), node("node1", ["--node-rank", "1"])]
        runs[0].wait_for(r"STEP 3 world=2\b", timeout=90, also=(runs[1],))
        runs.append(node("node2", []))  # numbered as it joins
        for run in runs:
            run.wait_for(r"STEP 3 world=3\b", timeout=90, also=tuple(runs))
        stories = "\n".join(f"--- node {n}:\n{run.stderr}" for n, run in enumerate(runs))
        for run in runs[:2]:
            assert "ROUND world=2 restart=0" in run.stdout, run.stdout + stories
            assert "mpddp: a node arrived" in run.stderr and "restarting the group" not in run.stderr, stories
        for run in runs:
            assert "ROUND world=3 restart=0" in run.stdout, run.stdout + stories
            assert "a new node -> 2: ranks 2" in run.stderr, stories  # the newcomer numbered as it joined
            run.list_tree()
        killed = time.monotonic()
        for run in runs[1:]:
            _lose(run)
        assert runs[0].finish(60) == 1, runs[0].stderr
        told = time.monotonic() - killed
        print(f"the survivor told the MIN story {told:.1f} s after the loss")
        assert told < BELOW_MIN_TIMEOUT + 15, f"told after {told:.1f} s"
        # round 1 admitted the newcomer; round 2, after the loss, is node 0's alone
        assert "round 2: 1 node(s)" in _the_min_story(runs[0]), runs[0].stderr
        runs[0].assert_nothing_left()
        for run in runs[1:]:
            run.assert_no_process_left()
    finally:
        for run in runs:
            run.kill()


def test_a_round_decided_below_min_is_the_min_story_not_a_config_error(tmp_path, etcd_cluster):
    """The launcher that decides a round reads its arrivals once the count reached MIN; one whose lease ran out
    in between is not among them, so a member list below MIN can be written. Here the test writes it, as that
    launcher would: the one launcher in it must tell the round's size and MIN (main: 'nnodes=2:1: the smallest
    size must be from 1 to the largest', exit 2)."""
    import json

    (tmp_path / "hi.py").write_text(HI)
    job = "decided-below-min"
    run = Run(["-m", "mpddp", "run", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
               "--rdzv-endpoint", etcd_cluster.endpoints, "--rdzv-id", job, "--timeout", "60", "hi.py"], tmp_path)
    try:
        client = etcd_cluster.client(0)
        deadline = time.monotonic() + 60
        while not (joined := [m["key"].decode() for _, m in client.get_prefix(f"/mpddp/{job}/i/")
                              if "/r/0/join/" in m["key"].decode()]):  # under the launch's incarnation
            assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr
            time.sleep(0.05)
        round_0, _, me = joined[0].rpartition("/join/")
        assert client.create(f"{round_0}/members", json.dumps([me]))
        assert run.finish(30) == 1, run.stderr
        assert "round 0: 1 node(s)" in _the_min_story(run), run.stderr
        assert "ran" not in run.stdout
        run.assert_nothing_left()
    finally:
        run.kill()


def test_too_few_nodes_is_a_rendezvous_error_that_survives_pickling():
    import pickle

    from mpddp.errors import RendezvousError, TooFewNodes

    error = pickle.loads(pickle.dumps(TooFewNodes("round 1: 1 node(s) ...", 1, 1, 2)))
    assert isinstance(error, RendezvousError) and (str(error), error.round_number, error.nodes, error.low) == (
        "round 1: 1 node(s) ...", 1, 1, 2)
