"""torchrun's command line under ``mpddp run``: every spelling is accepted (and reaches the config and the
worker's environment) or refused in one line, and each worker's environment is a real torchrun's, plus
mpddp's documented additions (docs/torchrun.rst)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mpddp.cli import main
from mpddp.cli.run import REFUSED
from mpddp.config import LaunchConfig
from mpddp.core.launcher.plan import node_env, plan_launch, rank_env
from mpddp.errors import ConfigError

from helpers import short_dir
from runs import Run

SCRIPTS = Path(__file__).parent / "scripts"
ENV_SCRIPT = str(SCRIPTS / "torchrun_env.py")
CPUS = len(os.sched_getaffinity(0))  # what torchrun's --nproc-per-node cpu counts
MULTI = {"nnodes": 2, "node_rank": 1, "master_port": 29500}
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.fixture
def parse(monkeypatch, tmp_path):
    """``mpddp run ARGV x.py`` up to the launch: the config and worker variables it would start with."""
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('never runs')\n")
    seen: dict = {}
    monkeypatch.setattr("mpddp.core.launcher.api.launch", lambda fn, config, args, init_process_group: seen.update(
        config=config, args=args))

    def parse(argv: list[str], target: str = "x.py") -> tuple[LaunchConfig, dict[str, str], tuple]:
        seen.clear()
        result = CliRunner().invoke(main, ["run", *argv, target], standalone_mode=False)
        if result.exception is not None:
            raise result.exception
        return replace(seen["config"], env=()), dict(seen["config"].env), seen["args"]

    return parse


ACCEPTED = [  # argv before the script, LaunchConfig fields, worker variables beyond AGENT_STORE
    (["--nproc-per-node", "2"], {"nprocs": 2}, {}),
    (["--nproc_per_node", "2"], {"nprocs": 2}, {}),
    (["--nproc-per-node=2"], {"nprocs": 2}, {}),
    (["--nproc_per_node=2"], {"nprocs": 2}, {}),
    (["--nproc-per-node", "gpu"], {}, {}),  # mpddp's default: one per GPU, else 1
    (["--nproc-per-node", "auto"], {}, {}),
    (["--nproc-per-node", "cpu"], {"nprocs": CPUS}, {}),
    (["--nnodes", "1"], {}, {}),
    (["--nnodes=1:1"], {}, {}),
    (["--nnodes=2:3", "--master-port", "29500"], {"nnodes": 3, "min_nnodes": 2, "master_port": 29500}, {}),  # elastic
    (["--nnodes", "2:2", "--node-rank", "1", "--master-addr", "node0", "--master-port", "29500"],
     {**MULTI, "master_addr": "node0"}, {}),
    (["--nnodes=2", "--node_rank=1", "--master_addr=node0", "--master_port=29500"], {**MULTI, "master_addr": "node0"},
     {}),
    (["--standalone", "--nproc-per-node", "2"], {"nprocs": 2}, {}),
    # under --standalone torchrun ignores the rendezvous flags: so does mpddp
    (["--standalone", "--rdzv-id", "job7", "--rdzv-endpoint", "node0:1", "--rdzv-backend", "c10d"], {}, {}),
    (["--rdzv-endpoint", "node0:29401", "--rdzv-backend", "c10d", "--nnodes", "2", "--node-rank", "1"],
     {**MULTI, "master_addr": "node0", "master_port": 29401}, {}),
    (["--rdzv_endpoint=node0", "--rdzv_backend=static", "--nnodes=2", "--node_rank=1"],
     {**MULTI, "master_addr": "node0", "master_port": 29400}, {}),  # torchrun's port for an endpoint without one
    # torchrun's elastic line, the same on every node: each is numbered as it joins (node_rank None)
    (["--nnodes=1:4", "--rdzv-id=job7", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--max-restarts=3"],
     {"nnodes": 4, "min_nnodes": 1, "rdzv_id": "job7", "master_addr": "node0", "master_port": 29400,
      "max_restarts": 3}, {}),
    (["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "node0:29401"],
     {"nnodes": 2, "master_addr": "node0", "master_port": 29401}, {}),
    (["--rdzv-endpoint", "[::1]:29402"], {"master_addr": "::1", "master_port": 29402}, {}),
    (["--rdzv-endpoint", "localhost:0"], {"master_addr": "localhost"}, {}),
    (["--rdzv-endpoint", "node0:29500", "--master-addr", "node0", "--master-port", "29500"],
     {"master_addr": "node0", "master_port": 29500}, {}),  # the same place twice is no conflict
    (["--max-restarts", "3"], {"max_restarts": 3}, {}),
    (["--max_restarts=3"], {"max_restarts": 3}, {}),
    (["--log-dir", "logs"], {"log_dir": "logs"}, {}),
    (["--log_dir=logs"], {"log_dir": "logs"}, {}),
    (["--start_method", "spawn"], {"start_method": "spawn"}, {}),
    (["--local-ranks-filter", "1", "--nproc-per-node", "2"], {"nprocs": 2, "output_ranks": (1,)}, {}),
    (["--local-ranks-filter", "0"], {"output_ranks": (0,)}, {}),  # one node: local ranks are global ones
    # local ranks 0 and 1 of node 1 are global ranks 1×2+0 and 1×2+1
    (["--local_ranks_filter=0,1", "--nproc_per_node=2", "--nnodes=2", "--node_rank=1", "--master_port=29500"],
     {**MULTI, "nprocs": 2, "output_ranks": (2, 3)}, {}),
    (["--redirects", "3", "--tee", "3"], {}, {}),  # accepted: lines always reach the terminal
    (["-r", "0:1,1:2", "-t", "3", "--log-dir", "logs"], {"log_dir": "logs"}, {}),
    (["--rdzv-id", "job7"], {"rdzv_id": "job7"}, {}),  # the plan's TORCHELASTIC_RUN_ID (below)
    (["--rdzv_id=job7"], {"rdzv_id": "job7"}, {}),
    (["--run-id", "job7"], {"rdzv_id": "job7"}, {}),
    (["--role", "trainer"], {}, {"ROLE_NAME": "trainer"}),
    (["--monitor-interval", "0.5", "--run-path"], {}, {}),
    (["--monitor_interval=5", "--run_path"], {}, {}),
    (["--no-prefix"], {"no_prefix": True}, {}),
    # torchrun 2.13's: the grace after a stop, the signals passed on, one GPU a rank, NUMA binding
    (["--shutdown-timeout", "5"], {"shutdown_timeout": 5.0}, {}),
    (["--shutdown_timeout=0"], {"shutdown_timeout": 0.0}, {}),
    (["--signals-to-handle", "SIGTERM,SIGUSR1"], {"signals_to_handle": ("SIGTERM", "SIGUSR1")}, {}),
    (["--signals_to_handle=SIGUSR1,SIGUSR2"], {"signals_to_handle": ("SIGUSR1", "SIGUSR2")}, {}),
    (["--virtual-local-rank"], {"virtual_local_rank": True}, {}),
    (["--virtual_local_rank"], {"virtual_local_rank": True}, {}),
    (["--numa-binding", "node"], {"numa_binding": "node"}, {}),
    (["--numa_binding=core-complex"], {"numa_binding": "core-complex"}, {}),
]


@pytest.mark.parametrize("argv, fields, env", ACCEPTED, ids=[" ".join(row[0]) for row in ACCEPTED])
def test_each_torchrun_spelling_reaches_the_config(parse, argv, fields, env):
    config, worker_env, (target, script_args, is_module) = parse([*argv])
    assert config == LaunchConfig(**fields)
    assert worker_env == {**AGENT_STORE, **env}
    assert (target, script_args, is_module) == ("x.py", (), False)


@pytest.mark.parametrize("flag", ["-m", "--module"])
def test_module_flag(parse, tmp_path, flag):
    (tmp_path / "mymod.py").write_text("")
    assert parse([flag], target="mymod")[2] == ("mymod", (), True)


def test_the_flags_reach_each_workers_environment(parse):
    """A two-node torchrun line, node 1: what its workers see (the plan's real environment, nothing started)."""
    config, extra, _ = parse(["--nnodes=2:2", "--node_rank=1", "--master_addr=127.0.0.1", "--master_port=29500",
                              "--nproc_per_node=2", "--max_restarts=3", "--rdzv_id=job7", "--role", "trainer"])
    plan = plan_launch(replace(config, env=tuple(extra.items())))
    shared = node_env(plan, 29500, restarts=1)
    envs = [rank_env(shared, slot, "/errors") for slot in plan.slots]
    assert [(e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"], e["TORCHELASTIC_ERROR_FILE"]) for e in envs] == [
        ("2", "0", "2", "/errors/rank2.json"), ("3", "1", "3", "/errors/rank3.json")]
    for e in envs:
        assert {k: e[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                                  "NODE_RANK")} == {
            "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
            "ROLE_NAME": "trainer", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "NODE_RANK": "1"}


def test_run_ids_without_the_flag():
    """torchrun's: a fresh id on one node (as --standalone), "none" on several (its static rendezvous)."""
    one = [plan_launch(LaunchConfig(nprocs=1)).run_id for _ in range(2)]
    assert one[0] != one[1] and all(str(uuid.UUID(i)) == i for i in one)
    assert plan_launch(LaunchConfig(nprocs=1, **MULTI)).run_id == "none"


UNKNOWN_VALUE = {"--no-python", "--run-path"}  # flags; the others take a value
REFUSED_ROWS = [  # argv before the script, the start of the one line
    (["--nnodes", "1:4"], "master_port=0 with nnodes>1: every node must know the port in advance"),
    (["--nnodes=3:2", "--rdzv-backend", "etcd"], "nnodes=3:2: the smallest size must be from 1 to the largest"),
    (["--nproc-per-node", "xpu"], "Invalid value for '--nprocs' / '--nproc-per-node' / '--nproc_per_node': "
                                  "nprocs='xpu' is not a number of workers"),
    (["--rdzv-backend", "etcd"], "rdzv_backend='etcd' needs the etcd cluster's members: pass --rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379"], "rdzv_backend='etcd' needs the job's id"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379", "--rdzv-id", "caf\u00e9"],
     "--rdzv-id 'caf\u00e9' is not ASCII, and the job's keys in etcd are named after it"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379", "--rdzv-id", "a/i/x"],
     "--rdzv-id 'a/i/x' has a '/', and the job's keys in etcd lie under /mpddp/<rdzv-id>/"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2", "--rdzv-id", "j"], "--rdzv-endpoint 'e1:2379,e2': "
                                                                                     "'e2' is not HOST:PORT"),
    (["--rdzv_backend=etcd-v2"], "rdzv_backend='etcd-v2' is unknown: use c10d"),
    (["--rdzv-conf", "ttl=1"], "rdzv_conf ttl='1' is not allowed: it must be a number of seconds from 2"),
    (["--rdzv-conf", "ttl"], "rdzv_conf='ttl': 'ttl' is not key=value"),
    (["--rdzv-conf", "cert=a.pem"], "rdzv_conf gives cert or key alone"),
    (["--standalone", "--nnodes", "2"], "--standalone is one node, but --nnodes is 2: drop --standalone"),
    (["--nnodes", "2:3", "--rdzv-backend", "static", "--rdzv-endpoint", "node0:29400"],
     "rdzv_backend='static' is a fixed number of nodes, but nnodes=2:3 is a range: pass --nnodes 3"),
    (["--local-ranks-filter", "0", "--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "node0:29400"],
     "--local-ranks-filter 0 on a node numbered as it joins (no --node-rank): its global ranks are known only then"),
    (["--rdzv-endpoint", "node0:29400", "--master-port", "29500"],
     "--rdzv-endpoint node0:29400 and --master-port 29500 both say where node 0 is, and disagree"),
    (["--rdzv-endpoint", "node0:port"], "--rdzv-endpoint 'node0:port' is not HOST:PORT"),
    (["--local-ranks-filter", "2", "--nproc-per-node", "2"], "--local-ranks-filter 2 names local rank 2, but this "
                                                             "node has 2: pass local ranks from 0 to 1"),
    (["--local-ranks-filter", "0", "--output-ranks", "0"], "--local-ranks-filter 0 and --output-ranks 0 both pick"),
    (["--local-ranks-filter", "0", "--nnodes", "2", "--master-port", "29500"],
     "--local-ranks-filter 0 on 2 nodes needs --nproc-per-node N"),
    (["--local-ranks-filter", "x"], "--local-ranks-filter 'x' is not a list of local ranks"),
    (["--rdzv_conf", "join_timeout=5"], "rdzv_conf join_timeout=5: --timeout is how long the nodes wait to meet "
                                        "here; pass --timeout 5"),
    (["--rdzv_conf", "color=red"], "rdzv_conf key 'color' is not known: use ttl, lease_ttl, last_call_timeout"),
    *[([flag] if flag in UNKNOWN_VALUE else [flag, "1"], f"{flag} is torchrun's, with no counterpart in mpddp: ")
      for flag in REFUSED],
]


@pytest.mark.parametrize("argv, words", REFUSED_ROWS, ids=[" ".join(row[0]) for row in REFUSED_ROWS])
def test_each_other_torchrun_flag_is_refused_saying_what_instead(parse, argv, words):
    with pytest.raises((ConfigError, click.UsageError)) as info:
        parse(argv)
    error = info.value
    message = error.format_message() if isinstance(error, click.UsageError) else str(error)
    assert message.startswith(words)
    assert "\n" not in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--nnodes", "3:2"], ["--rdzv-backend", "etcd"], ["--no-python"]])
def test_a_refusal_is_one_line_exit_2_and_starts_nothing(tmp_path, argv):
    (tmp_path / "x.py").write_text("open('ran', 'w').close()\n")
    out = subprocess.run([sys.executable, "-m", "mpddp", "run", *argv, "--nproc-per-node", "2", "x.py"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("mpddp: error: ") and len(out.stderr.splitlines()) == 1, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.py"]


# ---- the environment, against a real torchrun ------------------------------------------------------------

SAME = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE")
# set by both, each to its own: a free port, a fresh id and error file, threads
OWN_VALUES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")
MPDDP_ADDS = ("NODE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MPDDP_STDOUT_ISATTY", "PYTHONUNBUFFERED",
              "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")
STANDALONE = ["--standalone", "--nproc-per-node", "2"]
SPELLED_OUT = ["--nnodes", "1:1", "--nproc_per_node=2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
               "--rdzv-id", "job7", "--role", "trainer", "--max-restarts", "1"]
# torchrun 2.13's own flags (--numa-binding binds nothing without a GPU, and torchrun's then fails to bind)
TORCHRUN_213 = [*STANDALONE, "--shutdown-timeout", "5", "--signals-to-handle", "SIGTERM,SIGUSR1",
                "--virtual-local-rank"]


def _reports(stdout: str) -> dict[int, dict]:
    decoder = json.JSONDecoder()  # torchrun's ranks share one stream, where lines can glue
    found = [decoder.raw_decode(part)[0] for part in stdout.split("ENV ")[1:]]
    return {r["rank"]: r for r in found}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("argv", [STANDALONE, SPELLED_OUT, TORCHRUN_213], ids=["standalone", "spelled-out", "2.13"])
def test_the_environment_is_torchruns_plus_documented_additions(tmp_path, argv):
    virtual = ("CUDA_VISIBLE_DEVICES",) if "--virtual-local-rank" in argv else ()  # each rank's own device
    own = set(SAME + OWN_VALUES + MPDDP_ADDS + virtual)
    env = {k: v for k, v in os.environ.items()
           if k not in own and k != "TMPDIR" and not k.startswith(("TORCHELASTIC", "SLURM_"))}  # each its own TMPDIR
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv, ENV_SCRIPT], capture_output=True,
                            text=True, timeout=90, env={**env, "TMPDIR": str(short_dir())})
    assert theirs.returncode == 0, theirs.stderr
    ours = Run(["-m", "mpddp", "run", *argv, ENV_SCRIPT], tmp_path, env=env)
    try:
        assert ours.finish(90) == 0, ours.stderr
        ours.assert_nothing_left()  # the error files' directory too
    finally:
        ours.kill()
    a, b = _reports(theirs.stdout), _reports(ours.stdout)
    assert sorted(a) == sorted(b) == [0, 1]
    assert b[0]["env"]["TORCHELASTIC_ERROR_FILE"] != b[1]["env"]["TORCHELASTIC_ERROR_FILE"]  # one per rank
    launched = set(env) | {"MPDDP_TEST_RUN", "TMPDIR", "FAIL_GO"}  # what each launcher was given
    for rank in (0, 1):
        t = {k: v for k, v in a[rank].pop("env").items() if k not in launched}
        m = {k: v for k, v in b[rank].pop("env").items() if k not in launched}
        assert set(t) == set(SAME + OWN_VALUES + virtual)  # torchrun sets no variable that mpddp does not
        assert set(m) == set(t) | set(MPDDP_ADDS)
        assert {k: m[k] for k in SAME + virtual} == {k: t[k] for k in SAME + virtual}
        assert m["TORCHELASTIC_ERROR_FILE"].startswith(str(ours.tmpdir))
        if argv is SPELLED_OUT:
            assert (m["MASTER_ADDR"], m["TORCHELASTIC_RUN_ID"]) == (t["MASTER_ADDR"], t["TORCHELASTIC_RUN_ID"]) == (
                "localhost", "job7")
        else:
            assert uuid.UUID(m["TORCHELASTIC_RUN_ID"]) and m["MASTER_ADDR"] == "127.0.0.1"
        # torchelastic_launched, the collective timeout (torch's default for a script's own
        # init_process_group), an error file's directory that exists while the rank runs
        assert a[rank] == b[rank] and a[rank]["elastic"] and a[rank]["timeout"] == a[rank]["default_timeout"]
        assert a[rank]["error_dir_exists"] and not a[rank]["error_file_exists"]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftovers")
def test_two_nodes_by_hand_see_what_torchrun_gives_them(tmp_path):
    """``--nnodes 2 --node-rank R --master-addr --master-port``, both nodes on loopback: the same for every rank."""
    from multinode import free_port

    own = set(SAME + OWN_VALUES + MPDDP_ADDS)
    env = {k: v for k, v in os.environ.items() if k not in own and not k.startswith(("TORCHELASTIC", "SLURM_"))}
    seen, ports = {}, {}
    for launcher in (["torch.distributed.run"], ["mpddp", "run"]):
        port, tmp = free_port(), short_dir()  # the forkserver's socket lies in TMPDIR: short
        ports[launcher[0]] = str(port)
        nodes = [subprocess.Popen(
            [sys.executable, "-m", *launcher, "--nnodes", "2", "--node-rank", str(node), "--master-addr",
             "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1", ENV_SCRIPT],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "TMPDIR": str(tmp)})
            for node in (0, 1)]
        outs = [node.communicate(timeout=90) for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], outs
        seen[launcher[0]] = {**_reports(outs[0][0]), **_reports(outs[1][0])}
        if launcher[0] == "mpddp":
            assert list(tmp.iterdir()) == []  # the error files' directories are gone on both nodes
    a, b = seen["torch.distributed.run"], seen["mpddp"]
    assert sorted(a) == sorted(b) == [0, 1]
    for rank in (0, 1):
        t = {k: v for k, v in a[rank].pop("env").items() if k not in env and k != "TMPDIR"}
        m = {k: v for k, v in b[rank].pop("env").items() if k not in env and k != "TMPDIR"}
        assert set(m) == set(t) | set(MPDDP_ADDS) | {"OMP_NUM_THREADS"}  # torchrun sets it for 2 ranks or more
        assert (t["MASTER_PORT"], m["MASTER_PORT"]) == (ports["torch.distributed.run"], ports["mpddp"])
        everything_but = {"TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "MASTER_PORT"}
        assert {k: m[k] for k in t if k not in everything_but} == {k: t[k] for k in t if k not in everything_but}
        assert (m["RANK"], m["GROUP_RANK"], m["GROUP_WORLD_SIZE"], m["TORCHELASTIC_RUN_ID"]) == (
            str(rank), str(rank), "2", "none")
        assert a[rank] == b[rank]
