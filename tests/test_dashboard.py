"""``--dashboard``: the live view as a web page (core/launcher/dashboard.py, dashboard_options.py, web/).

Pure rules with a table (the address, who may read, the timeline's slices); the server on a stub view (token, 403,
405, Host); bad input as one line and exit code 2 before any rank starts; and a real browser: Debian's chromium,
headless, driven over its DevTools protocol, loads the page of a running 2-rank job (tests/scripts/live_job.py),
sees its 2 rows, and sees the page mark the straggler once the launcher names it, without a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import psutil
import pytest
from multinode import Cluster, free_port

from mpddp import dashboard_options
from mpddp.config import LaunchConfig
from mpddp.core.launcher import dashboard, stragglers
from mpddp.errors import ConfigError

JOB = Path(__file__).parent / "scripts" / "live_job.py"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---- pure: the address, who may read, the timeline ---------------------------------------------------------------

@pytest.mark.parametrize("value, remote, address", [
    (None, False, None), (False, False, None),
    (True, False, "127.0.0.1:0"), ("auto", False, "127.0.0.1:0"),
    (8265, False, "127.0.0.1:8265"), ("8265", False, "127.0.0.1:8265"),
    ("localhost:8265", False, "localhost:8265"), ("127.0.0.2:1", False, "127.0.0.2:1"),
    ("[::1]:8265", False, "[::1]:8265"),
    ("0.0.0.0:8265", True, "0.0.0.0:8265"), ("[::]:0", True, "[::]:0"), ("127.0.0.1:0", True, "127.0.0.1:0"),
])
def test_the_address_as_written_and_as_kept(value, remote, address):
    assert dashboard_options.parse(value, remote) == address
    if address is not None:
        assert dashboard_options.parse(address, remote) == address  # kept as it is, round after round


@pytest.mark.parametrize("value, remote, words", [
    ("train.py", False, r"dashboard='train.py' is not PORT or HOST:PORT: pass --dashboard auto"),
    (":8265", False, "is not PORT or HOST:PORT"),
    ("::1:8265", False, r"an IPv6 host in brackets, \[::1\]:8265"),
    (70000, False, "port 70000 is out of range: it must be from 0 to 65535"),
    ("0.0.0.0:8265", False, "listens where other machines can load the page: pass --dashboard-remote too"),
    ("gpu-a:8265", False, "pass --dashboard-remote too"),  # a name is never taken for local: it is not looked up
    (None, True, "dashboard_remote=True without a dashboard: pass --dashboard HOST:PORT too"),
    (1.5, False, "dashboard=1.5 is not an address"),
])
def test_bad_addresses_are_one_line(value, remote, words):
    with pytest.raises(ConfigError, match=words):
        LaunchConfig(dashboard=value, dashboard_remote=remote)


@pytest.mark.parametrize("token, given, host, refused", [
    (None, None, "127.0.0.1:8265", False), (None, None, "localhost:8265", False), (None, None, "[::1]:8265", False),
    (None, None, "localhost", False),
    (None, None, "evil.example:8265", True),  # a name pointed at 127.0.0.1 by a web page elsewhere (DNS rebinding)
    (None, None, None, True),
    ("s3cret", "s3cret", "gpu-a:8265", False), ("s3cret", None, "gpu-a:8265", True),
    ("s3cret", "s3cre", "127.0.0.1:8265", True), ("s3cret", "é", "gpu-a:8265", True),
])
def test_who_may_read(token, given, host, refused):
    assert (dashboard.refusal(token, given, host) is not None) == refused


def test_the_timeline_keeps_each_slices_largest_lag_of_the_span():
    now = 1000.0
    points = [(now - 200, 1, 0.9),  # before the span
              (now - 9.9, 0, 0.0), (now - 9.8, 1, 0.040), (now - 9.7, 1, 0.050),  # one slice of 0.5 s: 50 ms kept
              (now - 0.2, 0, 0.001), (now - 0.1, 1, 0.045)]
    seen = stragglers.timeline(points, told=1, told_at=now - 5, now=now, span=20.0, buckets=40)
    assert seen["span"] == 20.0 and seen["named"] == {"rank": 1, "ago": -5.0}
    assert seen["ranks"] == [{"rank": 0, "points": [[-9.75, 0.0], [-0.25, 1.0]]},
                             {"rank": 1, "points": [[-9.75, 50.0], [-0.25, 45.0]]}]
    assert stragglers.timeline(points, told=1, told_at=now - 50, now=now, span=20.0)["named"] is None


def test_the_whole_jobs_timeline_joins_every_nodes_and_names_node_0s_straggler():
    """Node 0's chart of a 2-node job held ranks 0 and 1 only. Now each node's part, moved to now by its age; the
    straggler named is the one node 0's lined-up nodes name, before a node's own."""
    now = 1000.0
    node1 = {"span": 120.0, "ranks": [{"rank": 2, "points": [[-1.0, 0.0]]}, {"rank": 3, "points": [[-1.0, 150.0]]}],
             "named": {"rank": 3, "ago": -2.0}}
    node0 = {"span": 120.0, "ranks": [{"rank": 0, "points": [[-0.5, 0.0]]}, {"rank": 1, "points": [[-0.5, 0.4]]}],
             "named": None}
    lined = {"span": 120.0, "ranks": [{"rank": 1, "points": [[-0.5, 0.0]]}, {"rank": 3, "points": [[-119.5, 149.0]]}],
             "named": {"rank": 3, "ago": -10.0}, "nodes": True}
    seen = stragglers.merged([(now, lined), (now, node0), (now - 0.8, node1)], now)
    assert [r["rank"] for r in seen["ranks"]] == [0, 1, 2, 3]
    assert seen["ranks"][3]["points"] == [[-119.5, 149.0], [-1.8, 150.0]]  # node 0's lined up; node 1's, 0.8 s old
    assert seen["ranks"][1]["points"] == [[-0.5, 0.0], [-0.5, 0.4]]
    assert seen["named"] == {"rank": 3, "ago": -10.0}
    older = stragglers.merged([(now - 5.0, lined)], now)
    assert older["ranks"] == [{"rank": 1, "points": [[-5.5, 0.0]]}] and older["named"] == {"rank": 3, "ago": -15.0}


def test_the_timeline_looks_back_no_further_than_it_must():
    now = 1000.0
    old = [(now - 500 + i * 1e-3, 0, 0.0) for i in range(1000)]
    late = [(now - 1.0, 0, 0.002)]

    class Counted(list):
        read = 0

        def __getitem__(self, i):
            Counted.read += 1
            return super().__getitem__(i)

    seen = stragglers.timeline(Counted(old + late), None, None, now)
    assert seen["ranks"] == [{"rank": 0, "points": [[-0.75, 2.0]]}] and Counted.read == 2


# ---- the server, on a stub view ------------------------------------------------------------------------------------

class _View:
    """What dashboard.serving reads of a LiveView: a snapshot and the whole job's timeline."""

    def __init__(self) -> None:
        self.looks = 0

    def snapshot(self):
        self.looks += 1
        return SimpleNamespace(to_json=lambda: json.dumps({"looks": self.looks}))

    def timeline(self):
        return stragglers.merged([], time.time())


