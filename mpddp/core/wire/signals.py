"""The signals mpddp itself uses, in one table, the one call that asks Linux for a parent-death signal, and
how the command line's handlers raise in the middle of an import.

Owns: which real-time signal carries what (they must never collide, and glibc keeps the first
real-time signals for itself, which ``SIGRTMIN`` already counts), ``prctl(PR_SET_PDEATHSIG)``, and
:func:`raise_stop`. Leaves what each signal's handler does to the module named beside it. Imports nothing but
the standard library: the forkserver and every process mpddp starts load it before torch.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
from types import FrameType

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
