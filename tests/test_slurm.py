"""SLURM variable parsing as tables: node lists, task counts, layouts, merging under flags."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from click.testing import CliRunner

from mpddp.cli import build_config, main
from mpddp.cli.options import LAUNCH_FIELDS
from mpddp.errors import ConfigError
from mpddp.machine import slurm
from mpddp.machine.cluster import apply_cluster
from mpddp.machine.joblayout import describe, port_for, user_command

pytestmark = pytest.mark.timeout(30)

MAIN = ["/site-packages/mpddp/__main__.py", "train", "--epochs", "1"]


def no_scontrol(spec: str) -> list[str] | None:
    return None


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("n1", ["n1"]),
        ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("rack1-[2-3]", ["rack1-2", "rack1-3"]),
        ("x[009-011]", ["x009", "x010", "x011"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("gpu[1],cpu[3-4],login", ["gpu1", "cpu3", "cpu4", "login"]),
        (" n1 , n2 ", ["n1", "n2"]),
    ],
)
def test_expand_nodelist(spec: str, hosts: list[str]) -> None:
    assert slurm.expand_nodelist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("gpu[01-03", "unbalanced brackets|unmatched bracket"),
        ("gpu01-03]", "unbalanced brackets"),
        ("gpu[3-1]", "backwards range '3-1'"),
        ("gpu[a-b]", "range 'a-b'"),
        ("", "names no host"),
    ],
)
def test_expand_nodelist_errors(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        slurm.expand_nodelist(spec)


def test_hostnames_prefers_scontrol_and_falls_back() -> None:
    assert slurm.hostnames("n[1-2]", lambda spec: ["from-scontrol"]) == ["from-scontrol"]
    assert slurm.hostnames("n[1-2]", no_scontrol) == ["n1", "n2"]


@pytest.mark.parametrize(("job_id", "port"), [(0, 20000), (1, 20001), (1234, 21234), (9999, 29999), (123456, 23456)])
def test_port_for_job(job_id: int, port: int) -> None:
    assert port_for(str(job_id)) == port
    assert 20000 <= port < 32768  # below Linux's ephemeral ports


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("1", [1]), ("1(x2)", [1, 1]), ("2(x3),1", [2, 2, 2, 1]), ("2,1", [2, 1]), ("4(x1)", [4])],
)
def test_parse_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert slurm.parse_tasks_per_node(spec) == counts


def test_parse_tasks_per_node_error() -> None:
    with pytest.raises(ConfigError, match=r"SLURM_TASKS_PER_NODE='2\(3\)' is not like"):
        slurm.parse_tasks_per_node("2(3)")


# What `srun -N2 --ntasks-per-node=1 --gpus-per-node=2` showed node n2 on the test cluster.
STEP_N2 = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NTASKS": "2",
    "SLURM_GPUS_ON_NODE": "2",
    "SLURM_STEP_GPUS": "0,1",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "SLURMD_NODENAME": "n2",
}
# The batch script of `sbatch --nodes=2 --ntasks-per-node=1`: no step id.
BATCH = {k: v for k, v in STEP_N2.items() if "STEP" not in k} | {"SLURM_NODEID": "0", "SLURMD_NODENAME": "n1"}


def layout(env: dict[str, str]) -> slurm.SlurmJob:
    found = slurm.read_job(env, no_scontrol)
    assert found is not None
    return found


def test_outside_slurm_there_is_no_layout() -> None:
    assert slurm.read_job({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}, no_scontrol) is None
    options = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None}
    assert apply_cluster(options, {}, MAIN) == options


def test_step_layout() -> None:
    got = layout(STEP_N2)
    assert (got.job_id, got.in_step, got.on_node, got.nnodes, got.node_rank) == (1234, True, True, 2, 1)
    assert (got.hosts, got.master_addr, got.master_port) == (("n1", "n2"), "n1", 21234)
    assert (got.tasks_per_node, got.tasks_here, got.gpus_on_node, got.gpu_ids) == ((1, 1), 1, 2, (0, 1))


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        # a one-node step inside a two-node job: the step's node list and node count, not the job's
        ({"SLURM_STEP_NODELIST": "n2", "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0"},
         "hosts", ("n2",)),
        ({"SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1"}, "nnodes", 1),
        ({"SLURM_STEP_NUM_NODES": None, "SLURM_NNODES": None, "SLURM_JOB_NUM_NODES": "3"}, "nnodes", 3),
        ({"SLURM_STEP_NODELIST": None, "SLURM_NODELIST": None, "SLURM_JOB_NODELIST": "gpu[01-03,7]"},
         "master_addr", "gpu01"),
        ({"SLURM_JOB_ID": None, "SLURM_JOBID": "77"}, "master_port", 20077),
        # sbatch's inherited SLURM_NTASKS_PER_NODE=2 loses to the step's own count
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "tasks_per_node", (1, 1)),
        ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None}, "tasks_per_node", (1,)),
        ({"SLURM_GPUS_ON_NODE": None}, "gpus_on_node", 2),  # counted from SLURM_STEP_GPUS
        ({"SLURM_GPUS_ON_NODE": None, "SLURM_STEP_GPUS": None, "SLURM_JOB_GPUS": "2,3,5"}, "gpus_on_node", 3),
        ({"SLURM_GPUS_ON_NODE": None, "SLURM_STEP_GPUS": None, "CUDA_VISIBLE_DEVICES": None}, "gpus_on_node", 0),
        ({"SLURM_STEP_GPUS": "2,3"}, "gpu_ids", (2, 3)),  # physical ids, for display
        ({"SLURM_STEP_GPUS": None, "SLURM_JOB_GPUS": "4"}, "gpu_ids", (4,)),
        ({"SLURM_STEP_GPUS": None}, "gpu_ids", (0, 1)),  # CUDA_VISIBLE_DEVICES
        ({"SLURM_STEP_GPUS": None, "CUDA_VISIBLE_DEVICES": "GPU-3f2a"}, "gpu_ids", None),
        ({"SLURM_STEP_ID": None}, "in_step", False),
        ({"SLURM_STEP_ID": None, "SLURM_STEPID": "3"}, "in_step", True),
        ({"SLURMD_NODENAME": None}, "on_node", False),
    ],
)
def test_layout_variables(env: dict[str, str | None], field: str, value: object) -> None:
    merged = {k: v for k, v in (STEP_N2 | env).items() if v is not None}
    assert getattr(layout(merged), field) == value


def test_bad_number_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"SLURM_NODEID='one' is not a number"):
        layout(STEP_N2 | {"SLURM_NODEID": "one"})


UNSET = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None}


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        (STEP_N2, {}, {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 21234}),
        # explicit flags win, one by one
        (STEP_N2, {"master_port": 29500}, {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 29500}),
        (STEP_N2, {"master_addr": "10.0.0.1"},
         {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 21234}),
        (STEP_N2, {"nnodes": 2, "node_rank": 1},
         {"nnodes": 2, "node_rank": 1, "master_addr": "n1", "master_port": 21234}),
        # --nnodes 1 inside a two-node step: the user runs a one-node job on each node
        (STEP_N2, {"nnodes": 1}, {"nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": None}),
        # a one-node step keeps the loopback default and an OS-chosen port
        (STEP_N2 | {"SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                    "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"},
         {}, {"nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": None}),
        # the batch script of a one-node job runs on that node: fine without srun
        (BATCH | {"SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "n1"}, {},
         {"nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": None}),
        # by hand inside a two-node batch script: explicit --nnodes, SLURM stays out
        (BATCH, {"nnodes": 3, "node_rank": 2, "master_addr": "h0", "master_port": 29500},
         {"nnodes": 3, "node_rank": 2, "master_addr": "h0", "master_port": 29500}),
    ],
)
def test_apply_slurm(env: dict[str, str], flags: dict[str, object], expected: dict[str, object]) -> None:
    options = UNSET | flags | {"nprocs": 2}
    got = apply_cluster(options, env, MAIN)
    assert got == expected | {"nprocs": 2}


@pytest.mark.parametrize(
    ("env", "flags", "words"),
    [
        (STEP_N2, {"nnodes": 3},
         r"--nnodes 3 but srun runs this job on 2 node\(s\).*drop --nnodes, or ask srun for --nodes=3"),
        (STEP_N2, {"node_rank": 0},
         r"--node-rank 0 on SLURM node 1 of 2 \(SLURM_NODEID\): .*every node would claim node rank 0; drop "
         r"--node-rank"),
        (STEP_N2 | {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"}, {},
         r"SLURM runs 2 mpddp tasks on one node \(tasks per node: 2,2\).*start it with: "
         r"srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=2 python -m mpddp train --epochs 1$"),
        (STEP_N2 | {"SLURM_STEP_TASKS_PER_NODE": "2,1"}, {}, r"tasks per node: 2,1"),
        (BATCH, {}, r"SLURM job 1234 runs this command outside srun, on 2 nodes: .*start it with: "
         r"srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=2 python -m mpddp train --epochs 1$"),
        # an salloc shell runs on the submit host: no SLURMD_NODENAME, no step
        ({k: v for k, v in BATCH.items() if k != "SLURMD_NODENAME"} | {"SLURM_NNODES": "1"}, {},
         r"outside srun, on the submit host \(an salloc shell\)"),
    ],
)
def test_layouts_that_cannot_work(env: dict[str, str], flags: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        apply_cluster(UNSET | flags, env, MAIN)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (MAIN, "python -m mpddp train --epochs 1"),
        (["/usr/local/bin/mpddp", "train"], "python -m mpddp train"),
        (["train.py", "--lr", "0.1 0.2"], "python train.py --lr '0.1 0.2'"),
        (["-c"], "python your_script.py"),
        ([], "python your_script.py"),
    ],
)
def test_user_command(argv: list[str], command: str) -> None:
    assert user_command(argv) == command


def test_describe_names_each_source() -> None:
    text = describe(slurm.read_layout(STEP_N2, MAIN, scontrol=no_scontrol))
    assert "From SLURM job 1234 (inside srun):" in text
    assert "node_rank   = 1              (SLURM_NODEID)" in text
    assert "master_addr = n1             (first host of SLURM_STEP_NODELIST=n[1-2])" in text
    assert "master_port = 21234          (20000 + SLURM_JOB_ID % 10000)" in text


@pytest.fixture
def slurm_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Replace every SLURM variable of this process with ``env`` (scontrol not asked)."""
    import os

    monkeypatch.setattr(slurm, "scontrol_hostnames", no_scontrol)
    for name in list(os.environ):
        if name.startswith(("SLURM", "CUDA_VISIBLE")):
            monkeypatch.delenv(name)

    def set_env(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


# what the CLI passes with no flag (None: unset), for every launch option it has
LAUNCH_DEFAULTS = {name: None for name in LAUNCH_FIELDS} | {
    "backend": "gloo", "start_method": "spawn", "max_restarts": 0, "output_ranks": "all", "verbose": False,
}


def test_build_config_takes_slurm_values_under_flags(slurm_env: Callable[[dict[str, str]], None]) -> None:
    slurm_env(STEP_N2)
    config = build_config(**LAUNCH_DEFAULTS | {"nprocs": 2, "master_port": 29555})
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (2, 1, "n1", 29555)
    assert config.gpus is None  # SLURM's choice stays in CUDA_VISIBLE_DEVICES, which gpus.py applies


def test_build_config_outside_slurm(slurm_env: Callable[[dict[str, str]], None]) -> None:
    config = build_config(**LAUNCH_DEFAULTS)
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (1, 0, "127.0.0.1", 0)


def test_cli_several_tasks_per_node_prints_the_srun_line(slurm_env: Callable[[dict[str, str]], None]) -> None:
    slurm_env(STEP_N2 | {"SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    with pytest.raises(ConfigError, match=r"start it with: srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=2 "):
        build_config(**LAUNCH_DEFAULTS)


def test_ranks_inside_an_allocation_shows_it(slurm_env: Callable[[dict[str, str]], None]) -> None:
    slurm_env(STEP_N2 | {"SLURM_STEP_GPUS": "4,5"})
    result = CliRunner().invoke(main, ["ranks"])
    assert result.exit_code == 0, result.output
    assert "From SLURM job 1234 (inside srun):" in result.output
    assert "world_size = nnodes × nprocs_per_node = 2 × 2 = 4" in result.output
    assert "   1           1  1×2+1 = 3         cuda:1   5" in result.output
    assert "note:" not in result.output


def test_ranks_in_the_batch_script_explains_srun(slurm_env: Callable[[dict[str, str]], None]) -> None:
    slurm_env(BATCH)
    result = CliRunner().invoke(main, ["ranks", "--nprocs", "3"])
    assert result.exit_code == 0, result.output
    assert "From SLURM job 1234 (outside srun):" in result.output
    assert "note: SLURM job 1234 runs this command outside srun, on 2 nodes" in result.output
    assert "world_size = nnodes × nprocs_per_node = 2 × 3 = 6" in result.output


def test_ranks_flags_win_over_the_allocation(slurm_env: Callable[[dict[str, str]], None]) -> None:
    slurm_env(STEP_N2)
    result = CliRunner().invoke(main, ["ranks", "--nnodes", "3", "--nprocs", "1"])
    assert result.exit_code == 0, result.output
    assert "From SLURM" not in result.output
    assert "world_size = nnodes × nprocs_per_node = 3 × 1 = 3" in result.output
