"""``mpddp.spawn``, torch.multiprocessing.spawn's signature: the DDP tutorial unchanged, indices, values, input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpddp

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
TUTORIAL = REPO / "tests" / "scripts" / "ddp_tutorial.py"


def _losses(stdout: str) -> list[str]:
    # found anywhere: under mp.spawn two ranks' lines can glue together on the shared stdout
    return sorted(re.findall(r"LOSS rank \d step \d [0-9.]{10}", stdout))


def test_the_ddp_tutorial_runs_under_mpddp_spawn_with_mp_spawns_losses(tmp_path):
    """pytorch.org's DDP tutorial, unchanged but for mp.spawn -> mpddp.spawn: the same losses, rank by rank."""
    from multinode import free_port

    from helpers import leftovers

    runs = {}
    for which in ("mp", "mpddp"):
        for _ in range(3 if which == "mp" else 1):  # mp.spawn's own run sometimes aborts at its exit (gloo's
            out = subprocess.run([sys.executable, str(TUTORIAL), which, str(free_port())],  # teardown, SIGABRT)
                                 capture_output=True, text=True, timeout=120, cwd=tmp_path)
            if out.returncode == 0:
                break
        if which == "mp" and out.returncode != 0:
            pytest.skip(f"the reference, mp.spawn's own run, failed 3 times: {out.stderr.strip().splitlines()[-1]}")
        assert out.returncode == 0, out.stderr
        runs[which] = _losses(out.stdout)
    assert len(runs["mp"]) == 6 and runs["mpddp"] == runs["mp"]
    assert not leftovers()


def by_index(i, scale):
    return i * scale


def fails_at_index_1(i):
    if i == 1:
        raise KeyError("missing")
    return i


def test_spawn_gives_fn_its_index_and_returns_every_value(no_leftovers):
    assert mpddp.spawn(by_index, args=(10,), nprocs=3) == [0, 10, 20]
    context = mpddp.spawn(by_index, args=(2,), nprocs=2, join=False)
    assert context.join(timeout=60) is True and context.values == [0, 2]
    context = mpddp.spawn(fails_at_index_1, nprocs=2, join=False)
    with pytest.raises(mpddp.WorkerFailed) as info:
        context.join(60)
    assert info.value.rank == 1


def test_spawn_checks_its_input_at_once_also_without_join(no_leftovers):
    with pytest.raises(mpddp.ConfigError, match="nprocs=0"):
        mpddp.spawn(by_index, nprocs=0, join=False)
    with pytest.raises(mpddp.ConfigError, match="join=1, daemon=False: both are True or False"):
        mpddp.spawn(by_index, join=1)


def test_launch_with_join_points_to_spawn():
    with pytest.raises(mpddp.ConfigError) as info:
        mpddp.launch(by_index, nprocs=2, join=True)
    assert str(info.value) == ("launch() got join=: launch() always waits for every rank and returns their values; "
                               "for torch.multiprocessing.spawn's signature (fn(i, *args), join=, daemon=) use "
                               "mpddp.spawn(fn, args=..., nprocs=..., join=False)")
