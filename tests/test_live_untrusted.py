"""The live view reads what comes from outside as untrusted, and ``mpddp top`` tells the truth about itself.

The runtime folder's entries and a launcher's answers are validated at the door (core/wire/typed.py): what does not
validate is skipped with one line, never a traceback, never another thread's death, never a file removed outside the
folder; an answer is capped and has a deadline. ``mpddp top`` is left by Ctrl-C, ``q`` and SIGTERM without a word
about workers (it starts none). Each launcher here is this test's own process, serving through
core/launcher/runtime_dir.py's real socket, or a socket of the test's that answers as a hostile process would.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from mpddp.core.launcher import live_snapshot, runtime_dir
from mpddp.core.launcher.live import Header, RankRow, Snapshot
from mpddp.core.wire import typed

ME = psutil.Process()


def _xdg(tmp_path: Path, monkeypatch) -> Path:
    xdg = tmp_path / "x"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    return xdg


def _top_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpddp", "top", *args]


def _top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(_top_cmd(*args), capture_output=True, text=True, timeout=timeout)


def _snapshot() -> Snapshot:
    rows = tuple(RankRow(r, r // 2, r % 2, 100 + r, "running", 57, 20.0, "#57 all_reduce", 0.0, False, 9.0, 300 << 20,
                         line=f"step {r}") for r in range(2))
    return Snapshot(Header("j", 0, 2, 1, 1, 0, 5.0, None, 0, "h"), rows)


def _entry(where: Path, name: str, **fields) -> Path:
    """A launcher's entry as this process would write it, with ``fields`` in place of its own."""
    info = {"pid": os.getpid(), "created": ME.create_time(), "job": "t", "node": 0, "host": "h", "argv": [],
            "socket": str(where / f"{name}.sock")} | fields
    path = where / f"{name}.json"
    path.write_text(json.dumps(info))
    return path


# ---- the runtime folder's entries ------------------------------------------------------------------------------

DEAD = 999_999_999  # above any pid_max (4,194,304 at most): no process


@pytest.mark.parametrize("fields, why", [
    ({"pid": "abc"}, "pid='abc' is not int"),
    ({"pid": -5}, "pid=-5 is no process id"),
    ({"pid": 0}, "pid=0 is no process id"),
    ({"pid": True}, "pid=True is not int"),
    ({"pid": 2 ** 70}, "is not int"),
    ({"created": "yesterday"}, "created='yesterday' is not float"),
    ({"created": -1.0}, "created=-1.0 is no start time"),
    ({"node": "0"}, "node='0' is not int or null"),
    ({"argv": "python job.py"}, "argv='python job.py' is not list[str]"),
    ({"socket": 7}, "socket=7 is not str"),
    ({"socket": "/etc/passwd"}, "socket='/etc/passwd' is not"),
    ({"pid": DEAD, "socket": "VICTIM"}, "socket="),  # a dead launcher's, naming a file outside: never removed
    ({"extra": 1}, "unknown field(s) extra"),
])
def test_a_malformed_entry_is_skipped_in_one_line_and_nothing_outside_is_removed(fields, why, tmp_path, monkeypatch):
    xdg = _xdg(tmp_path, monkeypatch)
    where = runtime_dir.folder()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    fields = {k: str(victim) if v == "VICTIM" else v for k, v in fields.items()}
    info = _entry(where, "1-0", **fields)
    told: list[str] = []
    assert runtime_dir.entries(skipped=told.append) == []
    assert len(told) == 1 and why in told[0] and str(info) in told[0], told
    assert victim.read_text() == "keep me" and info.exists()
    assert xdg.exists()


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000, b" " * 70_000])
def test_an_entry_that_is_no_json_object_is_skipped(content, tmp_path, monkeypatch):
    _xdg(tmp_path, monkeypatch)
    (runtime_dir.folder() / "1-0.json").write_bytes(content)
    told: list[str] = []
    assert runtime_dir.entries(skipped=told.append) == [] and len(told) == 1, told


def test_a_fifo_or_a_folder_named_like_an_entry_is_skipped_without_blocking(tmp_path, monkeypatch):
    _xdg(tmp_path, monkeypatch)
    where = runtime_dir.folder()
    os.mkfifo(where / "1-0.json")  # read, it would block for ever
    (where / "2-0.json").mkdir()
    told: list[str] = []
    assert runtime_dir.entries(skipped=told.append) == []
    assert len(told) == 2 and all("not a plain file" in t or "IsADirectory" in t for t in told), told


def test_a_launchers_live_thread_survives_every_malformed_entry_beside_it(tmp_path, monkeypatch):
    """``"pid": "abc"`` beside it killed the mpddp-live thread of every launcher started after it (its sweep)."""
    _xdg(tmp_path, monkeypatch)
    where = runtime_dir.folder()
    for n, fields in enumerate(({"pid": "abc"}, {"pid": -5}, {"created": "x"}, {"socket": 7})):
        _entry(where, f"{n + 1}-0", **fields)
    with runtime_dir.serving("a", 0, lambda: "A"):
        time.sleep(0.5)  # the sweep runs first, off the launch's path
        assert [t for t in threading.enumerate() if t.name == "mpddp-live"]
        mine = [e for e in runtime_dir.entries() if e.job == "a"]
        assert [runtime_dir.ask(e) for e in mine] == ["A"]


