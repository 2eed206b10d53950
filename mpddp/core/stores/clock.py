"""The time that the waiting loops of core/nodes and core/stores read, and how they wait: the machine's
(:data:`MACHINE`), or one that a test injects, which runs a wait of minutes in microseconds (tests/clock.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple


class Clock(NamedTuple):
    now: Callable[[], float]  # seconds, monotonic
    sleep: Callable[[float], None]


MACHINE = Clock(time.monotonic, time.sleep)
