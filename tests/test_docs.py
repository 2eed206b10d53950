"""The manual (docs/) and the front page stay true to the code and to CI.

The examples on the pages run in tests/test_readme.py; the build itself
(``python -m sphinx -W ...``, warnings as errors) runs in .ci/run. These
tests need no Sphinx: they read the pages' sources.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import click

import mpddp
import mpddp.trainer
from mpddp.cli import main
from mpddp.config import LaunchConfig

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.rst"
CI = ROOT / ".ci" / "run"
README_LIMIT = 250  # lines: a front page a newcomer reads to the end


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _bash_blocks(text: str) -> list[str]:
    """The one-line bodies of the page's ``.. code-block:: bash`` directives, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^\.\. code-block:: bash\n\n((?: {3}.*\n?)+)", text, re.M)]


def _documented() -> set[str]:
    text = (DOCS / "reference" / "api.rst").read_text(encoding="utf-8")
    return set(re.findall(r"^\.\. auto(?:function|class|exception|data)::\s+(\S+)", text, re.M))


def test_the_api_reference_covers_every_public_name():
    documented = _documented()
    missing = sorted({f"mpddp.{name}" for name in mpddp.__all__} - documented)
    assert not missing, f"docs/reference/api.rst has no autodoc entry for {missing}"
    missing = sorted({f"mpddp.trainer.{name}" for name in mpddp.trainer.__all__} - documented)
    assert not missing, f"docs/reference/api.rst has no autodoc entry for {missing}"


def test_the_api_reference_names_only_what_exists():
    for dotted in sorted(_documented()):
        module, _, name = dotted.rpartition(".")
        assert hasattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name), dotted


def test_every_launch_config_field_has_its_words_in_the_reference():
    conf = _load(DOCS / "conf.py", "mpddp_docs_conf")
    for field in dataclasses.fields(LaunchConfig):
        words = " ".join(conf._field_doc(field))
        assert len(words) > 20, f"LaunchConfig.{field.name} has no description for the API reference"
        entry = "\n".join(conf._field_entry(field))
        assert entry.startswith(f".. py:attribute:: {field.name}\n"), entry


def test_the_cli_reference_is_generated_from_the_click_group():
    text = (DOCS / "reference" / "cli.rst").read_text(encoding="utf-8")
    assert re.search(r"^\.\. click:: mpddp\.cli:main\n   :prog: mpddp\n   :nested: full$", text, re.M), text
    assert isinstance(main, click.Group) and {"train", "run", "ranks", "info"} <= set(main.commands)


def test_readme_commands_are_the_ones_ci_runs():
    readme, ci = README.read_text(encoding="utf-8"), CI.read_text(encoding="utf-8")
    blocks = _bash_blocks(readme)
    first, tests, build = blocks[0], blocks[1], blocks[-1]
    install, _, train = first.partition(" && ")
    assert install == "pip install -e '.[train]'" and train == "python -m mpddp train --nprocs 2", first
    assert re.search(rf"^{re.escape(install)}$", ci, re.M), f".ci/run does not run README's {install!r}"
    # the train part runs where README shows its output: a checked block of README
    assert re.search(rf"^\.\. readme-check: runs\n\n\.\. code-block:: console\n\n +\$ {re.escape(train)}$",
                     readme, re.M), f"README's {train!r} is not a checked block"
    assert tests.startswith("python -m pip install -q -e '.[test]' && ") and tests.endswith("python -m pytest -q")
    assert tests in ci, "README's test command and .ci/run differ"
    assert build.startswith("pip install -e '.[docs]' && python -m sphinx -W ") and build in ci, build


def test_the_manual_shows_the_same_build_command():
    build = _bash_blocks(README.read_text(encoding="utf-8"))[-1]
    assert build in _bash_blocks((DOCS / "development.rst").read_text(encoding="utf-8"))
    assert "docs/_build" in build and "docs/_build/" in (ROOT / ".gitignore").read_text()


def test_readme_stays_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LIMIT, (
        f"README.rst has {len(lines)} lines; move detail into docs/ (at most {README_LIMIT})")


def test_every_picture_shown_exists_and_is_made_by_the_script():
    pictures = _load(ROOT / "scripts" / "make_pictures.py", "make_pictures")
    shown = set()
    for page in DOCS.rglob("*.rst"):
        for target in re.findall(r"^\.\. (?:image|figure):: (\S+)", page.read_text(encoding="utf-8"), re.M):
            assert (page.parent / target).is_file(), f"{page.name} shows {target}, which does not exist"
            shown.add(Path(target).stem)
    committed = {p.stem for p in (DOCS / "_static").glob("*.png")}
    assert {"ranks", "stragglers"} <= shown, shown
    assert committed <= set(pictures.PICTURES), f"pictures not made by scripts/make_pictures.py: {committed}"


def test_the_rank_picture_is_drawn_from_the_rank_formula(tmp_path):
    pictures = _load(ROOT / "scripts" / "make_pictures.py", "make_pictures")
    target = tmp_path / "ranks.png"
    pictures.draw_ranks(target, nnodes=2, nprocs=4)
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 2 * height > 400, (width, height)
