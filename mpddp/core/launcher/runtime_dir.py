"""Where the launchers of this user on this machine say they run, and how a watcher asks one of them.

Owns: the per-user runtime folder (``$XDG_RUNTIME_DIR/mpddp``, else ``/tmp/mpddp-<uid>``: mode 0700, refused
unless this user owns it alone), a launcher's entry in it (``<pid>-<n>.json``, what it runs, and ``<pid>-<n>.sock``,
where it answers), :func:`serving`, which keeps both while the job runs and removes them when it ends (Ctrl-C and
failures too), and the watcher's side: :func:`entries` (the launchers alive; a dead one's entry is removed),
:func:`pick` (which one to ask) and :func:`look` (ask until every node's rows are in). What the folder holds and what a
socket answers is read as untrusted (core/wire/typed.py): an entry that does not validate is skipped with one line, a
reply is capped at :data:`MAX_REPLY` with a deadline on the whole read, and only files inside the folder are ever
removed.

Why a unix socket, not a JSON file rewritten every second: a thread blocked in ``accept()`` costs nothing while
nobody watches, and what a watcher reads is computed when it asks. The folder's mode keeps other users out; the
snapshot itself is core/launcher/live.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ...errors import ConfigError, MpddpError
from ...log import logger
from ..wire import typed
from .live import Snapshot

_LAUNCHES = itertools.count()  # this process's launches, for their entries' names
ASK_TIMEOUT = 5.0  # seconds a watcher waits for a launcher's answer
AGAIN = 0.3  # seconds between two asks of a watcher that waits for every node's rows
MAX_REPLY = 1 << 20  # bytes of a launcher's answer: a snapshot of 1,000 ranks is about 400 KiB
MAX_ENTRY = 1 << 16  # bytes of an entry: its argv is the longest part
_MAX_PID = (1 << 31) - 1  # a pid_t


class RuntimeDirRefused(MpddpError):
    """The runtime folder is not this user's alone (another owner, or open to others): nothing is read or written."""


@dataclass(frozen=True)
class Entry:
    """One launcher on this machine, as its ``<pid>-<n>.json`` says (``n``: a launch of that process)."""

    pid: int
    created: float  # the process's start time (psutil): a pid used again by another process is told apart
    job: str
    node: int | None
    host: str
    argv: list[str]
    socket: str

    def check(self, where: Path, name: str) -> None:
        """:class:`~mpddp.core.wire.typed.Malformed` unless it could be a launcher's: a pid of a process, and its
        socket the one beside it in the runtime folder ``where`` (a socket named elsewhere is never asked nor
        removed)."""
        if not 0 < self.pid <= _MAX_PID:
            raise typed.Malformed(f"pid={self.pid} is no process id")
        if self.created < 0:
            raise typed.Malformed(f"created={self.created} is no start time")
        if self.node is not None and self.node < 0:
            raise typed.Malformed(f"node={self.node} is no node rank")
        if self.socket != str(where / f"{name}.sock"):
            raise typed.Malformed(f"socket={self.socket!r} is not {name}.sock in {where}")

    @property
    def alive(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.created) < 1.0
        except psutil.Error:
            return False


