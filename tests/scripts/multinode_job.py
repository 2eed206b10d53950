"""One node of a multi-node job, for the multi-node tests.

``python multinode_job.py NODE_RANK PORT [ADDR] [TIMEOUT] [SECONDS]``: each rank all-reduces its rank and prints one
``RESULT`` line with what it saw. With SECONDS > 0 the ranks keep all-reducing that long (a job to kill). Under SLURM,
pass NODE_RANK ``slurm`` to let mpddp read the layout.
"""

from __future__ import annotations

import json
import sys
import time

import mpddp
from mpddp.machine.cluster import apply_cluster


def work(ctx: mpddp.WorkerContext, seconds: float) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)
    print(f"READY rank {ctx.rank}", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
    return {"rank": ctx.rank, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
            "world_size": dist.get_world_size(), "sum": total.item()}


if __name__ == "__main__":
    node, port = sys.argv[1], int(sys.argv[2])
    addr = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
    seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    if node == "slurm":  # what SLURM says, as the CLI reads it; explicit values would win
        unset = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None}
        where = {k: v for k, v in apply_cluster(unset).items() if v is not None}
    else:
        where = {"nnodes": 2, "node_rank": int(node), "master_addr": addr, "master_port": port}
    results = mpddp.launch(work, nprocs=2, args=(seconds,), backend="gloo", timeout=timeout, **where)
    print("RESULT " + json.dumps(results), flush=True)
