"""Trainer pieces in this process (no workers): config, checkpoint files, resume, accumulation."""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_task import TINY

from mpddp.errors import ConfigError
from mpddp.trainer import checkpoint
from mpddp.trainer.config import TrainConfig
from mpddp.trainer.faults import Fault, parse_fault
from mpddp.trainer.loop import Trainer
from mpddp.trainer.prepare import resolve

TASK = TINY + ":make_task"
DROPOUT = TINY + ":make_dropout_task"


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def fit(config):
    trainer = Trainer(resolve(config))
    trainer.fit()
    return trainer


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"epochs": 0}, "epochs=0 is not allowed: it must be an integer >= 1, e.g. --epochs 10"),
        ({"batch_size": 2.5}, "batch_size=2.5 is not allowed: it must be an integer >= 1"),
        ({"accumulate": 0}, "accumulate=0 is not allowed: it must be an integer >= 1, e.g. --accumulate 4"),
        ({"lr": -1.0}, "lr=-1.0 is not allowed: the learning rate must be a number > 0"),
        ({"lr": float("nan")}, "lr=nan is not allowed"),
        ({"precision": "fp16"}, "precision='fp16' is unknown: use one of auto, bf16, fp32"),
        ({"task": " "}, "task=' ' is empty: use digits, synthetic"),
        ({"inject_fault": "kill:one:5"}, "inject_fault='kill:one:5' is not KIND:RANK:STEP: KIND is one of kill, raise"),
        ({"inject_fault": "explode:0:5"}, "inject_fault='explode:0:5' is not KIND:RANK:STEP"),
    ],
)
def test_bad_train_options_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(**changes)
    assert "\n" not in str(e.value)


def test_fault_parsing_and_only_on_the_first_attempt():
    fault = parse_fault("kill:1:20")
    assert fault == Fault("kill", 1, 20) and parse_fault(None) is None
    assert fault.due(rank=1, step=20, restart=0)
    assert not fault.due(rank=1, step=20, restart=1)  # a restarted group runs clean
    assert not fault.due(rank=0, step=20, restart=0) and not fault.due(rank=1, step=19, restart=0)
    with pytest.raises(RuntimeError, match="injected fault: rank 0 raised at step 3"):
        Fault("raise", 0, 3).fire()


def test_a_fault_must_name_a_rank_of_the_world(tmp_path):
    from mpddp import LaunchConfig
    from mpddp.trainer.run import _check_fault_rank, train

    config = TrainConfig(task=TASK, epochs=1, batch_size=8, inject_fault="kill:3:1", run_dir=str(tmp_path / "run"))
    _check_fault_rank(config, LaunchConfig(nprocs=2, nnodes=2, master_port=29500), {})  # rank 3 of 4: fine
    _check_fault_rank(config, None, {"nprocs": None})  # one rank per GPU: counted at launch, checked on each rank
    with pytest.raises(ConfigError, match=r"^inject_fault='kill:3:1' names rank 3, but the world has 2 ranks "
                                          r"\(nnodes=1 × nprocs=2\): pass a RANK from 0 to 1$"):
        train(config, launch_config=LaunchConfig(nprocs=4), nprocs=2)  # the option wins, as in mpddp.launch
    with pytest.raises(ConfigError, match=r"^inject_fault='kill:3:1' names rank 3, but the world has 1 rank "
                                          r"\(world_size=1\): pass a RANK from 0 to 0$"):
        Trainer(resolve(config))  # where the launch chose nprocs: every rank refuses it
    assert not (tmp_path / "run").exists()


def test_checkpoint_write_is_atomic(tmp_path):
    state = {"signature": {}, "model": {}, "optimizer": {}, "epoch": 0, "batches_done": 0, "global_step": 7, "rng": []}
    path = checkpoint.save(state, tmp_path, 7)
    assert path.name == "ckpt-000000007.pt" and os.listdir(tmp_path) == [path.name]

    def crash(tmp):
        assert tmp.parent == tmp_path and tmp.stat().st_size > 0  # complete, not yet renamed
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(state, tmp_path, 8, before_replace=crash)
    assert os.listdir(tmp_path) == [path.name]  # no half file, no temporary file


def test_newest_skips_temporary_and_damaged_files(tmp_path):
    trainer = fit(TrainConfig(task=TASK, epochs=2, batch_size=8, run_dir=str(tmp_path)))
    ckpts = tmp_path / "checkpoints"
    good = checkpoint.candidates(ckpts)[0]
    (ckpts / ".ckpt-000000099.pt.solo.4242.tmp").write_bytes(good.read_bytes()[:100])  # this run's write that died
    (ckpts / ".ckpt-000000097.pt.0a1b2c3d4e5f.77.tmp").write_bytes(b"x")  # another run's, being written
    (ckpts / "ckpt-000000098.pt").write_bytes(good.read_bytes()[:1000])  # damaged by something else
    found = checkpoint.newest(ckpts, checkpoint.signature(trainer.model))
    assert found is not None and found[0] == good
    checkpoint.prune(ckpts, keep=1)
    assert [p.name for p in ckpts.glob("*.tmp")] == [".ckpt-000000097.pt.0a1b2c3d4e5f.77.tmp"]  # only its own


