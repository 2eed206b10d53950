"""What a launcher runs, as every launcher of one job must run it: its fingerprint.

Owns: :class:`Fingerprint` (the job's script or function, a script's arguments, and ``--nprocs``), its text as it
crosses from launcher to launcher through a store, what two of them differ in, in words, and the one line that
refuses a launcher of another job. A script is its file name (or ``-m`` module) and its arguments, as the command
line gives them; a function is its module and name: its arguments are Python objects that may differ from node to
node by design (mpddp's trainer passes each launcher's own token; a user, a node's own data path), so they are not
compared. Leaves writing and comparing it to core/nodes/etcd_identity.py (etcd: with the job's incarnation) and
core/rank/worker.py's roll call (every round's store: node 0's fingerprint stands).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SHOWN = 200  # characters of a job's text a line shows; past it, the rest is elided (the whole text is compared)


def script_job(target: str, argv: tuple[str, ...] | list[str], is_module: bool) -> str:
    """``mpddp run``'s job: the script's file name (not its folder: each machine may keep it elsewhere) or
    ``-m`` module, then its arguments."""
    head = ["-m", target] if is_module else [os.path.basename(os.path.normpath(target))]
    return shlex.join([*head, *argv])


def call_job(fn: Callable[..., Any]) -> str:
    """``launch(fn)``'s job: ``fn``'s module and qualified name (an object that is called: its type's)."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


@dataclass(frozen=True)
class Fingerprint:
    """What a launcher runs: ``job`` (:func:`script_job`, :func:`call_job`) with ``nprocs`` ranks a node."""

    job: str
    nprocs: int

    def encode(self) -> str:
        return json.dumps({"job": self.job, "nprocs": self.nprocs})

    @classmethod
    def decode(cls, text: str | bytes | None) -> Fingerprint | None:
        """One read from a store; None when absent or not one (written by an mpddp that wrote none: not compared)."""
        try:
            found = json.loads(text or "null")
            job, nprocs = found["job"], found["nprocs"]
        except (ValueError, TypeError, KeyError):
            return None
        return cls(job, nprocs) if isinstance(job, str) and isinstance(nprocs, int) else None

    def differs(self, standing: Fingerprint) -> str | None:
        """What this launcher's job differs in from the ``standing`` one's, in words; None: the same job."""
        said = []
        if self.job != standing.job:
            said.append(f"it runs `{_short(standing.job)}`, this launcher `{_short(self.job)}`")
        if self.nprocs != standing.nprocs:
            said.append(f"its nodes run --nprocs {standing.nprocs}, this launcher --nprocs {self.nprocs}")
        return "; ".join(said) or None


def refusal(job: str, difference: str, fix: str) -> str:
    """The line that refuses a launcher of another job than ``job`` (the job's id, in words)."""
    return (f"{job} is another job's: {difference}; {fix}, or start this launcher with that job's script, "
            "arguments and --nprocs")


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "…"
