"""Where every rank is: each rank's Python stack on demand, grouped by the frame it is stopped at.

Owns: the signal that makes a worker dump its stacks (``faulthandler``, on a pipe of its own), asking running ranks
for their stacks, turning a dump into the main thread's frames trimmed to the user's code, and the grouped report:

    ranks 0, 2, 3 wait together in barrier at train.py:40
    rank 1 is elsewhere: wait_for_nfs at data.py:77 (time.sleep(3600))  <- look here

Why faulthandler: its handler is C code that runs in the signal handler itself, so it dumps the stack while the main
thread is blocked in C (a collective, a sleep, a lock), where a Python-level handler would wait for the call to
return; it needs nothing installed, unlike py-spy (which also needs ptrace rights that containers often withhold).
A real-time signal is used, not SIGUSR1, which frameworks (Lightning's SLURM requeue) take for themselves.
"""

from __future__ import annotations

import contextlib
import faulthandler
import linecache
import os
import re
import signal
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .signals import STACK_SIGNAL

_WAIT = 0.5  # seconds to wait for the dumps of every rank asked
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_DECORATORS = ("wrapper", "_wrapper", "inner")  # torch.distributed wraps its collectives for logging
_CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mpddp/core: the launcher's own frames
_LIBRARY = tuple(dict.fromkeys(
    os.path.join(p, "") for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                  sysconfig.get_paths()["platlib"], _CORE)))  # not the trainer
# Where a rank that uses no CPU waits for its peers: a collective or the store, DDP's reducer, or the
# autograd engine (DDP all-reduces gradients from C++ hooks during backward).
_WAITS = tuple(os.path.join("torch", *part.split("/"), "") for part in ("distributed", "nn/parallel", "autograd"))
# Where a rank that *uses* a CPU may still only wait: a collective, or a CUDA sync (a GPU rank spins there).
_SPINS = tuple(os.path.join("torch", part, "") for part in ("distributed", "cuda"))
_CUDA = os.path.join("torch", "cuda", "")


ASKED = threading.Event()  # set by SIGUSR1 (the user asks where every rank is); core/launcher/attempt.py answers


def request(signum: int = 0, frame: object = None) -> None:
    """SIGUSR1's handler: ask the watch loop for every rank's stack (the job goes on)."""
    ASKED.set()


@contextlib.contextmanager
def on_demand() -> Iterator[None]:
    """Answer SIGUSR1 to this process while a launch runs (main thread only: signals land there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR1, request)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)
        ASKED.clear()


def install(fd: int) -> None:
    """In the worker: dump every thread's stack to ``fd`` whenever :data:`STACK_SIGNAL` arrives."""
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass(frozen=True)
class Location:
    """Where one rank's main thread is: ``text`` such as ``barrier at train.py:40``."""

    text: str
    waiting: bool  # inside torch's communication: a collective, the store, DDP's gradient sync
    dump: str  # the whole faulthandler dump, every thread, for the logs
    spinning: bool = False  # inside a collective or a CUDA sync: busy there is still waiting
    at_sync: bool = False  # inside torch.cuda (a sync): waiting for the GPU, which may be computing
    line: str = ""  # the user's line it is at, e.g. train.py:40


def main_frames(dump: str, main_thread: int | None) -> list[Frame]:
    """The main thread's frames in ``dump``, innermost first (faulthandler's order)."""
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in dump.splitlines():
        if match := _THREAD.match(line):
            current = threads.setdefault(int(match.group(1), 16), [])
        elif current is not None and (match := _FRAME.match(line)):
            current.append(Frame(match.group(1), int(match.group(2)), match.group(3)))
    if main_thread in threads:
        return threads[main_thread]
    return next(iter(threads.values()), [])


def _is_user(frame: Frame) -> bool:
    return not frame.file.startswith(_LIBRARY) and not frame.file.startswith("<")


