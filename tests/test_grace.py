"""A launcher told to stop gives its ranks torchrun's grace; torchrun 2.13's shutdown and placement flags.

Each case drives a real launcher in its own session (SIGINT at its default action, tests/conftest.py) whose
ranks run ``tests/scripts/save_on_signal.py``: on a stop they take 2 s to write a checkpoint, as a preempted
job's ranks do. Before, the launcher gave them 0.5 s and then SIGKILL, and torchrun 2.13's
``--shutdown-timeout``, ``--signals-to-handle``, ``--virtual-local-rank`` and ``--numa-binding`` were refused.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest
from multinode import free_port

from helpers import running
from runs import REPO, SCRIPTS, Run

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leftovers")]

SAVE = str(SCRIPTS / "save_on_signal.py")
SAVE_SECONDS = 2.0  # save_on_signal.py's checkpoint takes this long to write
KILL_MARGIN = 1.5  # seconds past --shutdown-timeout for SIGKILL to land and be seen, on 2 loaded cores


def started(run: Run, ranks: int, **kw: object) -> dict[int, int]:
    """Wait for every rank's READY line: {rank: pid}."""
    found = run.wait_for(r"READY rank=(\d+) .* pid=(\d+)", count=ranks, **kw)  # type: ignore[arg-type]
    return {int(m.group(1)): int(m.group(2)) for m in found}


def saved(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in out.glob("ckpt*") if not p.name.endswith(".tmp")}


def ended(run: Run, timeout: float = 60.0) -> int:
    try:
        rc = run.finish(timeout)
        run.assert_nothing_left()
    finally:
        run.kill()
    return rc


