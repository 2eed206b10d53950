"""The launcher's install carries the launcher: scikit-learn is the main job's extra, not mpddp's.

A real environment without scikit-learn: a venv (no pip) whose site-packages
links every package of this one but scikit-learn, so that ``import sklearn``
fails there as on a fresh ``pip install mpddp``, in the launcher and in every
worker it spawns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from helpers import leftovers

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def no_sklearn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv that has everything this one has, but scikit-learn."""
    root = tmp_path_factory.mktemp("venv-no-sklearn")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("sklearn", "scikit_learn")):
            (target / entry.name).symlink_to(entry)
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=150, cwd=cwd, env=env,
                          start_new_session=True)


def test_the_environment_really_lacks_scikit_learn(no_sklearn: Path, tmp_path: Path) -> None:
    out = _run(no_sklearn, "-c", "import importlib.util, torch, click; print(importlib.util.find_spec('sklearn'))",
               cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


def test_import_mpddp_and_mpddp_run_work_without_scikit_learn(no_sklearn: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        print("sum", int(total.item()), "sklearn" in __import__("sys").modules, flush=True)
        dist.destroy_process_group()
    """))
    out = _run(no_sklearn, "-c", "import mpddp; print(sorted(mpddp.__all__)[:1], mpddp.Task.__name__)", cwd=tmp_path)
    assert out.returncode == 0 and "Task" in out.stdout, out.stderr
    out = _run(no_sklearn, "-m", "mpddp", "run", "--nprocs", "2", str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("sum 3 False") == 2, out.stdout
    assert not leftovers()


def test_mpddp_train_without_scikit_learn_says_what_to_install(no_sklearn: Path, tmp_path: Path) -> None:
    out = _run(no_sklearn, "-m", "mpddp", "train", "--nprocs", "2", "--epochs", "1", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "mpddp: error: task 'digits' reads its images from scikit-learn, which is not installed: "
        "pip install 'mpddp[train]' (or scikit-learn), or pass --dataset synthetic"], out.stderr
    assert not (tmp_path / "runs").exists()  # nothing written
    out = _run(no_sklearn, "-m", "mpddp", "train", "--nprocs", "2", "--epochs", "1", "--dataset", "synthetic",
               "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not leftovers()
