"""Running a torchrun-style script or module inside a worker.

Owns: what ``mpddp run`` executes in each worker: the script (or ``-m``
module) as ``__main__`` with its own ``sys.argv``, exactly as ``python
script.py args`` would. The script calls ``init_process_group("env://")``
itself; the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE) makes rank 0 join the
launcher's store instead of binding the port. Leaves the command's options
to cli/run.py and the rest of the worker's life to core/rank/worker.py.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from ...context import WorkerContext


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
