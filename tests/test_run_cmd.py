"""`mpddp run` against `torchrun --standalone` on the same torchrun-style script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import short_dir

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leftovers")]
SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = str(SCRIPTS / "torchrun_style.py")


def results(stdout: str) -> list[dict]:
    # torchrun lets both ranks write to one stream, where lines can glue: decode from each marker
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:]]
    return sorted(found, key=lambda r: r["rank"])


def run(*args: str, cwd: Path | None = None, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    env = None if tmpdir is None else dict(os.environ, TMPDIR=str(tmpdir))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_same_ranks_and_result_as_torchrun(tmp_path):
    mine, torchruns = short_dir(), short_dir()
    ours = run("-m", "mpddp", "run", "--nprocs", "2", SCRIPT, "--lr", "0.1", tmpdir=mine)
    assert ours.returncode == 0, ours.stderr
    assert list(mine.iterdir()) == []  # torchrun leaves a torchelastic_* directory in its own
    theirs = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, "--lr", "0.1",
                 tmpdir=torchruns)
    assert theirs.returncode == 0, theirs.stderr
    a, b = results(ours.stdout), results(theirs.stdout)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x == y  # rank, world size, all_reduce sum, env, argv and __name__ all agree
    assert a[1]["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                           "GROUP_RANK": "0"}
    assert a[0]["argv"] == ["--lr", "0.1"] and a[0]["name"] == "__main__" and a[0]["sum"] == 3.0
    assert "[rank 0] RESULT" in ours.stdout and "[rank 1] RESULT" in ours.stdout
    assert "failed to bind" not in ours.stdout + ours.stderr  # rank 0 joined our store, bound nothing


def test_module_form():
    out = run("-m", "mpddp", "run", "--nprocs", "2", "-m", "torchrun_pkg", "x", cwd=SCRIPTS)
    assert out.returncode == 0, out.stderr
    assert [r["argv"] for r in results(out.stdout)] == [["x"], ["x"]]


def test_failing_script_exit_code_is_the_scripts():
    out = run("-m", "mpddp", "run", "--nprocs", "2", SCRIPT, "--fail")
    assert out.returncode == 3, out.stderr
    assert "rank 1 (node 0, local rank 1) failed first: it exited with code 3 (sys.exit)" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_script_is_one_line():
    out = run("-m", "mpddp", "run", "--nprocs", "2", "nope.py")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "mpddp: error: script 'nope.py' does not exist: pass a path to a .py file, or -m for a module"
    )


def test_missing_module_is_one_line(tmp_path):
    out = run("-m", "mpddp", "run", "--nprocs", "2", "-m", "no_such_module.train", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"mpddp: error: module 'no_such_module.train' cannot be found from {tmp_path}: check its name, run from "
        "the directory that holds its package, or install it (pip install -e .)"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_option_is_called_one(tmp_path):
    (tmp_path / "x.py").write_text("print('never runs')\n")
    out = run("-m", "mpddp", "run", "--nprocs", "2", "--nproc", "2", "x.py", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("mpddp: error: mpddp run has no option --nproc: did you mean --nprocs? "
                          "See `mpddp run --help`.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.py"]


def test_after_the_script_and_after_dashes_everything_is_the_scripts():
    from mpddp.cli import main

    command = main.commands["run"]
    params = command.make_context("run", ["--nprocs", "2", "train.py", "--epochs", "3", "--bogus"]).params
    assert (params["target"], params["script_args"], params["nprocs"]) == ("train.py", ("--epochs", "3", "--bogus"), 2)
    params = command.make_context("run", ["--", "-odd.py", "--lr", "1"]).params
    assert (params["target"], params["script_args"]) == ("-odd.py", ("--lr", "1"))


def test_a_script_whose_name_starts_with_a_dash_runs_after_dashes(tmp_path):
    (tmp_path / "-odd.py").write_text("import sys\nprint('ran with', sys.argv[1:])\n")
    out = run("-m", "mpddp", "run", "--nprocs", "1", "--", "-odd.py", "--lr", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[rank 0] ran with ['--lr', '1']" in out.stdout
