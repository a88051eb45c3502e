"""Method dpo's epoch figures in status (core/runevents.py, core/status.py): the trainer's
epoch event carries the rewards, margin and accuracy of the epoch's pairs and of the
held-out ones (docs/protocol.md); each epoch's are kept in status.history[].dpo, an SFT
epoch has none, and a value the status cannot hold is dropped, not written."""

from __future__ import annotations

import copy

from tpufinetune.core.runevents import PREFERENCE_KEYS, apply_event, split_malformed
from tpufinetune.core.status import TPUFineTuneStatus, checked_status

FIGURES = {"rewards_chosen": 0.41234, "rewards_rejected": -0.2, "margin": 0.61234, "accuracy": 0.75,
           "eval_rewards_chosen": 0.3, "eval_rewards_rejected": -0.1, "eval_margin": 0.4, "eval_accuracy": 0.9}


def epoch(n: int, **figures) -> dict:
    return {"event": "epoch", "epoch": n, "epochs": 3, "step": 4 * n, "loss": 0.6, "eval_loss": 0.55,
            "tokens_per_s": 100.0, "epoch_time_s": 2.0, **figures}


def test_a_dpo_epoch_keeps_its_figures_in_that_epochs_history_entry():
    status: dict = {}
    apply_event(status, epoch(1, **FIGURES))
    apply_event(status, epoch(2, **{**FIGURES, "margin": 0.9, "eval_accuracy": 1.0}))
    first, second = status["history"]
    assert first["dpo"] == {"rewardsChosen": 0.4123, "rewardsRejected": -0.2, "margin": 0.6123, "accuracy": 0.75,
                            "evalRewardsChosen": 0.3, "evalRewardsRejected": -0.1, "evalMargin": 0.4,
                            "evalAccuracy": 0.9}
    assert (second["dpo"]["margin"], second["dpo"]["evalAccuracy"]) == (0.9, 1.0)
    assert (first["loss"], first["evalLoss"]) == (0.6, 0.55)  # SFT's keys stay as they were
    # The status model declares every key (the API server would prune an undeclared one).
    assert checked_status(status) is status
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["history"] == status["history"]


def test_an_sft_epoch_and_a_run_without_held_out_pairs_keep_only_what_they_report():
    status: dict = {}
    apply_event(status, epoch(1))
    assert "dpo" not in status["history"][0]
    train_only = {k: v for k, v in FIGURES.items() if not k.startswith("eval_")}
    apply_event(status, epoch(2, **train_only, eval_accuracy=None))
    assert set(status["history"][1]["dpo"]) == {"rewardsChosen", "rewardsRejected", "margin", "accuracy"}


def test_the_same_epoch_read_twice_or_replayed_after_a_restore_gives_the_same_status():
    once: dict = {}
    apply_event(once, epoch(1, **FIGURES))
    twice = copy.deepcopy(once)
    apply_event(twice, epoch(1, **FIGURES, replayed=True))
    assert twice == once


def test_a_figure_the_status_cannot_hold_drops_its_event_not_every_later_one():
    kept, dropped = split_malformed({}, [epoch(1, **{**FIGURES, "accuracy": 1.5}), epoch(2, **FIGURES)])
    assert [e["epoch"] for e in kept] == [2]
    assert len(dropped) == 1 and "accuracy" in dropped[0][1]


def test_the_keys_read_are_the_trainers_dpo_figures():
    """The trainer's epoch event names each figure of dpo_loss.SUM_KEYS (less the loss, which
    is the event's own `loss`), and each again with eval_ for the held-out pairs."""
    from tpufinetune_trainer.methods.dpo_loss import SUM_KEYS

    figures = [key for key in SUM_KEYS if key != "loss"]
    assert set(PREFERENCE_KEYS) == set(figures) | {f"eval_{key}" for key in figures}
