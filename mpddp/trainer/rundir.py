"""A run's directory, taken whole: a new one's name, and the lock that keeps a second live run out of it.

Owns: the names of new run directories (``<date-time>``, then ``<date-time>-2``, ``-3``, ... for runs started
in the same second; :func:`order` sorts them), making one (``os.mkdir`` without ``exist_ok`` is atomic: of two
runs that chose the same name, the loser moves on to the next), and ``<run dir>/.lock``: who holds the
directory (pid, host, since when), published whole and held with ``flock`` for the run's life. The kernel
drops a flock when its holder dies, so a lock left by a dead run is told from a live run's exactly (no pid to
guess from) and taken over. What the holder forks closes its copy of the lock's descriptor (a forked rank or
DataLoader worker that outlives the holder must not keep the lock). Leaves which process holds it (the
launcher whose node writes, else rank 0: trainer/run.py and trainer/loop.py) and which directory a run uses
(trainer/prepare.py) to others. Imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError
from ..log import logger

LOCK_FILE = ".lock"
STAMP = "%Y%m%d-%H%M%S"  # a new run's name: sortable, one-second resolution (a number is added on a clash)
_NAME = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")
_TRIES = 20  # the lock file changed under us (released, or taken over) this often: give up, say so
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM}  # a file system without flock or link


def new_name(now: float | None = None) -> str:
    """A new run's directory name: the local date and time, ``20261205-101112``."""
    return time.strftime(STAMP, time.localtime(now))


def numbered(name: str, n: int) -> str:
    """The ``n``-th run of a second: ``name`` itself, then ``name-2``, ``name-3``, ..."""
    return name if n == 1 else f"{name}-{n}"


def order(name: str) -> tuple[str, int]:
    """Sort key of run directory names: by date and time, then by number (``-10`` after ``-9``)."""
    match = _NAME.match(name)
    return (match.group(1), int(match.group(2) or 1)) if match else (name, 0)


def make_new(proposed: Path) -> Path:
    """Make the run directory ``proposed`` names, or the next free number of its second; return it.

    Atomic: of two runs that propose the same name, one makes it and the
    other the next, never both the same.
    """
    match = _NAME.match(proposed.name)
    stem, n = (match.group(1), int(match.group(2) or 1)) if match else (proposed.name, 1)
    proposed.parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = proposed.parent / numbered(stem, n)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


@dataclass(frozen=True)
class Holder:
    """What ``.lock`` says of the run that holds the directory."""

    pid: int
    host: str
    since: float  # time.time() when it took the lock
    token: str = ""  # the run's token (trainer/run.py): a restart of the same run takes its own lock back quietly

    def __str__(self) -> str:
        return (f"pid {self.pid} on host {self.host} "
                f"(since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})")


def busy(run_dir: Path, holder: Holder | None) -> str:
    """The refusal: the directory is held by a live run."""
    who = str(holder) if holder else "a run whose lock file cannot be read"
    return (f"run_dir={str(run_dir)!r} is in use by {who}: wait for that run to end, or pass another --run-dir "
            "(a fresh run without --run-dir gets a directory of its own)")


def taken_over(run_dir: Path, holder: Holder | None) -> str:
    """The note: the lock's holder is gone (the kernel dropped its flock), and this run takes it."""
    return f"run_dir {str(run_dir)!r}: {str(holder) if holder else 'a run'} held it and is gone; lock taken over"


