"""ignite's idist.Parallel, written for torchrun: it reads the launcher's environment and joins."""

import json

import ignite.distributed as idist
import torch


def training(local_rank: int, config: dict) -> None:
    total = idist.all_reduce(torch.tensor([idist.get_rank() + 1.0]))
    print("RESULT " + json.dumps({"rank": idist.get_rank(), "world": idist.get_world_size(), "local_rank": local_rank,
                                  "nproc_per_node": idist.get_nproc_per_node(), "nnodes": idist.get_nnodes(),
                                  "node_rank": idist.get_node_rank(), "sum": total.item(),
                                  "backend": idist.backend()}), flush=True)


if __name__ == "__main__":
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(training, {})
