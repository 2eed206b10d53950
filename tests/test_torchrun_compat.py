"""Third-party training code, unchanged, under ``torchrun`` and under ``mpddp run``: the same result.

Lightning's Trainer and Fabric, accelerate's own test script and ignite's ``idist.Parallel`` find the
launcher through torchelastic's environment (Lightning picks ``TorchElasticEnvironment``), and a script
decorated with torchelastic's ``@record`` gets an error file whose content reaches the report. Each
third-party test skips with a reason where the ``compat`` extra is not installed
(``pip install -e '.[compat]'``). Models are tiny and runs short: about a minute for the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import short_dir

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftovers")]
COMPAT = Path(__file__).parent / "scripts" / "compat"


def launch(launcher: str, argv: list[str], tmp_path: Path, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGV``, or the same line with ``mpddp run`` for torchrun."""
    where, tmp = tmp_path / launcher[0], short_dir()  # the forkserver's socket lies in TMPDIR: short
    where.mkdir(parents=True)
    module = ["torch.distributed.run"] if launcher == "torchrun" else ["mpddp", "run"]
    full_env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    full_env.update(env or {}, TMPDIR=str(tmp))
    out = subprocess.run([sys.executable, "-m", *module, "--standalone", "--nproc-per-node", "2", *argv],
                         capture_output=True, text=True, timeout=150, cwd=where, env=full_env)
    if launcher == "mpddp":  # its own temporary files are gone (what the libraries leave is theirs)
        assert not list(tmp.glob("mpddp-*")), list(tmp.iterdir())
    return out


def both(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None, ok: bool = True,
         ) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    theirs, ours = launch("torchrun", argv, tmp_path, env), launch("mpddp", argv, tmp_path, env)
    for _ in range(2):  # the reference itself failed: a rank of torchrun's aborted ("terminate called without an
        if not ok or theirs.returncode == 0:  # active exception", SIGABRT, seen with Fabric): retried, not a verdict
            break
        shutil.rmtree(tmp_path / "t")
        theirs = launch("torchrun", argv, tmp_path, env)
    if ok and theirs.returncode != 0:
        pytest.skip(f"torchrun's own reference run failed 3 times (exit {theirs.returncode}): nothing to compare with")
    if ok:
        assert theirs.returncode == 0, theirs.stderr[-3000:]
        assert ours.returncode == 0, ours.stderr[-3000:]
    return theirs, ours


def results(stdout: str) -> list[dict]:
    """Each rank's RESULT, in rank order (torchrun's ranks share one stream, where lines can glue)."""
    decoder = json.JSONDecoder()
    return sorted((decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:]), key=lambda r: r["rank"])


def same(a: list[dict], b: list[dict]) -> None:
    """Rank by rank the same values; floats to within rounding (the ranks' thread counts may differ)."""
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], float) or (isinstance(x[key], list) and x[key] and isinstance(x[key][0], float)):
                assert y[key] == pytest.approx(x[key], rel=1e-5), key
            else:
                assert y[key] == x[key], key


def test_lightning_trainer_fit(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="the compat extra is not installed")
    theirs, ours = both([str(COMPAT / "lightning_fit.py"), "2"], tmp_path)
    a, b = results(theirs.stdout), results(ours.stdout)
    same(a, b)  # world size, ranks, environment, final loss and weights
    assert [(r["rank"], r["local_rank"], r["world"]) for r in b] == [(0, 0, 2), (1, 1, 2)]
    assert {r["environment"] for r in b} == {"TorchElasticEnvironment"}
    assert b[0]["weight"] == b[1]["weight"]  # DDP kept the replicas equal


def test_lightning_devices_auto_is_lightnings_own_error(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="the compat extra is not installed")
    theirs, ours = both([str(COMPAT / "lightning_fit.py"), "auto"], tmp_path, ok=False)
    error = ("You set `devices=1` and `num_nodes=1` in Lightning, but the product (1 * 1) does not match the world "
             "size (2)")
    for out in (theirs, ours):
        assert out.returncode == 1 and error in out.stderr, out.stderr[-3000:]
    # every rank raises it: whichever did first is named
    assert re.search(r"mpddp: rank (\d) \(node 0, local rank \1\) failed first: it raised ValueError: You set "
                     r"`devices=1`", ours.stderr), ours.stderr[-3000:]


def test_lightning_fabric(tmp_path):
    pytest.importorskip("lightning_fabric", reason="the compat extra is not installed")
    theirs, ours = both([str(COMPAT / "fabric_run.py")], tmp_path)
    a, b = results(theirs.stdout), results(ours.stdout)
    same(a, b)
    assert {r["environment"] for r in b} == {"TorchElasticEnvironment"} and {r["world"] for r in b} == {2}


def test_accelerate_test_script(tmp_path):
    accelerate = pytest.importorskip("accelerate", reason="the compat extra is not installed")
    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_script.py"
    theirs, ours = both([str(script)], tmp_path, env={"ACCELERATE_USE_CPU": "True"})
    sections = [set(re.findall(r"\*\*[^*\n]+\*\*", out.stdout)) for out in (theirs, ours)]
    assert sections[0] == sections[1] and "**Test reinstantiated state**" in sections[1]  # every part ran
    for out in (theirs, ours):
        assert "Num processes: 2" in out.stdout and "Process index: 1" in out.stdout
        assert "Training yielded the same results on one CPU or distributed setup with batch split." in out.stdout


def test_ignite_parallel(tmp_path):
    pytest.importorskip("ignite", reason="the compat extra is not installed")
    theirs, ours = both([str(COMPAT / "ignite_parallel.py")], tmp_path)
    a, b = results(theirs.stdout), results(ours.stdout)
    same(a, b)
    assert [(r["rank"], r["world"], r["nproc_per_node"], r["nnodes"], r["sum"]) for r in b] == [
        (0, 2, 2, 1, 3.0), (1, 2, 2, 1, 3.0)]


RAISE_LINE = 'raise ValueError("bad batch on rank 1")'


def test_record_error_file_reaches_the_report(tmp_path):
    """The script catches its exception and exits 5: only its @record error file still holds the traceback."""
    theirs, ours = both([str(COMPAT / "record_fail.py"), "--catch"], tmp_path, ok=False)
    assert theirs.returncode == 1  # torchrun always exits 1; mpddp with the failing rank's code
    assert "error_file: " in theirs.stderr and RAISE_LINE in theirs.stderr
    assert ours.returncode == 5, ours.stderr
    report = ours.stderr.split("mpddp: rank 1 (node 0, local rank 1) failed first: it exited with code 5 (sys.exit)\n")
    assert len(report) == 2, ours.stderr
    assert report[1].startswith("mpddp: traceback of rank 1, from its error file (torchelastic's @record, written ")
    assert RAISE_LINE in report[1] and "ValueError: bad batch on rank 1" in report[1]

    # uncaught, the worker reports the traceback itself, and the file adds its line and time
    raised = launch("mpddp", [str(COMPAT / "record_fail.py")], tmp_path / "r")
    assert raised.returncode == 1
    assert "failed first: it raised ValueError: bad batch on rank 1" in raised.stderr
    assert re.search(r"mpddp: rank 1's error file \(torchelastic's @record, written [0-9-]+ [0-9:]+\): "
                     r"ValueError: bad batch on rank 1\n", raised.stderr), raised.stderr
