"""What a ``pip install`` gets: the wheel and the sdist hold what they must, and the wheel runs the main job.

Both are built once for the file, by ``python -m build --no-isolation`` (nothing downloaded; the wheel is
built from the sdist, as pip does) from a copy of the checkout's files in a temporary folder: nothing is
written into the repository, which the other pytest-xdist worker is reading. The wheel is installed with
pip into a fresh environment (a venv without pip whose site-packages links this one's packages, mpddp
left out) and run from a folder outside the repository; the sdist is unpacked and its own tests collect
and run.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import leftovers

REPO = Path(__file__).resolve().parents[1]
LICENSE_HOLDER = "2026 The mpddp developers"
EXAMPLE_TASK = "mpddp.examples.moons:make_task"
CLASSIFIERS = {
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Topic :: System :: Distributed Computing",
    "Typing :: Typed",
}
_NOT_SOURCES = {".git", ".venv", "build", "dist", "_build", "runs", "__pycache__", ".pytest_cache", ".mypy_cache",
                ".ruff_cache"}


@dataclass(frozen=True)
class Built:
    checkout: Path  # the copy of the checkout the build ran in
    sources: list[str]  # its files, relative to it
    wheel: Path
    sdist: Path


def _sources(root: Path) -> list[str]:
    """The checkout's files as git sees them (tracked, or new and not ignored); without git, every file but
    the build and cache folders (an unpacked sdist runs this file too)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        names = [name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        relative = [p.relative_to(root) for p in root.rglob("*")]
        names = [str(p) for p in relative if not _NOT_SOURCES & set(p.parts) and ".egg-info" not in str(p)]
    return sorted(name for name in names if (root / name).is_file())  # a file deleted but not yet committed


def _run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    copy, dist = tmp_path_factory.mktemp("checkout"), tmp_path_factory.mktemp("dist")
    sources = _sources(REPO)
    for name in sources:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    out = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, copy], cwd=copy)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "License classifiers are deprecated" not in out.stdout + out.stderr, out.stderr[-3000:]
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    return Built(copy, sources, wheel, sdist)


@pytest.fixture(scope="module")
def fresh_python(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a new venv holding this one's packages (linked) but mpddp, which comes from the wheel."""
    root = tmp_path_factory.mktemp("venv-wheel")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    target = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=root).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "mpddp" not in entry.name.lower():  # the checkout's editable install: its .pth, finder, dist-info
            (target / entry.name).symlink_to(entry)
    out = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
                built.wheel], cwd=root)
    assert out.returncode == 0, out.stderr
    return python