def test_top_lists_the_skipped_entries_in_a_line_each_and_no_traceback(tmp_path, monkeypatch):
    xdg = _xdg(tmp_path, monkeypatch)
    where = runtime_dir.folder()
    for n, fields in enumerate(({"pid": "abc"}, {"pid": -5}, {"created": "x"}, {"socket": 7})):
        _entry(where, f"{n + 1}-0", **fields)
    done = subprocess.run(_top_cmd("--once"), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)})
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert [line.startswith("mpddp top: skipped ") for line in lines] == [True] * 4 + [False], lines
    assert lines[-1].startswith("mpddp: error: no mpddp job of yours runs on this machine")


# ---- a launcher's answers ---------------------------------------------------------------------------------------

def _rows(**change) -> str:
    data = json.loads(_snapshot().to_json())
    for path, value in change.items():
        *above, key = path.split("__")
        at = data
        for part in above:
            at = at[int(part)] if part.isdigit() else at[part]
        at[key] = value
    return json.dumps(data)


@pytest.mark.parametrize("answer, said", [
    ("garbage", "not JSON"),
    ("{}", "ranks and missing are lists"),
    ("[]", "a snapshot is a JSON object, not list"),
    (_rows(ranks="x"), "ranks and missing are lists"),
    (_rows(ranks=[1, 2]), "a row: a JSON object was expected, not int"),
    (_rows(ranks__0__rank="zero"), "rank='zero' is not int"),
    (_rows(ranks__1__rss=-1.5), "rank 1's row: rss=-1.5 is not int or null"),
    (_rows(header__elapsed="NaN"), "header: elapsed='NaN' is not float"),
    (_rows(header=None), "header: a JSON object was expected, not NoneType"),
    (_rows(missing=["1"]), "missing are node ranks"),
    (_rows(taken=None), "taken=None is not a time"),
    ("x" * (3 << 20), "an answer over 1,048,576 bytes"),
])
def test_an_answer_that_is_no_snapshot_is_one_line(answer, said, tmp_path, monkeypatch):
    xdg = _xdg(tmp_path, monkeypatch)
    with runtime_dir.serving("t", 0, lambda: answer):
        done = subprocess.run(_top_cmd("--once", "--wait", "0"), capture_output=True, text=True, timeout=60,
                              env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)})
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "answered what is no snapshot" in done.stderr, done.stderr
    assert said in done.stderr, done.stderr


def test_a_newer_launchers_fields_are_left_out(tmp_path, monkeypatch):
    """A header or a row with a field this version does not know (a newer mpddp): the table, not a traceback."""
    xdg = _xdg(tmp_path, monkeypatch)
    answer = _rows(header__newer=1, ranks__0__newer="x")
    with runtime_dir.serving("t", 0, lambda: answer):
        done = subprocess.run(_top_cmd("--once", "--wait", "0"), capture_output=True, text=True, timeout=60,
                              env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)})
    assert done.returncode == 0 and done.stdout.startswith("mpddp top  job j"), done


@contextlib.contextmanager
def _endless(where: Path, pace: float | None):
    """A process that answers like a launcher, without end: as fast as it can (``pace`` None) or a byte a pace."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(where / "9-0.sock"))
    server.listen(4)
    _entry(where, "9-0")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(b'{"header": ')
                while not stop.is_set():
                    conn.sendall(b" " * (1 << 16) if pace is None else b" ")
                    if pace is not None:
                        time.sleep(pace)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pace, said, within", [
    (None, "answered what is no snapshot (an answer over 1,048,576 bytes)", 4.0),
    (0.05, f"did not answer within {runtime_dir.ASK_TIMEOUT:g} s", runtime_dir.ASK_TIMEOUT + 4.0),
])
def test_an_answer_without_end_is_cut_by_its_cap_or_its_deadline(pace, said, within, tmp_path, monkeypatch):
    """An endless answer grew ``top --once`` to 3.2 GB in 13 s; now 1 MiB at most, and 5 s for the whole read. The
    bound: the ask's deadline, plus 4 s for the interpreter's start and mpddp's imports on 2 loaded cores."""
    xdg = _xdg(tmp_path, monkeypatch)
    with _endless(runtime_dir.folder(), pace):
        top = psutil.Popen(_top_cmd("--once", "--wait", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)})
        started, most = time.monotonic(), 0
        while top.poll() is None and time.monotonic() - started < 30:
            with contextlib.suppress(psutil.Error):
                most = max(most, top.memory_info().rss)
            time.sleep(0.05)
        took = time.monotonic() - started
        out, err = top.communicate(timeout=30)
    assert top.returncode == 1 and said in err and err.count("\n") == 1, err
    assert took < within, took
    assert most < 200 << 20, most  # the interpreter and mpddp's imports: about 60 MiB


