"""The store server (core/stores/store_server.py): node 0's store in a process of its own,
the launcher without torch."""

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import mpddp

from helpers import gone, leftovers, store_server_pid

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]


def test_a_launch_script_never_imports_torch_in_the_launcher(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import json, sys
        import mpddp

        def ddp_step(ctx):
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(torch.nn.Linear(4, 4))
            model(torch.ones(2, 4)).sum().backward()
            return [p.grad.sum().item() for p in model.parameters()]

        def a_tensor(ctx):
            import torch
            return torch.full((2,), float(ctx.rank))

        if __name__ == "__main__":
            grads = mpddp.launch(ddp_step, nprocs=2)
            torch_after_ddp = "torch" in sys.modules
            tensors = mpddp.launch(a_tensor, nprocs=2)  # loading a tensor imports torch, as pickle does
            print(json.dumps({"grads": grads, "torch_after_ddp": torch_after_ddp,
                              "tensors": [t.tolist() for t in tensors], "type": type(tensors[0]).__name__}))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch_after_ddp"] is False
    # the same step in this process, without DDP: one input, so the averaged gradients equal the local ones
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    expected = [p.grad.sum().item() for p in model.parameters()]
    assert got["grads"] == [pytest.approx(expected)] * 2
    assert got["tensors"] == [[0.0, 0.0], [1.0, 1.0]] and got["type"] == "Tensor"


def outlive(ctx):
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 0:
        store.set("rank0", str(os.getpid()))
        return "left"
    rank0 = int(store.get("rank0"))
    deadline = time.monotonic() + 30
    while psutil.pid_exists(rank0) and psutil.Process(rank0).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "rank 0 never exited"
        time.sleep(0.02)
    store.set("after", "yes")  # rank 0, and with it torch's default store owner, is gone
    return store.get("after").decode()


def test_the_store_outlives_a_rank_that_returned_first():
    assert mpddp.launch(outlive, nprocs=2) == ["left", "yes"]


def kill_the_store(ctx, tmp):
    if ctx.rank == 0:
        pid = store_server_pid()
        with open(os.path.join(tmp, "store.pid"), "w") as f:
            f.write(f"{pid} {time.time()}")  # when it was killed: the bound below is measured from it
        os.kill(pid, signal.SIGKILL)
    with open(os.path.join(tmp, f"rank{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_killed_store_server_is_the_named_cause_and_every_rank_stops(tmp_path, method):
    with pytest.raises(mpddp.StoreLost) as caught:
        mpddp.launch(kill_the_store, nprocs=2, args=(str(tmp_path),), start_method=method)
    pid, killed = (tmp_path / "store.pid").read_text().split()
    took = time.time() - float(killed)
    store = int(pid)
    message = str(caught.value)
    assert f"the store server (pid {store})" in message and "was killed by SIGKILL" in message, message
    assert took < 30, took  # from the kill (0.02 to 0.05 s quiet): watched, not a timeout (the ranks sleep 60 s)
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert gone([store, *ranks])
    again = pickle.loads(pickle.dumps(caught.value))  # job systems and pools pickle what a launch raised
    assert type(again) is mpddp.StoreLost and str(again) == message


def test_the_store_server_runs_none_of_the_scripts_top_level(tmp_path):
    script = tmp_path / "top.py"
    script.write_text(textwrap.dedent("""\
        import os
        import mpddp

        os.write(1, f"TOP {os.getpid()}\\n".encode())  # one write: two ranks' lines never interleave

        if __name__ == "__main__":
            print("RESULT", mpddp.launch(lambda ctx: ctx.rank, nprocs=2), flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT [0, 1]" in out.stdout
    # the launcher and each rank import the script (multiprocessing's rule for workers); the store server does not
    assert out.stdout.count("TOP") == 3, out.stdout


def test_store_server_stops_with_the_launch_under_fork(tmp_path):
    code = ("import mpddp, psutil; print(mpddp.launch(lambda c: c.rank, nprocs=2, start_method='fork')); "
            "print('CHILDREN', [p.pid for p in psutil.Process().children()])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[0, 1]" in out.stdout and "CHILDREN []" in out.stdout, out.stdout
    assert not leftovers(wait=0)



def test_a_jobwide_sigterm_is_reported_as_the_launchers_not_the_store_servers(tmp_path):
    """scancel, or ``kill -TERM`` to every process of the job: the store server dies too, and is no cause."""
    from runs import SCRIPTS, Run

    run = Run(["-m", "mpddp", "run", "--nprocs", "2", str(SCRIPTS / "fail_modes.py"), "block"], tmp_path)
    try:
        run.wait_for(r"READY rank=\d", count=2)
        pids = run.list_tree()
        assert len(pids) >= 1 + 1 + 2 + 1, pids  # launcher, forkserver, 2 ranks, the store server
        for pid in [run.proc.pid, *sorted(pids - {run.proc.pid})]:  # as a job system does: the launcher first
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        rc = run.finish(timeout=30)
        run.all_gone_at(pids)
        run.assert_nothing_left()
    finally:
        run.kill()
    assert rc == 143, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "mpddp: terminated (SIGTERM); every worker was stopped"
    assert "store server" not in run.stderr and "Traceback" not in run.stderr


def kill_the_first_store(ctx, tmp):
    if ctx.restart == 0:
        if ctx.rank == 0:
            os.kill(store_server_pid(), signal.SIGKILL)
        time.sleep(60)
    return ctx.rank, ctx.restart


def test_max_restarts_brings_a_fresh_store_server_after_one_was_lost(tmp_path, capfd):
    assert mpddp.launch(kill_the_first_store, nprocs=2, args=(str(tmp_path),), max_restarts=1) == [(0, 1), (1, 1)]
    err = capfd.readouterr().err
    assert "the store server (pid" in err and "was killed by SIGKILL" in err
    assert "mpddp: restarting the group (1 of 1)" in err


def test_a_store_server_lost_on_the_last_attempt_says_restarts_gave_up():
    with pytest.raises(mpddp.StoreLost, match=r"was killed by SIGKILL[\s\S]*gave up after 1 restart\(s\)"):
        mpddp.launch(kill_every_store, nprocs=2, max_restarts=1)


def kill_every_store(ctx):
    if ctx.rank == 0:
        os.kill(store_server_pid(), signal.SIGKILL)
    time.sleep(60)
