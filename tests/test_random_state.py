"""Every rank draws from its own random state, as a fresh process under torchrun does.

Ranks are forked from one forkserver (or from the launcher, under fork) that imported torch and numpy: without a
reseed every rank, and every restart, inherits the same generators. Each path a rank can be started by is checked:
``launch`` under the three start methods, ``mpddp.spawn``, ``mpddp run`` and a restart; a script that seeds
itself is compared with torchrun's draws.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mpddp

from helpers import short_dir

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leftovers")]


def draws(ctx) -> dict:
    """What a rank's generators give first: torch's seed and draw, numpy's legacy global draw, and random's."""
    import random

    import numpy
    import torch

    return {"rank": ctx.rank, "seed": torch.initial_seed(), "torch": torch.randn(3).tolist(),
            "numpy": numpy.random.rand(3).tolist(), "random": random.random()}


def assert_all_differ(found: list[dict]) -> None:
    for key in ("seed", "torch", "numpy", "random"):
        values = [json.dumps(d[key]) for d in found]
        assert len(set(values)) == len(values), f"{key} is the same on several ranks: {values}"


LAUNCH = """
import json, sys, numpy, torch, mpddp
from test_random_state import draws
torch.manual_seed(0)  # the launcher's own state: no rank may inherit it
numpy.random.seed(0)
print(json.dumps(mpddp.launch(draws, nprocs=2, start_method=sys.argv[1])))
"""


@pytest.mark.parametrize("start_method", ["forkserver", "fork", "spawn"])
def test_launch_gives_every_rank_its_own_random_state(start_method):
    """In a fresh interpreter, as a user's script runs it: ``fork`` is refused where the process runs threads,
    and a thread another test of this worker left behind is none of this test's business."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, str(Path(mpddp.__file__).parent.parent)])}
    done = subprocess.run([sys.executable, "-c", LAUNCH, start_method], capture_output=True, text=True, env=env,
                          timeout=150)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert [d["rank"] for d in found] == [0, 1]
    assert_all_differ(found)
    assert all(d["seed"] != 0 for d in found)


def test_two_launches_draw_differently():
    first, second = mpddp.launch(draws, nprocs=2), mpddp.launch(draws, nprocs=2)
    assert_all_differ([*first, *second])  # the forkserver is reused: its state must not be replayed


def by_index(i: int) -> tuple[int, int, list[float]]:
    import torch

    return i, torch.initial_seed(), torch.rand(2).tolist()


def test_spawn_gives_every_process_its_own_random_state():
    found = mpddp.spawn(by_index, nprocs=2)
    assert [i for i, _, _ in found] == [0, 1]
    assert found[0][1] != found[1][1] and found[0][2] != found[1][2]


def seed_per_attempt(ctx, record: str) -> int:
    """Write this attempt's seed; the first attempt of rank 1 then fails, so the group restarts once."""
    import torch

    with open(record, "a") as f:
        f.write(json.dumps({"rank": ctx.rank, "restart": ctx.restart, "seed": torch.initial_seed()}) + "\n")
    if ctx.restart == 0 and ctx.rank == 1:
        raise RuntimeError("fail once, to restart")
    return torch.initial_seed()


def test_a_restarted_rank_draws_a_new_seed(tmp_path):
    record = tmp_path / "seeds.jsonl"
    mpddp.launch(seed_per_attempt, args=(str(record),), nprocs=2, max_restarts=1)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted((r["restart"], r["rank"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seeds = [r["seed"] for r in rows]
    assert len(set(seeds)) == 4, rows  # a rank's restart does not replay its first attempt's state


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy, torch
    if "--seed" in sys.argv:
        torch.manual_seed(int(sys.argv[-1]))
        numpy.random.seed(int(sys.argv[-1]))
    print("DRAW " + json.dumps({"rank": int(os.environ["RANK"]), "seed": torch.initial_seed(),
                                "torch": torch.randn(3).tolist(), "numpy": numpy.random.rand(2).tolist()}),
          flush=True)
""")


def run_script(launcher: list[str], script: Path, *args: str) -> list[dict]:
    env = dict(os.environ, TMPDIR=str(short_dir()))
    done = subprocess.run([sys.executable, "-m", *launcher, str(script), *args], capture_output=True, text=True,
                          timeout=120, env=env, start_new_session=True)
    assert done.returncode == 0, done.stderr
    decoder = json.JSONDecoder()  # torchrun's ranks share one stream: decode from each marker
    found = [decoder.raw_decode(part)[0] for part in done.stdout.split("DRAW ")[1:]]
    return sorted(found, key=lambda d: d["rank"])


def test_mpddp_run_gives_every_rank_its_own_random_state(tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(SCRIPT)
    found = run_script(["mpddp", "run", "--nprocs", "2"], script)
    assert [d["rank"] for d in found] == [0, 1]
    assert found[0]["seed"] != found[1]["seed"] and found[0]["torch"] != found[1]["torch"]
    assert found[0]["numpy"] != found[1]["numpy"]


def test_a_script_that_seeds_itself_draws_what_it_draws_under_torchrun(tmp_path):
    script = tmp_path / "draw.py"
    script.write_text(SCRIPT)
    ours = run_script(["mpddp", "run", "--nprocs", "2"], script, "--seed", "0")
    theirs = run_script(["torch.distributed.run", "--standalone", "--nproc-per-node", "2"], script, "--seed", "0")
    assert len(ours) == len(theirs) == 2
    assert ours == theirs
    assert ours[0]["seed"] == 0 and ours[0]["torch"] == ours[1]["torch"]  # seeded alike: drawn alike