def test_mpddp_run_ranks_keep_the_checkpoint_they_save_on_sigterm(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", SAVE, str(out)], tmp_path)
    started(run, 2)
    assert run.stdout.count("sigint=default") == 2  # the forkserver ignores SIGINT, its ranks do not
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = ended(run)
    assert saved(out) == {"ckpt0.SIGTERM": "saved by rank 0", "ckpt1.SIGTERM": "saved by rank 1"}, run.stderr
    assert rc == 143, run.stderr
    assert run.exited_at - sent >= SAVE_SECONDS  # it waited for them
    assert run.stderr.strip().splitlines()[-1] == "mpddp: terminated (SIGTERM); every worker was stopped"
    assert "Traceback" not in run.stderr


def test_launch_ranks_keep_their_checkpoint_and_the_process_still_ends_by_sigterm(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import mpddp

        def fn(ctx, out):
            sys.path.insert(0, {str(SCRIPTS)!r})
            from save_on_signal import arm, wait
            arm(out)
            wait()

        if __name__ == "__main__":
            mpddp.launch(fn, nprocs=2, args=(sys.argv[1],), init_process_group=False, shutdown_timeout=20)
            print("launch() returned")
    """))
    run = Run([str(script), str(out)], tmp_path)
    started(run, 2)
    run.proc.send_signal(signal.SIGTERM)
    rc = ended(run)
    assert saved(out) == {"ckpt0.SIGTERM": "saved by rank 0", "ckpt1.SIGTERM": "saved by rank 1"}, run.stderr
    assert rc == -signal.SIGTERM, run.stderr  # as without mpddp: SIGTERM's default action, once the ranks saved
    assert "launch() returned" not in run.stdout and "Traceback" not in run.stderr, run.stderr


def test_mpddp_train_ranks_keep_the_checkpoint_their_task_saves_on_sigterm(tmp_path):
    """The trainer's ranks run the user's task file, whose factory can set the rank's SIGTERM handler."""
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "preempted_task.py"
    task.write_text(textwrap.dedent(f"""
        import os
        import sys
        sys.path[:0] = [{str(SCRIPTS)!r}, {str(REPO / "tests")!r}]
        from save_on_signal import arm
        from tiny_task import make_task as tiny

        def make_task(seed):
            if "RANK" in os.environ:  # in a rank, not in the launcher's own check of the task
                arm({str(out)!r})
            return tiny(seed)
    """))
    run = Run(["-m", "mpddp", "train", "--nprocs", "2", "--task", str(task), "--epochs", "100000"], tmp_path)
    started(run, 2, timeout=120)
    run.proc.send_signal(signal.SIGTERM)
    rc = ended(run)
    assert saved(out) == {"ckpt0.SIGTERM": "saved by rank 0", "ckpt1.SIGTERM": "saved by rank 1"}, run.stderr
    assert rc == 143, run.stderr


def test_two_nodes_preempted_together_keep_every_ranks_checkpoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    nodes = []
    for node in (0, 1):
        (tmp_path / f"n{node}").mkdir()
        nodes.append(Run(["-m", "mpddp", "run", "--nnodes", "2", "--node-rank", str(node), "--master-port", port,
                          "--nprocs", "2", SAVE, str(out)], tmp_path / f"n{node}"))
    try:
        for node in nodes:
            started(node, 2, also=tuple(n for n in nodes if n is not node))
        for node in nodes:  # a scheduler's preemption: every node's launcher is told
            node.proc.send_signal(signal.SIGTERM)
        codes = [ended(node) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    told = "\n".join(n.stderr for n in nodes)
    assert saved(out) == {f"ckpt{r}.SIGTERM": f"saved by rank {r}" for r in range(4)}, told
    assert codes == [143, 143], told


CHILDREN = textwrap.dedent("""
    import os, signal, subprocess, sys, time

    rank = int(os.environ["RANK"])
    # a child that speaks the moment its rank is gone (its stdin, a pipe from the rank, ends), as a DataLoader
    # worker cut off mid-hand-over prints a traceback
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('CHILD up', flush=True); sys.stdin.read(); "
                              f"print('ORPHAN of rank {rank}', flush=True)"], stdin=subprocess.PIPE)
    if rank == 1:  # it saves for a while on SIGTERM: its child keeps running meanwhile
        def save(signum, frame):
            time.sleep(1.0)
            print(f"SAVING rank={rank} child alive={child.poll() is None}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
    print(f"READY rank={rank} pid={os.getpid()}", flush=True)
    while True:
        time.sleep(0.05)
""")


def test_the_children_of_a_rank_that_a_signal_ends_go_before_it_and_those_of_one_that_saves_keep_running(
        tmp_path):
    """A rank with no handler for the signal dies of it at once: its children go first (SIGKILL), so none of them
    sees it gone and speaks (the traceback of a DataLoader worker whose fd its rank was fetching, seen in CI). A rank
    that handles the signal to save keeps its children meanwhile, as torchrun's agent does."""
    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(script)], tmp_path)
    run.wait_for(r"READY rank=\d", count=2)
    run.wait_for(r"CHILD up", count=2)
    run.proc.send_signal(signal.SIGTERM)
    rc = ended(run)
    assert rc == 143, run.stderr
    assert "SAVING rank=1 child alive=True" in run.stdout, run.stdout + run.stderr
    assert "ORPHAN of rank 0" not in run.stdout, run.stdout
    assert "Traceback" not in run.stderr, run.stderr


def test_a_second_ctrl_c_stops_ranks_in_their_grace_at_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", SAVE, str(out), "ignore"], tmp_path)
    ranks = set(started(run, 2).values())
    run.proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert running(ranks) and run.proc.poll() is None, run.stderr  # their grace: 30 s by default, as torchrun's
    second = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    gone = run.all_gone_at(ranks, 10.0)
    rc = ended(run)
    assert gone - second < KILL_MARGIN, gone - second  # SIGKILL at once, not at the grace's end
    assert rc == 130, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "mpddp: interrupted (SIGINT); every worker was stopped"


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_rank_that_ignores_sigterm_is_killed_at_the_shutdown_timeout(tmp_path, how):
    out = tmp_path / "out"
    out.mkdir()
    flag = ["--shutdown-timeout", "1"] if how == "flag" else []
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"} if how == "environment" else {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", *flag, SAVE, str(out), "ignore"], tmp_path, env=env)
    ranks = set(started(run, 2).values())
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    gone = run.all_gone_at(ranks, 30.0) - sent
    rc = ended(run)
    assert 1.0 <= gone < 1.0 + KILL_MARGIN, gone  # measured from the SIGTERM: the grace, then SIGKILL
    assert rc == 143, run.stderr


