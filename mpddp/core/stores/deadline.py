"""A call to a store that keeps its deadline against a host that went silent or froze.

Owns: :func:`within`, which runs a call on a thread of its own and stops waiting for it at a deadline, and
:data:`SILENT`, how long a store's host may leave one call unanswered. Why a thread: torch 2.13's TCPStore client
ignores its own timeout against a host that is frozen (SIGSTOP, a paused VM) or cut off (no RST, no FIN); measured
here, an ``add`` with a 2 s timeout waited 15 s on a frozen host and returned only at the thaw, and on a cut link TCP
gives up after many minutes. Its socket is not ours to give ``TCP_USER_TIMEOUT``. A call that missed its deadline
leaves its thread blocked in torch's client (a daemon thread; it holds no lock of ours): the caller must never use
that client again (core/stores/c10d_client.py, core/nodes/etcd_keys.py drop it). Leaves what a silent host means to
them.
"""

from __future__ import annotations

import threading
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
    done = threading.Event()
    outcome: list[Any] = []  # [True, value] or [False, exception]

    def run() -> None:
        try:
            outcome.extend((True, call()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
            outcome.extend((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="mpddp-store-call", daemon=True).start()
    if not done.wait(seconds):
        raise Silent(f"no answer within {seconds:g} s")
    ok, result = outcome
    if not ok:
        raise result
    return result  # type: ignore[no-any-return]
