"""What a rank's failure is reported as: its own exception and its chain, its return value, its place.

Real processes on the CPU with gloo; each case failed before its fix (the wording it had is in the docstring).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

import mpddp

pytestmark = pytest.mark.timeout(120)


def returns_a_generator(ctx):
    return (i for i in range(3))


def test_a_return_value_that_cannot_be_pickled_is_named_as_such(no_leftovers):
    """Was: "rank 0 raised TypeError: cannot pickle 'generator' object", with cloudpickle's frames only."""
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(returns_a_generator, nprocs=1)
    first = str(info.value).splitlines()[0]
    assert first == ("mpddp: rank 0 (node 0, local rank 0) failed first: it raised mpddp.errors.ReturnValueError: "
                     "rank 0's return value cannot be sent back to the launcher: a generator cannot be pickled "
                     "(TypeError: cannot pickle 'generator' object); return plain data (numbers, strings, lists, "
                     "dicts, tensors), e.g. list(...) of a generator, or the state_dict() of a model")
    assert "cloudpickle" not in str(info.value)


def fails_while_handling(ctx):
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("unexpected pos 87488 vs 87440")  # noqa: B904 - what torch.save does on a full disk


def wraps_its_cause(ctx):
    try:
        {}["lr"]
    except KeyError as e:
        raise ValueError("the config has no lr") from e


def test_an_error_raised_while_another_was_handled_reports_the_original(no_leftovers):
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(fails_while_handling, nprocs=1)
    assert str(info.value).splitlines()[0].endswith(
        "it raised OSError: [Errno 28] No space left on device, and while it was handled, RuntimeError: unexpected "
        "pos 87488 vs 87440")
    failure = info.value.failures[0]
    assert (failure.error_type, failure.message) == ("OSError", "[Errno 28] No space left on device")
    assert "During handling of the above exception" in failure.traceback  # the whole chain stays below
    # a `raise ... from e` is the user's own wording of the cause: it stays the headline
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(wraps_its_cause, nprocs=1)
    assert str(info.value).splitlines()[0].endswith("it raised ValueError: the config has no lr")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a 300 KB tmpfs: needs root")
def test_a_full_disk_while_saving_a_checkpoint_is_the_headline(tmp_path):
    """Was: torch's secondary "unexpected pos 10240 vs 10134"; the ENOSPC was only in the chain."""
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], check=True)
    try:
        out = subprocess.run([sys.executable, "-m", "mpddp", "train", "--dataset", "synthetic", "--samples", "2048",
                              "--features", "256", "--nprocs", "2", "--epochs", "1", "--checkpoint-dir", str(disk),
                              "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
        left = os.listdir(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert out.returncode == 1
    first = next(line for line in out.stderr.splitlines() if line.startswith("mpddp:"))
    assert first.startswith("mpddp: rank 0 (node 0, local rank 0) failed first: it raised OSError: [Errno 28] No "
                            "space left on device, and while it was handled, RuntimeError: "), out.stderr
    assert left == []  # the partial write is gone


def inits_again(ctx):
    import torch.distributed as dist

    dist.init_process_group("gloo")


def test_a_second_init_process_group_inside_launch_says_mpddp_made_the_group(no_leftovers):
    """Was: torch's "trying to initialize the default process group twice!" alone."""
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(inits_again, nprocs=1)
    lines = str(info.value).splitlines()
    assert "trying to initialize the default process group twice" in lines[0]
    assert lines[1] == ("mpddp: mpddp already made the process group before calling fn: remove your own "
                        "init_process_group() call, or pass init_process_group=False to launch() (or use mpddp run "
                        "for a torchrun-style script)")


class Unloadable(Exception):
    def __init__(self, a, b):  # pickles as Unloadable(message): cannot be rebuilt
        super().__init__(f"{a} {b}")


def raises_value_error(ctx):
    raise ValueError(f"bad shard {ctx.rank}")


def raises_unloadable(ctx):
    raise Unloadable("x", "y")


def test_worker_failed_carries_the_ranks_own_exception(no_leftovers):
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(raises_value_error, nprocs=1)
    assert isinstance(info.value.exception, ValueError) and str(info.value.exception) == "bad shard 0"
    assert info.value.__cause__ is info.value.exception
    with pytest.raises(mpddp.WorkerFailed) as info:  # one that cannot be rebuilt: the report stands alone
        mpddp.launch(raises_unloadable, nprocs=1)
    assert info.value.exception is None and "Unloadable: x y" in str(info.value)


def idle_forever(ctx):
    import threading

    threading.Event().wait()


def test_a_hang_in_a_library_call_names_the_users_function_and_the_call(no_leftovers):
    """Was: "ranks 0, 1 are all at wait at test_rank_errors.py:N": wait is threading's, the function is idle_forever."""
    with pytest.raises(mpddp.HangError) as info:
        mpddp.launch(idle_forever, nprocs=2, timeout=2)
    assert "  ranks 0, 1 are all at idle_forever at test_rank_errors.py:" in str(info.value)
    assert " (threading.Event().wait()), waiting in threading.wait" in str(info.value)


def test_a_notebook_cells_line_is_told_with_its_function_and_source():
    """A cell runs from the kernel's temporary file, which linecache holds (as IPython puts it there)."""
    import linecache
    import threading

    from mpddp.core.wire import stacks

    cell = "/tmp/ipykernel_4242/594081203.py"
    linecache.cache[cell] = (60, None, ["import threading\n", "\n", "def idle(ctx):\n",
                                        "    threading.Event().wait()\n"], cell)
    try:
        dump = ("Current thread 0x00007f0000000001 (most recent call first):\n"
                f'  File "{threading.__file__}", line 320 in wait\n'
                f'  File "{threading.__file__}", line 629 in wait\n'
                f'  File "{cell}", line 4 in idle\n')
        place = stacks.locate(dump, 0x7F0000000001)
    finally:
        del linecache.cache[cell]
    assert place is not None and not place.waiting
    assert place.text == "idle at 594081203.py:4 (threading.Event().wait()), waiting in threading.wait"


def leaves_early(ctx):
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(10)
    dist.all_reduce(t)
    if ctx.rank == 1:
        dist.destroy_process_group()
        time.sleep(60)
        return None
    dist.all_reduce(t)
    return None


def test_a_rank_that_destroys_its_group_early_is_named_for_leaving_not_for_a_timeout(no_leftovers):
    """Was: "rank 1 made no progress: rank 0 timed out waiting for it in a collective (... bugs in the applic);
    ... Raise --timeout": nothing timed out, and the quote was cut mid-word."""
    with pytest.raises(mpddp.WorkerFailed) as info:
        mpddp.launch(leaves_early, nprocs=2, timeout=30)
    report = str(info.value)
    assert type(info.value) is mpddp.WorkerFailed and info.value.rank == 1
    assert info.value.failures[0].outcome is mpddp.Outcome.EARLY_EXIT
    assert report.startswith("mpddp: rank 1 (node 0, local rank 1) left the process group (destroy_process_group at "
                             "test_rank_errors.py:")
    assert "while rank 0 was in all_reduce at test_rank_errors.py:" in report and "timed out" not in report
    assert "--timeout" not in report


def test_a_long_quote_is_cut_at_a_word_with_an_ellipsis():
    from mpddp.core.launcher.report import _short

    text = "Read error [127.0.0.1]:28358: Connection reset by peer and this is typically caused by a remote worker " \
           "hanging or by bugs in the application code of some rank"
    cut = _short(text, 120)
    assert cut.endswith("…") and len(cut) <= 121 and text.startswith(cut[:-1]) and text[len(cut) - 1] == " "
