"""A run's curves: TensorBoard event files, curves.png, `mpddp plot`, and runs without the extras.

One real `mpddp train` (digits, 3 epochs, 2 ranks) is shared by the tests
that read what it wrote; the rest read files written here.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_task import TINY

from mpddp.errors import ConfigError
from mpddp.trainer import curves
from mpddp.trainer.config import TrainConfig
from mpddp.trainer.loop import Trainer
from mpddp.trainer.output import EarlyCurves, finish_curves
from mpddp.trainer.prepare import resolve

from runs import Run

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"checkpoint: (\S+)  metrics: (\S+)  curves: (.+)")
WIDTH, HEIGHT = 1000, 400  # curves.FIGSIZE × curves.DPI


def record(epoch: int, loss: float = 1.0, accuracy: float | None = 0.5) -> dict:
    return {"epoch": epoch, "step": 10 * epoch, "train_loss": loss, "test_loss": loss / 2, "test_accuracy": accuracy,
            "lr": 0.002, "samples_per_s": 1000.0 + epoch}


def lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def without(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make ``import package`` (and its submodules) raise ImportError in this process, as if not installed."""
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in packages):
            monkeypatch.setitem(sys.modules, name, None)
    for p in packages:
        monkeypatch.setitem(sys.modules, p, None)


# ---- the metrics file as the curves read it --------------------------------------------------------------------