def test_prune_keeps_what_was_just_written_and_counts_only_whole_files(tmp_path):
    state = {"signature": {}, "model": {}, "optimizer": {}, "epoch": 0, "batches_done": 0, "global_step": 0, "rng": []}
    for step in (3, 5, 10):
        checkpoint.save(state, tmp_path, step)
    (tmp_path / "ckpt-000000999.pt").write_text("not a checkpoint\n")  # named newer than anything this run writes
    (tmp_path / "ckpt-000000007.pt").write_bytes((tmp_path / "ckpt-000000010.pt").read_bytes()[:-200])  # cut short
    checkpoint.prune(tmp_path, keep=2, written=tmp_path / "ckpt-000000010.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000005.pt", "ckpt-000000010.pt", "ckpt-000000999.pt"]
    checkpoint.prune(tmp_path, keep=1)  # nothing just written: the damaged file is not kept for a whole one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010.pt"]


def test_a_damaged_newer_checkpoint_costs_no_checkpoint_of_this_run(tmp_path):
    base = TrainConfig(task="synthetic", samples=64, features=4, epochs=1, batch_size=16, keep_checkpoints=1,
                       run_dir=str(tmp_path))
    first = fit(base)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "ckpt-000000999.pt").write_text("not a checkpoint\n")
    auto = resolve(replace(base, epochs=2, resume="auto"))
    assert auto.resume == str(ckpts / "ckpt-000000004.pt") == str(first.last_checkpoint)  # the newest that loads
    second = Trainer(auto).fit()
    assert second.checkpoint == str(ckpts / "ckpt-000000008.pt") and Path(second.checkpoint).is_file()
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-000000008.pt", "ckpt-000000999.pt"]  # keep 1
    assert resolve(replace(base, epochs=3, resume="auto")).resume == second.checkpoint
    Path(second.checkpoint).unlink()
    with pytest.raises(ConfigError) as e:  # only the damaged one left: not a silent start from scratch
        resolve(replace(base, epochs=3, resume="auto"))
    assert str(e.value) == (f"resume='auto': no checkpoint in '{ckpts}' loads (the newest, ckpt-000000999.pt, is "
                            "damaged or not an mpddp checkpoint): move the damaged files away, or pass a new "
                            "--checkpoint-dir to start fresh")


def test_resume_errors_name_the_file_and_the_fix(tmp_path):
    fit(TrainConfig(task=TASK, epochs=1, batch_size=8, run_dir=str(tmp_path / "a")))
    ckpt = str(checkpoint.candidates(tmp_path / "a" / "checkpoints")[0])
    other = tmp_path / "not-mpddp.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(Path(ckpt).read_bytes()[:500])
    cases = [
        (str(tmp_path / "nope.pt"), "nope.pt': no such checkpoint file; pass an existing ckpt-\\*.pt or --resume auto"),
        (str(cut), "cut.pt' is not a readable checkpoint .*: pass an older ckpt-\\*.pt or --resume auto"),
        (str(other), "not-mpddp.pt' is not an mpddp checkpoint \\(missing format, signature"),
    ]
    for resume, message in cases:
        with pytest.raises(ConfigError, match=message):
            resolve(TrainConfig(task=TASK, resume=resume, run_dir=str(tmp_path / "b")))
    with pytest.raises(ConfigError, match="holds a different model \\(0.bias: \\[16\\] in the file vs "
                                          "\\[32\\] here\\); pass a checkpoint of this task's model"):
        resolve(TrainConfig(task="synthetic", features=8, resume=ckpt, run_dir=str(tmp_path / "b")))
    assert not (tmp_path / "b").exists()  # nothing written


def test_run_directories_fresh_auto_and_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = resolve(TrainConfig(task=TASK, epochs=1, batch_size=8))
    assert Path(first.run_dir).parent == Path("runs/tiny_task")
    Trainer(first).fit()
    auto = resolve(TrainConfig(task=TASK, resume="auto"))
    assert auto.run_dir == first.run_dir and auto.resume == str(checkpoint.candidates(first.checkpoint_path)[0])
    done = Trainer(replace(auto, epochs=1)).fit()  # nothing left to train: evaluates and says how to train more
    assert done.epochs == 1 and done.checkpoint == auto.resume and done.test_accuracy is not None
    with pytest.raises(ConfigError, match="already holds checkpoints .* pass --resume auto to continue that run"):
        resolve(TrainConfig(task=TASK, run_dir=first.run_dir))
    empty = resolve(TrainConfig(task=TASK, resume="auto", run_dir=str(tmp_path / "new")))
    assert empty.resume is None  # nothing to resume yet: start from scratch


