"""Running a torchrun-style script or module inside a worker.

Owns: what ``mpddp run`` executes in each worker: the script (or ``-m``
module) as ``__main__`` with its own ``sys.argv``, exactly as ``python
script.py args`` would. The script calls ``init_process_group("env://")``
itself; the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE) makes rank 0 join the
launcher's store instead of binding the port; and :func:`compile_error`, the
launcher's look at the script before any worker starts: one that does not
compile is told once, in one line, instead of by every rank. Leaves the
command's options to cli/run.py and the rest of the worker's life to
core/rank/worker.py.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from ...context import WorkerContext


def compile_error(path: str) -> str | None:
    """``"train.py:12: SyntaxError: '(' was never closed"`` where the script does not compile, else None.

    Compiled from its bytes, as runpy does (a ``# coding:`` line counts); nothing of it runs. A script that cannot
    be read is left to the workers, whose error says why."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError:
        return None
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError and TabError too
        return f"{e.filename or path}:{e.lineno}: {type(e).__name__}: {e.msg}"
    except ValueError as e:  # a null byte (a SyntaxError from Python 3.12 on)
        return f"{path}: {type(e).__name__}: {e}"
    return None


def run_script(ctx: WorkerContext, target: str, argv: tuple[str, ...], is_module: bool) -> Any:
    """Execute ``target`` as ``__main__``; return None (scripts return nothing)."""
    if is_module:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")
    return None
