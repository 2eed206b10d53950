"""Bad input, through the real command line and through the API: one table.

Each CLI case must exit 2 with exactly one stderr line ``mpddp: error: ...``
that names the value, no traceback, nothing written to its directory (or to
its TMPDIR) and no process left. Each API case must raise the typed
exception with a one-line message naming the value, and write nothing.
The CLI cases run at the same time (a module fixture) to keep the suite fast.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import mpddp

from runs import marked

pytestmark = pytest.mark.timeout(180)


def job(ctx):
    return ctx.rank


@dataclass(frozen=True)
class Case:
    id: str
    words: str  # the message names the value this way
    cli: tuple[str, ...] | None = None  # arguments after `python -m mpddp`
    api: dict[str, Any] | None = None  # launch() options, or {"train": TrainConfig fields}
    error: type[Exception] = mpddp.ConfigError
    files: dict[str, str] = field(default_factory=dict)  # prepared in the case's directory
    seconds: float | None = None  # the CLI answers within this, before any import of torch (a torch that raises)
    nofile: int | None = None  # the CLI runs under `ulimit -n NOFILE`


OTHER_MODEL = "other-model.pt"  # a well-formed checkpoint of a model that is not the digits CNN
MULTI = ("--nnodes", "2", "--node-rank", "1", "--master-port", "29500")

CASES = [
    Case("nprocs-0", "nprocs=0", ("run", "--nprocs", "0", "x.py"), {"nprocs": 0}),
    Case("nprocs-negative", "nprocs=-1", ("run", "--nprocs", "-1", "x.py"), {"nprocs": -1}),
    Case("nprocs-abc", "'abc'", ("run", "--nprocs", "abc", "x.py"), {"nprocs": "abc"}),
    Case("node-rank-too-big", "node_rank=2 with nnodes=2",
         ("run", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "x.py"),
         {"nnodes": 2, "node_rank": 2, "master_port": 29500}),
    Case("master-port-70000", "master_port=70000", ("run", "--master-port", "70000", "x.py"), {"master_port": 70000}),
    Case("multinode-without-port", "master_port=0 with nnodes>1", ("run", "--nnodes", "2", "x.py"), {"nnodes": 2}),
    Case("gpus-repeated", "names GPU 0 twice", ("run", "--gpus", "0,0", "x.py"), {"gpus": [0, 0]}),
    Case("gpus-not-ids", "gpus='1,x'", ("run", "--gpus", "1,x", "x.py"), {"gpus": "1,x"}),
    Case("gpus-unknown", "gpus=7", ("run", "--gpus", "7", "x.py"), {"gpus": "7"}),
    Case("nccl-without-cuda", "backend='nccl'", ("run", "--backend", "nccl", "x.py"), {"backend": "nccl"}),
    Case("backend-unknown", "backend='mpi'", ("run", "--backend", "mpi", "x.py"), {"backend": "mpi"}),
    Case("start-method-unknown", "start_method='thread'", ("run", "--start-method", "thread", "x.py"),
         {"start_method": "thread"}),
    Case("timeout-zero", "timeout=0", ("run", "--timeout", "0", "x.py"), {"timeout": 0}),
    Case("max-restarts-negative", "max_restarts=-1", ("run", "--max-restarts", "-1", "x.py"), {"max_restarts": -1}),
    Case("output-ranks", "output_ranks='x'", ("run", "--output-ranks", "x", "x.py")),
    Case("unresolvable-master", "'no-such-host.invalid' does not resolve",
         ("run", *MULTI, "--master-addr", "no-such-host.invalid", "x.py"),
         {"nnodes": 2, "node_rank": 1, "master_port": 29500, "master_addr": "no-such-host.invalid"}, seconds=15.0),
    Case("log-dir-is-a-file", "'afile' is a file", ("run", "--log-dir", "afile", "x.py"), {"log_dir": "afile"},
         files={"afile": "not a directory\n"}),
    Case("log-dir-under-a-file", "log_dir='afile/logs' cannot be created: 'afile' is a file",
         ("run", "--log-dir", "afile/logs", "x.py"), {"log_dir": "afile/logs"}, files={"afile": "a file\n"}),
    Case("log-dir-on-proc", "log_dir='/proc/nope/x' cannot be created: '/proc' is not writable (on the proc",
         ("run", "--log-dir", "/proc/nope/x", "x.py"), {"log_dir": "/proc/nope/x"}),
    Case("nprocs-over-open-files", "nprocs=200 needs about 1664 open files in the launcher (8 per rank + 64) but the "
         "limit here is 256 (ulimit -n): pass --nprocs 24 or fewer", ("run", "--nprocs", "200", "x.py"), nofile=256),
    Case("nprocs-absurd", "nprocs=99999999999999999999 needs about 800000000000000000056 open files",
         ("run", "--nprocs", "99999999999999999999", "x.py"), {"nprocs": 99999999999999999999}, seconds=15.0),
    Case("output-ranks-beyond-the-world", "output_ranks=7 names rank 7, but the world has 2 ranks",
         ("run", "--nprocs", "2", "--output-ranks", "7", "x.py"), {"nprocs": 2, "output_ranks": 7}),
    Case("script-missing", "script 'nosuch.py' does not exist", ("run", "nosuch.py")),
    Case("run-unknown-option", "mpddp run has no option --bogus-option: see `mpddp run --help` for its options",
         ("run", "--bogus-option", "x.py")),
    Case("unknown-option", "unexpected keyword argument 'nproc'", api={"nproc": 2}),
    Case("fn-not-callable", "fn=42 is not callable", api={"fn": 42}),
    Case("live-not-a-bool", "live='yes' is not True or False", api={"live": "yes"}),
    Case("live-with-hosts", "live=True with hosts=", api={"live": True, "hosts": "node-a,node-b", "nprocs": 1}),
    Case("fn-arg-unshippable", "cannot send args[0]=<unlocked _thread.lock", api={"args": "lock"},
         error=mpddp.ShipError),
    Case("task-unknown", "task='nosuch'", ("train", "--task", "nosuch"), {"train": {"task": "nosuch"}}),
    Case("task-syntax-error", "broken.py raised SyntaxError: '(' was never closed", ("train", "--task", "broken.py"),
         {"train": {"task": "broken.py"}}, files={"broken.py": "def make_task(seed:\n"}),
    Case("task-raises-on-import", "raises.py raised ValueError: no data here", ("train", "--task", "raises.py"),
         {"train": {"task": "raises.py"}}, files={"raises.py": "raise ValueError('no data here')\n"}),
    Case("task-factory-raises", "task='factory.py': the factory raised ValueError: no data here",
         ("train", "--task", "factory.py"), {"train": {"task": "factory.py"}},
         files={"factory.py": "def make_task(seed):\n    raise ValueError('no data here')\n"}),
    Case("task-not-a-factory", "task='os:getcwd': getcwd is not a task factory", ("train", "--task", "os:getcwd"),
         {"train": {"task": "os:getcwd"}}),
    Case("checkpoint-dir-on-sys", "checkpoint_dir='/sys/x' cannot be created: '/sys' is not writable (on the sysfs",
         ("train", "--checkpoint-dir", "/sys/x"), {"train": {"checkpoint_dir": "/sys/x"}}),
    Case("checkpoint-dir-under-a-file", "checkpoint_dir='afile/ck' cannot be created: 'afile' is a file",
         ("train", "--checkpoint-dir", "afile/ck"), {"train": {"checkpoint_dir": "afile/ck"}},
         files={"afile": "a file\n"}),
    Case("run-dir-on-proc", "run_dir='/proc/x' cannot be created: '/proc' is not writable (on the proc file system)",
         ("train", "--run-dir", "/proc/x"), {"train": {"run_dir": "/proc/x"}}),
    Case("resume-auto-all-damaged", "resume='auto': no checkpoint in 'ck' loads (the newest, ckpt-000000999.pt, is "
         "damaged", ("train", "--checkpoint-dir", "ck", "--resume", "auto"),
         {"train": {"checkpoint_dir": "ck", "resume": "auto"}}, files={"ck/ckpt-000000999.pt": "not a checkpoint\n"}),
    Case("resume-missing", "resume='missing.pt': no such checkpoint file", ("train", "--resume", "missing.pt"),
         {"train": {"resume": "missing.pt"}}),
    Case("resume-corrupt", "resume='corrupt.pt' is not a readable checkpoint", ("train", "--resume", "corrupt.pt"),
         {"train": {"resume": "corrupt.pt"}}, files={"corrupt.pt": "not a checkpoint\n"}),
    Case("resume-other-model", f"resume='{OTHER_MODEL}' holds a different model (Other vs",
         ("train", "--resume", OTHER_MODEL), {"train": {"resume": OTHER_MODEL}}, files={OTHER_MODEL: ""}),
    Case("inject-fault", "inject_fault='boom:1:2'", ("train", "--inject-fault", "boom:1:2"),
         {"train": {"inject_fault": "boom:1:2"}}),
    Case("inject-fault-beyond-the-world", "inject_fault='kill:5:1' names rank 5, but the world has",
         ("train", "--nprocs", "2", "--inject-fault", "kill:5:1"), {"train": {"inject_fault": "kill:5:1"}}),
    Case("epochs-zero", "epochs=0", ("train", "--epochs", "0"), {"train": {"epochs": 0}}),
]


def prepare(directory: Path, case: Case) -> set[str]:
    """Write the files the case needs; return the directory listing before the run."""
    directory.mkdir(parents=True)
    (directory / "x.py").write_text("print('never runs')\n")
    for name, text in case.files.items():
        if name == OTHER_MODEL:
            torch.save({"format": "mpddp-checkpoint-1", "signature": {"model": "Other", "shapes": {}}, "model": {},
                        "optimizer": {}, "epoch": 0, "batches_done": 0, "global_step": 1, "rng": {}},
                       directory / name)
        else:
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text)
    return listing(directory)


def listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


@dataclass
class CliResult:
    rc: int | None  # None: still running after 120 s (then killed)
    stderr: str
    stdout: str
    seconds: float
    before: set[str]
    after: set[str]
    tmp_left: list[str]
    left: list[str]


def run_cli_case(case: Case, base: Path) -> CliResult:
    directory = base / case.id
    before = prepare(directory, case)
    # short, whatever this run's TMPDIR: the forkserver's socket lies in it (107 bytes at most, checked first)
    tmpdir = Path(tempfile.mkdtemp(prefix="bad-"))
    marker = uuid.uuid4().hex
    env = dict(os.environ, MPDDP_TEST_RUN=marker, TMPDIR=str(tmpdir))
    for name in [k for k in env if k.startswith("SLURM_")]:
        del env[name]
    if case.seconds is not None:  # told before torch is imported: a torch that cannot be imported is never seen
        (tmpdir / "torch").mkdir()
        (tmpdir / "torch" / "__init__.py").write_text("raise ImportError('mpddp imported torch before telling')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmpdir), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "mpddp", *case.cli]
    if case.nofile is not None:
        command = ["bash", "-c", f'ulimit -Sn {case.nofile} && exec "$@"', "bash", *command]
    start = time.monotonic()
    # files, not pipes: a child left holding a pipe kept subprocess.run from returning, and one case that hung hung
    # every case of the fixture (a side run at load 25); now it fails alone, named, with what it said
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=directory, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for p in marked(marker):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait()
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    deadline = time.monotonic() + 3.0
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    tmp_left = [p.name for p in tmpdir.iterdir() if p.name != "torch"]
    shutil.rmtree(tmpdir)
    return CliResult(rc, stderr, stdout, seconds, before, listing(directory), tmp_left,
                     [" ".join(p.cmdline()) for p in left])


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, CliResult]:
    base = tmp_path_factory.mktemp("bad_input")
    cli_cases = [c for c in CASES if c.cli is not None]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip([c.id for c in cli_cases], pool.map(lambda c: run_cli_case(c, base), cli_cases)))


def call_api(case: Case) -> None:
    from mpddp.trainer.config import TrainConfig
    from mpddp.trainer.run import train

    options = dict(case.api or {})
    if "train" in options:
        train(TrainConfig(**options["train"]), nprocs=1)
        return
    fn = options.pop("fn", job)
    if options.pop("args", None) == "lock":
        options["args"] = (threading.Lock(),)
    mpddp.launch(fn, **options)


PARAMS = [pytest.param(c, "cli", id=f"cli-{c.id}") for c in CASES if c.cli is not None]
PARAMS += [pytest.param(c, "api", id=f"api-{c.id}") for c in CASES if c.api is not None]


def test_the_table_is_big_enough_and_the_manual_counts_it():
    assert len([c for c in CASES if c.cli]) >= 15 and len([c for c in CASES if c.api]) >= 15
    guide = (Path(__file__).parent.parent / "docs" / "failures.rst").read_text(encoding="utf-8")
    assert f"``tests/test_bad_input.py`` holds the whole table ({len(CASES)} cases)" in guide


@pytest.mark.usefixtures("no_leftovers")
def test_the_most_ranks_the_open_file_check_allows_do_start(tmp_path):
    from mpddp.limits import FD_HEADROOM, FDS_PER_RANK

    limit = 128
    most = (limit - FD_HEADROOM) // FDS_PER_RANK
    (tmp_path / "x.py").write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}

    def under_the_limit(nprocs: int) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'ulimit -Sn {limit} && exec "$@"', "bash", sys.executable, "-m", "mpddp",
                               "run", "--nprocs", str(nprocs), "x.py"], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)

    started = under_the_limit(most)
    assert started.returncode == 0, started.stderr  # the estimate is not too low: these all had their pipes
    assert started.stdout.count("] ran") == most
    refused = under_the_limit(most + 1)
    assert refused.returncode == 2 and (
        f"limit here is {limit} (ulimit -n): pass --nprocs {most} or fewer" in refused.stderr)


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(("case", "surface"), PARAMS)
def test_bad_input_is_one_line_naming_the_value(case, surface, request, tmp_path, monkeypatch):
    if surface == "cli":
        result = request.getfixturevalue("cli_results")[case.id]
        lines = result.stderr.splitlines()
        assert result.rc == 2, (result.rc, f"{result.seconds:.1f} s", result.stderr)
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("mpddp: error: ") and case.words in lines[0], lines[0]
        assert "Traceback" not in result.stderr + result.stdout
        assert result.after == result.before, "the run wrote files"
        assert not result.tmp_left, f"temporary files left: {result.tmp_left}"
        assert not result.left, f"processes left: {result.left}"
        assert case.seconds is None or result.seconds < case.seconds, result.seconds
        return
    before = prepare(tmp_path / "cwd", case)
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(case.error) as info:
        call_api(case)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and case.words in message, message
    assert listing(tmp_path / "cwd") == before, "the call wrote files"


def one(ctx):
    return 1


@pytest.mark.parametrize(("options", "words"), [
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.123.45.67", "--master-port", "29511"],
     "master_addr='10.123.45.67' (10.123.45.67) is not an address of this machine, but node 0 hosts the store there"),
    (["--master-addr", "10.123.45.67"], "is not an address of this machine"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "no.such.host.invalid", "--master-port", "29511"],
     "master address 'no.such.host.invalid' does not resolve"),
    (["--master-port", "TAKEN"], "is already in use on 127.0.0.1: another job holds it"),
])
def test_an_address_node_0_cannot_host_is_bad_input_exit_2_before_anything_starts(tmp_path, options, words):
    """Was: an address not of this machine exited 1 (after the forkserver started), one that does not resolve 2."""
    import socket

    from helpers import leftovers

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    options = [str(taken.getsockname()[1]) if o == "TAKEN" else o for o in options]
    (tmp_path / "hi.py").write_text("print('ran')\n")
    try:
        out = subprocess.run([sys.executable, "-m", "mpddp", "run", "--nprocs", "1", "--timeout", "5", *options,
                              "hi.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        taken.close()
    assert out.returncode == 2 and out.stderr.startswith("mpddp: error: ") and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "ran" not in out.stdout
    assert not leftovers()
    with pytest.raises(mpddp.AddressError):  # the API's type: bad input (ConfigError), and a RendezvousError
        mpddp.launch(one, nprocs=1, master_addr="10.123.45.67")