def folder(create: bool = True) -> Path:
    """This user's runtime folder, made mode 0700 if ``create``; :class:`RuntimeDirRefused` if it is not ours
    alone (a folder of another user's under /tmp could list fake jobs, or read ours)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "mpddp" if base else Path("/tmp") / f"mpddp-{os.getuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=bool(base))
    try:
        st = path.lstat()
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeDirRefused(
            f"the runtime folder {path} is not yours alone (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}):"
            f" mpddp neither reads nor writes it; remove it, or set XDG_RUNTIME_DIR to a folder of your own")
    return path


@contextlib.contextmanager
def serving(job: str, node: int | None, answer: Callable[[], str]) -> Iterator[Path | None]:
    """This launcher's entry while the block runs: ``answer()`` (a snapshot's JSON) to each watcher that connects.
    A folder that cannot be used costs the job nothing: a warning, and no entry (None)."""
    name = f"{os.getpid()}-{next(_LAUNCHES)}"  # a process may run several launches at once (threads)
    server: socket.socket | None = None
    try:
        where = folder()
        path, info = where / f"{name}.sock", where / f"{name}.json"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an old one of a pid used again
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(4)
        entry = Entry(os.getpid(), psutil.Process().create_time(), job, node, socket.gethostname(), sys.argv[:],
                      str(path))
        _write(info, json.dumps(asdict(entry)))
    except (OSError, RuntimeDirRefused) as e:
        logger.warning("mpddp: `mpddp top` cannot see this job: %s", e)
        if server is not None:
            _close(server, path, info)
        yield None
        return
    ended = threading.Event()  # the sweep stops at its next entry (2,000 entries of dead launchers took seconds)
    try:
        thread = threading.Thread(target=_serve, args=(server, answer, ended), name="mpddp-live", daemon=True)
        thread.start()
        yield where
    finally:
        ended.set()
        _close(server, path, info)
        with contextlib.suppress(RuntimeError):  # a Ctrl-C inside start(), before the thread ran: nothing to join
            thread.join(ASK_TIMEOUT)  # gone before the launch returns: a launch after it (fork) finds no thread of ours


def _close(server: socket.socket, *paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()
    with contextlib.suppress(OSError):
        server.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
    server.close()


def _write(path: Path, text: str) -> None:
    """Written whole or not at all: a watcher never reads half an entry."""
    part = path.with_suffix(".part")
    part.write_text(text)
    part.replace(path)


def _serve(server: socket.socket, answer: Callable[[], str], ended: threading.Event) -> None:
    """One snapshot a connection, until the socket is closed. A watcher's trouble never reaches the job. First, off
    the launch's path, the entries of launchers killed outright go (else they would pile up until a watcher came),
    unless the launch ``ended`` meanwhile."""
    try:
        entries(ended=ended)
    except Exception as e:  # noqa: BLE001 - whatever lies beside our entry, this thread serves the job's watchers
        logger.debug("mpddp: the sweep of the runtime folder failed (%s: %s)", type(e).__name__, e)
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(ASK_TIMEOUT)
                conn.sendall(answer().encode())
            except Exception as e:  # noqa: BLE001 - a watcher gone, or a snapshot that failed: the job goes on
                logger.debug("mpddp: a watcher's snapshot failed (%s: %s)", type(e).__name__, e)


def entries(skipped: Callable[[str], None] = logger.debug, ended: threading.Event | None = None) -> list[Entry]:
    """The launchers of this user alive on this machine, oldest first; the entries of dead ones are removed. An
    entry that does not validate is left, and told to ``skipped`` in one line (a launcher's sweep: at debug). Once
    ``ended`` is set, the entries read so far."""
    where = folder(create=False)
    if not where.is_dir():
        return []
    found = []
    for info in sorted(where.glob("*.json")):
        if ended is not None and ended.is_set():
            break
        try:
            entry = _read_entry(info, where)
        except FileNotFoundError:
            continue  # its launcher ended meanwhile
        except (OSError, typed.Malformed) as e:
            skipped(f"mpddp: skipped {info}: {_why(e)}")
            continue
        if entry.alive:
            found.append(entry)
            continue
        for p in (info, where / f"{info.stem}.sock"):  # its launcher was killed (SIGKILL): nothing else removes it
            with contextlib.suppress(OSError):
                p.unlink()
    return sorted(found, key=lambda e: (e.created, e.pid))


def _read_entry(info: Path, where: Path) -> Entry:
    """One entry, read at most :data:`MAX_ENTRY` bytes of a plain file (never a FIFO, which would block, nor a link
    out of the folder) and validated."""
    fd = os.open(info, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise typed.Malformed("not a plain file")
        text = f.read(MAX_ENTRY + 1)
    if len(text) > MAX_ENTRY:
        raise typed.Malformed(f"over {MAX_ENTRY:,} bytes")
    entry = typed.fill(Entry, typed.loads(text), known_only=False)
    entry.check(where, info.stem)
    return entry


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, typed.Malformed) else f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"


def ask(entry: Entry, timeout: float = ASK_TIMEOUT) -> str:
    """The launcher's snapshot (JSON), read whole within ``timeout`` s and :data:`MAX_REPLY` bytes: OSError when it
    does not answer (it ended meanwhile), TimeoutError past the deadline, :class:`~mpddp.core.wire.typed.Malformed`
    past the cap."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(entry.socket)
        return typed.receive(conn, MAX_REPLY, timeout).decode(errors="replace")  # from_json refuses what is no JSON


def pick(found: list[Entry], job: str | None) -> Entry:
    """The launcher to ask (pure): of job ``job`` (its id, or a launcher's pid), else of the only job running here;
    of several of one job (nodes on one machine), the lowest node. Bad input: :class:`ConfigError` (exit code 2)."""
    if job is not None:
        found = [e for e in found if job in (e.job, str(e.pid))]
        if not found:
            raise ConfigError(f"--job {job}: no launcher of that job (id or pid) runs here; `mpddp top` without "
                              "--job lists them")
    if not found:
        raise NoJob(f"no mpddp job of yours runs on this machine (no launcher in {folder(create=False)})")
    jobs = sorted({e.job for e in found})
    if len(jobs) > 1:
        told = "; ".join(f"{j} (pid {', '.join(str(e.pid) for e in found if e.job == j)})" for j in jobs)
        raise ConfigError(f"{len(jobs)} jobs run here: {told}; pick one with --job ID or --job PID")
    return min(found, key=lambda e: (e.node is None, e.node or 0, e.created))


def look(entry: Entry, wait: float) -> Snapshot:
    """One snapshot of the job, asked again (every :data:`AGAIN` s, for ``wait`` s at most) until it is whole:
    the other nodes add their rows within a second or two of the first ask (core/launcher/live.py), and a rate
    needs two looks a second apart."""
    deadline = time.monotonic() + wait
    while True:
        try:
            snapshot = Snapshot.from_json(ask(entry))
        except TimeoutError:  # a launcher busy on a loaded machine: asked again while ``wait`` allows
            if time.monotonic() >= deadline:
                raise
            continue
        if snapshot.whole or time.monotonic() >= deadline:
            return snapshot
        time.sleep(AGAIN)


class NoJob(MpddpError):
    """No launcher of this user runs on this machine."""
