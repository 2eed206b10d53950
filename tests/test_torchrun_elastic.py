"""torchrun's elastic command line under ``mpddp run``: the same line on every node, with no ``--node-rank``.

Every combination of ``--nnodes`` (N, MIN:MAX, absurd), ``--rdzv-backend`` (c10d, static, etcd, absent) and
``--node-rank`` (absent, in range, out of range) is decided before anything starts: a valid config (the
launch itself not reached), or one line ``mpddp: error: ...`` naming the value and the fix, exit 2, from
the real command line. Then real jobs: two launchers on this machine started with torchrun's line each
find their number (node 0: the one that bound the endpoint) and run one all_reduce, as torchrun's do.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from mpddp.cli import main
from mpddp.config import LaunchConfig
from mpddp.errors import ConfigError

from helpers import leftovers, short_dir
from runs import Run, alive_or_zombie, marked

NNODES = ["2", "2:3", "0", "0:2", "3:2", "-1", "abc", "2:x"]
BACKENDS = ["c10d", "static", "etcd", None]  # None: no --rdzv-backend (mpddp's default, c10d)
NODE_RANKS = [None, "1", "7"]  # absent (numbered as it joins), in range, beyond any size above
ENDPOINT = "127.0.0.1:29411"  # c10d: node 0's store; etcd: the cluster's one member (never reached here)

# the one line's words for each absurd --nnodes, whatever the rest: (the value, the fix)
ABSURD = {
    "0": ("nnodes=0 is out of range", "pass the number of machines, e.g. --nnodes 2"),
    "0:2": ("nnodes=0:2: the smallest size must be from 1 to the largest", "pass e.g. --nnodes 1:2"),
    "3:2": ("nnodes=3:2: the smallest size must be from 1 to the largest", "pass e.g. --nnodes 2:3"),
    "-1": ("nnodes=-1 is out of range", "pass the number of machines, e.g. --nnodes 2"),
    "abc": ("nnodes='abc' is not a number of machines", "pass an integer such as 2, or MIN:MAX such as 2:4"),
    "2:x": ("nnodes='2:x' is not a number of machines", "pass an integer such as 2, or MIN:MAX such as 2:4"),
}


def expected(nnodes: str, backend: str | None, node_rank: str | None) -> dict | tuple[str, ...]:
    """The decision table: the config's fields where the line works, else the refusal's words."""
    if nnodes in ABSURD:
        return ABSURD[nnodes]
    low, high = (2, 3) if nnodes == "2:3" else (2, 2)
    if backend == "static" and low < high:
        return ("rdzv_backend='static' is a fixed number of nodes, but nnodes=2:3 is a range",
                "pass --nnodes 3", "or --rdzv-backend c10d for an elastic job")
    if node_rank == "7":
        if low == high:
            return ("node_rank=7 with nnodes=2: node ranks run from 0 to 1",
                    "pass --node-rank 1 or raise --nnodes to 8, or drop --node-rank")
        return ("node_rank=7 with nnodes=2:3: node ranks run from 0 to 2",
                "pass --node-rank 2 or less, raise MAX to --nnodes 2:8, or drop --node-rank")
    fields: dict = {"nnodes": high, "min_nnodes": low, "node_rank": None if node_rank is None else int(node_rank),
                    "rdzv_id": "job1"}
    if backend == "etcd":  # the endpoint names the etcd cluster
        return {**fields, "rdzv_backend": "etcd", "rdzv_endpoint": ENDPOINT}
    return {**fields, "rdzv_backend": "c10d", "master_addr": "127.0.0.1", "master_port": 29411}  # node 0's place


def argv(nnodes: str, backend: str | None, node_rank: str | None) -> list[str]:
    return ["--nnodes", nnodes, *(["--rdzv-backend", backend] if backend else []),
            *(["--node-rank", node_rank] if node_rank else []), "--rdzv-endpoint", ENDPOINT, "--rdzv-id", "job1",
            "--nproc-per-node", "1"]


ROWS = [(n, b, r) for n in NNODES for b in BACKENDS for r in NODE_RANKS]
WORKS = [row for row in ROWS if isinstance(expected(*row), dict)]
REFUSED = [row for row in ROWS if not isinstance(expected(*row), dict)]


def _id(row: tuple) -> str:
    nnodes, backend, rank = row
    return f"nnodes={nnodes}-{backend or 'no-backend'}-{'rank=' + rank if rank else 'no-rank'}"


SCHEDULERS = ("SLURM_", "OMPI_", "PMI_", "MPI_", "PBS_", "LSB_", "LSF_", "PET_", "KUBERNETES_")


def _job_free_env() -> dict[str, str]:
    """This machine's environment without any scheduler's variables (SLURM, MPI, ... would number the node)."""
    from mpddp.machine.cluster import present

    env = {k: v for k, v in os.environ.items() if not k.startswith(SCHEDULERS)}
    if present(env):
        pytest.skip(f"a scheduler's variables are set here: {present(env)}")
    return env


def test_the_table_holds_every_combination():
    assert len(ROWS) == 8 * 4 * 3 and len(WORKS) == 14 and len(REFUSED) == 82


@pytest.fixture
def parse(monkeypatch, tmp_path):
    """``mpddp run ARGV x.py`` up to the launch, which is never reached: the config it would start with."""
    for name in set(os.environ) - set(_job_free_env()):
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('never runs')\n")
    seen: dict = {}
    monkeypatch.setattr("mpddp.core.launcher.api.launch", lambda fn, config, args, init_process_group: seen.update(
        config=config))

    def parse(args: list[str]) -> LaunchConfig:
        result = CliRunner().invoke(main, ["run", *args, "x.py"], standalone_mode=False)
        if result.exception is not None:
            raise result.exception
        return replace(seen["config"], env=())

    return parse


@pytest.mark.parametrize("row", WORKS, ids=[_id(r) for r in WORKS])
def test_a_combination_that_works_builds_its_config(parse, row):
    """No --node-rank: ``node_rank`` None, numbered as the node joins (core/launcher/api.py, core/nodes/)."""
    config = parse(argv(*row))
    assert config == LaunchConfig(nprocs=1, **expected(*row))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def refusals() -> dict[str, tuple[subprocess.CompletedProcess, list[str], bool]]:
    """Every refused row through the real command line, a few at a time: (its result, processes left, ran)."""
    env = _job_free_env()
    base = Path(tempfile.mkdtemp(prefix="refused-"))

    def one(row: tuple) -> tuple[subprocess.CompletedProcess, list[str], bool]:
        where = base / uuid.uuid4().hex[:8]
        where.mkdir()
        (where / "x.py").write_text("open('ran', 'w').close()\n")
        marker = uuid.uuid4().hex
        out = subprocess.run([sys.executable, "-m", "mpddp", "run", *argv(*row), "x.py"], capture_output=True,
                             text=True, timeout=60, cwd=where,
                             env={**env, "MPDDP_TEST_RUN": marker, "TMPDIR": str(short_dir("rf-"))})
        deadline = time.monotonic() + 3.0
        while (left := marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return out, [" ".join(p.cmdline()) for p in left], (where / "ran").exists()

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(map(_id, REFUSED), pool.map(one, REFUSED)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", REFUSED, ids=[_id(r) for r in REFUSED])
def test_a_combination_that_cannot_work_is_one_line_exit_2(refusals, row):
    out, left, ran = refusals[_id(row)]
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("mpddp: error: "), out.stderr
    for words in expected(*row):
        assert words in lines[0], lines[0]
    assert "Traceback" not in out.stderr and out.stdout == "" and not ran and not left, (out.stdout, left)


@pytest.mark.parametrize(("options", "words"), [
    ({"nnodes": "0:2", "master_port": 29500}, "nnodes=0:2: the smallest size must be from 1 to the largest; pass "
                                              "e.g. --nnodes 1:2"),
    ({"nnodes": "2:3", "node_rank": 7, "rdzv_endpoint": ENDPOINT}, "node_rank=7 with nnodes=2:3: node ranks run "
                                                                   "from 0 to 2"),
    ({"nnodes": 2, "node_rank": 7, "rdzv_backend": "etcd", "rdzv_endpoint": ENDPOINT, "rdzv_id": "j"},
     "node_rank=7 with nnodes=2: node ranks run from 0 to 1"),
    ({"nnodes": "2:3", "rdzv_backend": "static", "rdzv_endpoint": ENDPOINT}, "rdzv_backend='static' is a fixed"),
    ({"nnodes": 2, "rdzv_endpoint": ENDPOINT, "master_port": 29500}, "--rdzv-endpoint 127.0.0.1:29411 and "
                                                                     "--master-port 29500 both say where node 0 is"),
])
def test_the_api_refuses_the_same(options, words):
    from mpddp.core.launcher.api import make_config

    with pytest.raises(ConfigError) as info:
        make_config(options)
    assert str(info.value).startswith(words) and "\n" not in str(info.value)


def test_the_api_reads_torchruns_elastic_line_as_the_cli_does(monkeypatch):
    """``mpddp.launch(fn, nnodes="2:3", rdzv_endpoint=...)``: the config the CLI builds from the same words."""
    from mpddp.core.launcher.api import make_config

    for name in set(os.environ) - set(_job_free_env()):
        monkeypatch.delenv(name)
    config = make_config({"nnodes": "2:3", "rdzv_backend": "c10d", "rdzv_endpoint": ENDPOINT, "rdzv_id": "job1",
                          "nprocs": 1})
    assert config == LaunchConfig(nprocs=1, **expected("2:3", "c10d", None))  # type: ignore[arg-type]
    assert LaunchConfig(nnodes="2:3", rdzv_endpoint=ENDPOINT, rdzv_id="job1",  # type: ignore[arg-type]
                        nprocs=1) == config
    assert LaunchConfig(nprocs=1).node_rank == 0  # one node: node 0, as ever


# ---- who is node 0: the launcher that binds the endpoint (core/launcher/api.py) ----------------------------------

@pytest.mark.parametrize(("node_rank", "where", "hosts"), [
    (None, "free", True),  # numbered, this machine's address, its port free: node 0, the socket kept
    (None, "taken", False),  # another launcher here bound it first: a client, numbered as it joins
    (None, "elsewhere", False),  # another machine's address: a client
    (1, "free", False),  # a given node rank is kept
])
def test_node_0_is_the_launcher_that_binds_the_endpoint(node_rank, where, hosts):
    from mpddp.core.launcher.api import _store_socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    if where == "taken":
        taken.listen()
    else:
        taken.close()
    addr = "192.0.2.1" if where == "elsewhere" else "127.0.0.1"  # TEST-NET-1: no machine's own
    config = LaunchConfig(nnodes=2, node_rank=node_rank, master_addr=addr, master_port=port)
    decided, sock = _store_socket(config)
    try:
        assert (sock is not None) == hosts
        assert decided.node_rank == (0 if hosts else node_rank)
        if sock is not None:
            assert sock.getsockname()[:2] == ("127.0.0.1", port)
            with pytest.raises(OSError):  # held: a second launcher here cannot bind it too
                socket.create_server(("127.0.0.1", port))
    finally:
        taken.close()
        if sock is not None:
            sock.close()


def test_a_round_orders_old_nodes_then_given_node_ranks_then_arrivals():
    """core/nodes/membership.py's order of an elastic round: a launcher without --node-rank comes after every
    launcher given one (c10d: node 0, the store's host, is given 0), in the order they came."""
    from mpddp.core.nodes.rules import member_order as _order

    arrivals = {"late": {"old": None, "rank": None, "since": 3.0}, "early": {"old": None, "rank": None, "since": 1.0},
                "given 1": {"old": None, "rank": 1, "since": 5.0}, "host": {"old": None, "rank": 0, "since": 4.0},
                "kept": {"old": 0, "rank": None, "since": 9.0}}
    assert sorted(arrivals, key=lambda m: _order(arrivals[m])) == ["kept", "host", "given 1", "early", "late"]


# ---- real jobs: two launchers on this machine, torchrun's line on both ------------------------------------------

JOB = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")}
    print("RESULT " + json.dumps({**seen, "sum": t.item()}), flush=True)
    dist.destroy_process_group()
""")


def _results(stdout: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line]


def _two_launchers(tmp_path: Path, command: list[str], line: list[str]) -> list[dict]:
    """``python COMMAND LINE job.py`` twice, each in its own session (SIGINT at its default), both exiting 0:
    every rank's RESULT, checked against the all_reduce computed here. Nothing of either is left running
    (and, of mpddp's, no temporary file)."""
    (tmp_path / "job.py").write_text(JOB)
    runs = []
    try:
        for node in range(2):
            (tmp_path / f"n{node}").mkdir()
            runs.append(Run([*command, *line, str(tmp_path / "job.py")], tmp_path / f"n{node}"))
        for run in runs:
            run.list_tree()
        codes = [run.finish(60) for run in runs]
        assert codes == [0, 0], [run.stderr for run in runs]
        for run in runs:
            if "mpddp" in command:
                run.assert_nothing_left()
            else:  # torchrun: its processes (it leaves its log directories in TMPDIR)
                deadline = time.monotonic() + 3.0
                while (left := alive_or_zombie(run.pids) + marked(run.marker)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not left, left
        seen = sorted((r for run in runs for r in _results(run.stdout)), key=lambda r: int(r["RANK"]))
    finally:
        for run in runs:
            run.kill()
    world = 2
    assert [(r["RANK"], r["GROUP_RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in seen] == [
        ("0", "0", "0", "2"), ("1", "1", "0", "2")]
    assert [r["sum"] for r in seen] == [float(sum(rank + 1 for rank in range(world)))] * world  # 1 + 2
    assert not leftovers()
    return seen


def _torchrun_line(port: int, backend: str, nnodes: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", backend, "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "job1", "--max-restarts", "1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "nnodes"), [("c10d", "2:3"), ("static", "2")])
def test_torchruns_line_without_node_rank_starts_a_two_node_job(tmp_path, backend, nnodes):
    """Was: ``TypeError: '>' not supported between instances of 'str' and 'int'`` on every node (c10d), and
    "mpddp needs each node's number" (static)."""
    from multinode import free_port

    _two_launchers(tmp_path, ["-m", "mpddp", "run"], _torchrun_line(free_port(), backend, nnodes))


@pytest.mark.timeout(60)
def test_torchrun_itself_numbers_the_same_line_the_same_way(tmp_path):
    """torchrun's own agents on the same line (its 30 s last call cut to 1 s, for both): the same ranks, world
    size and sum."""
    from multinode import free_port

    line = [*_torchrun_line(free_port(), "c10d", "2:3"), "--rdzv-conf", "last_call_timeout=1"]
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "mpddp").mkdir()
    theirs = _two_launchers(tmp_path / "torchrun", ["-m", "torch.distributed.run"], line)
    line[line.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{free_port()}"
    ours = _two_launchers(tmp_path / "mpddp", ["-m", "mpddp", "run"], line)
    assert ours == theirs
