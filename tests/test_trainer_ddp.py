"""The Trainer under real launches: 2 CPU ranks with gloo, compared with one process.

The central proof: two ranks with per-rank batch b end with the same weights
as one process on batch 2b over the same samples. Then: exact resume across
launches, an injected SIGKILL (also one during a checkpoint write) healed by a
restart with the same final weights, bit for bit.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_task import TINY, TRAIN

import mpddp
from mpddp.trainer import checkpoint
from mpddp.trainer.config import TrainConfig
from mpddp.trainer.loop import Trainer
from mpddp.trainer.prepare import resolve
from mpddp.trainer.run import train

pytestmark = pytest.mark.usefixtures("no_leftovers")

TASK = TINY + ":make_task"
DROPOUT = TINY + ":make_dropout_task"


def state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def equivalence_job(ctx, run_root):
    """On every rank: plain DDP training, the same with accumulation, shards, evaluation."""
    plain = Trainer(resolve(TrainConfig(task=TASK, epochs=2, batch_size=4, seed=2, run_dir=f"{run_root}/plain")), ctx)
    plain.fit()
    accum = Trainer(resolve(TrainConfig(task=TASK, epochs=2, batch_size=2, accumulate=2, seed=2,
                                        run_dir=f"{run_root}/accum")), ctx)
    accum.fit()
    shards = []
    for epoch in range(2):
        plain.sampler.set_epoch(epoch)
        plain.sampler.skip = 0
        shards.append(list(plain.sampler))
    return {"plain": state(plain), "accum": state(accum), "shards": shards, "eval": plain.evaluate(),
            "wrapped": type(plain.ddp).__name__, "test_shard": len(plain.test_loader.dataset)}


@pytest.mark.timeout(120)
def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path):
    ranks = mpddp.launch(equivalence_job, nprocs=2, args=(str(tmp_path),))
    single = Trainer(resolve(TrainConfig(task=TASK, epochs=2, batch_size=8, seed=2, run_dir=str(tmp_path / "one"))))
    single.fit()
    reference = state(single)
    assert ranks[0]["wrapped"] == "DistributedDataParallel"
    for name, value in reference.items():
        for r in ranks:
            torch.testing.assert_close(r["plain"][name], value, rtol=0, atol=1e-6)  # float64: much closer in fact
            torch.testing.assert_close(r["accum"][name], value, rtol=0, atol=1e-6)  # no_sync on micro-step 1 of 2
        assert torch.equal(ranks[0]["plain"][name], ranks[1]["plain"][name])  # the same weights on every rank
        assert torch.equal(ranks[0]["accum"][name], ranks[1]["accum"][name])
    for epoch in range(2):
        a, b = ranks[0]["shards"][epoch], ranks[1]["shards"][epoch]
        assert not set(a) & set(b) and sorted(a + b) == list(range(TRAIN))  # disjoint and complete
    assert ranks[0]["shards"][0] != ranks[0]["shards"][1]  # set_epoch: a new order each epoch
    # Sharded evaluation (11 + 10 samples) equals one process's over all 21: sums and counts.
    assert [r["test_shard"] for r in ranks] == [11, 10]
    expected = single.evaluate()
    for r in ranks:
        assert r["eval"]["accuracy"] == expected["accuracy"]
        assert r["eval"]["loss"] == pytest.approx(expected["loss"], rel=1e-12)
    saved = checkpoint.load(checkpoint.candidates(tmp_path / "plain" / "checkpoints")[0])
    assert set(saved["model"]) == set(reference)  # model.module's names, no "module." prefix
    assert len(saved["rng"]) == 2  # every rank's generators


BASE = TrainConfig(task=DROPOUT, epochs=4, batch_size=4, seed=7, keep_checkpoints=0)  # 8 steps per epoch


def final_weights(run_dir: Path) -> dict:
    newest = checkpoint.candidates(Path(run_dir) / "checkpoints")[0]
    assert newest.name == "ckpt-000000032.pt"
    return checkpoint.load(newest)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = train(replace(BASE, run_dir=str(run_dir)), nprocs=2)
    assert result.epochs == 4 and result.global_step == 32
    return final_weights(run_dir)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.timeout(120)
def test_two_epochs_then_resume_auto_for_two_more_is_bit_exact(tmp_path, uninterrupted, capsys):
    train(replace(BASE, epochs=2, run_dir=str(tmp_path)), nprocs=2)
    result = train(replace(BASE, run_dir=str(tmp_path), resume="auto"), nprocs=2)
    assert "resumed from" in capsys.readouterr().out and result.global_step == 32
    assert_same_weights(final_weights(tmp_path), uninterrupted)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.timeout(120)
def test_a_killed_rank_is_healed_by_a_restart_bit_for_bit(tmp_path, uninterrupted, capfd):
    # Rank 1 is SIGKILLed after step 13; the restart resumes from step 10, in the middle of epoch 2.
    config = replace(BASE, run_dir=str(tmp_path), checkpoint_every=5, inject_fault="kill:1:13")
    result = train(config, nprocs=2, max_restarts=1)
    out = capfd.readouterr()
    assert "ckpt-000000010.pt" in out.out + out.err and result.global_step == 32
    assert_same_weights(final_weights(tmp_path), uninterrupted)


@pytest.mark.timeout(120)
def test_a_kill_while_writing_a_checkpoint_leaves_the_last_complete_one(tmp_path, uninterrupted, capfd):
    # Rank 0 dies with step 10's checkpoint written to a temporary file but not renamed.
    config = replace(BASE, run_dir=str(tmp_path), checkpoint_every=5, inject_fault="kill-saving:0:10")
    train(config, nprocs=2, max_restarts=1)
    out = capfd.readouterr()
    assert "resumed from " + str(tmp_path / "checkpoints" / "ckpt-000000008.pt") in out.out + out.err
    assert_same_weights(final_weights(tmp_path), uninterrupted)
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))  # the dead write was cleaned up


@pytest.mark.timeout(60)
def test_an_injected_exception_names_its_rank(tmp_path):
    with pytest.raises(mpddp.WorkerFailed, match="injected fault: rank 1 raised at step 3") as e:
        train(replace(BASE, run_dir=str(tmp_path), inject_fault="raise:1:3"), nprocs=2)
    assert e.value.rank == 1


@pytest.mark.timeout(60)
def test_an_injected_hang_is_caught_by_the_timeout(tmp_path):
    with pytest.raises(mpddp.HangError, match="rank 1 made no progress") as e:
        train(replace(BASE, run_dir=str(tmp_path), inject_fault="hang:1:3"), nprocs=2, timeout=3)
    assert e.value.rank == 1
