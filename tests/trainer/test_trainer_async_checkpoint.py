"""Checkpoints that do not stop training, written straight to the store: two ranks (one
gloo group, one process each) run the Trainer's own checkpoint methods on a tiny FSDP2
model while every write to storage waits behind a gate the worker opens when it chooses
(tests/trainer/trainer_async_ckpt_worker.py).

What must hold: every file of a checkpoint is written through the pyarrow file system at
the storage URI (nothing staged locally); training takes steps while a save is in flight;
nothing (Ray Train's report, the `checkpoint` event, the history) claims a checkpoint before
it is complete, and every rank reports it at the same step; the next save waits for the one
in flight; each checkpoint reloads to exactly the state of its own step, not a later one;
trainer_state.json keeps its contents."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from tpufinetune_trainer import checkpoint as ckpt
from trainer_helpers import run_rank_processes

WORKER = Path(__file__).with_name("trainer_async_ckpt_worker.py")
WORLD = 2


def run_ranks(storage_uri: str, out_prefix: Path) -> list[dict]:
    run_rank_processes(WORKER, WORLD, lambda rank, port: [storage_uri, str(out_prefix), str(port), str(rank),
                                                          str(WORLD)])
    return [json.loads(Path(f"{out_prefix}.{rank}.json").read_text()) for rank in range(WORLD)]


def check_run(results: list[dict]) -> None:
    first, second, third, fourth = results[0]["locations"]
    steps = [ckpt.read_trainer_state(location)["step"] for location in (first, second, third, fourth)]
    for rank, result in enumerate(results):
        checks, log = result["checks"], result["log"]
        # Training went on while the first save was in flight, and nothing claimed it.
        assert checks["in_flight_after_3_steps"] and checks["reports_while_in_flight"] == 0, (rank, checks)
        assert not checks["complete_while_in_flight"]
        # Every rank reported each checkpoint once, in order, complete, in place, at the same step.
        reports = [e for e in log if e["what"] == "report"]
        assert [e["step"] for e in reports] == steps, (rank, reports)
        assert all(e["complete"] and e["mode"].endswith("NO_UPLOAD") for e in reports), reports
        assert checks["reported_by_step"] == results[0]["checks"]["reported_by_step"] < 200
        # The next save waited for the one in flight: the second was reported before the third started.
        order = [(e["what"], e.get("step")) for e in log if e["what"] in ("start", "report")]
        assert order.index(("report", steps[1])) < order.index(("start", steps[2])), order
        assert checks["third_waited_s"] >= 0.8, checks
        assert not checks["pending_after_synchronous"]
        # Each checkpoint holds its own step's state, not the end's.
        for location in (first, second, third):
            reload = result["reloads"][location]
            assert reload["equal_to_its_step"] and not reload["equal_to_the_end"], (location, reload)
        assert result["reloads"][fourth]["equal_to_its_step"] and result["reloads"][fourth]["equal_to_the_end"]
        # Straight to the store: every file a save wrote was opened at the storage URI.
        assert result["written"] and all(path.startswith(result["root"] + "/run/step_") for path in
                                          result["written"]), result["written"][:5]
        names = {path.rsplit("/", 1)[1] for path in result["written"]}
        assert {f"__{rank}_{i}.distcp" for i in range(ckpt.WRITE_THREADS)} <= names
        assert [e["step"] for e in result["history"]] == steps
    # Rank 0's events: one per checkpoint, after it is complete; blocked time and write time.
    events = [e for e in results[0]["log"] if e["what"] == "event"]
    assert [e["step"] for e in events] == steps and all(e["complete"] and e["kind"] == "checkpoint" for e in events)
    assert all(0 <= e["save_s"] <= e["write_s"] + 0.01 for e in events), events
    assert events[1]["save_s"] >= 0.8  # training's wait for a save counts as that save's blocked time
    assert not [e for e in results[1]["log"] if e["what"] == "event"]
    # trainer_state.json as a synchronous save wrote it: position, partial loss, history.
    state = results[0]["reloads"][second]["state"]
    assert state["step"] == steps[1] and state["epoch_step"] == steps[1] and state["run_name"] == "run"
    assert state["epoch_loss_sum"] == 2.5 * steps[1] and state["epoch_steps"] == 100
    assert [e["step"] for e in state["history"]] == steps[:2] and state["history"][0]["write_s"] > 0


def test_async_checkpoints_to_a_file_uri(tmp_path):
    check_run(run_ranks(f"file://{tmp_path / 'storage'}", tmp_path / "result"))


def test_async_checkpoints_to_a_bucket(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    check_run(run_ranks(gcs.unique_uri("runs", "async"), tmp_path / "result"))


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_in_a_bucket_checkpoints_straight_into_it_and_reports_complete_ones(
        ray_head, gcs, trainer_assets, monkeypatch):
    """The whole trainer as a Ray job, its storage a gs:// bucket (the emulator): Ray Train
    accepts the checkpoints written in place (no upload), each `checkpoint` event names a
    complete one, and the best is exported."""
    from tpufinetune_trainer import storage
    from trainer_helpers import Run, events_of
    from harness.waiting import wait_for

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    storage_uri = gcs.unique_uri("runs", "in-place")
    argv = ["finetune", "--model-id", str(trainer_assets.model), "--dataset", str(trainer_assets.data),
            "--dataset-split", "train[:160]", "--num-workers", "2", "--max-seq-len", "512", "--eval-fraction", "0.1",
            "--device", "cpu", "--storage-path", storage_uri, "--run-name", "in-place", "--checkpoint-every-steps", "3",
            "--keep-checkpoints", "20", "--num-epochs", "1"]
    client = ray_head.job_client()
    job_id = client.submit_job(entrypoint=shlex.join(["tpufinetune-train", *argv]),
                               runtime_env={"env_vars": {"STORAGE_EMULATOR_HOST": gcs.endpoint}},
                               submission_id=f"tpuft-bucket-{time.time_ns()}")
    try:
        wait_for(lambda: client.get_job_status(job_id).is_terminal(), 400, "the job to end", interval=1)
    except AssertionError:
        client.stop_job(job_id)
        raise
    logs = client.get_job_logs(job_id)
    assert str(client.get_job_status(job_id).value) == "SUCCEEDED", logs[-6000:]
    run = Run(0, logs, events_of(logs))
    checkpoints = run.of("checkpoint")
    steps = [e["step"] for e in checkpoints]
    assert len(steps) >= 3 and steps == sorted(set(steps)), steps
    for event in checkpoints:
        assert event["uri"].startswith(f"{storage_uri}/in-place/") and ckpt.is_complete(event["uri"]), event
        assert 0 <= event["save_s"] and event["write_s"] >= 0, event
    result = run.one("result")
    assert result["best_checkpoint_uri"] in {e["uri"] for e in checkpoints}
    assert storage.exists(f"{result['exported_model_uri']}/config.json", "file")
