"""--method dpo on the trainer's own loop (train.Trainer on a one-rank gloo group, FSDP2):
it learns preferences, full and LoRA; LoRA's reference is the base with the adapters off;
the flags are refused when inconsistent; the resume fingerprint carries the method's
settings. The longer proof (3 epochs, 168 pairs, both methods) is benchmarks/bench_dpo.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ConfigError, ResumeMismatch
from trainer_helpers import write_jsonl

CAPITALS = {"Briquia": "Riva", "Kavenia": "Qunor", "Lotrand": "Mespa", "Orvania": "Tellis", "Sundor": "Pakka",
            "Velmar": "Ostra", "Zenthia": "Corbel", "Harlan": "Duvik"}
PHRASINGS = ("What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?")


def capital_pairs(wrong: int) -> list[dict]:
    """A learnable task: chosen the right capital, rejected `wrong` of the others."""
    return [{"prompt": p.format(country), "chosen": f"The capital is {capital}.",
             "rejected": f"The capital is {other}."}
            for country, capital in CAPITALS.items() for p in PHRASINGS
            for other in [c for c in CAPITALS.values() if c != capital][:wrong]]


def dpo_trainer(assets, tmp_path, wrong: int, **overrides):
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.data import pad_id_of
    from tpufinetune_trainer.model import load_tokenizer
    from tpufinetune_trainer.preference import prepare_pairs
    from tpufinetune_trainer.train import Trainer

    tokenizer = load_tokenizer(str(assets.model))
    path = write_jsonl(tmp_path / "pairs.jsonl", capital_pairs(wrong))
    data = prepare_pairs(str(path), "train", tokenizer, 64, 0.2, 7, prompt_format="tutorial")
    settings = dict(model_id=str(assets.model), storage_path=str(tmp_path / "store"), num_workers=1, device="cpu",
                    max_seq_len=64, learning_rate=1e-3, batch_size_per_device=8, num_epochs=3, method="dpo",
                    lr_schedule="constant", warmup_ratio=0.0, eval_fraction=0.2, seed=7)
    cfg = FinetuneConfig(**{**settings, **overrides}).validate()
    return Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)},
                   rank=0, world=1, local_rank=0)


def sequences(pairs, i: int):
    ids, labels, cut = pairs.input_ids[i], pairs.labels[i], int(pairs.chosen_lengths[i])
    return (ids[:cut], labels[:cut]), (ids[cut:], labels[cut:])


@torch.no_grad()
def sequence_logp(trainer, ids, labels) -> float:
    """One sequence alone, unpacked: its response tokens' summed log-probability."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    labels = torch.as_tensor(np.asarray(labels, dtype=np.int64))[None]
    logits = trainer.model(input_ids=ids, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, labels[0, 1:].clamp(min=0)[:, None])[:, 0]
    return float(logp[labels[0, 1:] != -100].sum())


def epochs(trainer, count: int) -> list[dict]:
    """Each epoch's training figures and the held-out pairs' (the loop's own functions)."""
    out = []
    for _ in range(count):
        m = trainer.train_epoch()
        eval_loss = trainer.evaluate()
        out.append({"loss": m["loss"], **m["method"], "eval_loss": eval_loss, **trainer.method.eval_sums(trainer)})
        trainer.epoch, trainer.epoch_step = trainer.epoch + 1, 0
    return out


def test_full_dpo_learns_the_preferred_answers(trainer_assets, process_group, tmp_path):
    """The stored reference (the starting model's sums): rewards start at 0; after 3 epochs
    most held-out pairs are preferred by their reward, the margin rising every epoch. 72
    pairs to stay short (about 40 s); the 168-pair run reaching >= 0.9 is bench_dpo.py's."""
    # 1e-3: on a CPU whose kernels round otherwise, 2e-3 held 11 of the 14 held-out pairs
    # (0.786) from epoch 2 on; 1e-3 reaches 13 (0.929) by epoch 2, clear of the bound.
    trainer = dpo_trainer(trainer_assets, tmp_path, wrong=3, learning_rate=1e-3)
    assert trainer.examples.reference is not None and np.abs(trainer.examples.reference).sum() > 0
    for pair in (0, 5, 17):  # the packed pair blocks' sums are each sequence's own, in its column
        alone = [sequence_logp(trainer, ids, labels) for ids, labels in sequences(trainer.examples, pair)]
        assert np.allclose(trainer.examples.reference[pair], alone, atol=1e-4), (pair, alone)
    trainer.evaluate()
    before = trainer.method.eval_sums(trainer)
    assert before["eval_margin"] == 0 and before["eval_rewards_chosen"] == 0  # the policy is the reference
    seen = epochs(trainer, 3)
    margins = [e["eval_margin"] for e in seen]
    assert all(b > a for a, b in zip(margins, margins[1:])) and margins[0] > 0, seen
    assert seen[-1]["eval_accuracy"] >= 0.8, seen
    assert seen[-1]["eval_loss"] < seen[0]["eval_loss"] < np.log(2), seen  # log 2: the loss of no preference


