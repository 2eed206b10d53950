"""``launch(..., live=True)``: the job's live table, shown by the launcher itself while its job runs.

Owns: :func:`showing`, a thread of the launcher's (in a notebook, the kernel's) that looks at its
:class:`~mpddp.core.launcher.live.LiveView` once a second and shows the look on a :class:`Screen`: in a Jupyter
kernel a :class:`Cell`, one display updated in place (an HTML table, the text table as its text/plain); elsewhere
:class:`Text` on stderr, a table now and then, never redrawn in place (the ranks' lines share the stream, and a
file or a pipe must not fill with redraws). When the job ends, whatever ends it, the last look stays. What a row
says is core/launcher/live.py's; its words core/launcher/live_table.py's. A look that fails is told once and the
job goes on: watching never breaks it, and its thread only reads what the launcher keeps anyway.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TextIO

from ...log import logger
from . import live_table
from .live import LiveView, Snapshot

EVERY = 1.0  # seconds between two looks
TEXT_EVERY = {True: 10.0, False: 60.0}  # seconds between two tables on stderr: a terminal; a file or a pipe
STOP_WAIT = 2.0  # seconds the job's end waits for a look under way (it asks the round's store, which may be gone)


class Screen(Protocol):
    """Where the looks go; ``last``: the job has ended, this look stays."""

    def show(self, snapshot: Snapshot, last: bool) -> None: ...


class Cell:
    """A notebook cell: one display, made at the first look and updated in place after (IPython's display id)."""

    def __init__(self) -> None:
        self.handle: Any = None

    def show(self, snapshot: Snapshot, last: bool) -> None:
        from IPython.display import display

        bundle = {"text/plain": live_table.table(snapshot, 1 << 16), "text/html": live_table.html(snapshot)}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


class Text:
    """Plain text on a stream: a table once every rank runs and its row is in, then every :data:`TEXT_EVERY` s, and
    the last look (when there were ranks: a job that never started them has its error to say)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.since = time.monotonic()  # the last table, else the start
        self.first = True

    def show(self, snapshot: Snapshot, last: bool) -> None:
        now = time.monotonic()
        due = now - self.since >= TEXT_EVERY[self.tty]
        if last:
            due = bool(snapshot.ranks)
        elif self.first:  # once every rank runs, with its rates
            due = due or (snapshot.whole and bool(snapshot.ranks)
                          and all(r.state != "starting" for r in snapshot.ranks))
        if not due:
            return
        width = shutil.get_terminal_size().columns if self.tty else 1 << 16
        print(live_table.table(snapshot, width), file=self.stream, flush=True)
        self.since, self.first = now, False


def screen() -> Screen:
    """A :class:`Cell` in a Jupyter kernel (IPython's shell has a kernel: a terminal IPython has none), else stderr."""
    ipython = sys.modules.get("IPython")  # never imported here: a script that did not has no display
    shell = ipython.get_ipython() if ipython is not None else None
    return Cell() if getattr(shell, "kernel", None) is not None else Text(sys.stderr)


@contextlib.contextmanager
def showing(live: LiveView, on: bool) -> Iterator[None]:
    """While the block runs (the job), its table on :func:`screen`, and the last look when it ends; nothing if not
    ``on``."""
    if not on:
        yield
        return
    shown = _Showing(live, screen())
    try:
        yield
    finally:
        shown.stop()


class _Showing:
    """The thread that looks once a second, and the last look, which nothing shown after may hide."""

    def __init__(self, live: LiveView, on: Screen) -> None:
        self.live, self.screen = live, on
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ended = self._warned = False
        self._show(live.snapshot, last=False)  # from the caller's thread: a cell's display is made in the cell
        self._thread = threading.Thread(target=self._run, name="mpddp-live-display", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(EVERY):
            self._show(self.live.snapshot, last=False)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(STOP_WAIT)
        self._show(lambda: self.live.snapshot(ask=False), last=True)

    def _show(self, look: Callable[[], Snapshot], last: bool) -> None:
        try:
            snapshot = look()
            with self._lock:
                if self._ended:
                    return
                self._ended = last
                self.screen.show(snapshot, last)
        except Exception as e:  # noqa: BLE001 - a look that fails must not reach the job
            if not self._warned:
                logger.warning("mpddp: the live table failed (%s: %s); the job goes on", type(e).__name__, e)
            self._warned = True