def test_a_torn_last_line_is_left_for_the_next_redraw(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = lines(record(1), record(2))
    path.write_text(whole + json.dumps(record(3))[:40])  # epoch 3's write has not ended
    assert [r["epoch"] for r in curves.read_metrics(path)] == [1, 2]
    path.write_text(whole + json.dumps(record(3)))  # whole, its newline not yet written
    assert [r["epoch"] for r in curves.read_metrics(path)] == [1, 2, 3]
    path.write_text(whole + "\n")  # a blank line is no record
    assert [r["epoch"] for r in curves.read_metrics(path)] == [1, 2]


@pytest.mark.parametrize("content, message", [
    ("not json\n" + lines(record(1)), r"metrics.jsonl' line 1 is not JSON \(Expecting value\): pass the directory "
                                      r"of an mpddp train run .*, or delete the damaged line"),
    (lines(record(1)) + "{\"epoch\": 2, \"train_l\n" + lines(record(3)), "line 2 is not JSON"),  # torn, then resumed
    (lines(record(1)) + "\x00\x01 garbage", "line 2 is not JSON"),  # no record's beginning: not being written
    ("[1, 2]\n", "line 1 is not a JSON object"),
    (json.dumps({"loss": 1.0}) + "\n", "line 1 has no epoch, train_loss, test_loss, test_accuracy: it is not an "
                                       "mpddp train metrics file"),
    (lines({**record(1), "train_loss": "low"}), "line 1 has train_loss='low', not a number"),
    (lines({**record(1), "epoch": 0}), "line 1 has epoch=0, not a whole number >= 1"),
    (lines({**record(1), "test_loss": None}), "line 1 has test_loss=None, not a number"),
])
def test_a_damaged_metrics_file_is_a_config_error_naming_the_line(tmp_path, content, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        curves.read_metrics(path)


@pytest.mark.parametrize("epochs, shown", [
    ([1, 2, 3], [1, 2, 3]),
    ([1, 2, 3, 4, 3, 4, 5], [1, 2, 3, 4, 5]),  # resumed from epoch 2's checkpoint: 3 and 4 trained again
    ([1, 2, 2, 3], [1, 2, 3]),  # killed after epoch 2's line, before its checkpoint: epoch 2 again
    ([1, 2, 3, 1, 2], [1, 2]),  # started over in the same directory
])
def test_epochs_trained_again_replace_the_earlier_ones(epochs, shown):
    records = [record(e, loss=float(i)) for i, e in enumerate(epochs)]
    drawn = curves.history(records)
    assert drawn.epochs == shown
    assert drawn.train_loss == [float(max(i for i, e in enumerate(epochs) if e == s)) for s in shown]


@pytest.mark.parametrize("epochs", [1, 2, 3, 40])
def test_the_x_axis_shows_whole_epochs_only(epochs):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'mpddp[train]'")
    fig = curves.figure(curves.history([record(e, 1.0 / e, 0.5) for e in range(1, epochs + 1)]))
    fig.canvas.draw()  # ticks are placed when drawn
    for ax in fig.axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown and all(float(t).is_integer() for t in shown), (epochs, shown)
        assert 1 in shown or epochs > 1


def test_curves_png_has_the_figure_size_with_and_without_accuracy(tmp_path):
    for accuracy in (0.9, None):
        path = curves.draw(curves.history([record(1, 2.0, accuracy), record(2, 1.0, accuracy)]),
                           tmp_path / "curves.png", title="run")
        assert path == tmp_path / "curves.png"
        assert png_size(path) == (curves.FIGSIZE[0] * curves.DPI, curves.FIGSIZE[1] * curves.DPI) == (WIDTH, HEIGHT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no temporary file left


def test_tensorboard_hides_what_a_resumed_run_trains_again(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'mpddp[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = curves.TensorBoard(tmp_path, since_step=0)
    for epoch in (1, 2, 3):
        first.add(record(epoch, loss=float(epoch)))
    first.close()
    again = curves.TensorBoard(tmp_path, since_step=10)  # resumed from epoch 1's checkpoint (step 10)
    for epoch in (2, 3):
        again.add(record(epoch, loss=10.0 + epoch))
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss/train")] == [(10, 1.0), (20, 12.0), (30, 13.0)]


# ---- without the extras: nothing written, nothing fails ------------------------------------------------------


def test_without_matplotlib_and_tensorboard_a_fit_writes_neither_and_says_what_to_install(tmp_path, monkeypatch):
    without(monkeypatch, "matplotlib", "tensorboard", "torch.utils.tensorboard")
    run_dir = tmp_path / "run"
    result = Trainer(resolve(TrainConfig(task=TINY + ":make_task", epochs=2, batch_size=8,
                                         run_dir=str(run_dir)))).fit()
    assert result.curves is None and result.curves_note == "pip install 'mpddp[train]' to draw them (matplotlib)"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_rank_0_draws_curves_png_unless_its_caller_will(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'mpddp[train]'")
    for draw in (False, True):
        run_dir = tmp_path / f"draw-{draw}"
        result = Trainer(resolve(TrainConfig(task="synthetic", samples=40, features=4, epochs=1,
                                             run_dir=str(run_dir)))).fit(draw=draw)
        assert result.rank == 0 and result.curves_note == ""
        assert result.curves == (str(run_dir / "curves.png") if draw else None)
        assert (run_dir / "curves.png").exists() is draw


def test_rank_0_hands_the_last_epochs_tensorboard_point_to_its_caller(tmp_path):
    """fit(draw=False): its caller logs the last epoch's point (output.finish_curves, as train()'s launcher
    does), and rank 0 leaves it to the caller when it is the run's first: a one-epoch run's rank 0 opens no
    writer at all. Every record's point is read back once, whichever file TensorBoard reads first."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'mpddp[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for epochs in (1, 3):
        run_dir = tmp_path / f"epochs-{epochs}"
        result = Trainer(resolve(TrainConfig(task="synthetic", samples=40, features=4, epochs=epochs,
                                             run_dir=str(run_dir)))).fit(draw=False)
        logged = sorted((run_dir / "tb").glob("events.out.tfevents.*")) if (run_dir / "tb").exists() else []
        assert len(logged) == (0 if epochs == 1 else 1), logged
        finish_curves(run_dir, result.global_step)
        # two files made in the same second sort by pid: the launcher's may come first (it lost its point to
        # rank 0's purge beside a second suite); named to sort first here, it must keep it
        for made in set((run_dir / "tb").glob("events.out.tfevents.*")) - set(logged):
            made.rename(made.with_name("events.out.tfevents.0000000000.first"))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = EventAccumulator(str(run_dir / "tb"))
        events.Reload()
        assert [(s.step, s.value) for s in events.Scalars("loss/train")] == [
            (r["step"], pytest.approx(r["train_loss"], rel=1e-6)) for r in records]
        finish_curves(run_dir, result.global_step)  # twice (a caller that retries): the point is still one
        events = EventAccumulator(str(run_dir / "tb"))
        events.Reload()
        assert [s.step for s in events.Scalars("loss/train")] == [r["step"] for r in records]


def test_the_launcher_finishes_the_curves_as_soon_as_the_last_epoch_is_written(tmp_path):
    """EarlyCurves: the last epoch's record appended, the picture and TensorBoard's point follow at once (while
    the ranks still exit); an earlier record, or one a resumed run's file held before, draws nothing."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'mpddp[train]'")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(lines(record(1), record(2)))  # an earlier run's, already at --epochs 2
    early = EarlyCurves(tmp_path, epochs=3)
    try:
        with metrics.open("a") as f:
            f.write(lines(record(2, loss=5.0)))  # resumed from epoch 1: epoch 2 again, not the last
        time.sleep(0.3)
        assert early.drawn is None and not (tmp_path / "curves.png").exists()
        with metrics.open("a") as f:
            f.write(lines(record(3, loss=3.0)))
        deadline = time.monotonic() + 30
        while early.drawn is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        early.stop()
    assert early.result(30) == (str(tmp_path / "curves.png"), "")
    assert png_size(tmp_path / "curves.png") == (WIDTH, HEIGHT)
    assert early.result(40) is None  # not the run's last step: its launcher finishes the curves itself
    with metrics.open("a") as f:
        f.write(lines(record(3, loss=4.0)))  # trained again after it drew (a restart): drawn anew by the caller
    assert early.result(30) is None


def test_without_matplotlib_mpddp_plot_says_what_to_install(cli, tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(lines(record(1)))
    without(monkeypatch, "matplotlib")
    code, out, err = cli("plot", "run")
    assert (code, out) == (2, "")
    assert err == ("mpddp: error: drawing curves.png needs matplotlib, which is not installed: "
                   "pip install 'mpddp[train]' (or matplotlib)\n")


@pytest.mark.timeout(120)
def test_a_real_run_without_the_extras_succeeds_and_its_summary_says_what_to_install(tmp_path):
    blocked = tmp_path / "blocked"  # first on the path of the launcher and every rank: imports fail as if absent
    for package in ("matplotlib", "tensorboard"):
        (blocked / package).mkdir(parents=True)
        (blocked / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {package!r}'!r}, name={package!r})\n")
    run = Run(["-m", "mpddp", "train", "--dataset", "synthetic", "--samples", "256", "--epochs", "2", "--nprocs", "2",
               "--run-dir", "run"], tmp_path, env={"PYTHONPATH": f"{blocked}{os.pathsep}{REPO}"})
    try:
        assert run.finish(timeout=100) == 0, run.stderr
        run.assert_nothing_left()
    except BaseException:
        run.kill()  # a failed test leaves nothing running either
        raise
    summary = SUMMARY.fullmatch(run.stdout.strip().splitlines()[-1])
    assert summary and summary.group(3) == "pip install 'mpddp[train]' to draw them (matplotlib)", run.stdout
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "metrics.jsonl"]


# ---- one real digits run, read by several tests --------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """`mpddp train --nprocs 2 --epochs 3`: (run directory, its metrics records, its summary line's match)."""
    where = tmp_path_factory.mktemp("digits")
    run = Run(["-m", "mpddp", "train", "--nprocs", "2", "--epochs", "3", "--run-dir", "run"], where,
              env={"PYTHONPATH": str(REPO)})
    try:
        assert run.finish(timeout=150) == 0, run.stderr
        run.assert_nothing_left()
    except BaseException:
        run.kill()  # a failed run leaves nothing running either
        raise
    run_dir = where / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = SUMMARY.fullmatch(run.stdout.strip().splitlines()[-1])
    assert summary, run.stdout
    return run_dir, records, summary


@pytest.mark.timeout(240)
def test_the_summary_line_names_curves_png_drawn_from_the_metrics(digits_run):
    run_dir, records, summary = digits_run
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert run_dir.parent / summary.group(3) == run_dir / "curves.png"
    assert png_size(run_dir / "curves.png") == (WIDTH, HEIGHT)


@pytest.mark.timeout(240)
def test_tensorboard_reads_back_every_logged_value_from_rank_0_only(digits_run):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'mpddp[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records, _ = digits_run
    # rank 0's file (epochs 1 and 2), and its launcher's (epoch 3, handed over: see the test below)
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(curves.SCALARS)
    for tag, key in curves.SCALARS.items():
        logged = [(s.step, s.value) for s in events.Scalars(tag)]
        expected = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records]  # float32 in the event file
        assert logged == expected, tag


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftovers")
def test_mpddp_plot_redraws_curves_png(digits_run):
    run_dir, _, _ = digits_run
    (run_dir / "curves.png").unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plot = subprocess.run([sys.executable, "-m", "mpddp", "plot", "run"], cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=60)
    assert (plot.returncode, plot.stdout, plot.stderr) == (0, "curves: run/curves.png\n", "")
    assert png_size(run_dir / "curves.png") == (WIDTH, HEIGHT)


@pytest.mark.timeout(240)
def test_mpddp_plot_on_a_running_run_draws_its_whole_epochs(digits_run, cli, tmp_path):
    run_dir, _, _ = digits_run
    text = (run_dir / "metrics.jsonl").read_text()
    (tmp_path / "running").mkdir()
    (tmp_path / "running" / "metrics.jsonl").write_text(text[:len(text) - 30])  # epoch 3's line half written
    code, out, err = cli("plot", "running")
    assert (code, out, err) == (0, "curves: running/curves.png\n", "")
    assert png_size(tmp_path / "running" / "curves.png") == (WIDTH, HEIGHT)


# ---- mpddp plot: bad input is one line and exit 2 -------------------------------------------------------------


def test_mpddp_plot_bad_input_is_one_line_naming_the_path_and_the_fix(cli, tmp_path):
    for name, content in (("empty", None), ("started", ""), ("corrupt", "\x89PNG not json\n"),
                          ("foreign", json.dumps({"loss": 0.5}) + "\n")):
        (tmp_path / name).mkdir()
        if content is not None:
            (tmp_path / name / "metrics.jsonl").write_text(content)
    (tmp_path / "afile").write_text("x")
    fix = "pass the directory of an mpddp train run (runs/<task>/<date-time>, or its --run-dir)"
    cases = [
        ("nosuch", f"run directory 'nosuch' does not exist: {fix}"),
        ("afile", f"run directory 'afile' is not a directory: {fix}"),
        ("empty", f"'empty/metrics.jsonl' does not exist: {fix} that has finished an epoch"),
        ("started", "'started/metrics.jsonl' holds no finished epoch yet: try again once the run's first epoch "
                    "has ended"),
        ("corrupt", f"'corrupt/metrics.jsonl' line 1 is not JSON (Expecting value): {fix}, or delete the damaged "
                    "line"),
        ("foreign", "'foreign/metrics.jsonl' line 1 has no epoch, train_loss, test_loss, test_accuracy: it is not "
                    f"an mpddp train metrics file; {fix}"),
    ]
    for run_dir, message in cases:
        code, out, err = cli("plot", run_dir)
        assert (code, out, err) == (2, "", f"mpddp: error: {message}\n"), run_dir
    assert not list(tmp_path.rglob("*.png"))
