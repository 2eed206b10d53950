"""The output relay: every worker line reaches the parent's own streams.

Owns: reading each rank's stdout and stderr pipes on one parent thread,
cutting them into whole lines, prefixing ``[rank N] `` (or not: ``--no-prefix``
prints them as written), writing them to the parent's *current*
``sys.stdout``/``sys.stderr`` (so a Jupyter cell shows them), per-rank log
files, and the last lines of each rank for reports. One thread writes every
line, so two ranks' lines never glue (under torchrun, ranks share one
stream and a partial write of one lands inside another's line); a progress
bar that another rank interrupts is ended first.
Leaves what a worker writes to core/rank/worker.py, and when to stop to
core/launcher/attempt.py.
"""

from __future__ import annotations

import codecs
import collections
import os
import selectors
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_MAX_LINE = 1 << 16  # a "line" this long with no newline is flushed anyway


@dataclass
class _Stream:
    rank: int
    is_err: bool
    shown: bool
    log: IO[str] | None
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""
    drawn: int = 0  # width of the progress line drawn last with \r (0: none)


class Relay:
    """Relay lines from many ranks' pipes until each pipe reaches end of file."""

    def __init__(self, output_ranks: tuple[int, ...] | None, log_dir: str | None, tail: int = 30,
                 prefix: bool = True) -> None:
        self._output_ranks = output_ranks
        self._prefix = prefix
        self._bar: _Stream | None = None  # the stream whose progress line is drawn last, not ended yet
        self._log_dir = Path(log_dir) if log_dir else None
        self._selector = selectors.DefaultSelector()
        self._tails: dict[int, collections.deque[str]] = {}
        self._logs: list[IO[str]] = []
        self._tail = tail
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.received = 0  # bytes read from every rank: output written is progress (core/launcher/watchdog.py)

    def add(self, rank: int, out_fd: int, err_fd: int) -> None:
        """Watch one rank's stdout and stderr read ends (the relay closes them)."""
        log = None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self._log_dir / f"rank{rank}.log", "a", encoding="utf-8")
            self._logs.append(log)
        self._tails[rank] = collections.deque(maxlen=self._tail)
        shown = self._output_ranks is None or rank in self._output_ranks
        for fd, is_err in ((out_fd, False), (err_fd, True)):
            os.set_blocking(fd, False)
            # stderr is always shown: errors must never be filtered away
            self._selector.register(fd, selectors.EVENT_READ, _Stream(rank, is_err, shown or is_err, log))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mpddp-relay", daemon=True)
        self._thread.start()

    def tail(self, rank: int) -> list[str]:
        """The last lines rank ``rank`` wrote (stdout and stderr together)."""
        with self._lock:
            return list(self._tails.get(rank, ()))

    def note(self, rank: int, text: str) -> None:
        """Append mpddp's own ``text`` (a full stack dump) to rank ``rank``'s log file, if there is one."""
        if self._log_dir is not None:
            with open(self._log_dir / f"rank{rank}.log", "a", encoding="utf-8") as log:
                log.write(text.rstrip("\n") + "\n")

    def stop(self, timeout: float = 2.0) -> None:
        """Wait for every pipe's end of file (workers gone), then close all."""
        if self._thread is not None:
            self._thread.join(timeout)
        for key in list(self._selector.get_map().values()):
            self._close(key.fd, key.data)
        self._end_bar(None)  # the launcher's own next line starts a line of its own
        self._selector.close()
        for log in self._logs:
            log.close()

    def _run(self) -> None:
        while self._selector.get_map():
            for key, _ in self._selector.select(timeout=0.5):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                stream: _Stream = key.data
                self.received += len(data)
                if data:
                    self._feed(stream, stream.decoder.decode(data))
                else:
                    self._feed(stream, stream.decoder.decode(b"", final=True))
                    self._close(key.fd, stream)

    def _close(self, fd: int, stream: _Stream) -> None:
        if stream.pending:
            self._emit(stream, stream.pending, "\n")
            stream.pending = ""
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            pass
        os.close(fd)

    def _feed(self, stream: _Stream, text: str) -> None:
        text = stream.pending + text
        start = 0
        for i, ch in enumerate(text):
            if ch == "\n" or (ch == "\r" and text[i + 1 : i + 2] not in ("\n", "")):
                self._emit(stream, text[start:i], ch)
                start = i + 1
        stream.pending = text[start:]
        if stream.pending.endswith("\r") and len(stream.pending) > 1:
            self._emit(stream, stream.pending[:-1], "\r")
            stream.pending = ""
        if len(stream.pending) > _MAX_LINE:
            self._emit(stream, stream.pending, "\n")
            stream.pending = ""

    def _emit(self, stream: _Stream, line: str, end: str) -> None:
        line = line.rstrip("\r")
        if end == "\r" and not line:
            return  # a bare carriage return (tqdm starts with one): nothing to draw
        if end == "\n":
            with self._lock:
                self._tails[stream.rank].append(line)
            if stream.log is not None:
                stream.log.write(line + "\n")
                stream.log.flush()
        if not stream.shown:
            return
        out = sys.stderr if stream.is_err else sys.stdout
        self._end_bar(stream)
        text = f"[rank {stream.rank}] {line}" if self._prefix else line
        self._bar = stream if end == "\r" else None
        if end == "\r":  # a progress bar redraws in place, in terminals and notebooks alike
            text, stream.drawn = "\r" + text.ljust(stream.drawn), len(text)
        elif stream.drawn:  # a whole line after a bar: overwrite the bar, then go on
            text, stream.drawn = "\r" + text.ljust(stream.drawn) + "\n", 0
        else:
            text += "\n"
        try:
            out.write(text)
            out.flush()
        except (ValueError, OSError):
            pass  # the parent's stream was closed: keep draining the pipes

    def _end_bar(self, stream: _Stream | None) -> None:
        """Another stream's progress line is still open: end it, so that ``stream``'s text starts a line."""
        bar = self._bar
        if bar is None or bar is stream:
            return
        bar.drawn, self._bar = 0, None
        try:
            out = sys.stderr if bar.is_err else sys.stdout
            out.write("\n")
            out.flush()
        except (ValueError, OSError):
            pass
