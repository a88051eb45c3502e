"""Checkpoint on notice and early stopping, for real: Ray Train + FSDP2 on CPU (gloo, 2
workers) on the tiny Gemma, submitted through the Ray Job API as the operator does.

- SIGTERM to one worker (what its pod's preStop hook sends): both ranks finish the step,
  save it, report a `notice` event and stop (failure `Preempted`); the run resumed from that
  checkpoint starts at that very step (no step lost).
- `checkpoint-now` (a second Ray job, as the operator submits on a maintenance label):
  a step checkpoint is written and training goes on to the end.
- `--target-eval-loss`: the run stops after the evaluation that reaches it and exports
  that checkpoint.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

import pytest

from harness.waiting import wait_for
from tpufinetune_trainer.checkpoint import WRITE_THREADS, read_trainer_state
from trainer_helpers import Run, events_of, offline_env, run_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def args(assets, storage: Path, run_name: str, *extra: str) -> list[str]:
    return ["finetune", "--model-id", str(assets.model), "--dataset", str(assets.data),
            "--dataset-split", "train[:320]", "--num-workers", "2", "--max-seq-len", "512",
            "--learning-rate", "3e-3", "--eval-fraction", "0.1", "--device", "cpu",
            "--storage-path", str(storage), "--run-name", run_name, "--keep-checkpoints", "20",
            "--progress-interval", "0.2", "--num-epochs", "2", *extra]


class Job:
    def __init__(self, head, argv: list[str], env: dict | None = None):
        self.client = head.job_client()
        self.id = self.client.submit_job(entrypoint=shlex.join(["tpufinetune-train", *argv]),
                                         runtime_env={"env_vars": env or {}},
                                         submission_id=f"tpuft-notice-{time.time_ns()}")

    def events(self):
        return events_of(self.client.get_job_logs(self.id))

    def wait_step(self, step: int) -> None:
        wait_for(lambda: any(e.kind == "progress" and e["step"] >= step for e in self.events()), 300,
                 f"progress past step {step}", interval=0.5)

    def finish(self) -> tuple[str, Run]:
        try:
            wait_for(lambda: self.client.get_job_status(self.id).is_terminal(), 400, "the job to end", interval=1)
        except AssertionError:
            self.client.stop_job(self.id)
            raise
        logs = self.client.get_job_logs(self.id)
        return str(self.client.get_job_status(self.id).value), Run(0, logs, events_of(logs))


@pytest.fixture(scope="module")
def preempted(ray_head, trainer_assets, tmp_path_factory):
    """A run whose rank-1 worker gets SIGTERM after step 2 (its pod is being deleted)."""
    storage, notice_dir = tmp_path_factory.mktemp("storage"), tmp_path_factory.mktemp("notice")
    job = Job(ray_head, args(trainer_assets, storage, "preempted"), {"TPUFT_NOTICE_DIR": str(notice_dir)})
    job.wait_step(2)
    pids = sorted(int(p.name) for p in notice_dir.iterdir())
    assert len(pids) == 2, pids  # each worker announced itself for its pod's preStop hook
    signalled = time.monotonic()
    os.kill(pids[-1], signal.SIGTERM)
    wait_for(lambda: not any(notice_dir.iterdir()), 120, "every worker to have saved on notice", interval=0.2)
    released_s = time.monotonic() - signalled
    status, run = job.finish()
    return status, run, storage, released_s


def test_sigterm_on_one_worker_saves_the_step_on_every_rank_and_stops(preempted):
    status, run, storage, released_s = preempted
    assert status == "FAILED", run.tail()
    notices = run.of("notice")  # rank 0's, and the driver's again from the failure
    assert len(notices) == 2 and notices[0] == notices[1], notices
    notice = notices[0]
    assert notice["reason"] == "SIGTERM" and notice["step"] >= 2
    # Nothing ran past the saved step: the step in flight when the signal came is in it.
    assert max(e["step"] for e in run.of("progress")) <= notice["step"]
    saved = [e for e in run.of("checkpoint") if e["step"] == notice["step"]]
    assert len(saved) == 1 and saved[0]["epoch_end"] is False and saved[0]["uri"] == notice["uri"]
    assert sorted(p.name for p in Path(notice["uri"]).iterdir()) == sorted(
        [".metadata", *[f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(WRITE_THREADS)],
         "trainer_state.json"])  # both ranks' shards
    assert run.of("failure")[-1]["type"] == "Preempted"
    assert not run.of("result") and not run.of("epoch")
    # Well inside GKE's 30 s notice, and inside the pods' grace period.
    assert released_s < 30 and notice["save_s"] < 30, (released_s, notice)


@pytest.fixture(scope="module")
def resumed(ray_head, trainer_assets, preempted):
    """The next attempt, from the notice checkpoint, with a target every evaluation reaches."""
    _, run, storage, _ = preempted
    uri = run.of("notice")[0]["uri"]
    extra = ["--resume-from", uri, "--checkpoint-every-steps", "3", "--target-eval-loss", "1000"]
    return run_trainer(args(trainer_assets, storage, "resumed", *extra), offline_env(ray_head.env()), timeout=480)


def test_the_next_attempt_resumes_at_the_saved_step_and_loses_none(preempted, resumed):
    notice = preempted[1].of("notice")[0]
    assert resumed.rc == 0, resumed.tail()
    plan = resumed.one("plan")
    assert plan["resumed_from"] == notice["uri"]
    assert notice["step"] - plan["resumed_step"] == 0  # lost steps


def test_a_target_eval_loss_stops_after_the_evaluation_that_reaches_it(preempted, resumed):
    notice = preempted[1].of("notice")[0]
    stop = resumed.one("early_stop")
    assert stop["reason"] == "TargetEvalLoss" and stop["target_eval_loss"] == 1000
    first_eval = (notice["step"] // 3 + 1) * 3
    assert stop["step"] == first_eval and max(e["step"] for e in resumed.of("checkpoint")) == first_eval
    result = resumed.one("result")
    assert result["stopped_early"] == "TargetEvalLoss" and result["best_checkpoint_uri"] == stop["uri"]
    # The deciding evaluation is the one the trainer reported with that checkpoint: the same
    # loss in the result's metrics (the last checkpoint's) and in the checkpoint's own state.
    assert (result["metrics"]["step"], result["metrics"]["eval_loss"]) == (stop["step"], stop["eval_loss"])
    saved = read_trainer_state(stop["uri"])["history"][-1]
    assert (saved["uri"], saved["step"], saved["eval_loss"]) == (stop["uri"], stop["step"], stop["eval_loss"])
    assert 0 < stop["eval_loss"] <= stop["target_eval_loss"]
    # Training time counts the preempted attempt's too (saved with the notice's checkpoint).
    before = read_trainer_state(notice["uri"])["training_s"]
    assert 0 < before < stop["training_s"], (before, stop)
    assert (Path(result["exported_model_uri"]) / "model.safetensors").exists()


def test_checkpoint_now_saves_a_step_and_training_goes_on(ray_head, trainer_assets, tmp_path):
    job = Job(ray_head, args(trainer_assets, tmp_path, "asked"))
    job.wait_step(1)
    ask = Job(ray_head, ["checkpoint-now", "--run-name", "asked", "--reason", "Maintenance",
                         "--detail", "node gke-tpu-1 at 2026-12-01T18:00:00Z"])
    assert ask.finish()[0] == "SUCCEEDED"
    status, run = job.finish()
    assert status == "SUCCEEDED", run.tail()
    notice = run.one("notice")
    assert (notice["reason"], notice["requested_by"]) == ("Requested", "Maintenance")
    assert "gke-tpu-1" in notice["detail"]
    assert any(e["step"] == notice["step"] and not e["epoch_end"] for e in run.of("checkpoint"))
    assert run.one("result")["metrics"]["step"] > notice["step"]  # served once, and training went on
