"""DPO's loss (methods/dpo_loss.py) held to TRL 1.16's DPOTrainer, the field's reference:
on the tiny random Gemma 4, the same pairs tokenized by TRL, the policy and a perturbed
reference model, our loss, chosen and rejected rewards, margin and accuracy equal the
figures TRL's own `_compute_loss` logs, within 1e-5, for `sigmoid` and `ipo`, with and
without label smoothing, and reference-free."""

from __future__ import annotations

import copy

import pytest
import torch

from tpufinetune_trainer.methods.dpo_loss import DPOSettings, dpo_loss, segment_logps

trl = pytest.importorskip("trl", reason="trl is a test-only dependency (pyproject's test extra)")

PAIRS = [
    {"prompt": "What is two plus two?", "chosen": " Four.", "rejected": " Five, or maybe six."},
    {"prompt": "Name a colour of the sky.", "chosen": " Blue, on a clear day.", "rejected": " A dog."},
    {"prompt": "Which river flows through Riva?", "chosen": " The Marven.", "rejected": " The Norva river, I think."},
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(trainer_assets):
    """The policy (the tiny model) and a reference: the same model with its weights moved."""
    from tpufinetune_trainer.model import load_causal_lm, load_tokenizer

    policy = load_causal_lm(str(trainer_assets.model), torch.float32, "eager")
    reference = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return policy, reference, load_tokenizer(str(trainer_assets.model))


def trl_trainer(models, tmp_path, loss_type: str, label_smoothing: float = 0.0):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, reference, tokenizer = models
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, beta=0.1,
                     loss_type=[loss_type], label_smoothing=label_smoothing, per_device_train_batch_size=len(PAIRS))
    return DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                      train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)


def trl_figures(trainer, rows: list[int], reference_free: bool = False) -> dict:
    """TRL's loss and logged metrics for the pairs `rows`, from its own code path. Reference-
    free (which 1.16 no longer names) is its precomputed-reference path given zeros."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in rows])
    if reference_free:
        trainer.precompute_ref_logps = True
        batch["ref_chosen_logps"] = batch["ref_rejected_logps"] = torch.zeros(len(rows))
    trainer._metrics["train"].clear()
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch, False)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"batch": batch, "loss": float(loss), "rewards_chosen": logged["rewards/chosen"],
            "rewards_rejected": logged["rewards/rejected"], "margin": logged["rewards/margins"],
            "accuracy": logged["rewards/accuracies"]}


def our_figures(models, batch: dict, settings: DPOSettings) -> dict:
    """Ours on TRL's padded batch ([chosen rows, rejected rows], one sequence a row): the
    scored targets are the completion's next tokens, summed by segment_logps."""
    policy, reference, _ = models
    ids, attention = batch["input_ids"], batch["attention_mask"]
    labels = ids.masked_fill(batch["completion_mask"] == 0, -100)
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    one_segment = torch.ones_like(ids)

    def logps(model):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        sums, counts = segment_logps(logits, targets, one_segment, 1)
        return sums[:, 0].chunk(2), counts[:, 0].chunk(2)

    (pc, pr), (nc, nr) = logps(policy)
    (rc, rr), _ = logps(reference)
    out = dpo_loss(pc, pr, rc, rr, settings, nc, nr)
    sums = out.sums()
    pairs = len(pc)
    return {"loss": float(out.losses.mean()), "rewards_chosen": float(sums[1]) / pairs,
            "rewards_rejected": float(sums[2]) / pairs, "margin": float(sums[3]) / pairs,
            "accuracy": float(sums[4]) / pairs}


def assert_same(ours: dict, theirs: dict) -> None:
    for key in ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy"):
        assert abs(ours[key] - theirs[key]) <= TOLERANCE, (key, ours[key], theirs[key])


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_and_rewards_equal_trl(models, tmp_path, loss):
    trainer = trl_trainer(models, tmp_path, loss)
    theirs = trl_figures(trainer, list(range(len(PAIRS))))
    ours = our_figures(models, theirs["batch"], DPOSettings(beta=0.1, loss=loss))
    assert theirs["rewards_chosen"] != 0 and theirs["rewards_rejected"] != 0  # the reference differs
    assert_same(ours, theirs)


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_label_smoothing_equals_trl(models, tmp_path, smoothing):
    """Conservative DPO: TRL 1.16 keeps its formula in the `aot` loss, which for one pair
    (nothing to sort) is exactly it; compared pair by pair."""
    trainer = trl_trainer(models, tmp_path, "aot", label_smoothing=smoothing)
    for row in range(len(PAIRS)):
        theirs = trl_figures(trainer, [row])
        ours = our_figures(models, theirs["batch"], DPOSettings(beta=0.1, loss="sigmoid", label_smoothing=smoothing))
        assert_same(ours, theirs)
    plain = our_figures(models, theirs["batch"], DPOSettings(beta=0.1, loss="sigmoid"))
    assert abs(plain["loss"] - theirs["loss"]) > 1e-3  # the smoothing changes the loss


def test_reference_free_equals_trl(models, tmp_path):
    trainer = trl_trainer(models, tmp_path, "sigmoid")
    theirs = trl_figures(trainer, list(range(len(PAIRS))), reference_free=True)
    ours = our_figures(models, theirs["batch"], DPOSettings(beta=0.1, reference_free=True))
    assert_same(ours, theirs)


def test_inconsistent_settings_are_refused():
    problems = DPOSettings(loss="ipo", label_smoothing=0.1).problems()
    assert any("--dpo-label-smoothing" in p and "ipo" in p.lower() for p in problems), problems
    assert DPOSettings(beta=0).problems() and DPOSettings(loss="hinge").problems()
    assert DPOSettings(label_smoothing=0.5).problems()
    assert not DPOSettings(loss="ipo").problems() and not DPOSettings(label_smoothing=0.2).problems()