def locate(dump: str, main_thread: int | None) -> Location | None:
    """Where the main thread is, told by the user's innermost frame and the call it is in."""
    frames = main_frames(dump, main_thread)
    if not frames:
        return None
    waiting = any(part in f.file for f in frames for part in _WAITS)
    spinning = any(part in frames[0].file for part in _SPINS)
    at_sync = _CUDA in frames[0].file
    users = [i for i, f in enumerate(frames) if _is_user(f)]
    if not users:
        top = frames[0]
        return Location(f"{top.func} at {top.short}", waiting, dump, spinning, at_sync, top.short)
    user = frames[users[0]]
    library = [f for f in reversed(frames[: users[0]]) if f.func not in _DECORATORS]
    if library and waiting:  # inside torch's communication: name the call, e.g. barrier at train.py:40
        return Location(f"{library[0].func} at {user.short}", waiting, dump, spinning, at_sync, user.short)
    # the user's function, its line (a notebook cell's too: the kernel keeps cells in linecache) and, inside
    # another library's call, that call: "idle_forever at idle.py:5 (done.wait()), waiting in threading.wait"
    source = linecache.getline(user.file, user.line).strip()  # a C call such as time.sleep has no frame
    text = f"{user.func} at {user.short}" + (f" ({source})" if source else "")
    if library:
        text += f", waiting in {_module(library[0].file)}.{library[0].func}"
    return Location(text, waiting, dump, spinning, at_sync, user.short)


def _module(path: str) -> str:
    """``threading`` for .../lib/python3.11/threading.py, ``requests.api`` for a site-packages file."""
    for root in sorted(_LIBRARY, key=len, reverse=True):
        if path.startswith(root):
            path = path[len(root):]
            break
    return os.path.splitext(path)[0].replace(os.sep, ".").removesuffix(".__init__")


def ask(pids: dict[int, int], fds: dict[int, int]) -> dict[int, str]:
    """Signal each rank (rank -> pid) and read its dump from its stack pipe (rank -> fd)."""
    for fd in fds.values():
        _drain(fd)  # an old dump, from a signal sent by hand
    asked = []
    for rank, pid in pids.items():
        try:
            os.kill(pid, STACK_SIGNAL)
            asked.append(rank)
        except ProcessLookupError:
            continue
    dumps = {rank: "" for rank in asked}
    deadline = time.monotonic() + _WAIT
    while time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in asked:
            dumps[rank] += _drain(fds[rank])
        if all(dumps.values()):
            time.sleep(0.05)  # the handler writes line by line: let the last lines land
            for rank in asked:
                dumps[rank] += _drain(fds[rank])
            break
    return {rank: text for rank, text in dumps.items() if text}


def _drain(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def grouped(locations: dict[int, Location | None], finished: Iterable[int] = ()) -> list[str]:
    """One row per frame: ranks stopped at the same place together; the odd ones out marked."""
    groups: dict[tuple[str, bool], list[int]] = {}
    unknown = []
    for rank, where in sorted(locations.items()):
        if where is None:
            unknown.append(rank)
        else:
            groups.setdefault((where.text, where.waiting), []).append(rank)
    waiting_somewhere = any(w for _, w in groups)
    largest = max(groups.items(), key=lambda item: (item[0][1], len(item[1])), default=None)
    rows = []
    for (text, waiting), ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        who = ranks_named(ranks)
        many = len(ranks) > 1
        if len(groups) == 1:
            verb = ("wait together in" if many else "waits in") if waiting else ("are all at" if many else "is at")
            rows.append(f"{who} {verb} {text}")
            continue
        odd = (not waiting) if waiting_somewhere else (largest is not None and ranks is not largest[1])
        verb = (("wait together in" if many else "waits in") if waiting
                else ("are elsewhere:" if many else "is elsewhere:"))
        rows.append(f"{who} {verb} {text}" + ("  <- look here" if odd else ""))
    rows += [f"{ranks_named([r])} did not answer (it may be stopped or out of the interpreter)" for r in unknown]
    rows += [f"{ranks_named([r])} has already exited" for r in finished]
    return rows


def ranks_named(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-63, 65``: how every report names ranks (a run of four or more
    as a range, so that a hundred ranks make one short line; three read better written out)."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 4 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)
