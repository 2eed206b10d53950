"""mpddp in a real Jupyter kernel: cell-defined functions, live output, results, errors, interrupts.

Each test sends cells to an ipykernel running this environment's Python, through nbclient, as
the notebook front end would. The kernel's environment has no PYTEST_CURRENT_TEST (ipykernel
turns its fd capture off under pytest) and no PYTHONUNBUFFERED (Jupyter does not set it), so
the kernel behaves as under real Jupyter. One kernel serves the CPU tests in file order (the
first one runs a matmul before any launch); the example notebook and the GPU test get fresh ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from helpers import gone

EXAMPLE = Path(__file__).resolve().parent.parent / "scripts" / "ddp_notebook.ipynb"
KERNEL_NAME = "mpddp-test-python"
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Cell:
    """What one executed cell showed."""

    stdout: str
    stderr: str
    result: str | None  # text/plain of the execute_result
    error: str | None  # ename
    evalue: str
    traceback: str
    seconds: float
    displays: list[dict] = field(default_factory=list)  # the data of each display_data output

    @property
    def lines(self) -> list[str]:
        return (self.stdout + self.stderr).splitlines()


def _cell(node: nbformat.NotebookNode, seconds: float) -> Cell:
    streams = {"stdout": "", "stderr": ""}
    result = error = None
    evalue = tb = ""
    displays = []
    for out in node.outputs:
        if out.output_type == "display_data":
            displays.append(dict(out.data))
        elif out.output_type == "stream":
            streams[out.name] += out.text
        elif out.output_type == "execute_result":
            result = out.data.get("text/plain")
        elif out.output_type == "error":
            error, evalue, tb = out.ename, out.evalue, _ANSI.sub("", "\n".join(out.traceback))
    return Cell(streams["stdout"], streams["stderr"], result, error, evalue, tb, seconds, displays)


def kernel_env(cpu_only: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED")}
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tests mean CPU ranks, on a GPU machine too
    return env


class Kernel:
    """An ipykernel of this Python, driven through nbclient from one event loop."""

    def __init__(self, spec_dir: Path, cwd: Path, cpu_only: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.nb = nbformat.v4.new_notebook()
        self.km = AsyncKernelManager(kernel_name=KERNEL_NAME,
                                     kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir)]))
        # a TMPDIR of its own, short (the forkserver's socket lies in it), where nothing may be left at the end
        self.tmpdir = Path(tempfile.mkdtemp(prefix="kernel-"))
        env = {**kernel_env(cpu_only), "TMPDIR": str(self.tmpdir)}
        self.loop.run_until_complete(self.km.start_kernel(env=env, cwd=str(cwd)))
        self.client = NotebookClient(self.nb, km=self.km, timeout=120, allow_errors=True)
        self.loop.run_until_complete(self.client.async_start_new_kernel_client())
        self.pid: int = self.km.provisioner.pid  # type: ignore[union-attr]

    def run(self, source: str) -> Cell:
        node = self._add(source)
        start = time.monotonic()
        self.loop.run_until_complete(self.client.async_execute_cell(node, len(self.nb.cells) - 1))
        return _cell(node, time.monotonic() - start)

    def run_and_interrupt(
        self, source: str, ready: Callable[[Cell], bool], settle: float = 0.5, wait: float = 30.0
    ) -> tuple[Cell, float]:
        """Start a cell, press the stop button ``settle`` s after ``ready(outputs so far)``; seconds until it ended."""
        node = self._add(source)

        async def go() -> float:
            task = asyncio.ensure_future(self.client.async_execute_cell(node, len(self.nb.cells) - 1))
            deadline = time.monotonic() + wait
            while not task.done() and not ready(_cell(node, 0)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(settle)
            assert not task.done(), f"the cell ended before the interrupt: {_cell(node, 0)}"
            pressed = time.monotonic()
            await self.km.interrupt_kernel()
            await asyncio.wait_for(task, 30)
            return time.monotonic() - pressed

        seconds = self.loop.run_until_complete(go())
        return _cell(node, seconds), seconds

    def run_while(self, source: str, ready: Callable[[], bool], then: Callable[[], None], wait: float = 60.0) -> Cell:
        """Start a cell, call ``then()`` once ``ready()`` (or after ``wait`` s), and let the cell end."""
        node = self._add(source)

        async def go() -> None:
            task = asyncio.ensure_future(self.client.async_execute_cell(node, len(self.nb.cells) - 1))
            deadline = time.monotonic() + wait
            while not task.done() and not ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            then()
            await asyncio.wait_for(task, 60)

        self.loop.run_until_complete(go())
        return _cell(node, 0)

    def messages(self) -> list[dict]:
        """From now on, every message the cells get (nbclient folds a display's updates into it): the list."""
        seen: list[dict] = []
        process = self.client.process_message

        def record(msg: dict, cell: nbformat.NotebookNode, index: int) -> nbformat.NotebookNode | None:
            seen.append(msg)
            return process(msg, cell, index)

        self.client.process_message = record  # type: ignore[method-assign]
        return seen

    def restart_while(self, source: str, ready: Callable[[Cell], bool], wait: float = 30.0) -> list[psutil.Process]:
        """Start a cell, restart the kernel once ``ready``; the old kernel's processes still alive 10 s later."""
        node = self._add(source)

        async def go() -> list[psutil.Process]:
            task = asyncio.ensure_future(self.client.async_execute_cell(node, len(self.nb.cells) - 1))
            deadline = time.monotonic() + wait
            while not task.done() and not ready(_cell(node, 0)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not task.done(), f"the cell ended before the restart: {_cell(node, 0)}"
            old = psutil.Process(self.pid)
            family = [old, *old.children(recursive=True)]
            await self.km.restart_kernel(now=True)
            task.cancel()
            self.pid = self.km.provisioner.pid  # type: ignore[union-attr]
            return psutil.wait_procs(family, timeout=10)[1]

        return self.loop.run_until_complete(go())

    def workers(self) -> list[psutil.Process]:
        """The kernel's descendants other than multiprocessing's forkserver and resource tracker."""
        left = []
        for proc in psutil.Process(self.pid).children(recursive=True):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(proc.cmdline()) for h in _HELPERS):
                    left.append(proc)
            except psutil.NoSuchProcess:
                continue
        return left

    def _add(self, source: str) -> nbformat.NotebookNode:
        node = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(node)
        return node

    def close(self) -> None:
        """Shut the kernel down; its forkserver and resource tracker must go with it."""
        try:
            family = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        try:
            self.client.kc.stop_channels()  # type: ignore[union-attr]
            self.loop.run_until_complete(self.km.shutdown_kernel(now=False))
        finally:
            self.loop.close()
            asyncio.set_event_loop(None)
            _, alive = psutil.wait_procs(family, timeout=10)
            for proc in alive:
                proc.kill()
            assert not alive, f"left behind by the kernel: {[p.cmdline() for p in alive]}"
            # Jupyter kills the kernel's process group when it does not exit in time (the standard library's
            # resource tracker ignores the SIGTERM): the forkserver, in a group of its own, outlives it and
            # removes the kernel's multiprocessing directory (its socket, the ranks' error files)
            deadline = time.monotonic() + 5
            while (left := sorted(p.name for p in self.tmpdir.iterdir())) and time.monotonic() < deadline:
                time.sleep(0.05)
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            assert not left, f"left behind in the kernel's TMPDIR: {left}"


@pytest.fixture(scope="session")
def kernel_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel spec for the Python running the tests (the stock 'python3' may be another one)."""
    root = tmp_path_factory.mktemp("kernels")
    (root / KERNEL_NAME).mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "mpddp tests", "language": "python"}
    (root / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
    return root


@pytest.fixture(scope="module")
def kernel(kernel_spec: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    k = Kernel(kernel_spec, tmp_path_factory.mktemp("cwd"))
    try:
        yield k
    finally:
        k.close()


@pytest.fixture
def no_workers_left(kernel: Kernel) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 3
    while kernel.workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = kernel.workers()
    for proc in left:
        proc.kill()
    assert not left, f"workers left in the kernel: {[p.cmdline() for p in left]}"


def ok(cell: Cell) -> Cell:
    assert cell.error is None, f"{cell.error}: {cell.evalue}\n{cell.traceback}\n{cell.stdout}\n{cell.stderr}"
    return cell


SETUP = """\
import ctypes, os, sys, threading, time
from dataclasses import dataclass
import torch
import torch.distributed as dist
import mpddp

x = torch.randn(1024, 1024)
y = x @ x  # a multi-threaded op in the kernel, before any launch: a forked worker could hang after it
print("threads", torch.get_num_threads())
"""

IMPORTS = SETUP.split("\n\n")[0]

TRAIN = """\
SCALE = 10  # a notebook global the function uses

@dataclass
class Report:  # a class defined in a cell
    rank: int
    total: float

def shard_sum(rank):  # a helper defined in a cell
    return float(torch.arange(4.0)[rank::2].sum())

def train(ctx):
    print(f"python print from rank {ctx.rank}")
    print(f"python stderr from rank {ctx.rank}", file=sys.stderr)
    os.write(1, b"raw fd write\\n")
    ctypes.CDLL(None).printf(b"libc printf %d\\n", ctx.rank)
    t = torch.tensor([shard_sum(ctx.rank)])
    dist.all_reduce(t)
    return Report(ctx.rank, t.item() * SCALE)
"""


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_workers_left")
def test_cell_defined_train_function_returns_every_rank_and_prints_in_the_cell(kernel: Kernel):
    assert re.search(r"threads ([2-9]|\d\d)", ok(kernel.run(SETUP)).stdout) or psutil.cpu_count() == 1
    ok(kernel.run(TRAIN))
    cell = ok(kernel.run("results = mpddp.launch(train, nprocs=2)\nresults"))
    # every rank's value, in rank order; 0+2 + 1+3 = 6, all-reduced, times SCALE
    assert cell.result == "[Report(rank=0, total=60.0), Report(rank=1, total=60.0)]"
    assert ok(kernel.run("all(isinstance(r, Report) for r in results)")).result == "True"
    for rank in (0, 1):
        for line in (f"python print from rank {rank}", "raw fd write", f"libc printf {rank}"):
            assert f"[rank {rank}] {line}" in cell.stdout.splitlines()
        assert f"[rank {rank}] python stderr from rank {rank}" in cell.stderr.splitlines()
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in cell.lines)  # whole lines, never glued
    assert len(cell.lines) == 8


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_workers_left")
def test_closures_lambdas_and_an_unshippable_global(kernel: Kernel):
    ok(kernel.run(IMPORTS))  # each test runs alone too
    cell = ok(kernel.run(
        "offset = {'value': 7}\n"
        "def make(factor):\n"
        "    def inner(ctx):\n"
        "        return ctx.rank * factor + offset['value']\n"
        "    return inner\n"
        "(mpddp.launch(make(3), nprocs=2), mpddp.launch(lambda ctx: ctx.world_size - ctx.rank, nprocs=2))"
    ))
    assert cell.result == "([7, 10], [2, 1])"
    cell = kernel.run(
        "lock = threading.Lock()\n"
        "def guarded(ctx):\n"
        "    with lock:\n"
        "        return ctx.rank\n"
        "mpddp.launch(guarded, nprocs=2)"
    )
    assert cell.error == "ShipError"
    assert "cannot send global lock=<unlocked _thread.lock" in cell.evalue and "create locks" in cell.evalue
    assert "[rank" not in cell.stdout + cell.stderr  # refused as it was shipped: no worker ran it


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_workers_left")
def test_fork_is_refused_in_a_kernel_with_a_reason_and_a_fix(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    cell = kernel.run("mpddp.launch(lambda ctx: 1, nprocs=2, start_method='fork')")
    assert cell.error == "ConfigError"
    assert "start_method='fork' is unsafe here" in cell.evalue and "Python threads (Jupyter does)" in cell.evalue
    assert "use start_method='forkserver'" in cell.evalue


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_workers_left")
def test_ten_megabyte_results_from_each_rank(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    cell = ok(kernel.run(
        "N = 10 * 2**20 // 4  # float32: 10 MB a rank, far past a pipe's 64 KiB\n"
        "def big(ctx):\n"
        "    return torch.randn(N, generator=torch.Generator().manual_seed(ctx.rank))\n"
        "tensors = mpddp.launch(big, nprocs=2)\n"
        "[(t.numel() * t.element_size(), torch.equal(t, torch.randn(N, generator=torch.Generator().manual_seed(r))))\n"
        " for r, t in enumerate(tensors)]"
    ))
    assert cell.result == "[(10485760, True), (10485760, True)]"


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_workers_left")
def test_a_failing_rank_raises_in_the_cell_with_its_traceback(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    cell = kernel.run(
        "def load_batch(i):\n"
        "    raise ValueError(f'corrupt batch {i}')\n"
        "def fails(ctx):\n"
        "    print('step 1 done', flush=True)\n"
        "    if ctx.rank == 1:\n"
        "        load_batch(42)\n"
        "    dist.barrier()  # rank 0 waits here and fails only as a victim\n"
        "mpddp.launch(fails, nprocs=2, timeout=900)"  # stopped at once: a wait for the barrier's timeout would
    )  # outlast the test's 60 s
    assert cell.error == "WorkerFailed"
    assert "rank 1 (node 0, local rank 1) failed first: it raised ValueError: corrupt batch 42" in cell.evalue
    assert "mpddp: traceback of rank 1:" in cell.evalue and "in load_batch" in cell.evalue
    assert "in fails" in cell.evalue
    # the cell's source lines, which no file holds, are in the worker's traceback too
    assert "raise ValueError(f'corrupt batch {i}')" in cell.evalue and "load_batch(42)" in cell.evalue
    assert "[rank 1] step 1 done" in cell.stdout
    assert ok(kernel.run("'still usable'")).result == "'still usable'"


BLOCKED = """\
def blocked(ctx):
    print(f"pid {os.getpid()}", flush=True)
    if ctx.rank == 1:
        time.sleep(300)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return t.item()
mpddp.launch(blocked, nprocs=2, timeout=300)
"""


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_workers_left")
def test_interrupt_stops_every_rank_and_the_kernel_launches_again(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    cell, seconds = kernel.run_and_interrupt(BLOCKED, ready=lambda c: c.stdout.count("[rank") >= 2)
    assert cell.error == "KeyboardInterrupt", cell
    assert seconds < 5
    pids = [int(p) for p in re.findall(r"\[rank \d\] pid (\d+)", cell.stdout)]
    assert len(pids) == 2 and gone(pids)
    assert kernel.workers() == []
    again = ok(kernel.run("mpddp.launch(lambda ctx: ctx.rank + 1, nprocs=2)"))
    assert again.result == "[1, 2]"


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_workers_left")
def test_restarting_the_kernel_while_ranks_run_leaves_no_process(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    left = kernel.restart_while(BLOCKED, ready=lambda c: c.stdout.count("[rank") >= 2)
    assert left == []  # the kernel died: its forkserver follows, and the workers with it (parent-death signal)
    ok(kernel.run(IMPORTS))
    assert ok(kernel.run("mpddp.launch(lambda ctx: ctx.rank + 1, nprocs=2)")).result == "[1, 2]"


UNTIL_STOP = """\
def until_stop(ctx, stop):
    step = 0
    while True:  # every rank stops at the same step: the flag is reduced
        flag = torch.tensor([float(os.path.exists(stop))])
        dist.all_reduce(flag)
        if flag.item() > 0:
            return step
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.05)
"""


def _table_rows(text: str) -> dict[int, list[str]]:
    """The rows of a live table's text (RANK NODE LOCAL STATE COLL/S LAST COLLECTIVE ...), by rank."""
    return {int(cells[0]): cells for line in text.splitlines()[1:] if (cells := line.split()) and cells[0].isdigit()}


