"""The official DDP tutorial's basic example (pytorch.org, "Getting Started with Distributed Data Parallel"),
in its own shape: ``setup``/``cleanup``, ``ToyModel``, ``demo_basic(rank, world_size)`` and ``run_demo`` with
``mp.spawn``. ``python ddp_tutorial.py mp|mpddp PORT``: the same code under torch.multiprocessing.spawn or
mpddp.spawn (the one line that differs); each rank prints its losses. The port is an argument only so that
tests can run it twice at once; the tutorial hard-codes 12355.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import mpddp

PORT = sys.argv[2] if len(sys.argv) > 2 else "12355"


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(rank)

    # create model and move it to GPU with id rank
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    for step in range(3):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        print(f"LOSS rank {rank} step {step} {loss.item():.8f}", flush=True)

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    spawn = mp.spawn if sys.argv[1] == "mp" else mpddp.spawn
    spawn(demo_fn,
          args=(world_size,),
          nprocs=world_size,
          join=True)


if __name__ == "__main__":
    run_demo(demo_basic, 2)
