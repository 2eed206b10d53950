"""The error file of torchelastic's ``@record``: where each rank's lies, and what it says.

Owns: each rank's ``TORCHELASTIC_ERROR_FILE`` path, in a directory that
core/launcher/attempt.py creates for one attempt and removes after it (nothing is
left in TMPDIR), and reading a file that
``torch.distributed.elastic.multiprocessing.errors.record`` (or a handler
of the user's) wrote into a plain :class:`ErrorRecord`. A script decorated
with ``@record`` writes the exception as the rank saw it, also where the
worker's own report has no traceback (the script caught it and called
``sys.exit``, or a process it started failed). Leaves the report to
core/launcher/report.py and the worker's environment to core/launcher/plan.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

_MAX_BYTES = 1 << 20  # a traceback is a few KiB; a larger file is not torchelastic's


@dataclass(frozen=True)
class ErrorRecord:
    """What one rank's error file says."""

    message: str  # "ValueError: bad batch", as the rank saw it
    traceback: str | None  # the rank's own formatted traceback ("py_callstack")
    timestamp: int | None  # seconds since the epoch, when the rank wrote it


def path(directory: str, rank: int) -> str:
    """Rank ``rank``'s error file: one per rank, so that two failing ranks never share one."""
    return os.path.join(directory, f"rank{rank}.json")


def read(file: str) -> ErrorRecord | None:
    """The record in ``file``; None when the rank wrote none, or one that cannot be read as torchelastic's.

    Two shapes exist, as torchelastic's agent reads them: ``{"message":
    {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
    from ``@record``, and ``{"message": "...", "timestamp": ...}`` from other
    handlers.
    """
    try:
        with open(file, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        data: Any = json.loads(raw) if len(raw) <= _MAX_BYTES else None
    except (OSError, ValueError):  # none, or half written when the rank was killed
        return None
    if not isinstance(data, dict):
        return None
    body = data.get("message")
    if isinstance(body, str):
        return ErrorRecord(body, None, _seconds(data.get("timestamp")))
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        return None
    extra: Any = body.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    timestamp = extra.get("timestamp") if isinstance(extra, dict) else None
    return ErrorRecord(body["message"], callstack if isinstance(callstack, str) and callstack.strip() else None,
                       _seconds(timestamp))


def _seconds(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
