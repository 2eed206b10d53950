"""In each rank: torch's flight recorder, turned on and read while the rank runs.

Owns: turning the flight recorder on (``TORCH_FR_BUFFER_SIZE``, unless the user set it or its older NCCL name) in
the ranks' environment, and the reader thread in each rank that sends the launcher every collective the rank entered
since its last report and how far each process group completed (:class:`~mpddp.core.wire.protocol.Collectives`),
for core/launcher/board.py to line up.

Why the flight recorder: it is PyTorch's own record of the collectives each rank entered (DDP's bucket all_reduces
too), numbered per process group alike on every rank, so "which rank did not arrive at #N" and "did they call the
same thing at #N" are bookkeeping, not guesses from stacks. Measured (torch 2.13, CPU, gloo): reading its entries
costs about 11 µs per entry kept, its status about 10 µs in all. So the buffer is small (:data:`BUFFER`), the
entries are read only when the status changed, and no more often than keeps the reader under 0.5 % of a core.
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from ..wire.protocol import Call, Collectives, Lane

ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the recorder's size; the second is its older name
BUFFER = 64  # entries kept per rank: 0.5 s of 128 collectives/s; more are sampled; reading costs grow with it
_INTERVAL = 0.5  # seconds between two reads, at least (a mismatch is told within about this)
_DUTY = 0.005  # the reader's share of one core, at most ...
_REPORTS_PER_TIMEOUT = 4  # ... unless a read then comes later than a quarter of the watchdog's --timeout


def env_defaults(env: dict[str, str]) -> None:
    """Turn the flight recorder on in the ranks' environment, unless the user chose its size (0: off).

    NCCL writes the recorder to files (``/tmp/nccl_trace_rank_N``) on a timeout or an error when it is on
    and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` allows: a launch must leave no file behind, and the launcher reports
    the same view itself, so mpddp's recorder comes with that off (a user who sets the size decides both).
    """
    if not any(name in env for name in ENV):
        env["TORCH_FR_BUFFER_SIZE"] = str(BUFFER)
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


# ---- in the rank -----------------------------------------------------------------------------

RUNNING: Reader | None = None  # this rank's reader, once started


class Reader:
    """In a rank: a daemon thread that reads the flight recorder and sends what changed.

    A CUDA build of torch keeps NCCL's collectives in a recorder of their own (``_dump_nccl_trace``),
    apart from the one other backends write to (``_dump_fr_trace``): both are read.
    """

    def __init__(self, dumps: list[Callable[..., bytes]], send: Callable[[Collectives], None],
                 timeout: float = math.inf) -> None:
        self._dumps, self._send = dumps, send
        # the longest wait between two reads: the launcher's watchdog counts a report as progress, and a rank
        # whose collectives move must report within its --timeout (a first read of ~10 ms meant 2 s of wait)
        self._longest = max(_INTERVAL, timeout / _REPORTS_PER_TIMEOUT)
        self._status: object = None
        self._newest: dict[int, int] = {}  # per recorder, the newest record id sent
        # A process group is named the same on every member but numbered (pg_id) by each process; a name set up
        # again (the default group destroyed and made anew) gets a new pg_id, and its numbers start again.
        self._lanes: dict[tuple[int, int], Lane] = {}  # (recorder, pg_id) -> its lane
        self._generations: dict[tuple[str, str], int] = {}  # (name, backend) -> generations seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpddp-collectives", daemon=True)
        self.busy = 0.0  # seconds spent reading and sending: its cost, which scripts/bench_train.py reports
        self.since = time.perf_counter()

    @classmethod
    def start(cls, send: Callable[[Collectives], None], environ: dict[str, str],
              timeout: float = math.inf) -> Reader | None:
        """A running reader, or None where this torch has no flight recorder or the user turned it off."""
        import torch

        c10d = torch._C._distributed_c10d
        dumps = [f for name in ("_dump_nccl_trace", "_dump_fr_trace") if (f := getattr(c10d, name, None)) is not None]
        size = next((environ[name] for name in ENV if name in environ), "0")
        if not dumps or not size.strip().isdigit() or int(size) <= 0:
            return None
        global RUNNING
        reader = RUNNING = cls(dumps, send, timeout)
        reader._thread.start()
        return reader

    def stop(self) -> None:
        """Stop reading, after a last read: a rank that ends within one interval still reports its collectives."""
        self._stop.set()
        self._thread.join(1.0)
        try:
            if (report := self.read()) is not None:
                self._send(report)
        except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError):
            pass  # the channel is closed: the launcher stopped listening

    def _run(self) -> None:
        wait = _INTERVAL
        while not self._stop.wait(wait):
            started = time.perf_counter()
            try:
                report = self.read()
                if report is not None:
                    self._send(report)
            except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError):
                return  # the channel closed (the rank ends), or this torch's recorder differs: stop quietly
            took = time.perf_counter() - started
            self.busy += took
            wait = min(max(_INTERVAL, took / _DUTY), self._longest)

    def read(self) -> Collectives | None:
        """What changed since the last read, or None: the status first (cheap), the entries only if it moved."""
        statuses = [self._load(dump, includeCollectives=False).get("pg_status") or {} for dump in self._dumps]
        if statuses == self._status:
            return None
        self._status = statuses
        calls: list[Call] = []
        completed: list[tuple[Lane, int]] = []
        for i, (dump, status) in enumerate(zip(self._dumps, statuses)):
            if not status:
                continue
            entries = sorted(self._load(dump, includeCollectives=True).get("entries", ()),
                             key=lambda e: e.get("record_id", 0))
            for entry in entries:
                if entry.get("is_p2p") or (entry.get("collective_seq_id") or 0) <= 0:
                    continue  # point-to-point ops are numbered apart, and lined up by nobody
                lane = self._lane(i, entry)
                if entry.get("record_id", 0) > self._newest.get(i, -1):  # only what is new becomes a Call
                    calls.append(_call(entry, lane))
            if entries:
                self._newest[i] = max(self._newest.get(i, -1), max(e.get("record_id", 0) for e in entries))
            # the status is keyed by pg_id, and counts every op of the group (op_id), point-to-point ones too
            completed += [(known, int(st.get("last_completed_collective", -1))) for pg, st in status.items()
                          if (known := self._lanes.get((i, _int(pg)))) is not None]
        return Collectives(tuple(calls), tuple(completed))

    def _lane(self, recorder: int, entry: dict[str, Any]) -> Lane:
        key = (recorder, int(entry.get("pg_id", -1)))
        if key not in self._lanes:
            name = str((entry.get("process_group") or ("?",))[0])
            backend = str(entry.get("profiling_name", "?")).rpartition(":")[0]
            generation = self._generations.get((name, backend), -1) + 1
            self._generations[(name, backend)] = generation
            self._lanes[key] = (name, backend, generation)
        return self._lanes[key]

    @staticmethod
    def _load(dump: Callable[..., bytes], **what: bool) -> dict[str, Any]:
        loaded = pickle.loads(dump(includeStackTraces=False, onlyActive=False, **what))
        return loaded if isinstance(loaded, dict) else {}


def _int(text: object) -> int:
    try:
        return int(str(text))
    except ValueError:
        return -1


def _call(entry: dict[str, Any], lane: Lane) -> Call:
    """One flight-recorder entry as a :class:`Call`."""
    return Call(group=lane[0], seq=int(entry.get("collective_seq_id") or 0),
                op=str(entry.get("profiling_name", "?")).rpartition(":")[2],
                sizes=tuple(tuple(int(n) for n in s) for s in entry.get("input_sizes") or ()),
                dtypes=tuple(str(d) for d in entry.get("input_dtypes") or ()),
                entered=int(entry.get("time_created_ns") or 0), backend=lane[1], generation=lane[2],
                op_id=int(entry.get("op_id") or 0))
