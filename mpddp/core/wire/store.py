"""The client's end of a TCPStore: how a rank and a launcher connect to the job's store.

Owns: the one call that makes a client (``is_master=False``), for the ranks
(core/rank/worker.py) and the launchers of other nodes (core/nodes/c10d.py),
and a launcher's torch import with torch's C++ warnings off. Leaves hosting
the store to core/stores/listen.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from datetime import timedelta

_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"  # read by torch's C++ library once, as it loads


def connect(addr: str, port: int, timeout: float) -> object:
    """A client of node 0's store; retries connecting until ``timeout``."""
    load_torch()
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout))


def load_torch() -> None:
    """torch.distributed, imported quietly (:func:`quiet_torch`): a launcher's first import of it."""
    with quiet_torch():
        import torch.distributed  # noqa: F401


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Around a launcher's first import of torch: its C++ warnings off in this process, not in its children.

    A launcher's store client fails when another node is lost, and torch's
    client then writes a warning with a C++ stack to stderr per failed
    operation (dozens of lines on the user's terminal, measured), where
    mpddp tells the loss in one line. The level is read when torch loads:
    set for the import, and taken back before any rank is started, so the
    ranks keep torch's warnings (in their logs). A no-op once torch is
    loaded (a script that imported it), or when the user set the level.
    """
    if "torch" in sys.modules or _LOG_LEVEL in os.environ:
        yield
        return
    os.environ[_LOG_LEVEL] = "FATAL"
    try:
        yield
    finally:
        os.environ.pop(_LOG_LEVEL, None)
