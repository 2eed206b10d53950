"""The Trainer on a GPU: device placement, bf16 autocast, pinned memory (skipped without CUDA)."""

import pytest
import torch

import mpddp
from mpddp.trainer.config import TrainConfig
from mpddp.trainer.loop import Trainer
from mpddp.trainer.prepare import resolve

# device_count() only: is_available() in the parent would poison forked children (DESIGN.md).
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_leftovers")]


def gpu_job(ctx, run_dir):
    trainer = Trainer(resolve(TrainConfig(epochs=3, batch_size=64, run_dir=run_dir)), ctx)
    result = trainer.fit()
    inputs = trainer.task.test_set.tensors[0][:4].to(ctx.device)
    with trainer.autocast:
        dtype = trainer.model(inputs).dtype
    return {"device": str(next(trainer.model.parameters()).device), "autocast_dtype": str(dtype),
            "pinned": trainer.train_loader.pin_memory, "accuracy": result.test_accuracy}


@pytest.mark.timeout(180)
def test_digits_on_one_gpu_in_bf16(tmp_path):
    [r] = mpddp.launch(gpu_job, nprocs=1, args=(str(tmp_path),))
    assert r["device"] == "cuda:0" and r["pinned"]
    assert r["autocast_dtype"] == "torch.bfloat16"  # precision auto = bf16 on GPUs that support it
    assert r["accuracy"] > 0.9