def _fresh_env() -> dict[str, str]:
    """This environment, less what would put the checkout's mpddp on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}


# ---- what each archive holds -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_wheel_holds_the_license_the_type_marker_and_the_example_task(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = wheel.namelist()
        licenses = [n for n in names if re.fullmatch(r"mpddp-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
        assert len(licenses) == 1, names
        text = wheel.read(licenses[0]).decode()
        metadata = email.parser.Parser().parsestr(wheel.read(next(n for n in names if n.endswith("/METADATA")))
                                                  .decode())
    assert text.startswith("MIT License") and f"Copyright (c) {LICENSE_HOLDER}" in text
    assert {"mpddp/py.typed", "mpddp/examples/__init__.py", "mpddp/examples/moons.py"} <= set(names)
    assert all(n.startswith(("mpddp/", "mpddp-")) for n in names), [n for n in names if not n.startswith("mpddp")]
    assert metadata["Author"] == metadata["Maintainer"] == "The mpddp developers"
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Documentation", "Source", "Changelog"} <= set(urls), urls
    assert all(u.startswith("https://github.com/mpddp/mpddp") for u in urls.values()), urls
    assert CLASSIFIERS <= set(metadata.get_all("Classifier")), metadata.get_all("Classifier")
    assert any(c.startswith("Development Status :: ") for c in metadata.get_all("Classifier"))
    # PEP 639: an SPDX expression, and no license classifier beside it (setuptools 77 deprecates them, and refuses
    # one beside an expression)
    assert metadata["License-Expression"] == "MIT", metadata.items()
    assert not [c for c in metadata.get_all("Classifier") if c.startswith("License :: ")]
    assert metadata["Requires-Python"] == ">=3.10"


@pytest.mark.timeout(120)
def test_the_wheel_holds_the_dashboards_page(built: Built) -> None:
    """--dashboard serves its page from the package: every file of web/, and nothing it loads from elsewhere."""
    web = sorted(name for name in built.sources if name.startswith("mpddp/core/launcher/web/"))
    assert {"index.html", "dashboard.js", "dashboard.css"} <= {name.rsplit("/", 1)[1] for name in web}, web
    with zipfile.ZipFile(built.wheel) as wheel:
        assert set(web) <= set(wheel.namelist()), sorted(set(web) - set(wheel.namelist()))
        page = b"".join(wheel.read(name) for name in web)
    assert not re.search(rb"(src|href)=\"(https?:)?//", page) and b"import(" not in page


@pytest.mark.timeout(120)
def test_the_sdist_holds_the_tests_the_manual_and_the_scripts(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        held = {name.partition("/")[2] for name in sdist.getnames()}
    wanted = [name for name in built.sources
              if name.startswith(("tests/", "docs/", "scripts/", "mpddp/", ".ci/")) or "/" not in name]
    assert not set(wanted) - held, f"the sdist leaves out {sorted(set(wanted) - held)}"
    for name in ("tests/conftest.py", "tests/helpers.py", "tests/scripts/ddp_tutorial.py", "docs/index.rst",
                 "docs/conf.py", "scripts/make_pictures.py", "README.rst", "LICENSE", "CHANGELOG.rst",
                 "pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "mpddp/py.typed"):
        assert name in held, name
    assert any(n.startswith("tests/data/") for n in held) and any(n.startswith("tests/scripts/") for n in held)
    assert not [n for n in held if n.startswith("docs/_build") or n.endswith(".pyc")]


# ---- an unpacked sdist's own tests -------------------------------------------------------------


def _tests(collected: str) -> Counter[str]:
    """How many tests ``pytest --collect-only -q`` printed of each function (a parameter's id may hold the
    folder's path, or be cut to ``spec3`` when that is long)."""
    return Counter(line.partition("[")[0] for line in collected.splitlines() if "::" in line)



@pytest.mark.timeout(180)
def test_the_unpacked_sdist_s_tests_collect_and_run(built: Built, tmp_path: Path) -> None:
    with tarfile.open(built.sdist) as sdist:
        # the "data" filter (no links out, no devices) where this Python has it: 3.10.12, 3.11.4 and later
        sdist.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (root,) = tmp_path.iterdir()
    # its own mpddp first on the path (python -m puts the folder there), none of this run's pytest settings
    env = {k: v for k, v in _fresh_env().items() if not k.startswith("PYTEST_")} | {"PYTHONPATH": str(root)}
    where = _run([sys.executable, "-c", "import mpddp; print(mpddp.__file__)"], cwd=root, env=env)
    assert where.stdout.strip() == str(root / "mpddp" / "__init__.py"), where.stdout + where.stderr
    pytest_args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q"]
    collected = _run([*pytest_args, "--collect-only"], cwd=root, env=env, timeout=150)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    # the checkout the sdist was made from (the copy: the repository's files may change meanwhile)
    here = _run([*pytest_args, "--collect-only"], cwd=built.checkout, env=env | {"PYTHONPATH": str(built.checkout)},
                timeout=150)
    ids, wanted = _tests(collected.stdout), _tests(here.stdout)
    assert ids == wanted and ids.total() > 500, (sorted(wanted - ids)[:20], sorted(ids - wanted)[:20])
    ran = _run([*pytest_args, "tests/test_rank_math.py"], cwd=root, env=env, timeout=150)
    assert ran.returncode == 0 and re.search(r"^\d+ passed", ran.stdout, re.M), ran.stdout[-3000:] + ran.stderr
    assert not (root / ".pytest_cache").exists()
    assert not leftovers()


# ---- the installed wheel, outside the repository -----------------------------------------------


@pytest.mark.timeout(240)
def test_the_installed_wheel_trains_the_digits_and_the_example_task(fresh_python: Path, tmp_path: Path) -> None:
    env = _fresh_env()
    where = _run([fresh_python, "-c", "import mpddp, mpddp.examples.moons as m; print(mpddp.__file__, m.__file__)"],
                 cwd=tmp_path, env=env)
    site = fresh_python.parent.parent
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()) and where.stdout, where.stdout + where.stderr
    mpddp_script = fresh_python.parent / "mpddp"  # the console script pip wrote
    digits = _run([mpddp_script, "train", "--nprocs", "2", "--epochs", "1"], cwd=tmp_path, env=env, timeout=180)
    assert digits.returncode == 0, digits.stdout[-2000:] + digits.stderr[-3000:]
    assert re.search(r"^\[rank 0\] epoch +1/1 .*test acc", digits.stdout, re.M), digits.stdout
    assert re.search(r"^checkpoint: runs/digits/\S+/ckpt-000000023\.pt ", digits.stdout, re.M), digits.stdout
    moons = _run([fresh_python, "-m", "mpddp", "train", "--task", EXAMPLE_TASK, "--nprocs", "2", "--epochs", "1"],
                 cwd=tmp_path, env=env, timeout=180)
    assert moons.returncode == 0, moons.stdout[-2000:] + moons.stderr[-3000:]
    assert re.search(r"^checkpoint: runs/moons/\S+/ckpt-000000032\.pt ", moons.stdout, re.M), moons.stdout  # 2048/64
    assert not leftovers()


@pytest.mark.timeout(120)
def test_the_installed_train_help_names_only_what_the_install_has(fresh_python: Path, tmp_path: Path) -> None:
    helped = _run([fresh_python.parent / "mpddp", "train", "--help"], cwd=tmp_path, env=_fresh_env())
    assert helped.returncode == 0, helped.stderr
    text = " ".join(helped.stdout.split())
    assert EXAMPLE_TASK in text, text
    assert not re.findall(r"\b(?:scripts|tests|docs)/\S+", text), text  # the repository's folders: not installed
    names = sorted(set(re.findall(r"\bmpddp(?:\.\w+)+(?::\w+)?", text)))
    resolve = ("import importlib, sys\n"
               "for name in sys.argv[1:]:\n"
               "    module, _, attr = name.partition(':')\n"
               "    getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)\n")
    found = _run([fresh_python, "-c", resolve, *names], cwd=tmp_path, env=_fresh_env())
    assert found.returncode == 0, (names, found.stderr)
