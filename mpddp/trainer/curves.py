"""A run's curves: TensorBoard event files while it trains, ``curves.png`` drawn from its metrics file.

Owns: reading a run's ``metrics.jsonl`` as the curves see it (a running
run's torn last line skipped; the epochs a resume trains again replace the
earlier ones), drawing ``curves.png`` (train and test loss, test accuracy,
per epoch, on matplotlib's Agg canvas: no display, and no pyplot, whose
global state a notebook's own plots use), and rank 0's TensorBoard event
files in ``<run dir>/tb``. matplotlib and tensorboard are optional extras:
whether each is there is decided here only, by the ImportError of its
import. Leaves the per-epoch record and the metrics file to trainer/loop.py
and trainer/output.py, when to draw to trainer/output.py, and
``mpddp plot`` to cli/plot.py. Imports neither torch nor matplotlib at the
top, so that ``mpddp plot`` starts fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .config import METRICS_FILE

CURVES_FILE = "curves.png"
EVENTS_DIR = "tb"  # tensorboard --logdir <run dir>/tb
FIGSIZE, DPI = (10.0, 4.0), 100  # curves.png is 1000 × 400 pixels
INSTALL = "pip install 'mpddp[train]'"  # the extra with matplotlib
# TensorBoard tag -> the metrics record's key: one point per epoch, at the global step
SCALARS = {"loss/train": "train_loss", "loss/test": "test_loss", "accuracy/test": "test_accuracy", "lr": "lr",
           "samples_per_s": "samples_per_s"}
_NEEDED = ("epoch", "train_loss", "test_loss", "test_accuracy")
_FIX = "pass the directory of an mpddp train run (runs/<task>/<date-time>, or its --run-dir)"


@dataclass(frozen=True)
class Curves:
    """What curves.png shows, one entry per epoch in order; accuracy is None where the task has none."""

    epochs: list[int]
    train_loss: list[float]
    test_loss: list[float]
    test_accuracy: list[float | None]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file in order, with the fields the curves need.

    The last line of a running run may be in the middle of its write: a
    record not yet ended by its newline that does not parse is left for the
    next redraw. Any other line that is not such a record is an error.
    """
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist: {_FIX} that has finished an epoch")
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    tail = lines.pop()  # after the last newline: "" once the writer is done with it
    records = [_record(line, path, n) for n, line in enumerate(lines, 1) if line.strip()]
    if tail.strip() and not _torn(tail):
        records.append(_record(tail, path, len(lines) + 1))
    return records


def _torn(line: str) -> bool:
    """The beginning of a record whose write has not ended (the next redraw has it whole)."""
    if not line.lstrip().startswith("{"):
        return False  # not a record's beginning: damaged, and _record says so
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return True
    return False


def _record(line: str, path: Path, n: int) -> dict[str, Any]:
    where = f"{str(path)!r} line {n}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not JSON ({e.msg}): {_FIX}, or delete the damaged line") from e
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not a JSON object: {_FIX}")
    missing = [key for key in _NEEDED if key not in record]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}: it is not an mpddp train metrics file; {_FIX}")
    bad = [key for key in _NEEDED if not _fits(key, record[key])]
    if bad:
        wanted = "a whole number >= 1" if bad[0] == "epoch" else "a number"
        raise ConfigError(f"{where} has {bad[0]}={record[bad[0]]!r}, not {wanted}: {_FIX}, or delete the damaged line")
    return record


def _fits(key: str, value: object) -> bool:
    if key == "epoch":
        return type(value) is int and value >= 1
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number or (key == "test_accuracy" and value is None)


def history(records: list[dict[str, Any]]) -> Curves:
    """The epochs that led to the run's newest state.

    A run resumed from an older checkpoint trains some epochs again and
    appends them: an epoch number at or below one already seen replaces
    that epoch and every later one.
    """
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["epoch"] >= record["epoch"]:
            kept.pop()
        kept.append(record)
    return Curves(epochs=[r["epoch"] for r in kept], train_loss=[float(r["train_loss"]) for r in kept],
                  test_loss=[float(r["test_loss"]) for r in kept],
                  test_accuracy=[None if r["test_accuracy"] is None else float(r["test_accuracy"]) for r in kept])


def redraw(run_dir: Path) -> Path | None:
    """Draw ``<run_dir>/curves.png`` from the run's metrics file; None if matplotlib is not installed.

    Works on a run that is still training. A missing run directory, a
    missing or damaged metrics file, or one without a whole epoch yet, is a
    ConfigError naming the path and the fix.
    """
    if not run_dir.is_dir():
        state = "is not a directory" if run_dir.exists() else "does not exist"
        raise ConfigError(f"run directory {str(run_dir)!r} {state}: {_FIX}")
    metrics = run_dir / METRICS_FILE
    records = read_metrics(metrics)
    if not records:
        raise ConfigError(f"{str(metrics)!r} holds no finished epoch yet: try again once the run's first epoch "
                          "has ended")
    return draw(history(records), run_dir / CURVES_FILE, title=str(run_dir))


