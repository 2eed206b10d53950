"""Fault injection for reliability tests: ``--inject-fault KIND:RANK:STEP``.

Owns: parsing the switch and making one rank fail on purpose, on the first attempt only (``ctx.restart == 0``), so
that a restarted group runs clean. Right after optimizer step STEP: ``kill`` (the rank SIGKILLs itself, as the OOM
killer would), ``raise`` (``RuntimeError``), ``hang`` (it sleeps forever; its peers block in the next collective
until the launcher's timeout). While writing step STEP's checkpoint, after the temporary file is complete but before
it is renamed (only rank 0 writes checkpoints, so use RANK 0): ``kill-saving`` (SIGKILL) and ``stall-saving`` (it
sleeps forever, as on a slow disk: a Ctrl-C or the watchdog then finds the temporary file). Where in the loop faults
fire, and the check of RANK against the world's size, are trainer/loop.py's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..errors import ConfigError

KINDS = ("kill", "raise", "hang", "kill-saving", "stall-saving")
SAVING = ("kill-saving", "stall-saving")  # fire inside a checkpoint's write, not after a step


@dataclass(frozen=True)
class Fault:
    """One planned failure: ``kind`` on ``rank`` at global step ``step``."""

    kind: str
    rank: int
    step: int

    def due(self, rank: int, step: int, restart: int, kind: str | None = None) -> bool:
        """True when this rank must fail now (never after a restart)."""
        return restart == 0 and rank == self.rank and step == self.step and (kind is None or kind == self.kind)

    def fire(self) -> None:
        """Fail the way ``kind`` says; returns only for an unknown kind."""
        if self.kind in ("kill", "kill-saving"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "raise":
            raise RuntimeError(f"injected fault: rank {self.rank} raised at step {self.step} (--inject-fault)")
        if self.kind in ("hang", "stall-saving"):
            while True:  # a stuck rank: only the launcher's timeout ends this
                time.sleep(3600)


def parse_fault(spec: str | None) -> Fault | None:
    """``"kill:1:20"`` -> ``Fault("kill", 1, 20)``; None or "" -> None."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit():
        raise ConfigError(f"inject_fault={spec!r} is not KIND:RANK:STEP: KIND is one of {', '.join(KINDS)}, "
                          "RANK and STEP are integers >= 0, e.g. --inject-fault kill:1:20")
    return Fault(parts[0], int(parts[1]), int(parts[2]))


def check_fault_rank(spec: str | None, world_size: int, layout: str) -> None:
    """Refuse a fault on a rank the world does not have: it would never fire, and the test would pass."""
    fault = parse_fault(spec)
    if fault is not None and fault.rank >= world_size:
        raise ConfigError(f"inject_fault={spec!r} names rank {fault.rank}, but the world has {world_size} "
                          f"rank{'s' if world_size > 1 else ''} ({layout}): pass a RANK from 0 to {world_size - 1}")
