"""The output relay end to end: C-level writes, the rank filter, per-rank log files."""

import os
import subprocess
import sys
import textwrap

import pytest

import mpddp

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftovers")]

# C stdio is fully buffered on a pipe; without PYTHONUNBUFFERED (a Jupyter kernel, a plain
# `python script.py`) nothing but the worker itself can make printf reach the relay.
BUFFERED_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

C_WRITES = textwrap.dedent("""
    import ctypes, os, sys, time
    import mpddp

    def job(ctx):
        libc = ctypes.CDLL(None)
        libc.printf(b"printf from rank %d\\n", ctx.rank)   # C stdio, as a C extension would
        os.write(1, b"fd write from rank %d\\n" % ctx.rank)  # a raw write(2) on fd 1
        libc.printf(b"printf no newline from rank %d", ctx.rank)
        return ctx.rank

    if __name__ == "__main__":
        print("result", mpddp.launch(job, nprocs=2), flush=True)
""")


def test_c_printf_and_fd_writes_reach_the_relay_without_pythonunbuffered(tmp_path):
    script = tmp_path / "c_writes.py"
    script.write_text(C_WRITES)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=BUFFERED_ENV)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] printf from rank {rank}" in lines
        assert f"[rank {rank}] fd write from rank {rank}" in lines
        assert f"[rank {rank}] printf no newline from rank {rank}" in lines
        # line-buffered, not flushed at exit: the printf line comes before the later fd write
        assert (lines.index(f"[rank {rank}] printf from rank {rank}")
                < lines.index(f"[rank {rank}] fd write from rank {rank}"))
    assert lines[-1] == "result [0, 1]"


def chatty(ctx, n):
    # partial writes from both ranks at once: the relay must cut whole lines per rank, never glue
    for i in range(n):
        os.write(1, f"line {i} ".encode())
        os.write(1, f"of rank {ctx.rank}\n".encode())
    print(f"to stderr from rank {ctx.rank}", file=sys.stderr)
    return ctx.rank


def test_lines_from_partial_writes_are_never_glued(capsys):
    assert mpddp.launch(chatty, nprocs=2, args=(300,)) == [0, 1]
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 600
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] line {i} of rank {rank}" for i in range(300)]
    assert sorted(out.err.splitlines()) == ["[rank 0] to stderr from rank 0", "[rank 1] to stderr from rank 1"]


def test_output_ranks_filter_stdout_only_and_log_dir_keeps_everything(tmp_path, capsys):
    logs = tmp_path / "logs"
    assert mpddp.launch(chatty, nprocs=2, args=(2,), output_ranks=(0,), log_dir=str(logs)) == [0, 1]
    out = capsys.readouterr()
    assert out.out.splitlines() == ["[rank 0] line 0 of rank 0", "[rank 0] line 1 of rank 0"]
    # stderr is never filtered: warnings and errors of every rank stay visible
    assert sorted(out.err.splitlines()) == ["[rank 0] to stderr from rank 0", "[rank 1] to stderr from rank 1"]
    for rank in (0, 1):  # one file per rank, unprefixed, stdout and stderr
        lines = (logs / f"rank{rank}.log").read_text().splitlines()  # stdout and stderr: two pipes, any order
        assert sorted(lines) == [f"line 0 of rank {rank}", f"line 1 of rank {rank}", f"to stderr from rank {rank}"]


def fail_on_rank_one(ctx):
    print(f"rank {ctx.rank} starting", flush=True)
    if ctx.rank == 1:
        raise ValueError("bad batch on rank 1")
    return 0


def test_a_filtered_rank_still_shows_its_error(tmp_path, capsys):
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(fail_on_rank_one, nprocs=2, output_ranks=(0,), log_dir=str(tmp_path))
    assert info.value.rank == 1
    assert "ValueError: bad batch on rank 1" in str(info.value) and "fail_on_rank_one" in str(info.value)
    assert "rank 1 starting" in str(info.value)  # its last lines are in the report, though not shown live
    assert "[rank 1]" not in capsys.readouterr().out
    assert (tmp_path / "rank1.log").read_text() == "rank 1 starting\n"


RUN_SCRIPT = textwrap.dedent("""
    import os, sys
    rank = int(os.environ["RANK"])
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("ranks", ["0", "all"])
def test_cli_output_ranks_and_log_dir(tmp_path, ranks):
    script = tmp_path / "job.py"
    script.write_text(RUN_SCRIPT)
    logs = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "mpddp", "run", "--output-ranks", ranks, "--log-dir", str(logs), "--nprocs", "2",
         str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    shown = ["[rank 0] out of rank 0"] + (["[rank 1] out of rank 1"] if ranks == "all" else [])
    assert sorted(out.stdout.splitlines()) == shown
    assert "[rank 0] err of rank 0" in out.stderr and "[rank 1] err of rank 1" in out.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    assert sorted((logs / "rank1.log").read_text().splitlines()) == ["err of rank 1", "out of rank 1"]


PARTIAL_WRITES = textwrap.dedent("""
    import os
    rank = int(os.environ["RANK"])
    for i in range(200):  # each line in two writes, both ranks at once
        os.write(1, f"line {i} ".encode())
        os.write(1, f"of rank {rank}\\n".encode())
""")


def test_no_prefix_prints_whole_lines_for_a_pipeline(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(PARTIAL_WRITES)
    out = subprocess.run([sys.executable, "-m", "mpddp", "run", "--no-prefix", "--nprocs", "2", str(script)],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):  # as the script wrote them: no prefix, none glued to another rank's
        assert [line for line in lines if line.endswith(f"of rank {rank}")] == [
            f"line {i} of rank {rank}" for i in range(200)]
    assert len(lines) == 400
