"""A call to a store that keeps its deadline against a host that went silent or froze.

Owns: :func:`within`, which runs a call on a thread of its own and stops waiting for it at a deadline;
:func:`answered`, the same for a call of many store operations (the deadline is each operation's, longer for one on
many keys: :data:`PER_KEY`); and :data:`SILENT`, how long a store's host may leave one operation unanswered. Why a
thread: torch 2.13's TCPStore client ignores its own timeout against a host that is frozen (SIGSTOP, a paused VM) or
cut off (no RST, no FIN); measured here, an ``add`` with a 2 s timeout still waited 15 s later on a frozen host, and
returned only at the thaw, and on a cut link TCP gives up after many minutes. Its socket is not ours to give
``TCP_USER_TIMEOUT``. A call that missed its deadline leaves its thread blocked in torch's client (a daemon thread;
it holds no lock of ours): the caller must never use that client again (core/stores/c10d_client.py and
core/nodes/etcd_keys.py drop it). Leaves what a silent host means to them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Seconds a store's host may leave one call unanswered before it counts as silent. A call takes milliseconds, on a
# starved machine too (measured: an add every 0.25 s for 30 s, its server and client each in a session of their own
# beside busy processes on 2 cores: 5 ms at most beside 8, 12 ms beside 20); the caller's own thread may wait out a
# stretch of another thread's GIL (3.4 s at most, measured beside 20, during a first import of torch, which no round
# watch overlaps).
SILENT = 5.0


class Silent(TimeoutError):
    """The call did not return within its deadline: its host is silent (cut off, frozen, or its machine gone)."""


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``'s value, or its exception, if it returns within ``seconds``; else :class:`Silent`."""
    return _run(seconds, call, None)


def answered(seconds: float, op: Callable[[Any], T], store: Any) -> T:
    """``op(store)``'s value, or its exception, so long as the store answers each of its operations within
    ``seconds``: an op of many operations (a beat read one key a node, 100,000 nodes) takes as long as they take,
    and one operation left unanswered for ``seconds`` is :class:`Silent`."""
    answers = _Answers(store)
    return _run(seconds, lambda: op(answers), answers)


# Seconds an operation on many keys is given more, a key (a check or a read of every node's beat): measured, a check of
# 100,000 keys took 2.9 s on a quiet 2-core machine and 12.8 s beside 12 busy processes (0.13 ms a key); 1 ms a key
# keeps a margin of about 8 over that, and a beat's operations (a key or two) stay at SILENT.
PER_KEY = 0.001


class _Answers:
    """A store whose every operation, once answered, says when (:func:`answered`'s clock), and, while it runs, how
    much longer than the deadline its keys may take (``extra``)."""

    def __init__(self, store: Any) -> None:
        self._store, self.last, self.extra = store, time.monotonic(), 0.0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if not callable(found):
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.extra = PER_KEY * sum(len(a) for a in args if isinstance(a, (list, tuple)))
            try:
                return found(*args, **kwargs)
            finally:
                self.last, self.extra = time.monotonic(), 0.0

        return timed

    def deadline(self, seconds: float) -> float:
        return self.last + seconds + self.extra


def _run(seconds: float, call: Callable[[], T], answers: _Answers | None) -> T:
    done = threading.Event()
    outcome: list[Any] = []  # [True, value] or [False, exception]

    def run() -> None:
        try:
            outcome.extend((True, call()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
            outcome.extend((False, e))
        finally:
            done.set()

    start = time.monotonic()
    threading.Thread(target=run, name="mpddp-store-call", daemon=True).start()

    def deadline() -> float:
        return answers.deadline(seconds) if answers is not None else start + seconds

    while not done.wait(max(0.0, deadline() - time.monotonic())):
        if time.monotonic() >= deadline():
            raise Silent(f"no answer within {seconds:g} s")
    ok, result = outcome
    if not ok:
        raise result
    return result  # type: ignore[no-any-return]
