"""One node of a multi-node DDP job whose rank may fail, for the tests of rounds (tests/test_rounds.py).

``python rounds_job.py NODE_RANK NNODES PORT [options]``: every rank trains a small DDP model for ``--steps`` steps
on data fixed by the seed (so the final weights are known in advance: a run that never failed computes them), and
prints one ``RESULT`` line with each local rank's final weights. ``--fail RANK``: that global rank fails at step
``--at`` (by ``--how``: sigkill, raise, exit, hang) on the first attempt only (``--always``: on every attempt).
``--rounds RANK:HOW,RANK:HOW,...``: in round R (the job's R-th restart) the rank and the way of entry R, at step
``--at``; none after the list's end. Each rank prints ``READY rank N attempt A`` after its first step (with ``at``
and the wall time: scripts/bench_recovery.py reads it), ``FAILING rank N at T`` just before it fails, and the pid of
its process in ``PID rank N``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import mpddp

REPORT = "--- the launch's report ---"  # after the launcher's own lines (a warning may come first, under load)


def work(ctx: mpddp.WorkerContext, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1000 + ctx.rank)
    print(f"PID rank {ctx.rank} {os.getpid()}", flush=True)
    for step in range(opts["steps"]):
        x = torch.randn(8, 4, generator=data)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            print(f"READY rank {ctx.rank} attempt {ctx.restart} at {time.time():.6f}", flush=True)
        fail, how = opts["fail"], opts["how"]
        if opts["rounds"]:
            fail, how = (opts["rounds"][ctx.restart] if ctx.restart < len(opts["rounds"]) else (-1, how))
        failing = ctx.rank == fail and (opts["always"] or opts["rounds"] or ctx.restart == 0)
        if failing and step == opts["at"]:
            print(f"FAILING rank {ctx.rank} at {time.time():.6f}", flush=True)
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit":
                sys.exit(7)
            if how == "hang":
                time.sleep(3600)  # never reaches the next step's all_reduce
            raise RuntimeError(f"rank {ctx.rank} fails on purpose")
        time.sleep(opts["pause"])
    dist.barrier()
    return {"rank": ctx.rank, "restart": ctx.restart, "world_size": dist.get_world_size(),
            "weights": [round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("node_rank", type=int)
    parser.add_argument("nnodes", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail", type=int, default=-1)
    parser.add_argument("--at", type=int, default=2)
    parser.add_argument("--how", choices=["sigkill", "raise", "exit", "hang"], default="sigkill")
    parser.add_argument("--always", action="store_true")
    parser.add_argument("--rounds", default="")
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    a = parser.parse_args()
    rounds = [(int(rank), how) for rank, how in (entry.split(":") for entry in a.rounds.split(",") if entry)]
    opts = {"steps": a.steps, "fail": a.fail, "at": a.at, "how": a.how, "always": a.always, "pause": a.pause,
            "rounds": rounds}
    try:
        results = mpddp.launch(work, nprocs=a.nprocs, args=(opts,), backend="gloo", timeout=a.timeout,
                               nnodes=a.nnodes, node_rank=a.node_rank, master_addr="127.0.0.1", master_port=a.port,
                               max_restarts=a.max_restarts)
    except mpddp.WorkerFailed as e:
        print(f"{REPORT}\n{e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except mpddp.MpddpError as e:
        print(f"mpddp: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(results), flush=True)