@pytest.mark.parametrize("flags, listed, sent, file, rc, line", [
    # SLURM's warning before its time limit: passed on, and the job stops, as under torchrun
    (["--signals-to-handle", "SIGTERM,SIGUSR1"], "SIGTERM,SIGUSR1", signal.SIGUSR1, "SIGUSR1", 138,
     "stopped by SIGUSR1"),
    (["--signals_to_handle=USR2"], "SIGUSR2", signal.SIGUSR2, "SIGUSR2", 140, "stopped by SIGUSR2"),
    # a stop by a signal not listed: the ranks get SIGTERM, as torchrun's agent sends them
    (["--signals-to-handle", "SIGTERM"], "SIGTERM", signal.SIGINT, "SIGTERM", 130, "interrupted (SIGINT)"),
    ([], "SIGTERM,SIGINT,SIGHUP,SIGQUIT", signal.SIGINT, "SIGINT", 130, "interrupted (SIGINT)"),
])
def test_signals_to_handle_says_which_signal_the_ranks_get(tmp_path, flags, listed, sent, file, rc, line):
    out = tmp_path / "out"
    out.mkdir()
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", *flags, SAVE, str(out)], tmp_path)
    started(run, 2)
    run.proc.send_signal(sent)
    code = ended(run)
    assert saved(out) == {f"ckpt{r}.{file}": f"saved by rank {r}" for r in range(2)}, run.stderr
    assert code == rc, run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"mpddp: {line}; every worker was stopped"
    assert set(re.findall(r"signals=(\S+)", run.stdout)) == {listed}  # TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the rule of a machine without a GPU")
@pytest.mark.parametrize("virtual", [True, False])
def test_virtual_local_rank_gives_each_rank_local_rank_0_and_its_own_device(tmp_path, monkeypatch, virtual):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = Run(["-m", "mpddp", "run", "--nproc_per_node", "3", *(["--virtual-local-rank"] * virtual), SAVE, str(out),
               "quick"], tmp_path)
    assert ended(run) == 0, run.stderr
    seen = {int(m.group(1)): (m.group(2), m.group(3)) for m in re.finditer(r"READY rank=(\d+) local=(\S+) cvd=(\S+)",
                                                                             run.stdout)}
    # torchrun's rule on a machine without a GPU (CUDA_VISIBLE_DEVICES unset): LOCAL_RANK 0, the local rank's device
    assert seen == ({r: ("0", str(r)) for r in range(3)} if virtual else {r: (str(r), "None") for r in range(3)})


def test_numa_binding_without_a_gpu_says_it_binds_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = Run(["-m", "mpddp", "run", "--nprocs", "2", "--numa-binding", "node", SAVE, str(out), "quick"], tmp_path,
              env={"CUDA_VISIBLE_DEVICES": ""})
    assert ended(run) == 0, run.stderr
    assert run.stderr.splitlines() == ["mpddp: --numa-binding node binds nothing here: no GPU is visible, and torch "
                                       "binds each rank to the CPUs near its GPU"], run.stderr
    assert len(re.findall("READY", run.stdout)) == 2


def test_ctrl_c_at_every_moment_of_mpddp_trains_start_prints_no_traceback(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the launcher, and the forkserver while it imports."""
    # the forkserver's interpreter as it starts, its import of torch, and the two moments
    for moment in ("forkserver+0", "forkserver+0.8", "0.9", "2.1"):
        where = tmp_path / moment
        where.mkdir()
        run = Run(["-m", "mpddp", "train", "--nprocs", "2"], where)
        began = time.monotonic()
        if moment.startswith("forkserver"):
            server = _forkserver_of(run)
            time.sleep(float(moment.partition("+")[2]))  # in the middle of its import of torch
        else:
            time.sleep(max(0.0, began + float(moment) - time.monotonic()))
        os.killpg(run.proc.pid, signal.SIGINT)
        rc = ended(run)
        assert "Traceback" not in run.stderr, (moment, run.stderr)
        assert rc == 130, (moment, rc, run.stderr)
        if moment.startswith("forkserver"):
            assert not running([server])


def test_the_forkserver_ignores_a_ctrl_c_while_it_imports_torch(tmp_path):
    """The terminal's Ctrl-C reaches the forkserver too (its process group is the launcher's until it imports
    mpddp's worker): it must not die of it, or print a traceback, whoever gets the signal first."""
    run = Run(["-m", "mpddp", "train", "--nprocs", "2"], tmp_path)
    server = _forkserver_of(run)
    time.sleep(0.3)
    os.kill(server, signal.SIGINT)
    time.sleep(1.0)
    alive = running([server])
    os.killpg(run.proc.pid, signal.SIGINT)
    rc = ended(run)
    assert alive and "Traceback" not in run.stderr and rc == 130, (alive, rc, run.stderr)


def _forkserver_of(run: Run) -> int:
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(run.proc.pid).children():
            try:
                if "forkserver" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.005)
    raise AssertionError(f"no forkserver started:\n{run.stderr}")


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("args, env, said", [
    (["--shutdown-timeout", "-1"], {}, "shutdown_timeout=-1.0 is not allowed: it must be a number of seconds >= 0"),
    (["--shutdown-timeout", "soon"], {}, "'soon' is not a valid float"),
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"},
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon' is not a number of seconds: set it to e.g. 30, or unset it (30 s)"),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], {}, "signals_to_handle holds 'SIGFOO', which is no signal's name"),
    (["--signals-to-handle", "SIGKILL"], {}, "signals_to_handle names SIGKILL, which the launcher cannot pass on"),
    (["--numa-binding", "nearby"], {}, "numa_binding='nearby' is not one of torch's modes: use node, socket, "
                                       "exclusive, core-complex"),
])
def test_a_bad_value_is_one_line_and_exit_2(cli, monkeypatch, tmp_path, command, args, env, said):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('a worker started')\n")
    target = [str(script)] if command == "run" else []
    code, out, err = cli(command, "--nprocs", "2", *args, *target)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mpddp: error: ") and said in err, err
    assert "Traceback" not in err and "worker started" not in out + err


