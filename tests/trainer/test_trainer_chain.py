"""The SFT -> DPO chain through the export (spec.model.initFrom, artifact export: the DPO run's
--model-id is the SFT run's export), on one gloo rank with the trainer's own loop.

An SFT run (Trainer.run: one epoch, its export and the export's proof), then a DPO run on
preference pairs whose --model-id is that export: its weights are the export's, its reference
is the SFT model (the stored reference equals the SFT model's own log-probabilities; rewards
are 0 before the first step) and it trains (the held-out margin rises). Full, and LoRA: the SFT's
merged export, DPO with new adapters on it, the reference the merged model with them off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from test_dpo_train import epochs, sequence_logp, sequences
from test_trainer_init_checkpoint import pair_data
from tpufinetune_trainer import lora
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from trainer_helpers import make_trainer


def sft_export(assets, prepared, storage: Path, **overrides):
    """An SFT run of one epoch, exported and proven (Trainer.run); the trainer and its export."""
    trainer = make_trainer(assets.model, prepared, storage, run_name="sft", **overrides)
    trainer.run()
    return trainer, storage / "sft" / "export"


def dpo_from(export: Path, tmp_path: Path, **overrides):
    from tpufinetune_trainer.train import Trainer

    data = pair_data(None, tmp_path, model=export)  # the export's own tokenizer
    settings = dict(model_id=str(export), storage_path=str(tmp_path / "store"), num_workers=1, device="cpu",
                    max_seq_len=64, learning_rate=1e-3, batch_size_per_device=8, num_epochs=1, method="dpo",
                    lr_schedule="constant", warmup_ratio=0.0, eval_fraction=0.2, seed=7, run_name="dpo")
    cfg = FinetuneConfig(**{**settings, **overrides}).validate()
    return Trainer(cfg, BACKENDS["cpu"], data, rank=0, world=1, local_rank=0)


def differing_from_export(trainer, export: Path) -> tuple[int, list[str]]:
    """(weights compared, those that differ): every base weight of the run against the export's
    tensor of its name, as the run holds it (a LoRA run's base in bf16)."""
    from safetensors.torch import load_file

    saved = load_file(str(export / "model.safetensors"))
    compared, differ = 0, []
    for name, param in trainer.model.named_parameters():
        if lora.is_adapter(name):
            continue
        held = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        compared += 1
        if not torch.equal(held, saved[lora.base_name(name)].to(held.dtype)):
            differ.append(name)
    return compared, differ


@pytest.mark.timeout(600)
def test_full_sft_export_then_dpo_from_it(trainer_assets, prepared, process_group, no_ray_report, tmp_path):
    sft, export = sft_export(trainer_assets, prepared, tmp_path / "storage", learning_rate=3e-3)
    assert (export / "model.safetensors").is_file()
    dpo = dpo_from(export, tmp_path)
    compared, differ = differing_from_export(dpo, export)
    assert compared == len(list(sft.model.parameters())) and differ == [], differ
    # The reference is the SFT model: the stored sums are its own log-probabilities.
    for pair in (0, 7, 21):
        alone = [sequence_logp(sft, ids, labels) for ids, labels in sequences(dpo.examples, pair)]
        assert np.allclose(dpo.examples.reference[pair], alone, atol=1e-4), (pair, alone)
    dpo.evaluate()
    before = dpo.method.eval_sums(dpo)
    assert before["eval_margin"] == 0 and before["eval_rewards_chosen"] == 0 and before["eval_rewards_rejected"] == 0
    seen = epochs(dpo, 1)
    assert seen[0]["eval_margin"] > 0 and np.isfinite(seen[0]["loss"]), seen


@pytest.mark.timeout(600)
def test_lora_sft_merged_export_then_dpo_lora_from_it(trainer_assets, prepared, process_group, no_ray_report,
                                                      tmp_path):
    sft, export = sft_export(trainer_assets, prepared, tmp_path / "storage", method="lora", lora_rank=4,
                             lora_alpha=8.0, lora_dropout=0.0, learning_rate=1e-2)
    assert (export / "model.safetensors").is_file() and (export.parent / "export-adapter").is_dir()
    dpo = dpo_from(export, tmp_path, dpo_lora=True, learning_rate=3e-3, lora_rank=8, lora_alpha=16.0,
                   lora_dropout=0.0)
    assert dpo.examples.reference is None  # the reference: the merged model, the new adapters off
    compared, differ = differing_from_export(dpo, export)
    assert compared > 20 and differ == [], differ
    dpo.evaluate()
    assert dpo.method.eval_sums(dpo)["eval_margin"] == 0
    seen = epochs(dpo, 1)
    assert seen[0]["eval_margin"] > 0 and seen[0]["eval_rewards_chosen"] != 0, seen
