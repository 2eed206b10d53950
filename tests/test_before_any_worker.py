"""What a newcomer is told, or given, before any worker starts (issue 60's first hour).

A script that does not compile is one line naming file:line, exit 2, and no worker, nor the forkserver that forks
them, ever starts: every Python process the launch starts, and every fork of one, writes a line (a
``sitecustomize`` on the path), so "none started" is counted, not timed. ``--dashboard`` alone means ``auto``
where it cannot take the script's name; before the script it gets one line that says what it takes. The launcher
imports none of the rendezvous backends before its forkserver starts: they cost every launch ~40 ms in series with
the forkserver's own imports. The ``jupyter`` extra holds what the notebook guide and its example need, and the
guide quotes ShipError's hint as it reads.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from helpers import short_dir

ROOT = Path(__file__).parent.parent
STARTS = """\
import os
_path = os.environ.get("MPDDP_TEST_STARTS")
if _path:
    with open(_path, "a") as _f:
        _f.write(f"python {os.getpid()}\\n")
    os.register_at_fork(after_in_child=lambda: open(_path, "a").write(f"fork {os.getpid()}\\n"))
"""


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(STARTS)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, TMPDIR=str(short_dir()), **more)


def _mpddp(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpddp", *args], capture_output=True, text=True, timeout=100,
                          cwd=cwd, env=env, start_new_session=True)


# ---- a script that does not compile ------------------------------------------------------------------------------

BROKEN = {
    "SyntaxError": ("import torch\nprint('starting'\nx = 1\n", "bad.py:2: SyntaxError: '(' was never closed"),
    "IndentationError": ("def main():\nreturn 1\n", "bad.py:2: IndentationError: expected an indented block"),
}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("kind", BROKEN)
def test_a_script_that_does_not_compile_is_one_line_and_no_worker_ever_starts(kind, tmp_path):
    source, told = BROKEN[kind]
    (tmp_path / "bad.py").write_text(source)
    starts = tmp_path / "starts.txt"
    out = _mpddp("run", "--nprocs", "2", "bad.py", cwd=tmp_path, env=_env(tmp_path, MPDDP_TEST_STARTS=str(starts)))
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [out.stderr.rstrip("\n")] and out.stdout == "", out.stderr
    assert out.stderr.startswith(f"mpddp: error: {told}") and "no worker was started" in out.stderr, out.stderr
    # one Python process, the launcher's: no forkserver (every worker's parent), no fork, no rank
    started = starts.read_text().splitlines()
    assert len(started) == 1 and started[0].startswith("python "), started


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
def test_the_count_of_starts_sees_the_workers_of_a_script_that_compiles(tmp_path):
    """The check above can fail: the same count, for a script that runs, sees the forkserver and its forks."""
    (tmp_path / "good.py").write_text("print('ran')\n")
    starts = tmp_path / "starts.txt"
    out = _mpddp("run", "--nprocs", "2", "good.py", cwd=tmp_path, env=_env(tmp_path, MPDDP_TEST_STARTS=str(starts)))
    assert out.returncode == 0, out.stderr
    kinds = [line.split()[0] for line in starts.read_text().splitlines()]
    assert kinds.count("python") >= 2 and kinds.count("fork") >= 2, kinds  # launcher, forkserver; ranks, store


# ---- --dashboard with no value -----------------------------------------------------------------------------------

def test_a_bare_dashboard_before_the_script_says_what_it_takes(cli):
    code, out, err = cli("run", "--nprocs", "2", "--dashboard", "job.py")
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and "Missing argument" not in err, err
    assert err.startswith("mpddp: error: Invalid value for '--dashboard': dashboard='job.py' is not PORT or "
                          "HOST:PORT: --dashboard takes auto, PORT or HOST:PORT; alone (last, or before another "
                          "option) it means auto, and before the script, write --dashboard auto job.py."), err


@pytest.mark.parametrize("command, args", [
    ("run", ["--dashboard", "--nprocs", "1", "job.py"]),  # before another option
    ("train", ["--nprocs", "1", "--dashboard"]),  # last
    ("run", ["--dashboard", "8265", "job.py"]),  # with its value, as before
])
def test_a_bare_dashboard_where_it_cannot_take_the_script_is_auto(command, args):
    from mpddp.cli import main

    ctx = main.commands[command].make_context(command, list(args))  # it reads the list it is given away
    assert ctx.params["dashboard"] == ("8265" if "8265" in args else "auto"), ctx.params


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
def test_a_bare_dashboard_serves_the_job_s_page_on_a_free_port(tmp_path):
    # the job runs until the test has loaded its page: it waits for the file the test writes then
    (tmp_path / "job.py").write_text(textwrap.dedent("""\
        import os, time
        while not os.path.exists("loaded"):
            time.sleep(0.05)
        print("job done", flush=True)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "mpddp", "run", "--nprocs", "1", "--dashboard", "--timeout",
                                 "60", "job.py"], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stderr is not None
        lines = iter(launcher.stderr.readline, "")  # until the line comes, or the launcher ends without it
        line = next((line for line in lines if "the dashboard of this job" in line), "")
        told = re.fullmatch(r"mpddp: the dashboard of this job: (http://127\.0\.0\.1:(\d+)/)\n", line)
        assert told and int(told.group(2)) > 0, line
        with urllib.request.urlopen(told.group(1), timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
        (tmp_path / "loaded").write_text("")
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0 and "[rank 0] job done" in out, err


# ---- the launch's start ------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
def test_no_rendezvous_backend_is_imported_before_the_forkserver_starts(tmp_path):
    """What the launcher imports before its forkserver starts is paid in series with the forkserver's imports (the
    first step's critical path, scripts/bench_first_step.py); the backends' ~40 ms are paid beside them instead."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import json, sys
        import mpddp
        import mpddp.core.launcher.api as api

        seen = []
        start_context = api.start_context

        def watched(*args, **kwargs):
            seen.extend(sorted(m for m in sys.modules if m.startswith("mpddp.core.nodes")))
            return start_context(*args, **kwargs)

        api.start_context = watched

        def work(ctx):
            return ctx.rank

        if __name__ == "__main__":
            assert mpddp.launch(work, nprocs=1) == [0]
            print(json.dumps(seen))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                         env=_env(tmp_path), start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [], out.stdout


# ---- the notebook guide ------------------------------------------------------------------------------------------

def test_the_jupyter_extra_holds_what_the_notebook_guide_and_its_example_need():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extra = {re.split(r"[<>=!~ \[]", line.strip())[0].lower()
             for line in setup["options.extras_require"]["jupyter"].splitlines() if line.strip()}
    assert "ipykernel" in extra and extra & {"notebook", "jupyterlab"}, extra  # the kernel and a server
    required = {re.split(r"[<>=!~ \[]", line.strip())[0].lower()
                for line in setup["options"]["install_requires"].splitlines() if line.strip()}
    notebook = json.loads((ROOT / "scripts" / "ddp_notebook.ipynb").read_text())
    code = "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    modules = set(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M)) - set(sys.stdlib_module_names) - {"mpddp"}
    distributions = packages_distributions()
    needed = {dist.lower() for module in modules for dist in distributions.get(module, [module])}
    assert modules and needed <= extra | required, (needed, extra | required)
    guide = (ROOT / "docs" / "notebooks.rst").read_text()
    assert "pip install -e '.[jupyter]'" in guide and "scripts/ddp_notebook.ipynb" in guide


def test_the_notebook_guide_quotes_shiperrors_hint_as_it_reads():
    import threading

    from mpddp.core.wire.payload import pack_call
    from mpddp.errors import ShipError

    lock = threading.Lock()

    def fn(ctx):
        with lock:
            return ctx.rank

    with pytest.raises(ShipError) as e:
        pack_call(fn, (), {})
    hint = str(e.value).split(" to the workers: ", 1)[1]
    guide = " ".join((ROOT / "docs" / "notebooks.rst").read_text().split())
    assert f"to the workers: {hint}``" in guide, hint