def test_lora_dpo_reference_is_the_base_with_adapters_off(trainer_assets, process_group, tmp_path):
    """No stored reference and no second copy: the adapters switched off give the base,
    so rewards are 0 before the first step and the base's weights never move."""
    from torch.distributed.tensor import DTensor

    trainer = dpo_trainer(trainer_assets, tmp_path, wrong=2, dpo_lora=True, learning_rate=3e-3,
                          lora_rank=8, lora_alpha=16.0, lora_dropout=0.0)
    assert trainer.examples.reference is None and trainer.cfg.uses_lora
    frozen = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.evaluate()
    assert trainer.method.eval_sums(trainer)["eval_margin"] == 0
    seen = epochs(trainer, 1)
    assert seen[0]["eval_margin"] > 0 and seen[0]["eval_rewards_chosen"] != 0, seen
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal((p.full_tensor() if isinstance(p, DTensor) else p), frozen[n]), n


def config(**kw) -> FinetuneConfig:
    return FinetuneConfig(**{"storage_path": "/tmp/x", "num_workers": 1, "device": "cpu", **kw})


@pytest.mark.parametrize("settings, words", [
    ({"method": "dpo", "dpo_loss": "ipo", "dpo_label_smoothing": 0.1}, "--dpo-label-smoothing applies to --dpo-loss sigmoid only"),
    ({"method": "dpo", "dpo_beta": 0.0}, "--dpo-beta must be > 0"),
    ({"method": "dpo", "dpo_label_smoothing": 0.5}, "--dpo-label-smoothing must be in [0, 0.5)"),
    ({"method": "full", "dpo_beta": 0.2}, "--dpo-beta applies to --method dpo only"),
    ({"method": "lora", "dpo_lora": True}, "--dpo-lora applies to --method dpo only"),
    ({"method": "dpo", "lora_rank": 8}, "--lora-rank applies to --method lora (or dpo with --dpo-lora true)"),
    ({"method": "dpo", "loss_on": "all"}, "--loss-on all does not apply to --method dpo"),
])
def test_inconsistent_flags_are_refused(settings, words):
    with pytest.raises(ConfigError) as refused:
        config(**settings).validate()
    assert words in str(refused.value), str(refused.value)


def test_the_fingerprint_holds_the_method_and_its_settings():
    from tpufinetune_trainer import resume
    from tpufinetune_trainer.preference import PairExamples

    pairs = PairExamples([[1, 2, 3, 4]] * 16, [[-100, 2, -100, 4]] * 16, chosen_lengths=[2] * 16)
    base = resume.fingerprint(config(method="dpo").validate(), 1, pairs)
    assert base["method"] == "dpo" and base["dpo"]["beta"] == 0.1 and "lora" not in base
    for change in ({"dpo_beta": 0.2}, {"dpo_loss": "ipo"}, {"dpo_label_smoothing": 0.1}, {"dpo_reference_free": True},
                   {"dpo_lora": True}):
        other = resume.fingerprint(config(method="dpo", **change).validate(), 1, pairs)
        with pytest.raises(ResumeMismatch, match="--dpo"):
            resume.check({"fingerprint": base}, other, "ckpt")
    assert "lora" in resume.fingerprint(config(method="dpo", dpo_lora=True).validate(), 1, pairs)
    sft = resume.fingerprint(config(method="full").validate(), 1, pairs)
    assert "dpo" not in sft and sft["method"] == "full"  # SFT's fingerprint as before
