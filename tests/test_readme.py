"""README.rst's and the manual's commands run, and print what the pages show.

A comment ``.. readme-check: MODE`` marks the next block (a ``code-block``
directive or a ``::`` literal block), in README.rst and in every page of
docs/:

- ``exact``: every ``$ command`` prints exactly the lines shown;
- ``runs``: every ``$ command`` prints each line shown, compared with every
  number as 0 and runs of spaces as one (timings, ports and losses vary);
  ``...`` in a line matches anything, a line of its own stands for lines left
  out; ``$ echo $?`` gives the exit status expected (else 0);
- ``python``: the Python block runs and prints the literal block after it;
- ``file NAME``: the block is written to NAME where the commands run (every
  page's files, for every check: a name is given once).

A page that shows one of README's checked blocks includes it
(``.. include:: ../README.rst`` between markers), so each runs once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.rst"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.rst") if "_build" not in p.parts)]
CHECK = re.compile(r"^\.\. readme-check: (exact|runs|python|file (\S+))\s*$")


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


def _next_block(lines: list[str], start: int) -> tuple[list[str], int]:
    j = start
    while not (lines[j].startswith(".. code-block::") or lines[j].rstrip().endswith("::")):
        j += 1
    return _block(lines, j)


def checks(pages: list[Path]) -> tuple[list[tuple[str, str, list[str], list[str]]], dict[str, list[tuple[str, str]]]]:
    """Every checked block as (mode, "page:line", body, shown), and every file block as name -> [(page:line, text)]."""
    found, files = [], {}
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            m = CHECK.match(line)
            if not m:
                continue
            where = f"{page.relative_to(ROOT)}:{n + 1}"
            body, end = _next_block(lines, n + 1)
            if m.group(2):
                files.setdefault(m.group(2), []).append((where, "\n".join(body) + "\n"))
            elif m.group(1) == "python":
                shown, _ = _next_block(lines, end)
                found.append(("python", where, body, shown))
            else:
                found.append((m.group(1), where, body, []))
    return found, files


CHECKS, FILES = checks(PAGES)


def _commands(body: list[str]) -> list[tuple[str, list[str], int]]:
    """(command, lines shown after it, exit status shown by a following `echo $?`)."""
    out: list[tuple[str, list[str], int]] = []
    lines = iter(body)
    for line in lines:
        if line.startswith("$ echo $?"):
            command, shown, _ = out[-1]
            out[-1] = (command, shown, int(next(lines)))
        elif line.startswith("$ "):
            out.append((line[2:], [], 0))
        elif out:
            out[-1][1].append(line)
    return out


def _normal(line: str) -> str:
    return " ".join(re.sub(r"\d[\d,.]*", "0", line).split())  # 2,923 and 0.5 are numbers too


def _pattern(shown: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in _normal(shown).split("...")))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _argv(command: str) -> list[str]:
    argv = command.split()
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "mpddp":
        argv[:1] = [sys.executable, "-m", "mpddp"]
    return argv


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,where,body,shown", CHECKS, ids=[c[1] for c in CHECKS])
def test_readme_block(mode, where, body, shown, tmp_path):
    for name, [(_, text), *_] in FILES.items():
        (tmp_path / name).write_text(text)
    if mode == "python":
        script = tmp_path / "example.py"
        script.write_text("\n".join(body) + "\n")
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.splitlines()) == sorted(shown)  # ranks print concurrently
        return
    commands = _commands(body)
    assert commands, f"{where}: a checked block with no `$ ` command"
    for command, expected, status in commands:
        out = subprocess.run(_argv(command), capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
        assert out.returncode == status, f"{command}\n{out.stdout}\n{out.stderr}"
        if mode == "exact":
            assert out.stdout.rstrip("\n").splitlines() == expected, command
            continue
        actual = [_normal(text) for text in (out.stdout + out.stderr).splitlines()]
        for text in expected:
            if text.strip() in ("", "..."):
                continue
            pattern = _pattern(text)
            assert any(pattern.fullmatch(a) for a in actual), f"{command}: {text!r} not printed:\n{out.stderr}"


def test_readme_and_the_manual_have_checked_blocks():
    pages = {where.split(":")[0] for _, where, _, _ in CHECKS}
    assert len([c for c in CHECKS if c[1].startswith("README.rst:")]) >= 4
    assert {"docs/failures.rst", "docs/torchrun.rst"} <= pages, pages


def test_each_file_block_is_named_once():
    twice = {name: [where for where, _ in found] for name, found in FILES.items() if len(found) > 1}
    assert not twice, f"a file block's name is given on two pages: {twice}"


def test_the_pages_include_readme_blocks_that_exist():
    # a page shows README's checked block between its markers, and does not check it again
    readme = README.read_text(encoding="utf-8")
    for page in PAGES[1:]:
        for marker in re.findall(r":start-after: (\.\. include-start: .+)", page.read_text(encoding="utf-8")):
            assert marker in readme, f"{page.name}: README has no {marker!r}"
            assert marker.replace("start", "end") in readme, f"{page.name}: README has no end for {marker!r}"


def test_the_comparison_is_not_blind():
    # numbers and spacing are free, words are not
    assert _pattern("epoch   1/10  loss 0.25  2,923 samples/s").fullmatch(
        _normal("epoch  10/10 loss 1.5 923 samples/s"))
    assert not _pattern("epoch 1/10 loss 0.25").fullmatch(_normal("epoch 1/10 accuracy 0.25"))
    assert _pattern("(RuntimeError: ...by peer...) — x").fullmatch(
        _normal("(RuntimeError: [a.cc:5] Read error: reset by peer.) — x"))
    assert _commands(["$ a", "one", "$ echo $?", "3", "$ b"]) == [("a", ["one"], 3), ("b", [], 0)]


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