def draw(curves: Curves, path: Path, title: str = "") -> Path | None:
    """Write ``curves`` as a PNG of :data:`FIGSIZE` × :data:`DPI` pixels; None if matplotlib is not installed."""
    fig = figure(curves, title)
    if fig is None:
        return None
    # Through a temporary file: a viewer, or `mpddp plot` while the run ends, sees the old picture or the new one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def figure(curves: Curves, title: str = "") -> Any:
    """The two panels (loss, accuracy) against whole epochs, on an Agg canvas; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:  # the extra is not installed: no picture, and the caller says what to install
        return None
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(curves.epochs, curves.train_loss, "o-", label="train loss")
    loss_ax.plot(curves.epochs, curves.test_loss, "s--", label="test loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    scored = [(e, 100 * a) for e, a in zip(curves.epochs, curves.test_accuracy) if a is not None]
    if scored:
        acc_ax.plot([e for e, _ in scored], [a for _, a in scored], "o-", color="tab:green")
    else:
        acc_ax.text(0.5, 0.5, "no accuracy: the task's outputs are not classes", ha="center",
                    transform=acc_ax.transAxes)
    acc_ax.set_ylabel("test accuracy (%)")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("epoch")
        # min_n_ticks=1: one epoch is one tick, 1 (with the default of 2 a span under 2 falls back to 0.945, 0.960, …)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    # Fixed margins, not layout="constrained": its solver was 0.08 s of a 0.14 s drawing (measured), which a
    # training run's launcher pays on the way to its exit; ticks of up to six characters fit in these.
    fig.subplots_adjust(left=0.075, right=0.985, bottom=0.13, top=0.88, wspace=0.22)
    return fig


class TensorBoard:
    """Rank 0's TensorBoard event files in ``<run dir>/tb``: every :data:`SCALARS` curve, a point per epoch.

    ``since_step`` is the global step this run starts (or resumes) from:
    what an earlier attempt logged after it is hidden in TensorBoard
    (``purge_step``), as the epochs trained again replace it in curves.png.
    Without tensorboard installed nothing is written.
    """

    def __init__(self, run_dir: Path, since_step: int) -> None:
        self.log_dir, self.since_step = run_dir / EVENTS_DIR, since_step
        self.writer: Any = None
        self.installed = True

    def add(self, record: dict[str, Any]) -> None:
        """Log one epoch's record at its global step, and flush: a running run shows epoch by epoch."""
        if self.writer is None and self.installed:
            # Opened at the first epoch's end, not before: by then the rank has forked its DataLoader workers
            # (kept for the whole run), and a process must not fork while the writer's thread runs.
            self.writer = _summary_writer(self.log_dir, self.since_step + 1)
            self.installed = self.writer is not None
        if self.writer is None:
            return
        for tag, key in SCALARS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], global_step=record["step"])
        self.writer.flush()  # also keeps the epochs of a run killed later

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def last_point(run_dir: Path, record: dict[str, Any]) -> None:
    """Log ``record``, a run's last epoch, for the launcher that rank 0 handed it to: a writer of its own (a
    file of its own in ``<run dir>/tb``, which TensorBoard reads with rank 0's), hiding any point at or after
    its step that an earlier run logged (a run resumed at its last epoch, or trained to it twice). Where rank 0
    logged the point too, in a file of this run, either file's purge leaves the point once, in either order."""
    tensorboard = TensorBoard(run_dir, since_step=record["step"] - 1)
    tensorboard.add(record)
    tensorboard.close()


def _summary_writer(log_dir: Path, purge_step: int) -> _EventFile | None:
    try:
        return _EventFile(log_dir, purge_step)
    except ImportError:  # the tensorboard extra is not installed: no event files, and no failure
        return None


class _EventFile:
    """One event file in ``log_dir``, written by the tensorboard package's own writer.

    torch's ``SummaryWriter`` is a layer over the same writer, and importing
    it imports torch: about 1.1 s of a launcher's CPU that would compete
    with its forkserver's import and its ranks (measured), for a point per
    epoch. ``purge_step``: TensorBoard's rule for a restarted run, a START
    event at that step hides whatever another file logged at or after it.
    """

    def __init__(self, log_dir: Path, purge_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(log_dir))  # the file, and its first event: the format's version
        self._writer.add_event(Event(wall_time=time.time(), step=purge_step,
                                     session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(wall_time=time.time(), step=global_step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def prefetch() -> threading.Thread:
    """Import matplotlib's canvas and TensorBoard's writer in a thread of this process, for a :func:`draw` and
    a :func:`last_point` later on.

    The launcher of ``mpddp train`` calls it as it launches: it imports no
    torch, so these imports (about 0.5 s, measured) are done on the core the
    forkserver's import of torch leaves free, before the ranks start, and the
    drawing costs only the drawing. Never in a process that forks while the
    thread may run: the child could inherit an import lock held by it. The
    caller joins the thread before it returns: one left importing after a
    quick failure (bad input) created loggers while the caller's process went
    on, and pytest's log capture, which iterates the loggers, failed on it.
    """
    thread = threading.Thread(target=_import_both, name="mpddp-curves-import", daemon=True)
    thread.start()
    return thread


def _import_both() -> None:
    with contextlib.suppress(ImportError):  # not installed: draw() says so, later
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
        from matplotlib.ticker import MaxNLocator  # noqa: F401
    with contextlib.suppress(ImportError):  # not installed: no event files
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
