"""Lightning Fabric, written for torchrun: a few DDP steps on a tiny model."""

import json

import torch
from lightning_fabric import Fabric

if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(32, 4)
    shard = x[fabric.global_rank::fabric.world_size]
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(shard), shard.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    total = fabric.all_reduce(loss.detach(), reduce_op="sum")
    print("RESULT " + json.dumps({"rank": fabric.global_rank, "world": fabric.world_size,
                                  "local_rank": fabric.local_rank, "node_rank": fabric.node_rank,
                                  "environment": type(fabric.strategy.cluster_environment).__name__,
                                  "loss": total.item()}), flush=True)