def _both_at_a_collective(text: str, states: tuple[str, ...]) -> bool:
    """Ranks 0 and 1 have a row, in one of ``states``, with their last collective: ``#N all_reduce``."""
    rows = _table_rows(text)
    return sorted(rows) == [0, 1] and all(
        row[3] in states and "all_reduce" in row and re.fullmatch(r"#\d+", row[row.index("all_reduce") - 1])
        for row in rows.values())


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_workers_left")
def test_live_shows_the_table_in_the_cell_updated_in_place(kernel: Kernel, tmp_path: Path):
    ok(kernel.run(IMPORTS))
    ok(kernel.run(UNTIL_STOP))
    stop = tmp_path / "STOP"
    messages = kernel.messages()

    def updates() -> list[dict]:
        return [m["content"] for m in messages if m["msg_type"] == "update_display_data"]

    def running() -> bool:  # an update while the ranks run: both rows, with their last collective
        return any(_both_at_a_collective(u["data"]["text/plain"], ("running", "waiting")) for u in updates())

    cell = ok(kernel.run_while(f"mpddp.launch(until_stop, nprocs=2, args=({str(stop)!r},), live=True)", running,
                               stop.touch))
    assert running(), [u["data"]["text/plain"] for u in updates()]
    steps = [int(n) for n in re.findall(r"\d+", cell.result or "")]
    assert len(steps) == 2 and steps[0] == steps[1] > 0, cell.result
    made = [m["content"] for m in messages if m["msg_type"] == "display_data"]
    assert len(made) == 1 and made[0]["transient"]["display_id"]  # one display, made once ...
    assert {u["transient"]["display_id"] for u in updates()} == {made[0]["transient"]["display_id"]}  # ... updated
    (shown,) = cell.displays  # what the cell keeps: the last look, every rank done, with its last collective
    assert shown["text/plain"].startswith("mpddp top  job ") and "<table" in shown["text/html"]
    assert _both_at_a_collective(shown["text/plain"], ("done",)), shown["text/plain"]
    assert f"[rank 0] step {steps[0]}" in cell.stdout  # the ranks' lines still come, beside the table


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_workers_left")
def test_live_leaves_the_last_look_after_a_failure_and_after_the_stop_button(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    failed = kernel.run(
        "def fails_later(ctx):\n"
        "    dist.barrier()\n"
        "    if ctx.rank == 1:\n"
        "        raise ValueError('late')\n"
        "    dist.barrier()\n"
        "mpddp.launch(fails_later, nprocs=2, live=True)")
    assert failed.error == "WorkerFailed"
    (shown,) = failed.displays
    rows = _table_rows(shown["text/plain"])
    assert "rank 1 (node 0, local rank 1) failed first: it raised ValueError: late" in (
        shown["text/plain"].splitlines()[1])
    assert sorted(rows) == [0, 1] and rows[1][3] == "failed", shown["text/plain"]
    cell, _ = kernel.run_and_interrupt(BLOCKED.replace("timeout=300)", "timeout=300, live=True)"),
                                       ready=lambda c: c.stdout.count("[rank") >= 2)
    assert cell.error == "KeyboardInterrupt", cell
    (shown,) = cell.displays
    rows = _table_rows(shown["text/plain"])
    assert sorted(rows) == [0, 1] and not {r[3] for r in rows.values()} & {"starting", "running", "waiting"}, rows


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_workers_left")
def test_without_live_no_table_is_shown(kernel: Kernel):
    ok(kernel.run(IMPORTS))
    cell = ok(kernel.run("mpddp.launch(lambda ctx: ctx.rank, nprocs=2)"))
    assert cell.result == "[0, 1]" and cell.displays == []
    assert "mpddp top" not in cell.stdout + cell.stderr
    refused = kernel.run("mpddp.launch(lambda ctx: ctx.rank, nprocs=2, live='yes')")
    assert refused.error == "ConfigError" and refused.evalue.startswith("live='yes' is not True or False")


@pytest.mark.timeout(120)
def test_the_example_notebook_end_to_end(kernel_spec: Path):
    nb = nbformat.read(EXAMPLE, as_version=4)
    k = Kernel(kernel_spec, EXAMPLE.parent)
    try:
        cells = [k.run(c.source) for c in nb.cells if c.cell_type == "code"]
        for cell in cells:
            ok(cell)
        assert k.workers() == []
    finally:
        k.close()
    text = "\n".join(line for c in cells for line in c.lines)
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] epoch 1 ", text, re.M), text
    assert re.search(r"weights identical on every rank: True", text), text
    # what the notebook shows as its outputs is what running it prints: the launcher's summary line too
    assert re.search(r"^mpddp: collectives: \d+ lined up across 2 ranks", text, re.M), text
    stored = "".join(out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.outputs)
    assert re.search(r"^mpddp: collectives: \d+ lined up across 2 ranks", stored, re.M), "stale notebook outputs"
    accuracies = [float(a) for a in re.findall(r"rank \d: .*accuracy (\d\.\d+)", text)]
    assert len(accuracies) == 2 and min(accuracies) > 0.8, text


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_cuda_initialized_in_the_kernel(kernel_spec: Path, tmp_path: Path):
    import torch

    if torch.cuda.device_count() == 0:  # device_count() does not initialize CUDA here
        pytest.skip("needs a CUDA GPU")
    k = Kernel(kernel_spec, tmp_path, cpu_only=False)
    try:
        ok(k.run("import torch, mpddp\nimport torch.distributed as dist\n"
                 "a = torch.ones(2, device='cuda') * 2\nprint(torch.cuda.is_initialized())"))
        cell = ok(k.run(
            "def on_gpu(ctx):\n"
            "    t = torch.ones(1, device=ctx.device) * (ctx.rank + 1)\n"
            "    dist.all_reduce(t)\n"
            "    return (ctx.device, torch.cuda.current_device(), t)\n"
            "mpddp.launch(on_gpu)"
        ))
        assert "cuda:0" in cell.result and "tensor([" in cell.result, cell
        refused = k.run("mpddp.launch(lambda ctx: 1, start_method='fork')")
        assert refused.error == "ConfigError" and "Cannot re-initialize CUDA in forked subprocess" in refused.evalue
        assert ok(k.run("float(a.sum())")).result == "4.0"  # the kernel's CUDA still works
        assert k.workers() == []
    finally:
        k.close()
