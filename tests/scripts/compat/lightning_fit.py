"""A Lightning Trainer fit, written for torchrun: ``lightning_fit.py DEVICES`` (a number, or auto)."""

import json
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.last_loss = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    devices = sys.argv[1] if sys.argv[1] == "auto" else int(sys.argv[1])
    pl.seed_everything(0, verbose=False)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    weight = model.layer.weight.detach().flatten().tolist()
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "world": trainer.world_size,
                                  "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
                                  "environment": type(trainer.strategy.cluster_environment).__name__,
                                  "loss": model.last_loss, "weight": weight}), flush=True)
