"""README.rst's commands run, and print what README.rst shows.

A block preceded by ``.. readme-check: exact`` must print exactly what is
shown; ``.. readme-check: runs`` must exit 0 and print every shown line that
holds no digit (timings and losses vary; ``...`` stands for lines left out); ``.. readme-check: python`` runs the
Python block and compares its output with the literal block after it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.rst"
CHECK = re.compile(r"^\.\. readme-check: (exact|runs|python)\s*$")


def _block(lines: list[str], start: int) -> tuple[list[str], int]:
    """The indented body (dedented) of the directive or literal block starting at ``start``."""
    i = start + 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    body = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    return textwrap.dedent("\n".join(body)).splitlines(), i


def checks() -> list[tuple[str, int, list[str], list[str]]]:
    lines = README.read_text(encoding="utf-8").splitlines()
    found = []
    for n, line in enumerate(lines):
        m = CHECK.match(line)
        if not m:
            continue
        j = n + 1
        while not lines[j].startswith(".. code-block::"):
            j += 1
        body, end = _block(lines, j)
        if m.group(1) == "python":
            k = end
            while not lines[k].rstrip().endswith("::"):
                k += 1
            shown, _ = _block(lines, k)
            found.append(("python", n + 1, body, shown))
        else:
            found.append((m.group(1), n + 1, body, []))
    return found


CHECKS = checks()


def _commands(body: list[str]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in body:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,line,body,shown", CHECKS, ids=[f"README.rst:{c[1]}" for c in CHECKS])
def test_readme_block(mode, line, body, shown, tmp_path):
    if mode == "python":
        script = tmp_path / "example.py"
        script.write_text("\n".join(body) + "\n")
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.splitlines()) == sorted(shown)  # ranks print concurrently
        return
    commands = _commands(body)
    assert commands, f"README.rst:{line}: a checked block with no `$ ` command"
    for command, expected in commands:
        argv = command.split()
        if argv[0] == "python":
            argv[0] = sys.executable
        out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
        assert out.returncode == 0, f"{command}\n{out.stderr}"
        actual = out.stdout.rstrip("\n").splitlines()
        if mode == "exact":
            assert actual == expected, command
        else:
            for text in expected:
                if text.strip() not in ("", "...") and not re.search(r"\d", text):
                    assert text in actual, f"{command}: {text!r} not printed"


def test_readme_has_checked_blocks():
    assert len(CHECKS) >= 2
    text = README.read_text(encoding="utf-8")
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    test_command = re.search(r"python -m pip install -q -e '\.\[test\]'.*pytest -q", text)
    assert test_command and test_command.group(0) in ci, "README's test command and .ci/run differ"


def test_readme_is_valid_restructuredtext():
    import docutils.core
    import docutils.utils

    problems: list[str] = []
    settings = {"report_level": 2, "halt_level": 5, "warning_stream": False}
    doctree = docutils.core.publish_doctree(README.read_text(encoding="utf-8"), settings_overrides=settings)
    for node in doctree.findall(lambda n: n.tagname == "system_message"):
        if node["level"] >= docutils.utils.Reporter.WARNING_LEVEL:
            problems.append(node.astext())
    assert not problems, problems
