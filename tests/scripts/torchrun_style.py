"""A script written for torchrun: env:// rendezvous, LOCAL_RANK, sys.argv."""

import json
import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")  # env://: reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    seen = {k: os.environ.get(k) for k in keys}
    print("RESULT " + json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": t.item(),
                                  "env": seen, "argv": sys.argv[1:], "name": __name__}), flush=True)
    dist.destroy_process_group()
    if "--fail" in sys.argv and rank == 1:
        sys.exit(3)
