"""Shared helpers of the benchmark scripts: medians, paired ratios, tables, JSON.

Speed claims come only from ratios measured side by side in one run: each
repetition runs every variant once (interleaved, A B A B ...), so a noisy
machine slows all of them alike, and the ratio of a repetition is taken
against the reference measured in that same repetition.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> str:
    """The CPU model and core count, as `lscpu` names them."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{model}, {os.cpu_count()} logical CPUs"


def load() -> float:
    """The 1-minute load average: a figure taken above the core count was measured on a busy machine."""
    import os

    return os.getloadavg()[0]


def wait_for_quiet(busy_percent: float, patience: float) -> float:
    """Wait until the machine's CPUs are at most ``busy_percent`` busy (over one second), at most
    ``patience`` seconds; return the busy share last seen. Between repetitions nothing of the
    benchmark runs, so what is busy then is someone else. ``busy_percent`` >= 100: no wait."""
    import time

    import psutil

    deadline = time.monotonic() + patience
    while True:
        busy = psutil.cpu_percent(interval=1.0)
        if busy <= busy_percent or busy_percent >= 100 or time.monotonic() > deadline:
            return busy


def paired_ratios(values: Sequence[float], reference: Sequence[float]) -> list[float]:
    """value / reference within each repetition."""
    return [v / r for v, r in zip(values, reference) if r > 0]


def summary(values: Sequence[float], reference: Sequence[float] | None = None) -> dict[str, Any]:
    """Median, min, max and (against ``reference``) the median paired ratio and its range."""
    out: dict[str, Any] = {"values": list(values), "median": statistics.median(values),
                           "min": min(values), "max": max(values)}
    if reference is not None:
        ratios = paired_ratios(values, reference)
        out.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios), ratios=ratios)
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        data = {"machine": machine(), "python": sys.version.split()[0], **data}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")


def torch_version() -> str:
    import torch

    return str(torch.__version__)
