"""Checkpoint on notice and early stopping on the test ground (cpu runs, gs:// storage):
- GKE's maintenance label on a node of the run: the operator asks the trainer for a
  checkpoint now, and training goes on; then, in the same run,
- a worker pod deleted mid-epoch with a 30 s grace: its preStop hook has the trainer save the
  step before the pod goes, and the retry resumes from that very step;
- training.targetEvalLoss: the run stops after the evaluation that reaches it, exports that
  checkpoint and fills status.timeToTarget."""

from __future__ import annotations

import time

import pytest

from tpufinetune_trainer.events import parse_text
from ground_runs import jobs_of, resource, running, start_run
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"


def events_of_attempt(kube, cluster: str, uid: str, attempt: int) -> list:
    client = kube.head_job_client(cluster)
    return parse_text(client.get_job_logs(f"tft-{uid}-{attempt}"))


def training(kube, cluster: str, uid: str) -> None:
    """The first attempt's workers are stepping (its plan is out)."""
    kube.wait_for(lambda: any(e.kind == "plan" for e in events_of_attempt(kube, cluster, uid, 1)),
                  "the trainer's plan", timeout=300, interval=1)


def workers(kube, cluster: str) -> list[dict]:
    return [p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]


def test_maintenance_then_a_deleted_worker_each_get_a_checkpoint_and_the_retry_loses_no_step(
        operator, ground, kube, ground_assets, storage):
    """One run, two notices: GKE's maintenance label on a node of the run (a checkpoint now,
    training goes on), then a worker pod deleted mid-epoch with a 30 s grace (its preStop
    hook has the trainer save the step before the pod goes; the retry resumes from it)."""
    # ttlSecondsAfterFinished keeps the head after the end, to read attempt 2's log. Every
    # checkpoint is kept: with the default of one, Ray Train deletes the notice's checkpoint
    # (reported without an evaluation, so ranked last) once the epoch's next one completes,
    # which can come before the bucket is looked at below.
    manifest = resource("notice", ground_assets, storage, epochs=10, rows=640, maxRetries=1,
                        terminationGracePeriodSeconds=30, ttlSecondsAfterFinished=300,
                        checkpoint={"keep": 100})
    uid, cluster = start_run(kube, manifest)
    running(kube, "notice")
    training(kube, cluster, uid)

    # Maintenance scheduled on a node of the run.
    node = workers(kube, cluster)[0]["spec"]["nodeName"]
    when = str(int(time.time()) + 3600)
    labelled = time.monotonic()
    ground.kubectl("label", "node", node, f"{MAINTENANCE_LABEL}={when}")
    try:
        kube.wait_for(lambda: (kube.status("notice").get("notice") or {}).get("requestedBy")
                      == "Maintenance", "a checkpoint on notice", timeout=120, interval=0.5)
        saved_s = time.monotonic() - labelled
    finally:
        ground.kubectl("label", "node", node, f"{MAINTENANCE_LABEL}-")
    status = kube.status("notice")
    assert status["phase"] == "Running" and status["attempt"] == 1  # the request stopped nothing
    assert status["maintenance"]["nodes"] == [node] and status["maintenance"]["requests"] == 1
    assert status["notice"]["reason"] == "Requested" and node in status["notice"]["detail"]
    assert ground.gcs.list(status["notice"]["checkpointURI"])
    # The operator's poll (woken by the node watch at once), the request job's start on the
    # head, the trainer's next read (1 s) and one step: generous for two slow cores.
    assert saved_s < 90, saved_s
    request_jobs = [j.submission_id for j in jobs_of(kube, cluster, uid) if "checkpoint" in j.submission_id]
    assert request_jobs == [f"tft-{uid}-1-checkpoint-1"]

    # A worker pod deleted (as the cloud takes a host), mid-epoch.
    victim = workers(kube, cluster)[0]["metadata"]["name"]
    deleted = time.monotonic()
    kube.kubectl("delete", "pod", victim, "--grace-period=30", "--wait=true", timeout=90)
    gone_s = time.monotonic() - deleted
    assert gone_s < within(30), gone_s  # the hook returned once the step was saved, before the grace ran out

    first = kube.head_job_client(cluster).get_job_logs(f"tft-{uid}-1")
    notices = [e for e in parse_text(first) if e.kind == "notice"]
    assert notices, first[-6000:]
    notice = notices[-1]  # the driver's, from the failure (rank 0's may have gone with its pod)
    assert notice["reason"] == "SIGTERM" and notice["step"] >= 1
    assert ground.gcs.list(notice["uri"]), notice["uri"]  # the step's shards are in the bucket
    status = kube.wait_for(lambda: (s := kube.status("notice")).get("phase") in ("Succeeded", "Failed") and s,
                           "the run to end", timeout=600)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 2 and status["notice"]["step"] == notice["step"]
    plan = next(e for e in events_of_attempt(kube, cluster, uid, 2) if e.kind == "plan")
    assert plan["resumed_from"] == notice["uri"]
    assert notice["step"] - plan["resumed_step"] == 0  # lost steps
    # The attempts say the same: a preemption, resumed from the notice's checkpoint, at most
    # one step lost (the one in flight when the notice came, if it was not finished).
    first_attempt, second_attempt = status["attempts"]
    # The pod is gone when the operator looks: it names it, or its replacement.
    assert first_attempt["reason"] == "Preempted", first_attempt
    assert victim in first_attempt["message"] or "was replaced" in first_attempt["message"], first_attempt
    assert second_attempt["reason"] == "Succeeded" and second_attempt["resumedFrom"] == notice["uri"]
    assert first_attempt["lostSteps"] <= 1, first_attempt
    reasons = [e["reason"] for e in kube.items("events") if e["involvedObject"]["name"] == "notice"]
    assert "Maintenance" in reasons and reasons.count("CheckpointOnNotice") >= 2, reasons


def test_a_target_eval_loss_stops_the_run_early_and_exports_that_checkpoint(
        operator, ground, kube, ground_assets, storage):
    # Every evaluation reaches this target: the first one (after step 2) ends the run.
    manifest = resource("early-stop", ground_assets, storage, epochs=3,
                        training={"targetEvalLoss": 1000.0, "checkpointEverySteps": 2})
    start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("early-stop").get("phase") == "Succeeded", "Succeeded", timeout=600)
    status = kube.status("early-stop")
    stop = status["earlyStop"]
    assert stop["reason"] == "TargetEvalLoss" and stop["step"] == 2 and stop["evalLoss"] <= 1000
    assert status["checkpointURI"] == stop["checkpointURI"]  # the exported one is the one that reached it
    assert status["timeToTarget"] > 0
    assert status["exportedModelURI"] and ground.gcs.list(status["exportedModelURI"])
    assert status.get("epoch", 0) < 3  # it did not train on