# ---- how top is left ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _watched(tmp_path: Path, monkeypatch, on_pty: bool):
    """``mpddp top`` watching this process's fake job (a valid snapshot, every ask), its output read on a pty or
    a pipe; yields (the process, a function that waits for a text in its output, the master fd or None)."""
    xdg = _xdg(tmp_path, monkeypatch)
    answer = _snapshot().to_json()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg), "COLUMNS": "200"}
    with runtime_dir.serving("t", 0, lambda: answer):
        if on_pty:
            master, slave = pty.openpty()
            proc = subprocess.Popen(_top_cmd("--interval", "0.2"), stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True)
            os.close(slave)
        else:
            proc = subprocess.Popen(_top_cmd("--interval", "0.2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env)
            master = None
        seen = bytearray()

        def until(text: bytes, timeout: float = 30) -> None:
            fd = master if master is not None else proc.stdout.fileno()
            deadline = time.monotonic() + timeout
            while text not in seen:
                assert time.monotonic() < deadline and proc.poll() is None, seen.decode(errors="replace")
                if select.select([fd], [], [], 0.1)[0]:
                    seen.extend(os.read(fd, 1 << 16))

        try:
            yield proc, until, master
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if master is not None:
                os.close(master)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, code", [("SIGINT", 130), ("SIGTERM", 143), ("q", 0)])
def test_top_is_left_by_ctrl_c_sigterm_and_q_without_a_word(how, code, tmp_path, monkeypatch):
    """Ctrl-C printed "interrupted (SIGINT); every worker was stopped" (top starts none), SIGTERM sometimes a
    traceback, and there was no ``q``."""
    with _watched(tmp_path, monkeypatch, on_pty=how == "q") as (proc, until, master):
        until(b"mpddp top  job j")  # the first table is out: top is in its loop
        time.sleep(0.5)
        if how == "q":
            os.write(master, b"q")
        else:
            proc.send_signal(getattr(signal, how))
        assert proc.wait(20) == code
        err = proc.stderr.read().decode()
        assert err.strip() == "", err  # Ctrl-C: click's newline, so that the shell's prompt starts a line of its own


@pytest.mark.timeout(120)
def test_sigterm_at_any_moment_of_top_is_143_and_silent(tmp_path, monkeypatch):
    """SIGTERM at ten moments of top's life (its imports, its first ask, between looks): 143 and nothing said."""
    xdg = _xdg(tmp_path, monkeypatch)
    answer = _snapshot().to_json()
    with runtime_dir.serving("t", 0, lambda: answer):
        for delay in (0.05, 0.15, 0.25, 0.35, 0.5, 0.7, 0.9, 1.2, 1.6, 2.2):
            proc = subprocess.Popen(_top_cmd("--interval", "0.2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)})
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            # -15: before the interpreter installs mpddp's handler, SIGTERM's default action (no word either)
            assert proc.wait(20) in (143, -signal.SIGTERM), (delay, proc.returncode)
            err = proc.stderr.read().decode()
            assert "Traceback" not in err and "worker" not in err, (delay, err)


def test_the_typed_door_refuses_a_bool_for_an_int_and_leaves_a_newer_field_out():
    header = json.loads(_snapshot().to_json())["header"]
    assert typed.fill(Header, header | {"newer": 1}) == _snapshot().header
    with pytest.raises(typed.Malformed, match="world_size=True is not int"):
        typed.fill(Header, header | {"world_size": True})
    with pytest.raises(typed.Malformed, match="unknown field"):
        typed.fill(Header, header | {"newer": 1}, known_only=False)


@pytest.mark.parametrize("live, said", [
    ({"rows": "x", "lags": [], "taken": 1.0}, "an object of rows and lags"),
    ({"rows": [], "lags": [], "taken": "now"}, "taken='now' is not a time"),
    ({"rows": [{"rank": "0"}], "lags": [], "taken": 1.0}, "a row:"),
    ({"rows": [], "lags": [{"span": 120, "ranks": [{"rank": 0, "points": [[1]]}], "named": None}], "taken": 1.0},
     "not a timeline"),
    ([1, 2], "an object of rows and lags"),
])
def test_another_nodes_part_of_another_shape_is_refused_at_the_door(live, said):
    """Another node's part (read from the round's store): refused in one line, so that the look leaves it out."""
    with pytest.raises(typed.Malformed, match=said):
        live_snapshot.read_part(json.dumps({"0": [], "~live": live}).encode())
    assert live_snapshot.read_part(json.dumps({"0": []}).encode()) is None  # nobody watched it: no part
    part = live_snapshot.Part(5.0, _snapshot().ranks, ({"span": 120.0, "ranks": [], "named": None, "nodes": False},))
    assert live_snapshot.read_part(json.dumps({"~live": part.shared()}).encode()) == part
