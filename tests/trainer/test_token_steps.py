"""--tokens-per-step (spec.training.tokensPerStep, MaxText's way): a step is a fixed number
of token positions, full packed blocks whatever examples they hold. The planner (pure), the
trainer's refusals, the resume fingerprint, and real steps of the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpufinetune_trainer import data, resume
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.data import BatchPlan, epoch_step_count, plan_epoch, plan_run
from tpufinetune_trainer.errors import ConfigError, DataError, ResumeMismatch
from tpufinetune_trainer.train import Trainer
from trainer_helpers import BLOCK_LENGTH

pytestmark = pytest.mark.timeout(180)


def token_plan(world: int, blocks: int, accum: int, length: int) -> BatchPlan:
    return BatchPlan(world, blocks, accum, blocks=blocks, tokens_per_step=world * blocks * accum * length)


@pytest.mark.parametrize("count,length,world,blocks,accum,seed", [
    (2000, 512, 2, 1, 1, 0), (5000, 256, 4, 2, 2, 3), (777, 1024, 1, 3, 1, 9), (20000, 512, 8, 1, 4, 42)])
def test_every_step_is_full_blocks_and_no_example_twice_in_an_epoch(count, length, world, blocks, accum, seed):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(4.5, 0.8, count).astype(np.int64) + 4, length)
    plan = token_plan(world, blocks, accum, length)
    steps = epoch_step_count(lengths, plan)
    assert steps == int(lengths.sum()) // plan.tokens_per_step
    seen_any = np.zeros(count, dtype=bool)
    for epoch in (1, 2, 3):
        packed = data.pack_epoch(lengths, plan, epoch, seed, length)
        assert len(packed.steps) == steps and (packed.per_step == plan.global_blocks).all()
        assert all(0 < lengths[b].sum() <= length for b in packed.blocks)
        members = np.concatenate(packed.steps)
        assert len(members) == len(np.unique(members))  # no example twice in an epoch
        for step, (examples, first) in enumerate(zip(packed.steps, range(0, len(packed.blocks), plan.global_blocks))):
            in_blocks = sorted(i for b in packed.blocks[first:first + plan.global_blocks] for i in b)
            assert list(examples) == in_blocks, step
        # Full blocks: the steps hold the data's tokens but for what packing leaves over.
        used = lengths[members].sum()
        assert used >= 0.9 * steps * plan.tokens_per_step, (used, steps * plan.tokens_per_step)
        assert len(members) >= 0.85 * count
        seen_any[members] = True
        again = data.pack_epoch(lengths, plan, epoch, seed, length)
        assert [list(b) for b in again.blocks] == [list(b) for b in packed.blocks]  # a resume gets the same
    assert seen_any.mean() > 0.97  # what one epoch leaves over, another takes
    shape = plan_run(lengths, lengths // 2, plan, 3, seed, length)
    assert shape.plan.blocks == blocks and shape.plan.tokens_per_step == plan.tokens_per_step
    epoch = plan_epoch(lengths, lengths // 2, shape.plan, 2, seed, length)
    assert epoch.slots.shape == (steps, accum, world, blocks) and (epoch.slots >= 0).all()  # no padding block


def test_the_epochs_differ_and_the_examples_mode_is_untouched():
    lengths = np.random.default_rng(1).integers(5, 200, 3000)
    plan = token_plan(2, 1, 1, 512)
    one, two = (data.pack_epoch(lengths, plan, e, 0, 512).blocks for e in (1, 2))
    assert one != two
    examples = BatchPlan(2, 4, 1)
    assert epoch_step_count(lengths, examples) == data.steps_per_epoch(3000, examples) == 375


def config(**overrides) -> FinetuneConfig:
    settings = dict(model_id="m", storage_path="gs://b", num_workers=4, device="cpu", max_seq_len=512,
                    batch_size_per_device=2)
    return FinetuneConfig(**{**settings, **overrides})


def test_the_trainer_refuses_a_step_it_cannot_make_naming_the_field_and_a_value():
    plan = config(tokens_per_step=8192).validate().batch_plan()
    assert (plan.world, plan.blocks, plan.accum, plan.global_blocks) == (4, 2, 2, 16)
    with pytest.raises(ConfigError, match=r"--tokens-per-step 5000 \(spec.training.tokensPerStep\) is not a multiple "
                                          r"of 4 devices x --batch-size-per-device 2 x --max-seq-len 512 = 4096.*4096"):
        config(tokens_per_step=5000).validate().batch_plan()
    with pytest.raises(ConfigError, match="exclude each other"):
        config(tokens_per_step=8192, global_batch_examples=16).validate()
    with pytest.raises(DataError, match=r"hold 4000 tokens, fewer than one step's --tokens-per-step 4096"):
        epoch_step_count(np.full(40, 100), config(tokens_per_step=4096).validate().batch_plan())


def test_a_resume_with_another_tokens_per_step_is_refused_naming_it():
    rows = (np.arange(20000, dtype=np.int32), np.arange(0, 20001, 100, dtype=np.int64))  # 200 examples of 100
    examples = data.Examples(data.Ragged(*rows), data.Ragged(*rows))
    saved = resume.fingerprint(config(tokens_per_step=4096).validate(), 4, examples)
    assert saved["tokens_per_step"] == 4096
    assert "tokens_per_step" not in resume.fingerprint(config().validate(), 4, examples)  # older checkpoints match
    current = resume.fingerprint(config(tokens_per_step=4096).validate(), 4, examples)
    assert resume.check({"fingerprint": saved, "step": 1}, current, "gs://b/r/ckpt") is True
    changed = resume.fingerprint(config(tokens_per_step=8192).validate(), 4, examples)
    with pytest.raises(ResumeMismatch, match=r"--tokens-per-step 4096 -> 8192; steps per epoch 4 -> 2"):
        resume.check({"fingerprint": saved, "step": 1}, changed, "gs://b/r/ckpt")


def test_real_steps_take_full_blocks_and_the_loss_falls(trainer_assets, prepared, process_group, tmp_path):
    cfg = FinetuneConfig(model_id=str(trainer_assets.model), storage_path=str(tmp_path), num_workers=1, device="cpu",
                         max_seq_len=BLOCK_LENGTH, learning_rate=3e-3, batch_size_per_device=1, num_epochs=1,
                         tokens_per_step=2 * BLOCK_LENGTH, max_steps=12).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], prepared, rank=0, world=1, local_rank=0)
    assert (trainer.plan.blocks, trainer.plan.accum) == (1, 2)
    assert trainer.epoch_steps == int(trainer.examples.lengths.sum()) // (2 * BLOCK_LENGTH)
    epoch = trainer.epoch_plan
    assert (epoch.slots >= 0).all()  # every step is two blocks of examples, no padding block
    assert epoch.real_tokens.sum() > 0.9 * trainer.epoch_steps * 2 * BLOCK_LENGTH  # packed nearly full
    losses = []
    for _ in range(12):
        loss_sum = torch.zeros(())
        count = int(epoch.label_tokens[trainer.epoch_step])
        trainer.train_step(loss_sum)
        trainer.epoch_step += 1
        losses.append(float(loss_sum) / count)
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