def test_launch_takes_the_same_options_and_refuses_the_same_values():
    import mpddp
    from mpddp import ConfigError, LaunchConfig

    config = LaunchConfig(shutdown_timeout=5, signals_to_handle="term,USR1", virtual_local_rank=True,
                          numa_binding="Socket")
    assert (config.shutdown_timeout, config.signals_to_handle, config.virtual_local_rank, config.numa_binding) == \
        (5.0, ("SIGTERM", "SIGUSR1"), True, "socket")
    with pytest.raises(ConfigError, match=r"^shutdown_timeout=inf is not allowed"):
        mpddp.launch(print, nprocs=1, shutdown_timeout=float("inf"))
    with pytest.raises(ConfigError, match=r"^signals_to_handle holds 'SIGNOPE'"):
        mpddp.launch(print, nprocs=1, signals_to_handle=["SIGTERM", "SIGNOPE"])


def test_the_defaults_are_torchruns(monkeypatch):
    """Read from torch 2.13's own launcher: its --signals-to-handle default, its shutdown timeout, its NUMA modes."""
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig
    from torch.distributed.run import get_args_parser
    from torch.numa.binding import AffinityMode

    from mpddp import LaunchConfig
    from mpddp.shutdown_options import NUMA_MODES

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    torchrun = get_args_parser().parse_args(["train.py"])
    ours = LaunchConfig()
    assert ",".join(ours.signals_to_handle) == torchrun.signals_to_handle
    assert ours.shutdown_timeout == TorchLaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout
    assert NUMA_MODES == tuple(mode.value for mode in AffinityMode)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert LaunchConfig().shutdown_timeout == 7.0 == \
        TorchLaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout


@pytest.mark.parametrize("visible, local", [(None, 0), (None, 2), ("4,6", 1), ("GPU-a1,GPU-b2", 0), (" 3, 5", 1)])
def test_virtual_local_rank_on_gpus_is_torchruns_rule(monkeypatch, visible, local):
    """Each GPU rank's CUDA_VISIBLE_DEVICES, from the node's (mpddp's pinned GPUs, or the user's), as torchrun's
    own agent computes it."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from mpddp.core.launcher.plan import virtual_gpu_env
    from mpddp.rank_math import RankSlot

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    theirs: dict[str, str | None] = {}
    LocalElasticAgent._set_local_rank_env(None, theirs, local, SimpleNamespace(virtual_local_rank=True))
    slot = RankSlot(node_rank=0, local_rank=local, rank=local, world_size=8, nprocs_per_node=8, gpu=local,
                    cuda_index=local)
    assert virtual_gpu_env(visible, slot) == theirs


def test_virtual_local_rank_keeps_gpus_hidden_for_a_cpu_job():
    """CUDA_VISIBLE_DEVICES='' made this a CPU job: a rank must not be shown GPU 1 (torchrun refuses local rank 1)."""
    from mpddp.core.launcher.plan import virtual_gpu_env
    from mpddp.rank_math import RankSlot

    slot = RankSlot(node_rank=0, local_rank=1, rank=1, world_size=2, nprocs_per_node=2, gpu=None)
    assert virtual_gpu_env("", slot) == {"LOCAL_RANK": "0"}
    assert virtual_gpu_env(None, slot) == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1"}
