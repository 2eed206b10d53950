"""The client's end of a TCPStore: how a rank and a launcher connect to the job's store.

Owns: the one call that makes a client (``is_master=False``), for the ranks
(core/rank/worker.py) and the launchers of other nodes (core/nodes/c10d.py).
Leaves hosting the store to core/nodes/rendezvous.py.
"""

from __future__ import annotations

from datetime import timedelta


def connect(addr: str, port: int, timeout: float) -> object:
    """A client of node 0's store; retries connecting until ``timeout``."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout))
