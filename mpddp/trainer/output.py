"""What the user sees of a training run: progress, one line per epoch, a metrics file, curves.

Owns: rank 0's voice (other ranks stay quiet unless ``verbose``), the tqdm
bar per epoch (only when the launcher says the user's stdout is a terminal
or notebook, ``MPDDP_STDOUT_ISATTY=1``), the per-epoch summary line, the
JSON-lines metrics file (one record per epoch: a run that starts or resumes
at a global step first drops the records after it, see
:func:`keep_records_until`), and when the curves are written: TensorBoard's
points by rank 0 every epoch and ``curves.png`` at the end, or, under the
launcher of :func:`~mpddp.trainer.train`, the last epoch's point and
``curves.png`` by that launcher once the ranks exit (:func:`finish_curves`),
what the run's last line says of them, and what a rank returns
(:class:`TrainResult`). It reads losses at most every
:data:`PROGRESS_INTERVAL` seconds, so the bar costs no GPU sync per step.
Leaves computing the numbers to trainer/loop.py, and the event files and
the drawing to trainer/curves.py. Imports no torch (but for type hints):
the launcher of :func:`~mpddp.trainer.train` imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from . import curves

if TYPE_CHECKING:
    import torch

PROGRESS_INTERVAL = 0.5  # seconds between progress-bar refreshes (and loss.item() syncs)


@dataclass(frozen=True)
class TrainResult:
    """What :func:`~mpddp.trainer.train_worker` returns on every rank."""

    epochs: int
    global_step: int
    train_loss: float
    test_loss: float
    test_accuracy: float | None
    checkpoint: str | None
    metrics: str
    run_dir: str
    curves: str | None = None  # rank 0's curves.png; None: not drawn (other ranks, or see curves_note)
    curves_note: str = ""  # why rank 0 drew none, e.g. what to install
    rank: int = 0  # the global rank that returned it


class Reporter:
    """Prints and records for one rank; only rank 0 (or every rank with ``verbose``) talks."""

    def __init__(self, rank: int, verbose: bool, epochs: int, metrics_path: Path) -> None:
        self.rank, self.epochs, self.metrics_path = rank, epochs, metrics_path
        self.talks = rank == 0 or verbose
        self.bar: Any = None
        self.tensorboard: curves.TensorBoard | None = None
        self.hand_over = False  # the last epoch's TensorBoard point is the caller's (start_run)

    def say(self, line: str) -> None:
        """One line on this rank's stdout (relayed as ``[rank N] line``)."""
        if self.talks:
            print(line, flush=True)

    def start_run(self, global_step: int, hand_over: bool = False) -> None:
        """Training starts, or resumes, at ``global_step``: rank 0 keeps the metrics file's records up to there
        (:func:`keep_records_until`) and TensorBoard's curves from there.

        ``hand_over``: the caller writes the last epoch's point too, with ``curves.png``, once rank 0 has
        appended it to the metrics file (:func:`finish_curves`), and rank 0 leaves it to the caller when it is
        the first point this run logs: tensorboard's import and writer (0.15 s and more, measured) then cost a
        run of one epoch nothing on rank 0's path, where the launcher and every other rank wait for it.
        """
        self.hand_over = hand_over
        if self.rank == 0:
            if dropped := keep_records_until(self.metrics_path, global_step):
                self.say(f"note: {self.metrics_path} held {dropped} record(s) after step {global_step}, where this "
                         "run starts: dropped, the epochs are trained again")
            self.tensorboard = curves.TensorBoard(self.metrics_path.parent, since_step=global_step)

    def end_run(self) -> None:
        """Close TensorBoard's files (also after a failure: every finished epoch is in them)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def draw_curves(self) -> tuple[str | None, str]:
        """Rank 0 draws ``curves.png`` from the metrics file: (its path, "") or (None, why not)."""
        return draw_curves(self.metrics_path.parent) if self.rank == 0 else (None, "")

    def start_epoch(self, epoch: int, total: int, done: int) -> None:
        """Open the epoch's progress bar when stdout reaches a terminal."""
        if not self.talks or os.environ.get("MPDDP_STDOUT_ISATTY") != "1":
            return
        from tqdm import tqdm

        # stdout is the launcher's pipe: size the bar for the user's terminal less the "[rank N] " prefix.
        width = min(100, shutil.get_terminal_size((80, 24)).columns - len(f"[rank {self.rank}] "))
        self.bar = tqdm(total=total, initial=done, file=sys.stdout, ncols=width,
                        desc=f"epoch {epoch + 1}/{self.epochs}",
                        unit="step", leave=False, mininterval=PROGRESS_INTERVAL)

    def step(self, loss: torch.Tensor, rate: float) -> None:
        """One optimizer step done; the loss is read only when the bar is about to redraw."""
        if self.bar is None:
            return
        self.bar.update(1)
        if time.monotonic() - self.bar.last_print_t >= PROGRESS_INTERVAL:
            self.bar.set_postfix_str(f"loss {loss.item():.4f}  {rate:,.0f} samples/s", refresh=False)

    def end_epoch(self, record: dict[str, Any], last: bool = False) -> None:
        """Close the bar, print the summary line, append the record to the metrics file (rank 0), and give
        it to TensorBoard unless it is the run's ``last`` epoch, handed over (:meth:`start_run`), and the first
        this run logs."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        acc = record["test_accuracy"]
        acc_text = "" if acc is None else f"  test acc {100 * acc:6.2f}%"
        self.say(f"epoch {record['epoch']:>3}/{self.epochs}  train loss {record['train_loss']:.4f}  "
                 f"test loss {record['test_loss']:.4f}{acc_text}  {record['samples_per_s']:,.0f} samples/s  "
                 f"elapsed {record['elapsed_s']:.1f}s")
        if self.rank == 0:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        # Handed over only while rank 0's writer is not open (this run's first epoch is its last): a writer open
        # since an earlier epoch makes the point in milliseconds, and its file must hold the point. Two files
        # made in the same second sort by pid, and rank 0's purge (a START at the step it began from) then
        # hid the launcher's point when rank 0's file sorted after it (seen beside a second suite).
        if self.tensorboard is not None and not (last and self.hand_over and self.tensorboard.writer is None):
            self.tensorboard.add(record)


class EarlyCurves:
    """A thread of :func:`~mpddp.trainer.train`'s launcher that finishes the curves (:func:`finish_curves`) as
    soon as rank 0 has appended the run's last epoch to the metrics file, while the ranks save their
    checkpoint and exit: the drawing (about 0.09 s, measured) then overlaps their teardown instead of
    following it. Only where this launcher's own rank 0 writes that file (one node; never under
    ``--start-method fork``: nothing may run in a thread of a process that forks). It looks at the file's
    size every :data:`_LOOK` seconds, and reads the file only when it grew.
    """

    _LOOK = 0.01

    def __init__(self, run_dir: Path, epochs: int) -> None:
        self.run_dir, self.epochs = run_dir, epochs
        self.path = run_dir / curves.METRICS_FILE
        self.drawn: tuple[dict[str, Any], tuple[str | None, str]] | None = None  # the record, what it drew
        self._known = self._records()  # a resumed run's earlier records count for nothing here
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpddp-early-curves", daemon=True)
        self._thread.start()

    def _records(self) -> list[dict[str, Any]]:
        try:
            return curves.read_metrics(self.path)
        except ConfigError:  # none yet, or damaged: draw_curves says so at the end
            return []

    def _watch(self) -> None:
        size = -1
        while not self._stop.wait(self._LOOK):
            try:
                now = self.path.stat().st_size
            except OSError:
                continue
            if now == size:
                continue
            size = now
            with contextlib.suppress(ConfigError):
                # rank 0 may drop some of the earlier records first (a resume): the new last one is none of them
                last = [r for r in curves.read_metrics(self.path)[-1:] if r not in self._known]
                if last and last[0]["epoch"] >= self.epochs and (self.drawn is None or self.drawn[0] != last[0]):
                    self.drawn = (last[0], finish_curves(self.run_dir, last[0]["step"]))

    def stop(self) -> None:
        """No more looks (a drawing under way is finished first)."""
        self._stop.set()
        self._thread.join()

    def result(self, global_step: int) -> tuple[str | None, str] | None:
        """Once stopped: what it drew, if that was the run's last record, at ``global_step``; else None (finish
        the curves now)."""
        if self.drawn is None or self.drawn[0]["step"] != global_step:
            return None
        with contextlib.suppress(ConfigError, IndexError):
            if curves.read_metrics(self.path)[-1] == self.drawn[0]:  # nothing was appended after it
                return self.drawn[1]
        return None


def keep_records_until(path: Path, step: int) -> int:
    """Drop the records of the metrics file ``path`` after global step ``step``; return how many went.

    The run starts (0) or resumes (its checkpoint's step) at ``step``: the
    records after it describe work that is done again, and would be there
    twice. So is a last line cut short by a killed run (the next record
    would be glued to it). The file is rewritten whole (a temporary file,
    then ``os.replace``): a reader, ``mpddp plot`` say, sees the old file or
    the new one. Lines that are not records are kept for curves.py to name.
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return 0
    lines = text.split("\n")
    torn = lines.pop().strip() != ""  # after the last newline: "" unless a write was cut short
    kept = [line for line in lines if not _after(line, step)]
    if len(kept) == len(lines) and not torn:
        return 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(lines) - len(kept) + torn


def _after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and type(record.get("step")) is int and record["step"] > step


def finish_curves(run_dir: Path, global_step: int) -> tuple[str | None, str]:
    """What rank 0 handed over (:meth:`Reporter.start_run`), once the ranks exited: TensorBoard's point of the
    run's last epoch, the record at ``global_step``, then ``curves.png`` (what :func:`draw_curves` returns)."""
    with contextlib.suppress(ConfigError):  # no metrics file: nothing trained, and draw_curves says so
        last = [r for r in curves.read_metrics(run_dir / curves.METRICS_FILE) if r.get("step") == global_step]
        if last:
            curves.last_point(run_dir, last[-1])
    return draw_curves(run_dir)


def draw_curves(run_dir: Path) -> tuple[str | None, str]:
    """Draw ``<run_dir>/curves.png`` from its metrics file: (its path, "") or (None, why not)."""
    try:
        drawn = curves.redraw(run_dir)
    except ConfigError as e:  # no metrics file (nothing trained here) or a damaged one: the run itself went well
        return None, f"not drawn: {e}"
    return (str(drawn), "") if drawn else (None, f"{curves.INSTALL} to draw them (matplotlib)")
