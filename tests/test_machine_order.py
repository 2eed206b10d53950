"""Machines start in any order: an elastic c10d job on two namespace hosts (tests/machines.py) whose other machine's
launcher comes to the round before the endpoint's, in torchrun's own spelling (``--rdzv-backend c10d --rdzv-endpoint
HOST:PORT``, no ``--node-rank``).

The endpoint's machine hosts the job's store, and is node 0 of every round (docs/machines.rst): only its launcher
decides a round's members. Before, the other machine ran round 0 alone as its node 0, admitted the endpoint's, and both
failed ("master_addr=… is not an address of this machine", "node 0's store … does not answer").
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from machines import Hosts

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
GIL_HELD = REPO / "tests" / "scripts" / "gil_held"  # sitecustomize: the first import of torch holds the GIL

JOB = textwrap.dedent("""
    import os, socket, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(40):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        time.sleep(0.02)
    print(f"DONE rank={rank} world={world} host={socket.gethostname()} master={os.environ['MASTER_ADDR']}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("late", [5])
def test_the_endpoints_machine_coming_second_is_node_0_and_both_run(tmp_path, late):
    """Host n1's launcher, the endpoint's, starts first and serves its store, then holds still for ``late`` seconds at
    its first import of torch (tests/scripts/gil_held: a loaded machine's import) before it comes to the round; host
    n2's comes meanwhile. Before, n2 ran round 0 alone (--nnodes 1:2's MIN, once the 3 s last call passed), as
    ``DONE rank=0 world=1 host=n2``, and n1 never ran."""
    (tmp_path / "job.py").write_text(JOB)
    with Hosts(tmp_path / "hosts", 2) as hosts:
        line = ["-m", "mpddp", "run", "--nnodes", "1:2", "--nprocs", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{hosts[0].address}:29400", str(tmp_path / "job.py")]
        held = {"PYTHONPATH": f"{GIL_HELD}:{REPO}", "MPDDP_TEST_HOLD_GIL": str(late)}
        endpoint = hosts[0].launch(line, tmp_path / "n1", env=held)  # its first import of torch: after its store
        other = hosts[1].launch(line, tmp_path / "n2")
        codes = [run.finish(120) for run in (endpoint, other)]
        assert codes == [0, 0], [run.stderr for run in (endpoint, other)]
        done = [re.search(r"DONE rank=(\d) world=(\d) host=(\w+) master=(\S+)", run.stdout)
                for run in (endpoint, other)]
        assert all(done), [run.stdout + run.stderr for run in (endpoint, other)]
        found = {(m.group(3), int(m.group(1)), int(m.group(2)), m.group(4)) for m in done if m}
        assert found == {("n1", 0, 2, hosts[0].address), ("n2", 1, 2, hosts[0].address)}, found
        for run in (endpoint, other):
            run.assert_nothing_left()