class RunLock:
    """``<run dir>/.lock``, held by this process until :meth:`release` (or until it dies)."""

    def __init__(self, path: Path, fd: int | None, took_over: bool, previous: Holder | None = None) -> None:
        self.path, self.fd = path, fd  # fd None: the file system has no locks (said when taken)
        self.took_over, self.previous = took_over, previous  # from a gone holder (None: its record unreadable)
        if fd is not None:
            _HELD.add(fd)

    def release(self) -> None:
        """Remove the lock file, then let go of the lock: the next run finds the directory free."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if _same(self.fd, self.path):  # never another run's file (one that took over a lock we lost)
                self.path.unlink()
        _HELD.discard(self.fd)
        os.close(self.fd)
        self.fd = None


def take(run_dir: Path, token: str = "") -> RunLock:
    """Lock ``run_dir`` (it exists) for this process; ConfigError naming the holder if a live run holds it.

    The record is written to a temporary file that is locked first, then
    published under the lock's name at once (``link`` fails where the name
    exists): a reader never sees a lock without its holder. A lock file
    nobody holds a flock on is a dead run's: replaced the same way, while
    this process holds its flock, so two runs never both take it over.
    """
    path, mine = run_dir / LOCK_FILE, Holder(os.getpid(), socket.gethostname(), time.time(), token)
    tmp = run_dir / f".lock.{mine.pid}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # close-on-exec, as every fd Python opens
    try:
        os.write(fd, json.dumps(asdict(mine)).encode())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        took_over, previous = _publish(tmp, path)
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_LOCKS:
            raise
        logger.warning("mpddp: run_dir %r: its file system has no file locks (%s): a second run there is not "
                       "stopped", str(run_dir), os.strerror(e.errno or 0))
        return RunLock(path, None, False)
    except BaseException:
        os.close(fd)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return RunLock(path, fd, took_over, previous)


def _publish(tmp: Path, path: Path) -> tuple[bool, Holder | None]:
    """Give ``tmp`` the lock's name: at once where it is free, (False, None), else over a gone holder's file,
    (True, that holder; None if its record is unreadable)."""
    for _ in range(_TRIES):
        try:
            os.link(tmp, path)
            return False, None
        except FileExistsError:
            pass
        taken = _take_over(path, tmp)
        if taken[0]:
            return taken
    raise ConfigError(f"run_dir={str(path.parent)!r}: its lock file changed {_TRIES} times while this run tried "
                      "to take it; another run is starting there: try again, or pass another --run-dir")


def _take_over(path: Path, tmp: Path) -> tuple[bool, Holder | None]:
    """The lock file at ``path`` exists: refuse if its holder is alive, else replace it with ``tmp``:
    (True, the gone holder). (False, None): it went away meanwhile, try again."""
    try:
        old = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, None
    try:
        try:
            fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.02)  # a run taking over a dead one's file holds its flock for a moment: look again
            if not _same(old, path):
                return False, None
            raise ConfigError(busy(path.parent, _read(path))) from None
        if not _same(old, path):  # released (and removed) between our open and our flock
            return False, None
        previous = _read(path)
        os.replace(tmp, path)  # ours, already locked and whole, while we hold the gone one's flock
        return True, previous
    finally:
        os.close(old)


def _same(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read(path: Path) -> Holder | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return Holder(int(record["pid"]), str(record["host"]), float(record["since"]), str(record.get("token", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def held(run_dir: str, new: bool, token: str = "") -> Iterator[str]:
    """Make and lock the run directory for the ``with`` block; yield its path.

    ``new``: ``run_dir`` is a new run's proposed name (:func:`make_new`
    takes it or the next free one); else it is made if missing. A
    directory this made and the run left empty (it failed before writing
    anything) is removed at the end, with the lock.
    """
    path = Path(run_dir)
    made = _missing(path.parent if new else path)
    if new:
        path = make_new(path)
        made.append(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
    try:
        lock = take(path, token)
    except BaseException:
        _remove_empty(made)
        raise
    if lock.took_over and not (token and lock.previous and lock.previous.token == token):
        logger.warning("mpddp: %s", taken_over(path, lock.previous))
    try:
        yield str(path)
    finally:
        lock.release()
        _remove_empty(made)


def _missing(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, outermost first."""
    gone = [p for p in (path, *path.parents) if not p.exists()]
    return gone[::-1]


def _remove_empty(made: list[Path]) -> None:
    for path in reversed(made):  # innermost first
        with contextlib.suppress(OSError):
            path.rmdir()


_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_in_child() -> None:
    # A forked child shares the lock's open file: closing its copy keeps the lock its parent's alone, and
    # gone when the parent dies (flock would stay while any copy is open). Closing is not unlocking.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)
