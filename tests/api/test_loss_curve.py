"""status.curve (core/runevents.py): progress events folded into a bounded loss curve, and
the step of each epoch kept in history so its eval loss can be drawn on the same axis."""

from __future__ import annotations

import pytest

from tpufinetune.core.runevents import add_curve_point, apply_event
from tpufinetune.core.status import CURVE_LIMIT, TPUFineTuneStatus, checked_status


def progress(step: int, loss: float = 1.0, **extra) -> dict:
    return {"event": "progress", "v": 1, "epoch": 1, "epochs": 1, "step": step, "total_steps": 10_000,
            "loss": loss, "lr": 1e-4, "tokens_per_s": 500.0, "step_time_s": 0.1, **extra}


def test_each_progress_event_adds_one_point_with_its_sample():
    status: dict = {}
    apply_event(status, progress(10, loss=2.5, training_s=12.34))
    apply_event(status, progress(20, loss=2.25, training_s=24.5))
    assert status["curve"] == [
        {"step": 10, "loss": 2.5, "learningRate": 0.0001, "tokensPerSecond": 500.0, "trainingSeconds": 12.3},
        {"step": 20, "loss": 2.25, "learningRate": 0.0001, "tokensPerSecond": 500.0, "trainingSeconds": 24.5}]
    checked_status(status)  # every key declared: the API server keeps them


def test_the_curve_stays_bounded_in_order_and_keeps_its_first_and_newest_points():
    status: dict = {}
    for step in range(1, 2001):
        apply_event(status, progress(step, loss=1000.0 / step))
        curve = status["curve"]
        assert len(curve) <= CURVE_LIMIT
        assert curve[0]["step"] == 1 and curve[-1]["step"] == step
    steps = [p["step"] for p in status["curve"]]
    assert steps == sorted(set(steps))
    assert len(steps) > CURVE_LIMIT // 2  # thinning halves, it does not empty
    assert all(p["loss"] == round(1000.0 / p["step"], 4) for p in status["curve"])
    TPUFineTuneStatus.model_validate(status)  # within the CRD's maxItems


def test_thinning_drops_every_other_point_deterministically():
    curve = [{"step": s} for s in range(5)]
    assert add_curve_point(curve, {"step": 5}, limit=5) == [{"step": s} for s in (0, 2, 4, 5)]
    assert add_curve_point(curve, {"step": 5}, limit=6) == [{"step": s} for s in range(6)]
    with pytest.raises(ValueError, match="first and newest"):
        add_curve_point(curve, {"step": 5}, limit=1)


def test_a_resumed_attempt_replaces_the_repeated_steps_instead_of_zig_zagging():
    status: dict = {}
    for step in (10, 20, 30, 40):
        apply_event(status, progress(step, loss=5.0 - step / 10))
    # The next attempt resumed from the checkpoint of step 20 and reports 25 and 30 again.
    apply_event(status, progress(25, loss=2.9))
    apply_event(status, progress(30, loss=2.8))
    assert [(p["step"], p["loss"]) for p in status["curve"]] == [(10, 4.0), (20, 3.0), (25, 2.9), (30, 2.8)]


def test_the_same_event_read_twice_leaves_the_curve_as_it_was():
    status: dict = {}
    for event in (progress(10), progress(20), progress(20)):
        apply_event(status, event)
    assert [p["step"] for p in status["curve"]] == [10, 20]


def test_an_epoch_keeps_its_step_in_history_for_the_eval_point():
    status: dict = {}
    apply_event(status, {"event": "epoch", "v": 1, "epoch": 1, "epochs": 2, "step": 40, "loss": 2.0,
                         "eval_loss": 2.5})
    assert status["history"] == [{"epoch": 1, "step": 40, "loss": 2.0, "evalLoss": 2.5}]
    assert "step" not in status  # the top level has the last epoch's metrics, not a step
    checked_status(status)
