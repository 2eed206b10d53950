"""The signals mpddp itself uses, in one table, the one call that asks Linux for a parent-death signal, and
how the command line's handlers raise in the middle of an import.

Owns: which real-time signal carries what (they must never collide, and glibc keeps the first
real-time signals for itself, which ``SIGRTMIN`` already counts), ``prctl(PR_SET_PDEATHSIG)``,
:func:`raise_stop`, :class:`Terminated` (a signal told the launcher to stop), :func:`told` (which signal the
ranks are passed, or None for a stop of mpddp's own) and :func:`stops_on` (the signals of
``--signals-to-handle`` caught while a launch runs). Leaves what each signal's handler does to the module named
beside it, and the grace to core/launcher/stop.py. Imports nothing but the standard library: the forkserver and
every process mpddp starts load it before torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

STACK_SIGNAL = signal.SIGRTMIN + 4  # "print your stacks" to a rank (core/wire/stacks.py)
LAUNCHER_GONE = signal.SIGRTMIN + 5  # the forkserver's parent-death signal: its launcher died (core/rank/forkserver.py)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def on_parent_death(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process the moment its parent dies (no-op off Linux/glibc)."""
    prctl(PR_SET_PDEATHSIG, signum)


def prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        pass


def raise_stop(stop: BaseException, signum: int, frame: FrameType | None) -> None:
    """From a signal handler of the launcher's: raise ``stop`` in the main thread, but never inside an import.

    Raised in an import, or in a callback of one (the module lock's weakref), CPython can swallow it ("Exception
    ignored in ...") and leave its import lock held. Measured: a Ctrl-C 1 s into ``mpddp train`` beside a second
    test suite was lost that way; the run trained to its end, then hung. There the signal is sent again, as
    if it came anew, once the main thread has left the import (a thread of its own watches it: no import).
    A second signal while the first waits is raised at once: an import that never ends must not hold it.
    """
    with _HOLD:
        hold = not _held and _importing(frame)
        _held.clear()  # a second one: the first is not sent again
        if hold:
            _held.append(signum)
    if not hold:
        raise stop
    threading.Thread(target=_again_after_import, args=(signum,), name="mpddp-signal-again", daemon=True).start()


_held: list[int] = []  # a signal held back until the main thread leaves its import
_HOLD = threading.RLock()  # the handler can run again inside itself


def _importing(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _again_after_import(signum: int) -> None:
    main = threading.main_thread().ident or 0
    while (frame := sys._current_frames().get(main)) is not None:
        if not _importing(frame):
            with _HOLD:
                if _held:  # not raised by a second signal meanwhile
                    _held.clear()
                    signal.pthread_kill(main, signum)  # its handler again, outside the import (a wait it is in ends)
            return
        time.sleep(0.005)


class Terminated(BaseException):
    """A signal told the launcher to stop (SIGTERM, SIGHUP, one of ``--signals-to-handle``); raised in the main
    thread to tear down. ``signum``: the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def told(cause: BaseException, passed: Sequence[int]) -> int | None:
    """The signal the ranks get when ``cause`` stopped the launcher: the one it was told to stop by, if
    ``passed`` (``--signals-to-handle``) names it, else SIGTERM, as torchrun's agent sends on any other stop.
    None: no one told it to stop (a rank's own failure, a lost store): the ranks get mpddp's fast teardown."""
    if isinstance(cause, KeyboardInterrupt):
        signum: int = signal.SIGINT
    elif isinstance(cause, Terminated):
        signum = cause.signum
    else:
        return None
    return signum if signum in passed else signal.SIGTERM


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise_stop(Terminated(signum), signum, frame)


@contextlib.contextmanager
def stops_on(signums: Sequence[int], says_why: bool = False) -> Iterator[None]:
    """While a launch runs: each of ``signums`` (but SIGINT, a KeyboardInterrupt already) stops it, as
    :class:`Terminated`, so that the ranks get the signal and their grace (core/launcher/attempt.py).

    Why a launch's own: ``launch()`` runs in the user's process, where SIGTERM's default ends the launcher at
    once, and SLURM's SIGUSR1 is the command line's stack dump unless ``--signals-to-handle`` names it. The
    handlers before are back afterwards; a process that the signal would have ended (its default action) still
    ends by it, once its ranks had their grace, unless it ``says_why`` (the command line's: one line, exit 128 +
    the signal). Signals reach the main thread only: elsewhere, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _terminated) for s in signums if s != signal.SIGINT}
    try:
        yield
    except Terminated as e:
        _restore(previous)
        if previous.get(e.signum) is signal.SIG_DFL and not says_why:
            signal.raise_signal(e.signum)  # as it would have, without the launch: the ranks are gone now
        raise
    finally:
        _restore(previous)


def _restore(handlers: Mapping[int, Any]) -> None:
    for s, handler in handlers.items():
        if handler is not None:  # None: a handler set outside Python, which Python cannot set back
            signal.signal(s, handler)