@pytest.mark.parametrize("resume_at", ["epoch", "mid-epoch"])
def test_resume_continues_bit_for_bit(tmp_path, resume_at):
    base = TrainConfig(task=DROPOUT, epochs=4, batch_size=4, seed=5, checkpoint_every=3, keep_checkpoints=0)
    full = fit(replace(base, run_dir=str(tmp_path / "full")))
    fit(replace(base, epochs=2, run_dir=str(tmp_path / "half")))
    ckpts = checkpoint.candidates(tmp_path / "half" / "checkpoints")
    start = ckpts[0] if resume_at == "epoch" else ckpts[1]  # step 32 ends epoch 2; step 30 is in its middle
    assert start.name == ("ckpt-000000032.pt" if resume_at == "epoch" else "ckpt-000000030.pt")
    torch.manual_seed(12345)  # the resumed run must not depend on what ran before it in this process
    resumed = fit(replace(base, run_dir=str(tmp_path / "half"), resume=str(start)))
    assert resumed.global_step == full.global_step == 64
    for name, value in params(full).items():
        assert torch.equal(value, params(resumed)[name]), name


def test_accumulation_equals_one_big_batch(tmp_path):
    base = TrainConfig(task=TASK, epochs=2, seed=1)
    big = fit(replace(base, batch_size=16, run_dir=str(tmp_path / "big")))
    small = fit(replace(base, batch_size=4, accumulate=4, run_dir=str(tmp_path / "small")))
    assert big.global_step == small.global_step == 8
    for name, value in params(big).items():
        torch.testing.assert_close(params(small)[name], value, rtol=0, atol=1e-12)


def test_progress_bar_only_on_a_terminal_and_metrics_as_json_lines(tmp_path, monkeypatch, capsys):
    import json

    import mpddp.trainer.output as output

    monkeypatch.setattr(output, "PROGRESS_INTERVAL", 0.0)  # redraw at every step
    monkeypatch.setenv("MPDDP_STDOUT_ISATTY", "1")
    fit(TrainConfig(task=TASK, epochs=1, batch_size=8, run_dir=str(tmp_path / "tty")))
    shown = capsys.readouterr().out
    assert "epoch 1/1" in shown and "8/8" in shown and "samples/s" in shown and "loss " in shown
    monkeypatch.setenv("MPDDP_STDOUT_ISATTY", "0")
    fit(TrainConfig(task=TASK, epochs=2, batch_size=8, run_dir=str(tmp_path / "pipe")))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("\r" not in line for line in lines)  # plain summary lines only
    assert lines[1].startswith("epoch   2/2  train loss ") and "test acc" in lines[1] and "elapsed" in lines[1]
    records = [json.loads(line) for line in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"], r["global_batch"]) for r in records] == [(1, 8, 8), (2, 16, 8)]
    assert set(records[0]) >= {"train_loss", "test_loss", "test_accuracy", "samples_per_s", "elapsed_s"}


@pytest.mark.parametrize("before, after", [(2, 1), (2, 3), (3, 2), (4, 4)])
def test_a_sampler_cut_after_the_samples_seen_under_another_world_size_sees_each_other_sample_once(before, after):
    """The epoch's order is DistributedSampler's (seed, epoch); 2 batches of 8 per rank done on ``before`` ranks,
    then the rest on ``after``: every sample once, the rest split evenly, and no cut at all on one layout."""
    from torch.utils.data import DistributedSampler

    from mpddp.trainer.loop import ResumableSampler

    data, done = list(range(101)), 2 * 8
    first = [list(DistributedSampler(data, before, r, shuffle=True, seed=7))[:done] for r in range(before)]
    rest = []
    for r in range(after):
        sampler = ResumableSampler(data, after, r, shuffle=True, seed=7)
        sampler.base = done * before
        rest.append(list(sampler))
        assert len(sampler) == len(rest[-1])
    assert len({len(shard) for shard in rest}) == 1  # every rank the same number of batches: no rank waits
    seen = [i for shard in first + rest for i in shard]
    assert set(seen) == set(data) and len(seen) - len(data) < after  # only the padding repeats
    plain = ResumableSampler(data, before, 0, shuffle=True, seed=7)
    plain.skip = done
    assert list(plain) == list(DistributedSampler(data, before, 0, shuffle=True, seed=7))[done:]