def _get(url: str, path: str, method: str = "GET", host: str | None = None) -> tuple[int, dict, bytes]:
    where = urlsplit(url)
    conn = http.client.HTTPConnection("127.0.0.1", where.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        conn.close()


def test_a_local_page_answers_its_reads_and_only_reads(caplog):
    view = _View()
    with dashboard.serving(LaunchConfig(dashboard="auto"), view) as url:  # type: ignore[arg-type]
        assert url is not None and url.startswith("http://127.0.0.1:") and "token" not in url
        status, headers, body = _get(url, "/")
        assert status == 200 and b'src="dashboard.js"' in body and headers["Cache-Control"] == "no-store"
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        assert _get(url, "/dashboard.js")[0] == _get(url, "/dashboard.css")[0] == 200
        assert json.loads(_get(url, "/snapshot.json")[2]) == {"looks": 1}
        assert json.loads(_get(url, "/timeline.json")[2]) == {"span": stragglers.SPAN, "ranks": [], "named": None}
        assert json.loads(_get(url, "/look.json")[2]) == {"snapshot": {"looks": 2}, "timeline": {
            "span": stragglers.SPAN, "ranks": [], "named": None}}
        assert _get(url, "/nothing")[0] == 404
        for method in ("POST", "PUT", "DELETE", "PATCH", "HEAD"):
            status, headers, _ = _get(url, "/snapshot.json", method)
            assert (status, headers["Allow"]) == (405, "GET"), method
        assert _get(url, "/snapshot.json", host="evil.example:80")[0] == 403
        assert view.looks == 2  # nothing refused looked at the job
    with pytest.raises(OSError):
        _get(url, "/")  # gone with the block


def test_a_page_other_machines_reach_needs_its_token():
    view = _View()
    with dashboard.serving(LaunchConfig(dashboard="0.0.0.0:0", dashboard_remote=True),  # type: ignore[arg-type]
                           view) as url:
        assert url is not None
        token = url.split("?token=")[1]
        assert len(token) >= 32 and url.startswith(f"http://{socket.gethostname()}:")
        port = urlsplit(url).port
        for path in ("/", "/snapshot.json", "/timeline.json", "/dashboard.js", f"/?token={token[:-1]}"):
            status, _, body = _get(url, path, host=f"127.0.0.1:{port}")
            assert status == 403 and b"forbidden" in body, path
        status, _, body = _get(url, f"/?token={token}", host=f"gpu-a:{port}")
        assert status == 200 and f'src="dashboard.js?token={token}"'.encode() in body
        assert _get(url, f"/snapshot.json?token={token}")[0] == 200
        assert _get(url, f"/snapshot.json?token={token}", "POST")[0] == 405
        assert view.looks == 1


def test_a_taken_port_is_one_line_before_any_rank_starts(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('A RANK RAN', flush=True)\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cases = [(["--dashboard", f"127.0.0.1:{port}"], f"dashboard='127.0.0.1:{port}' cannot be served (Address "
                  "already in use): another program listens there: pick another port, or auto"),
                 (["--dashboard", "nosuchhost.invalid:0", "--dashboard-remote"], "dashboard='nosuchhost.invalid:0': "
                  "the host 'nosuchhost.invalid' is not known"),
                 (["--dashboard", "192.0.2.1:0", "--dashboard-remote"], "it is no address of this machine"),
                 (["--dashboard", "train.py"], "dashboard='train.py' is not PORT or HOST:PORT"),
                 (["--dashboard", "0.0.0.0:0"], "pass --dashboard-remote too")]
        for flags, words in cases:
            done = subprocess.run([sys.executable, "-m", "mpddp", "run", "--nprocs", "1", "--backend", "gloo", *flags,
                                   str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, (flags, done.stdout, done.stderr)
            assert lines[0].startswith("mpddp: error: ") and words in lines[0], (flags, lines)
            assert "A RANK RAN" not in done.stdout


# ---- a real browser on the page of a running job ------------------------------------------------------------------

class Browser:
    """Headless chromium on one page, asked through its DevTools protocol (a websocket; tornado's client)."""

    def __init__(self, url: str, profile: Path) -> None:
        self.loop = asyncio.new_event_loop()
        sandbox = ["--no-sandbox"] if os.getuid() == 0 else []  # chromium's sandbox refuses root
        self.proc = subprocess.Popen(
            [str(CHROMIUM), "--headless", "--disable-gpu", *sandbox, f"--user-data-dir={profile}",
             "--remote-debugging-port=0", "--no-first-run", "--window-size=1200,900", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().count("\n") >= 1):
            assert self.proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = int(active.read_text().splitlines()[0])
        targets = self._targets(port, deadline)
        self.ws = self.loop.run_until_complete(self._connect(targets[0]["webSocketDebuggerUrl"]))
        self.sent = 0

    def _targets(self, port: int, deadline: float) -> list[dict]:
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/json/list")
                pages = [t for t in json.loads(conn.getresponse().read()) if t["type"] == "page"]
            finally:
                conn.close()
            if pages or time.monotonic() > deadline:
                return pages
            time.sleep(0.2)

    async def _connect(self, url: str):
        from tornado.websocket import websocket_connect

        return await websocket_connect(url, max_message_size=64 << 20)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        self.sent += 1
        ask = {"id": self.sent, "method": "Runtime.evaluate", "params": {"expression": expression,
                                                                          "returnByValue": True}}
        return self.loop.run_until_complete(self._ask(ask))

    async def _ask(self, ask: dict):
        await self.ws.write_message(json.dumps(ask))
        while True:
            message = await asyncio.wait_for(self.ws.read_message(), 30)
            assert message is not None, "chromium closed the DevTools connection"
            answer = json.loads(message)
            if answer.get("id") == ask["id"]:
                return answer["result"]["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.loop.close()
        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=10)
        for proc in alive:  # a helper of its own session: by pid
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.proc.wait(10)


_ROWS = """JSON.stringify({
  rows: [...document.querySelectorAll('#ranks tbody tr')].map(tr => ({rank: tr.dataset.rank,
    straggler: tr.classList.contains('straggler'), lag: tr.querySelector('td.lag').textContent,
    state: tr.querySelector('td[class^="state-"]').textContent})),
  columns: [...document.querySelectorAll('#columns th')].map(th => th.textContent),
  summary: document.getElementById('summary').textContent,
  points: Number(document.getElementById('timeline').dataset.points || 0),
  named: document.getElementById('timeline').dataset.named || '',
  charted: document.getElementById('timeline').dataset.ranks || '',
  notes: document.getElementById('notes').textContent,
  controls: document.querySelectorAll('button, form, input, select, textarea').length,
  status: document.getElementById('status').textContent})"""


def _until(browser: Browser, ok, what: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        seen = json.loads(browser.evaluate(_ROWS) or "{}")  # None: the page has not loaded yet
        with contextlib.suppress(KeyError):
            if ok(seen):
                return seen
        assert time.monotonic() < deadline, f"the page did not show {what}: {seen}"
        time.sleep(0.5)


@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: .ci/run installs Debian's (apt-get install chromium)")
def test_a_browser_sees_the_ranks_and_the_straggler_marked_live(no_leftovers, tmp_path):
    pytest.importorskip("tornado.websocket", reason="tornado's websocket client drives chromium (the test extra)")
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    cluster = Cluster(tmp_path)
    browser = None
    try:
        node = cluster.start([], command=[sys.executable, str(JOB), "1", "0", "0", str(tmp_path / "STOP")],
                             env={"XDG_RUNTIME_DIR": str(xdg), "SLOW_RANK": "1", "DASHBOARD": "auto"})
        deadline = time.monotonic() + 90
        while "the dashboard of this job: " not in node.stderr:
            assert node.proc.poll() is None and time.monotonic() < deadline, node.stderr
            time.sleep(0.1)
        lines = [line for line in node.stderr.splitlines() if "the dashboard of this job: " in line]
        assert len(lines) == 1 and lines[0].startswith("mpddp: the dashboard of this job: http://127.0.0.1:")
        browser = Browser(lines[0].rsplit(" ", 1)[1], tmp_path / "chromium")
        seen = _until(browser, lambda s: len(s["rows"]) == 2, "2 rows", 120)
        assert [r["rank"] for r in seen["rows"]] == ["0", "1"] and seen["columns"][0] == "RANK"
        assert "2 rank(s) on 1 node(s)" in seen["summary"] and seen["controls"] == 0
        marked = _until(browser, lambda s: any(r["straggler"] for r in s["rows"]) and s["named"] and s["points"],
                        "the straggler marked", 120)  # named after 50 collectives: 5 s at 10 a second
        assert [r["straggler"] for r in marked["rows"]] == [False, True], marked
        assert marked["rows"][1]["lag"].endswith(" ms *") and marked["named"] == "1"
        assert marked["status"].startswith("updated")
        (tmp_path / "STOP").write_text("")
        assert node.wait(60) == 0, node.stderr
        gone = _until(browser, lambda s: s["status"].startswith("the launcher does not answer"), "the job's end", 30)
        assert len(gone["rows"]) == 2  # the last look stays on the page
    finally:
        if browser is not None:
            browser.close()
        cluster.kill_all()


def _dashboard_url(node, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while "the dashboard of this job: " not in node.stderr:
        assert node.proc.poll() is None and time.monotonic() < deadline, node.stderr
        time.sleep(0.1)
    return next(line for line in node.stderr.splitlines() if "the dashboard of this job: " in line).rsplit(" ", 1)[1]


@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: .ci/run installs Debian's (apt-get install chromium)")
def test_node_0s_page_of_two_nodes_is_the_whole_job(no_leftovers, tmp_path):
    """Rank 3 (node 1) the straggler: node 0's page showed it in the table, but its chart held ranks 0 and 1 only
    (its /timeline.json was node 0's), and its closing summary said "no straggler" after the line that named rank 3.
    Now its chart and table hold every rank of both nodes, rank 3 named; the summary agrees with the line, and node
    1's, which covers its own ranks only, says so."""
    pytest.importorskip("tornado.websocket", reason="tornado's websocket client drives chromium (the test extra)")
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    cluster, browser, port = Cluster(tmp_path), None, free_port()
    try:
        nodes = [cluster.start([], command=[sys.executable, str(JOB), "2", str(n), str(port), str(tmp_path / "STOP")],
                               env={"XDG_RUNTIME_DIR": str(xdg), "SLOW_RANK": "3", **({"DASHBOARD": "auto"} if n == 0
                                                                                       else {})})
                 for n in (0, 1)]
        url = _dashboard_url(nodes[0])
        browser = Browser(url, tmp_path / "chromium")
        seen = _until(browser, lambda s: len(s["rows"]) == 4 and s["status"].startswith("updated"), "4 rows", 120)
        assert [r["rank"] for r in seen["rows"]] == ["0", "1", "2", "3"] and "4 rank(s) on 2 node(s)" in seen["summary"]
        assert "Rows' age: node 0 " in seen["notes"] and ", node 1 " in seen["notes"], seen["notes"]
        marked = _until(browser, lambda s: s["named"] == "3" and s["charted"] == "0,1,2,3"
                        and [r["straggler"] for r in s["rows"]] == [False, False, False, True],
                        "rank 3 named in the chart and the table, every rank charted", 150)
        assert marked["rows"][3]["lag"].endswith(" ms *"), marked
        whole = json.loads(_get(url, "/timeline.json")[2])
        assert [r["rank"] for r in whole["ranks"]] == [0, 1, 2, 3] and whole["named"]["rank"] == 3, whole
        # each rank's typical lag, its median: one step of another rank's that a busy machine held up is a spike
        typical = {r["rank"]: statistics.median(p[1] for p in r["points"]) for r in whole["ranks"]}
        assert max(typical, key=typical.__getitem__) == 3 and typical[3] >= 30, typical  # 50 ms a step more
        deadline = time.monotonic() + 120  # node 0 names it once 50 collectives of both nodes are lined up
        while "mpddp: rank 3 is a straggler: " not in nodes[0].stderr:
            assert time.monotonic() < deadline and nodes[0].proc.poll() is None, nodes[0].stderr
            time.sleep(0.2)
        assert _until(browser, lambda s: s["named"] == "3", "rank 3 named", 10)["charted"] == "0,1,2,3"
        (tmp_path / "STOP").write_text("")
        for node in nodes:
            assert node.wait(90) == 0, node.stderr
        told = [line for line in nodes[0].stderr.splitlines() if "straggler" in line]
        summary = [line for line in told if line.startswith("mpddp: collectives: ")]
        assert len(summary) == 1 and "lined up across 2 nodes" in summary[0], told
        assert "rank 3 was the straggler" in summary[0] and "no straggler" not in summary[0], told
        other = [line for line in nodes[1].stderr.splitlines() if line.startswith("mpddp: collectives: ")]
        assert len(other) == 1 and "lined up across node 1's ranks only (2 ranks)" in other[0], nodes[1].stderr
    finally:
        if browser is not None:
            browser.close()
        cluster.kill_all()
