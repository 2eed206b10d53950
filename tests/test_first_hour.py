"""What a newcomer met in the first hour: each gets one line that names the value and the fix, or the right output.

The missing main guard is told before any worker starts; more CPU ranks than CPUs get a note; a failure of many
ranks is a few grouped lines; other launchers' spellings (``--nproc-per-node`` for ``ranks``, ``--device``) get
mpddp's; the Python API's errors speak Python; a generator argument gets a fix that fits it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import mpddp
from mpddp.core.wire.stacks import ranks_named
from mpddp.machine.cores import oversubscribed, usable_cpus

from helpers import short_dir

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]
NO_GPU = shutil.which("nvidia-smi") is None


def run(*args: str, cwd=None, path=None) -> subprocess.CompletedProcess:
    """``python ARGS``; ``path``: first on its PYTHONPATH (a ``torch`` there shadows the real one)."""
    env = dict(os.environ, TMPDIR=str(short_dir()))
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=100, cwd=cwd, env=env,
                          start_new_session=True)


UNGUARDED = {
    "launch": """
        import mpddp

        def work(ctx):
            return ctx.rank

        print(mpddp.launch(work, nprocs=2))
    """,
    "spawn in a function": """
        import mpddp

        def work(i):
            return i

        def main():
            return mpddp.spawn(work, nprocs=2, join=False).join()

        try:
            main()
        except KeyError:
            pass
    """,
}


@pytest.mark.parametrize("name", UNGUARDED)
def test_a_script_with_no_main_guard_is_told_before_any_worker_starts(name, tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent(UNGUARDED[name]))
    (tmp_path / "torch").mkdir()  # told before torch is imported, so before any worker starts: this one raises
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('mpddp imported torch before telling')\n")
    out = run(str(script), cwd=tmp_path, path=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    first, *rest = out.stderr.splitlines()
    assert first.startswith("mpddp: error: noguard.py line ") and "no `if __name__ == \"__main__\":` guard" in first
    shown = "\n".join(rest)
    assert 'if __name__ == "__main__":' in shown
    assert ("print(mpddp.launch(work, nprocs=2))" if name == "launch" else "        main()") in shown


GUARDED = {
    "fork": """
        import mpddp

        def work(ctx):
            return ctx.rank

        print(mpddp.launch(work, nprocs=2, start_method="fork"))  # fork re-imports nothing: no guard needed
    """,
    "compound guard": """
        import sys
        import mpddp

        def work(ctx):
            return ctx.rank

        if __name__ == "__main__" and len(sys.argv) > 0:
            print(mpddp.launch(work, nprocs=2))
    """,
}


@pytest.mark.parametrize("name", GUARDED)
def test_a_script_that_can_launch_is_not_refused(name, tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent(GUARDED[name]))
    out = run(str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[0, 1]"]


def test_ranks_takes_torchruns_nproc_per_node(cli):
    code, out, _ = cli("ranks", "--nproc-per-node", "4", "--nnodes", "2")
    assert code == 0
    same = cli("ranks", "--nprocs", "4", "--nnodes", "2")
    assert (code, out) == same[:2]
    assert "world_size = nnodes × nprocs_per_node = 2 × 4 = 8" in out


def test_device_is_answered_with_gpus(cli):
    code, _, err = cli("train", "--device", "cuda")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "mpddp train has no option --device: " in err and "--gpus" in err and "CUDA_VISIBLE_DEVICES" in err


@pytest.mark.skipif(not NO_GPU, reason="tells what happens on a machine without a GPU")
def test_gpus_on_a_machine_without_one_names_the_missing_gpu_not_nccl(cli):
    code, _, err = cli("train", "--nprocs", "2", "--gpus", "0")
    assert code == 2
    assert "gpus=0 but this machine has no visible NVIDIA GPU" in err and "drop --gpus" in err
    assert "NCCL" not in err


@pytest.mark.skipif(not NO_GPU, reason="tells what happens on a machine without a GPU")
def test_nccl_without_a_gpu_speaks_python_to_a_python_caller():
    with pytest.raises(mpddp.ConfigError, match=r"backend='nccl' needs CUDA GPUs.*pass backend='gloo'"):
        mpddp.launch(lambda ctx: None, nprocs=1, backend="nccl")


def test_a_generator_argument_gets_a_fix_that_fits_it():
    with pytest.raises(mpddp.ShipError) as e:
        mpddp.launch(lambda ctx, items: None, args=((i for i in range(3)),), nprocs=1)
    assert "cannot send args[0]=<generator object" in str(e.value)
    assert "list(...)" in str(e.value) and "locks" not in str(e.value)


@pytest.mark.parametrize("ranks,cpus,told", [(2, 2, False), (1, 2, False), (3, 2, True), (100, 2, True)])
def test_more_cpu_ranks_than_cpus_is_noted(ranks, cpus, told):
    note = oversubscribed(ranks, cpus)
    assert (note is not None) == told
    if told:
        assert f"{ranks} CPU ranks on this node's {cpus} CPU(s)" in note and f"--nprocs {cpus}" in note


@pytest.mark.parametrize("ranks,named", [
    ([3], "rank 3"), ([0, 2], "ranks 0, 2"), ([0, 1, 2], "ranks 0, 1, 2"), ([2, 0, 1, 3], "ranks 0-3"),
    ([*range(99), 100], "ranks 0-98, 100"), ([0, 1, 2, 4, 5, 6, 7], "ranks 0, 1, 2, 4-7"),
])
def test_ranks_are_named_with_ranges(ranks, named):
    assert ranks_named(ranks) == named


FAILS = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 3:
    raise ValueError("rank three is broken")
dist.barrier()
"""


def test_an_oversubscribed_failure_is_noted_and_told_in_few_lines(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    nprocs = max(8, usable_cpus() + 1)
    out = run("-m", "mpddp", "run", "--nprocs", str(nprocs), str(script), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    err = [line for line in out.stderr.splitlines() if not line.startswith("[rank")]
    assert any(f"{nprocs} CPU ranks on this node's {usable_cpus()} CPU(s)" in line for line in err), err
    assert any(line.startswith("mpddp: rank 3 (node 0, local rank 3) failed first") for line in err), err
    others = err[err.index("mpddp: the other ranks:") + 1:]
    others = [line for line in others if line.startswith("  rank")]
    named = [int(n) for line in others for n in _numbers(line.split(":")[0])]
    assert sorted(named) == [r for r in range(nprocs) if r != 3], others  # each once, in few lines
    assert len(others) <= 3, others


def _numbers(text: str) -> list[int]:
    found: list[int] = []
    for low, high in re.findall(r"(\d+)(?:-(\d+))?", text):
        found += range(int(low), int(high or low) + 1)
    return found
