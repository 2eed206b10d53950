"""Real launches on CPU with gloo: values, order, failures, nothing left behind."""

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import mpddp

from helpers import gone

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]


def all_reduce_job(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)  # the process group is already initialized by mpddp
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": dist.get_world_size(),
        "dist_rank": dist.get_rank(),
        "sum": t.item() * scale,
        "env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_all_reduce_and_return_values_in_rank_order(nprocs):
    results = mpddp.launch(all_reduce_job, nprocs=nprocs, args=(10,))
    expected_sum = sum(range(1, nprocs + 1)) * 10  # computed here, independently of the workers
    assert [r["rank"] for r in results] == list(range(nprocs))
    for rank, r in enumerate(results):
        assert r["dist_rank"] == rank and r["local_rank"] == rank and r["world_size"] == nprocs
        assert r["sum"] == expected_sum
        assert r["env"] == (str(rank), str(rank), str(nprocs), "127.0.0.1")
        assert r["pid"] != os.getpid()
    assert len({r["pid"] for r in results}) == nprocs
    assert gone([r["pid"] for r in results])


def test_threads_per_rank_follow_cores_divided_by_ranks(monkeypatch):
    import psutil

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = psutil.cpu_count(logical=False) or os.cpu_count()
    results = mpddp.launch(all_reduce_job, nprocs=2, args=(1,))
    assert [r["threads"] for r in results] == [max(1, cores // 2)] * 2


def test_lambda_and_closure_travel_by_value():
    assert mpddp.launch(lambda ctx: ctx.rank * 10, nprocs=3) == [0, 10, 20]
    offset = {"value": 7}

    def closure(ctx, factor):
        return ctx.rank * factor + offset["value"]

    assert mpddp.launch(closure, nprocs=2, args=(3,)) == [7, 10]


def test_context_fields():
    ctx = mpddp.launch(lambda ctx: ctx, nprocs=2)[1]
    assert (ctx.rank, ctx.local_rank, ctx.node_rank, ctx.world_size) == (1, 1, 0, 2)
    assert (ctx.nprocs_per_node, ctx.nnodes, ctx.device, ctx.backend, ctx.restart) == (2, 1, "cpu", "gloo", 0)


def raise_on_rank_one(ctx):
    if ctx.rank == 1:
        raise KeyError("no such sample 42")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here and fails as a victim
    return t.item()


def test_a_raising_rank_is_named_with_its_original_error():
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(raise_on_rank_one, nprocs=2)
    err = info.value
    assert err.rank == 1
    text = str(err)
    assert "rank 1 (node 0, local rank 1) failed first: it raised KeyError: 'no such sample 42'" in text
    assert "Traceback (most recent call last)" in text and "raise_on_rank_one" in text
    assert "test_launch.py" in text  # the traceback points at the user's file, not <dynamic-code>
    assert "rank 0:" in text
    assert gone([f.pid for f in err.failures])


def test_python_dash_c_use():
    code = "import mpddp; print(mpddp.launch(lambda ctx: ctx.rank * 10, nprocs=3))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[0, 10, 20]"


def test_missing_main_guard_shows_the_guard(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent("""
        import mpddp

        def train(ctx):
            return ctx.rank

        print(mpddp.launch(train, nprocs=2))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 2  # bad input, told before any worker starts (tests/test_first_hour.py: the rest)
    assert out.stderr.startswith("mpddp: error: noguard.py line 7 starts workers at the script's top level")
    assert 'if __name__ == "__main__":\n        print(mpddp.launch(train, nprocs=2))' in out.stderr
    assert "bootstrapping phase" not in out.stderr and "Traceback" not in out.stderr


def test_the_guarded_script_works(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent("""
        import mpddp

        class Doubler:  # a class from the script's __main__ inside the worker
            def __call__(self, x):
                return 2 * x

        def train(ctx):
            return Doubler()(ctx.rank)

        if __name__ == "__main__":
            print(mpddp.launch(train, nprocs=2))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[0, 2]"


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_other_start_methods(method):
    if method == "fork":
        code = "import mpddp; print(mpddp.launch(lambda c: c.rank + 1, nprocs=2, start_method='fork'))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "[1, 2]"
    else:
        assert mpddp.launch(lambda c: c.rank + 1, nprocs=2, start_method=method) == [1, 2]


def test_fork_never_hangs_after_a_multithreaded_op_and_refuses_with_threads():
    code = (
        "import threading, time, torch, mpddp\n"
        "torch.set_num_threads(2); x = torch.randn(512, 512); x @ x\n"
        "def job(c):\n"
        "    y = torch.randn(512, 512); y @ y  # a parallel op in the forked child\n"
        "    return torch.get_num_threads()\n"
        "print('ran:', mpddp.launch(job, nprocs=1, start_method='fork'))\n"
        "threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n"
        "try:\n"
        "    mpddp.launch(job, nprocs=1, start_method='fork')\n"
        "except mpddp.ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert "ran: [1]" in out.stdout, out.stderr
    assert "refused: start_method='fork' is unsafe here: this process runs 2 Python threads" in out.stdout
    assert "forkserver" in out.stdout


def test_not_callable_and_unshippable():
    import threading

    with pytest.raises(mpddp.ConfigError, match="fn=42 is not callable"):
        mpddp.launch(42, nprocs=1)
    lock = threading.Lock()
    with pytest.raises(mpddp.ShipError, match=r"cannot send args\[0\]=<unlocked _thread.lock"):
        mpddp.launch(lambda ctx, lk: 1, nprocs=1, args=(lock,))
    with pytest.raises(mpddp.ConfigError, match=r"args=5 is not a tuple: .*args=\(5,\)"):
        mpddp.launch(lambda ctx, x: x, nprocs=1, args=5)
    with pytest.raises(mpddp.ConfigError, match="unexpected keyword argument 'nproc'"):
        mpddp.launch(lambda ctx: 1, nproc=2)


def test_workers_multiprocessing_has_the_platform_default_and_stdin_scripts_work():
    code = (
        "import multiprocessing, mpddp\n"
        "print(mpddp.launch(lambda c: multiprocessing.get_start_method(), nprocs=1))\n"
    )
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    expected = multiprocessing.get_context().get_start_method()  # this platform's default, as under torchrun
    assert out.stdout.strip().splitlines()[-1] == f"[{expected!r}]"


def test_verbose_prints_each_workers_banner(capsys):
    assert mpddp.launch(lambda ctx: ctx.rank, nprocs=2, verbose=True) == [0, 1]
    out = capsys.readouterr().out.splitlines()
    assert "[rank 0] node 0 · local rank 0 · rank 0×2+0 = 0 of 2 · cpu" in out
    assert "[rank 1] node 0 · local rank 1 · rank 0×2+1 = 1 of 2 · cpu" in out


def leave_a_thread(ctx, returned):
    import threading
    import time

    threading.Thread(target=time.sleep, args=(600,), name="forgotten").start()
    with open(f"{returned}{ctx.rank}", "w") as f:  # when fn returns: the bound below is measured from it
        f.write(str(time.time()))
    return ctx.rank


def test_a_forgotten_non_daemon_thread_does_not_keep_the_launch_alive(capsys, tmp_path):
    import time

    from mpddp.core.rank.worker import THREAD_GRACE

    assert mpddp.launch(leave_a_thread, nprocs=2, args=(str(tmp_path / "returned"),)) == [0, 1]
    took = time.time() - min(float((tmp_path / f"returned{rank}").read_text()) for rank in (0, 1))
    assert took < THREAD_GRACE + 20, took  # from fn's return: the grace (5 s), not the thread's 600 s; 20 s of load
    err = capsys.readouterr().err
    assert "[rank 1] mpddp: rank 1: fn returned but left thread(s) forgotten running" in err


@pytest.mark.timeout(120)
def test_a_rank_killed_while_its_dataloader_workers_run_leaves_no_leak_warning(tmp_path, no_leftovers):
    """The resource tracker unlinks a killed rank's semaphores without a "leaked semaphore" line."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import mpddp, torch
        from torch.utils.data import DataLoader, TensorDataset

        def fn(ctx):
            data = TensorDataset(torch.arange(1000.0))
            loader = DataLoader(data, batch_size=1, num_workers=2, multiprocessing_context="fork")
            for i, _ in enumerate(loader):
                if i == 5 and ctx.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.01)

        if __name__ == "__main__":
            try:
                mpddp.launch(fn, nprocs=2, init_process_group=False)
            except mpddp.WorkerFailed as e:
                print("failed:", e.rank, e.exit_code)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert out.stdout.strip() == "failed: 1 137", out.stderr
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr
