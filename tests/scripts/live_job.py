"""A job to watch with ``mpddp top``, for tests/test_live.py.

``python live_job.py NNODES NODE_RANK PORT STOP [RDZV_BACKEND ENDPOINT ID]``: 2 ranks a node all-reduce a flag every
50 ms, printing ``step N``, until the file STOP exists (every rank sees it in the same step: the flag is reduced),
then print one ``RESULT`` line. ``SLOW_RANK`` in the environment: that rank sleeps 50 ms more a step (a straggler);
``LIVE=1``: ``launch(..., live=True)``; ``DASHBOARD``: launch's ``dashboard=`` (tests/test_dashboard.py).
"""

from __future__ import annotations

import json
import os
import sys
import time

import mpddp


def work(ctx: mpddp.WorkerContext, stop: str) -> int:
    import torch
    import torch.distributed as dist

    slow = int(os.environ.get("SLOW_RANK", "-1"))
    step = 0
    while True:
        flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            return step
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.05 + (0.05 if ctx.rank == slow else 0.0))


if __name__ == "__main__":
    nnodes, port, stop = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4]
    node = None if sys.argv[2] == "-" else int(sys.argv[2])  # "-": numbered as it joins (etcd)
    where: dict = {"nnodes": nnodes, "node_rank": node, "master_addr": "127.0.0.1", "master_port": port}
    if len(sys.argv) > 5:
        where = {"nnodes": nnodes, "node_rank": node, "rdzv_backend": sys.argv[5], "rdzv_endpoint": sys.argv[6],
                 "rdzv_id": sys.argv[7], "local_addr": "127.0.0.1"}
    results = mpddp.launch(work, nprocs=2, args=(stop,), backend="gloo", timeout=60,
                           live=os.environ.get("LIVE") == "1", dashboard=os.environ.get("DASHBOARD"), **where)
    print("RESULT " + json.dumps(results), flush=True)
