"""A run's own metrics from its status (core/runmetrics.py): which values each gauge takes,
which are left out, and the queue wait of a Kueue admission, which the driver observes."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import REGISTRY

from run_helpers import MemoryCluster, body, in_loop, settings
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import runmetrics
from tpufinetune.core.progress import ProgressTracker
from tpufinetune.core.status import TPUFineTuneStatus
from tpufinetune.driver import Run

RUNNING = {
    "phase": "Running", "attempt": 2, "epoch": 1, "loss": 2.5, "evalLoss": 2.7,
    "tokensPerSecond": 900.0,
    "progress": {"step": 30, "totalSteps": 120, "percent": 25.0, "loss": 2.1, "learningRate": 2e-05,
                 "tokensPerSecond": 1000.0, "stepTimeSeconds": 0.5, "etaSeconds": 45},
    "usage": {"chipHours": 0.5, "hostHours": 0.125, "provisioningSeconds": 12.0},
}


def test_a_running_status_gives_every_gauge_from_its_freshest_source():
    assert runmetrics.values(RUNNING) == {
        "tpufinetune_run_epoch": 1, "tpufinetune_run_step": 30, "tpufinetune_run_progress_ratio": 0.25,
        "tpufinetune_run_loss": 2.1,  # the progress window's, not the last epoch's 2.5
        "tpufinetune_run_eval_loss": 2.7, "tpufinetune_run_learning_rate": 2e-05,
        "tpufinetune_run_tokens_per_second": 1000.0, "tpufinetune_run_step_time_seconds": 0.5,
        "tpufinetune_run_eta_seconds": 45, "tpufinetune_run_attempts": 2,
        "tpufinetune_run_chip_seconds": 1800.0,
    }
    # Every gauge but the method's and the generation's (test_dpo_and_generation_figures_...).
    assert set(runmetrics.values(RUNNING)) | set(PREFERENCE_AND_GENERATION) == set(runmetrics.GAUGES)
    assert runmetrics.SERIES_PER_RUN == 23


PREFERENCE_AND_GENERATION = {
    "tpufinetune_run_rewards_chosen": 0.25, "tpufinetune_run_rewards_rejected": -0.5,
    "tpufinetune_run_reward_margin": 0.75, "tpufinetune_run_preference_accuracy": 0.875,
    "tpufinetune_run_eval_rewards_chosen": 0.125, "tpufinetune_run_eval_rewards_rejected": -0.25,
    "tpufinetune_run_eval_reward_margin": 0.375, "tpufinetune_run_eval_preference_accuracy": 0.75,
    "tpufinetune_run_eval_exact_match": 0.5, "tpufinetune_run_eval_rouge_l": 0.625, "tpufinetune_run_eval_bleu": 31.5,
}


def test_dpo_and_generation_figures_come_from_the_last_epoch_that_has_them():
    """history[].dpo of the last epoch with one (training and held-out pairs), and
    history[].eval of the last epoch evaluated (an epoch without generation leaves the
    previous figures standing); the model declares every key read."""
    status = {"history": [
        {"epoch": 1, "dpo": {"rewardsChosen": 0.0, "margin": 0.0, "accuracy": 0.5}, "eval": {"exactMatch": 0.0}},
        {"epoch": 2, "dpo": {"rewardsChosen": 0.25, "rewardsRejected": -0.5, "margin": 0.75, "accuracy": 0.875,
                             "evalRewardsChosen": 0.125, "evalRewardsRejected": -0.25, "evalMargin": 0.375,
                             "evalAccuracy": 0.75},
         "eval": {"exactMatch": 0.5, "rougeL": 0.625, "bleu": 31.5, "examples": 8}},
        {"epoch": 3, "loss": 1.0},
    ]}
    assert runmetrics.values(status) == PREFERENCE_AND_GENERATION
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True)
    assert runmetrics.values(dumped) == PREFERENCE_AND_GENERATION
    sft = {"history": [{"epoch": 1, "loss": 1.5, "evalLoss": 1.6}]}
    assert not set(runmetrics.values(sft)) & set(PREFERENCE_AND_GENERATION)  # absent, not 0


def test_the_status_model_declares_every_key_read():
    # The values come from keys the status model owns (a renamed key would silently drop a series).
    dumped = TPUFineTuneStatus.model_validate(RUNNING).model_dump(by_alias=True, exclude_none=True)
    assert runmetrics.values(dumped) == runmetrics.values(RUNNING)


def test_a_new_run_has_no_series_but_its_phase():
    assert runmetrics.values({}) == {}
    assert runmetrics.values(None) == {}
    assert runmetrics.values({"phase": "Pending", "attempt": 1}) == {"tpufinetune_run_attempts": 1}


def test_epoch_values_stand_in_until_a_progress_window_reports():
    status = {"epoch": 2, "loss": 1.5, "tokensPerSecond": 800.0,
              "history": [{"epoch": 1, "evalLoss": 1.9}, {"epoch": 2}]}
    assert runmetrics.values(status) == {
        "tpufinetune_run_epoch": 2, "tpufinetune_run_loss": 1.5, "tpufinetune_run_tokens_per_second": 800.0,
        "tpufinetune_run_eval_loss": 1.9,  # the last evaluated epoch, not the last epoch
    }


@pytest.mark.parametrize("progress,ratio", [
    ({"step": 130, "totalSteps": 120}, 1.0),  # past the plan (a resumed run): clamped
    ({"percent": 40.0}, 0.4),
    ({"step": 5, "totalSteps": 0}, None),  # no plan yet: no ratio, no division by zero
])
def test_the_progress_ratio_stays_within_zero_and_one(progress, ratio):
    assert runmetrics.values({"progress": progress}).get("tpufinetune_run_progress_ratio") == ratio


def test_values_that_are_not_finite_numbers_are_left_out():
    status = {"attempt": True, "epoch": "2", "loss": float("nan"), "progress": {"step": None}}
    assert runmetrics.values(status) == {}


def test_queue_wait_is_measured_only_for_an_admission():
    queued = {"phase": "Queued", "phaseTransitionTime": "2026-01-01T10:00:00Z"}
    admitted = {"phase": "Provisioning", "phaseTransitionTime": "2026-01-01T10:07:30Z"}
    assert runmetrics.queue_wait(queued, admitted) == 450.0
    assert runmetrics.queue_wait(queued, {**admitted, "phase": "Deleting"}) is None
    assert runmetrics.queue_wait(queued, {**queued, "phaseTransitionTime": "2026-01-01T10:09:00Z"}) is None
    assert runmetrics.queue_wait({**queued, "phase": "Pending"}, admitted) is None
    assert runmetrics.queue_wait({"phase": "Queued"}, admitted) is None


class KueueCluster(MemoryCluster):
    """The run's RayCluster as Kueue leaves it: suspended until the test admits it."""

    admitted = False

    async def observe(self, ident, name):
        view = await super().observe(ident, name)
        return dataclasses.replace(view, suspended=self.exists and not self.admitted,
                                   ready=view.ready and self.admitted)


@in_loop
async def test_the_driver_observes_the_queue_wait_once_kueue_admits_the_run():
    count = REGISTRY.get_sample_value("tpufinetune_queue_wait_seconds_count") or 0.0
    cluster = KueueCluster()
    resource = body()
    resource["spec"]["queueName"] = "tpu-queue"
    run = Run(resource, cluster, RayJobs(), settings(status_write_interval=0), ProgressTracker())
    phases_seen = [(await run.step()).phase for _ in range(3)]
    assert phases_seen == ["Pending", "Provisioning", "Queued"]
    assert (await run.step()).phase == "Queued"
    assert (REGISTRY.get_sample_value("tpufinetune_queue_wait_seconds_count") or 0.0) == count
    cluster.admitted = True
    assert (await run.step()).phase == "Provisioning"
    assert REGISTRY.get_sample_value("tpufinetune_queue_wait_seconds_count") == count + 1
