"""The pure state machine: every transition, retry, failure message and deletion rule."""

from datetime import timedelta

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.runevents import split_malformed
from tpufinetune.core.status import checked_status
from tpufinetune.core.phases import ClusterView, Identity, JobView, Observations, Plan
from tpufinetune.core.phasemodel import recorded_cluster_uid

from phase_helpers import ENDED, IDENT, PLAN, READY, T0, kinds, running_status, step

def test_new_resource_persists_identities_before_any_side_effect():
    d = step({})
    assert d.phase == phases.PENDING
    assert d.status["rayClusterName"] == "demo-rc"
    assert d.status["jobId"] == "tft-uid-1-1"
    assert d.status["attempt"] == 1
    assert d.status["epochProgress"] == "0/2"
    assert d.status["observedGeneration"] == 3
    assert kinds(d) == ["RecordEvent"]


def test_pending_creates_the_cluster_and_moves_to_provisioning():
    d = step(step({}).status)
    assert d.phase == phases.PROVISIONING
    assert phases.CreateCluster("demo-rc") in d.actions
    assert cond.find(d.status, cond.CLUSTER_READY)["status"] == "False"


def test_provisioning_recreates_a_missing_cluster_and_waits_for_ready():
    status = step(step({}).status).status
    d = step(status, cluster=ClusterView(exists=False))
    assert d.actions == [phases.CreateCluster("demo-rc")]
    d = step(status, cluster=ClusterView(exists=True, ready=False))
    assert d.phase == phases.PROVISIONING and d.actions == []
    d = step(status, cluster=READY)
    assert d.phase == phases.SUBMITTING
    assert d.status["dashboardURL"] == "http://head:8265"
    assert cond.is_true(d.status, cond.CLUSTER_READY)


def test_a_cluster_owned_by_someone_else_is_refused_with_a_condition_not_adopted():
    status = step(step({}).status).status
    d = step(status, cluster=ClusterView(exists=True, owned=False, ready=True))
    assert d.phase == phases.PROVISIONING
    assert "not owned" in d.status["message"]
    assert cond.find(d.status, cond.CLUSTER_READY)["reason"] == "NotOwned"
    assert not any(isinstance(a, (phases.CreateCluster, phases.DeleteCluster)) for a in d.actions)
    # the same observation again does not repeat the Warning event
    again = step(d.status, cluster=ClusterView(exists=True, owned=False, ready=True))
    assert kinds(again) == []


def test_a_cluster_owned_by_someone_else_still_ends_the_run_at_the_provisioning_timeout():
    status = step(step({}).status).status
    foreign = ClusterView(exists=True, owned=False, ready=True, uid="someone-elses")
    d = step(status, now=T0 + timedelta(minutes=31), cluster=foreign)
    assert d.phase == phases.FAILED
    assert cond.find(d.status, cond.FAILED)["reason"] == "ProvisioningTimeout"
    assert "not owned" in d.status["message"] and "after 30 min" in d.status["message"]
    # The release can only name its own: no uid of the foreign cluster goes with the delete.
    assert recorded_cluster_uid(d.status, foreign) == ""


def test_provisioning_times_out_and_releases_the_slice():
    status = step(step({}).status).status
    problem = "0/4 nodes available: insufficient google.com/tpu"
    late = T0 + timedelta(minutes=31)
    d = step(status, now=late, cluster=ClusterView(exists=True, ready=False, problem=problem))
    assert d.phase == phases.FAILED
    assert problem in d.status["message"]
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert cond.find(d.status, cond.FAILED)["reason"] == "ProvisioningTimeout"


def test_submitting_submits_once_and_attaches_to_an_existing_job():
    status = step(step(step({}).status).status, cluster=READY).status
    d = step(status, cluster=READY, job=None)
    assert d.actions == [phases.SubmitJob("tft-uid-1-1", 1)]
    assert d.phase == phases.SUBMITTING
    # after a restart the job exists already: attach, never submit again
    d = step(status, cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING
    assert not any(isinstance(a, phases.SubmitJob) for a in d.actions)
    assert cond.is_true(d.status, cond.JOB_SUBMITTED)


def test_epoch_events_fill_metrics_history_and_progress():
    status = running_status()
    events = (
        {"event": "epoch", "epoch": 1, "epochs": 2, "loss": 3.14159, "eval_loss": 3.2, "tokens_per_s": 1234.56, "epoch_time_s": 10.0},
        {"event": "checkpoint", "epoch": 1, "uri": "gs://b/ckpt_1"},
    )
    d = step(status, cluster=READY, job=JobView("RUNNING"), events=events)
    s = d.status
    assert (s["epoch"], s["epochs"], s["epochProgress"]) == (1, 2, "1/2")
    assert s["loss"] == 3.1416 and s["evalLoss"] == 3.2 and s["tokensPerSecond"] == 1234.6
    assert s["checkpointURI"] == "gs://b/ckpt_1"
    assert s["history"] == [
        {"epoch": 1, "loss": 3.1416, "evalLoss": 3.2, "tokensPerSecond": 1234.6, "epochTimeSeconds": 10.0, "checkpointURI": "gs://b/ckpt_1"}
    ]
    # the same events again (a log replay after restart) change nothing
    assert step(s, cluster=READY, job=JobView("RUNNING"), events=events).status["history"] == s["history"]


def test_success_records_result_and_releases_the_cluster():
    status = running_status()
    events = (
        {"event": "epoch", "epoch": 2, "epochs": 2, "loss": 2.5},
        {"event": "result", "best_checkpoint_uri": "gs://b/best", "exported_model_uri": "gs://b/hf"},
    )
    d = step(status, cluster=READY, job=JobView("SUCCEEDED"), events=events)
    assert d.phase == phases.SUCCEEDED
    assert d.status["checkpointURI"] == "gs://b/best"
    assert d.status["exportedModelURI"] == "gs://b/hf"
    assert cond.is_true(d.status, cond.SUCCEEDED)
    assert not cond.is_true(d.status, cond.RUNNING)
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert "completionTime" in d.status


def test_a_checkpoint_on_notice_is_kept_in_status_and_recorded_as_an_event():
    events = (
        {"event": "checkpoint", "epoch": 1, "step": 7, "epoch_end": False, "uri": "gs://b/run/step_0000007"},
        {"event": "notice", "reason": "Requested", "requested_by": "Maintenance", "detail": "node n1",
         "epoch": 1, "step": 7, "uri": "gs://b/run/step_0000007", "save_s": 2.5},
    )
    d = step(running_status(), cluster=READY, job=JobView("RUNNING"), events=events)
    assert d.status["notice"] == {"reason": "Requested", "requestedBy": "Maintenance", "detail": "node n1",
                                  "step": 7, "checkpointURI": "gs://b/run/step_0000007", "saveSeconds": 2.5,
                                  "time": cond.timestamp(T0)}
    assert d.status["checkpointURI"] == "gs://b/run/step_0000007"
    recorded = [a for a in d.actions if isinstance(a, phases.RecordEvent) and a.reason == "CheckpointOnNotice"]
    assert len(recorded) == 1 and "step 7" in recorded[0].message and "Maintenance" in recorded[0].message
    assert split_malformed(running_status(), list(events))[1] == []  # the status model takes it
    # The driver repeats a SIGTERM's notice (rank 0's line may be lost with its pod): once.
    sigterm = {"event": "notice", "reason": "SIGTERM", "step": 9, "uri": "gs://b/run/step_0000009", "save_s": 1.0}
    first = step(d.status, cluster=READY, job=JobView("RUNNING"), events=(sigterm,))
    again = step(first.status, cluster=READY, job=JobView("FAILED"), events=(sigterm,), now=T0 + timedelta(seconds=5))
    assert first.status["checkpointURI"] == again.status["checkpointURI"] == "gs://b/run/step_0000009"
    assert again.status["notice"] == first.status["notice"]  # its time too
    assert "CheckpointOnNotice" not in [a.reason for a in again.actions if isinstance(a, phases.RecordEvent)]


def test_an_early_stop_at_the_target_fills_time_to_target():
    events = ({"event": "early_stop", "reason": "TargetEvalLoss", "epoch": 2, "step": 30, "eval_loss": 1.23456,
               "target_eval_loss": 1.3, "training_s": 812.345, "uri": "gs://b/run/step_0000030"},
              {"event": "result", "best_checkpoint_uri": "gs://b/run/step_0000030", "stopped_early": "TargetEvalLoss"})
    d = step(running_status(), cluster=READY, job=JobView("SUCCEEDED"), events=events)
    assert d.phase == phases.SUCCEEDED
    assert d.status["timeToTarget"] == 812.3
    assert d.status["earlyStop"] == {"reason": "TargetEvalLoss", "step": 30, "evalLoss": 1.2346,
                                     "checkpointURI": "gs://b/run/step_0000030"}
    patience = ({"event": "early_stop", "reason": "Patience", "step": 12, "eval_loss": 2.0, "training_s": 5.0},)
    assert "timeToTarget" not in step(running_status(), cluster=READY, job=JobView("RUNNING"),
                                      events=patience).status
    assert split_malformed(running_status(), list(events))[1] == []


def test_maintenance_on_a_node_of_the_run_asks_for_a_checkpoint_once_per_node_and_attempt():
    labelled = (("gke-tpu-a", "1767272400"),)
    d = step(running_status(), cluster=READY, job=JobView("RUNNING"), maintenance=labelled)
    request = [a for a in d.actions if isinstance(a, phases.RequestCheckpoint)]
    assert request == [phases.RequestCheckpoint("tft-uid-1-1-checkpoint-1", 1, 1, "Maintenance",
                                                "node gke-tpu-a at 2026-01-01T13:00:00Z")]
    assert d.status["maintenance"]["nodes"] == ["gke-tpu-a"] and d.status["maintenance"]["requests"] == 1
    assert [a.reason for a in d.actions if isinstance(a, phases.RecordEvent)] == ["Maintenance"]
    assert d.phase == phases.RUNNING
    # Seen again (every poll while the label stays): nothing more is asked.
    again = step(d.status, cluster=READY, job=JobView("RUNNING"), maintenance=labelled)
    assert not [a for a in again.actions if isinstance(a, phases.RequestCheckpoint)]
    # A second node: a second request, with its own submission id.
    both = labelled + (("gke-tpu-b", "1767272400"),)
    second = step(again.status, cluster=READY, job=JobView("RUNNING"), maintenance=both)
    assert [a.submission_id for a in second.actions if isinstance(a, phases.RequestCheckpoint)] == [
        "tft-uid-1-1-checkpoint-2"]
    assert second.status["maintenance"]["nodes"] == ["gke-tpu-a", "gke-tpu-b"]
    # Not while the job is not running (nothing to checkpoint).
    idle = step(running_status(), cluster=READY, job=JobView("SUCCEEDED"), maintenance=labelled)
    assert not [a for a in idle.actions if isinstance(a, phases.RequestCheckpoint)]


def test_trainer_failure_event_becomes_the_message():
    status = running_status()
    events = ({"event": "failure", "type": "DatasetError", "message": "column 'response' missing"},)
    d = step(status, cluster=READY, job=JobView("FAILED", "exit 1"), events=events, **ENDED)
    assert d.phase == phases.FAILED
    assert d.status["message"] == "DatasetError: column 'response' missing"
    assert cond.find(d.status, cond.FAILED)["reason"] == "TrainerFailed"


def test_a_failed_job_is_decided_once_its_log_tail_and_its_slice_are_read():
    status = running_status()
    d = step(status, cluster=READY, job=JobView("FAILED", "Job entrypoint command failed"))
    assert d.actions == [phases.ReadLogTail("tft-uid-1-1"), phases.ReadSliceHealth("2026-01-01T12:00:00Z")]
    assert d.phase == phases.RUNNING
    d = step(status, cluster=READY, job=JobView("FAILED", "Job entrypoint command failed"),
             **{**ENDED, "log_tail": "Killed"})
    assert d.phase == phases.FAILED
    assert "Killed" in d.status["message"]


def test_retry_resubmits_with_the_next_deterministic_id():
    plan = Plan(cluster_name="demo-rc", epochs=2, max_retries=1)
    status = running_status()
    failure = ({"event": "failure", "type": "RuntimeError", "message": "preempted"},)
    d = step(status, plan=plan, cluster=READY, job=JobView("FAILED"), events=failure, **ENDED)
    assert d.phase == phases.SUBMITTING
    assert d.status["attempt"] == 2 and d.status["jobId"] == "tft-uid-1-2"
    assert "trainerFailure" not in d.status
    d = step(d.status, plan=plan, cluster=READY, job=None)
    assert d.actions == [phases.SubmitJob("tft-uid-1-2", 2)]
    # the second failure is final
    d = step(step(d.status, plan=plan, cluster=READY, job=JobView("RUNNING")).status, plan=plan, cluster=READY, job=JobView("FAILED"), events=failure, **ENDED)
    assert d.phase == phases.FAILED


def test_a_job_stopped_outside_the_operator_fails_the_run():
    d = step(running_status(), cluster=READY, job=JobView("STOPPED"), **ENDED)
    assert d.phase == phases.FAILED
    assert cond.find(d.status, cond.FAILED)["reason"] == "JobStopped"


def test_invalid_spec_fails_with_the_reason_and_creates_nothing():
    d = step({}, spec_error="spec.tpu.topology: '3x3' is not a valid v6e topology")
    assert d.phase == phases.FAILED
    assert "spec.tpu.topology" in d.status["message"]
    assert not any(isinstance(a, (phases.CreateCluster, phases.SubmitJob)) for a in d.actions)


def _plan_of(model: str) -> Plan:
    from tpufinetune.core.api import parse_spec

    spec = parse_spec({"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "img", "model": {"id": model},
                       "checkpoint": {"storagePath": "gs://bucket/ckpt"}})
    return phases.plan_for(IDENT, spec, timedelta(minutes=30))


def test_a_run_that_cannot_fit_its_slice_fails_before_any_raycluster():
    d = step({}, plan=_plan_of("google/gemma-4-31B-it"))
    assert d.phase == phases.FAILED
    failed = cond.find(d.status, cond.FAILED)
    assert failed["reason"] == "DoesNotFit"
    assert "GiB of HBM per chip" in d.status["message"] and "28.8 GiB usable" in d.status["message"]
    assert "smallest that fits" in d.status["message"]
    assert "CreateCluster" not in kinds(d) and "SubmitJob" not in kinds(d)
    assert d.status["plan"]["fits"] is False and d.status["plan"]["basis"] == "table"
    assert checked_status(d.status) is d.status  # status.plan is declared


def test_a_run_that_fits_records_its_plan_and_goes_on():
    d = step({}, plan=_plan_of("google/gemma-4-E2B-it"))
    assert d.phase == phases.PENDING
    assert d.status["plan"]["fits"] is True
    assert "CreateCluster" in kinds(step(d.status, plan=_plan_of("google/gemma-4-E2B-it")))


def test_an_edit_that_cannot_fit_before_submission_fails_and_releases():
    status = step(step({}).status).status
    d = step(status, plan=_plan_of("google/gemma-4-31B-it"), cluster=ClusterView(exists=True))
    assert d.phase == phases.FAILED and cond.find(d.status, cond.FAILED)["reason"] == "DoesNotFit"
    assert phases.DeleteCluster("demo-rc") in d.actions


def test_terminal_phase_keeps_releasing_until_the_cluster_is_gone():
    done = step(running_status(), cluster=READY, job=JobView("SUCCEEDED")).status
    assert step(done, cluster=READY).actions == [phases.DeleteCluster("demo-rc")]
    assert step(done, cluster=ClusterView(exists=False)).actions == []


def test_deleting_a_finished_released_run_keeps_its_phase_and_posts_nothing():
    """Nothing to stop or release: no Deleting phase, no Event (in a namespace being deleted
    the operator's RoleBinding is already gone), no action, so the finalizer goes."""
    done = step(running_status(), cluster=READY, job=JobView("SUCCEEDED")).status
    released = step(done, cluster=ClusterView(exists=False)).status
    d = step(released, cluster=ClusterView(exists=False), deleting=True)
    assert (d.phase, d.actions) == (phases.SUCCEEDED, [])  # no RecordEvent, no DeleteCluster
    assert d.status == released
    # Its RayCluster still up (or not seen: observation failed): it is released, as before.
    assert step(released, cluster=READY, deleting=True).phase == phases.DELETING
    assert phases.DeleteCluster("demo-rc") in step(released, cluster=None, deleting=True).actions


@pytest.mark.parametrize("job,cluster,complete", [
    (JobView("RUNNING"), READY, False),
    (JobView("STOPPED"), READY, False),
    (JobView("STOPPED"), ClusterView(exists=False), True),
    (None, ClusterView(exists=True, owned=False), True),
    # The head died with its cluster: the job's state is unknown, and that must not matter.
    (None, ClusterView(exists=False), True),
    # A head that does not answer (or refuses the token): the cluster still goes.
    (None, READY, False),
])
def test_deletion_stops_the_job_and_deletes_the_cluster(job, cluster, complete):
    d = step(running_status(), cluster=cluster, job=job, deleting=True)
    assert d.phase == phases.DELETING
    assert (phases.StopJob("tft-uid-1-1") in d.actions) == (job is not None and job.status == "RUNNING")
    # The finalizer goes once a deleting step asks no delete (handlers.release).
    assert (phases.DeleteCluster("demo-rc") in d.actions) == (cluster.exists and cluster.owned) == (not complete)


def test_deletion_never_asks_to_stop_a_job_on_a_cluster_that_is_gone():
    d = step(running_status(), cluster=ClusterView(exists=False), job=JobView("RUNNING"), deleting=True)
    assert not any(isinstance(a, (phases.StopJob, phases.DeleteCluster)) for a in d.actions)


def test_condition_transition_time_only_moves_when_the_status_flips():
    s = {}
    cond.set_condition(s, cond.RUNNING, True, "A", "a", T0, 1)
    cond.set_condition(s, cond.RUNNING, True, "B", "b", T0 + timedelta(hours=1), 1)
    assert cond.find(s, cond.RUNNING)["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    cond.set_condition(s, cond.RUNNING, False, "C", "c", T0 + timedelta(hours=2), 1)
    assert cond.find(s, cond.RUNNING)["lastTransitionTime"] == "2026-01-01T14:00:00Z"


def test_suspend_before_provisioning_creates_nothing_until_resumed():
    suspended = Plan(cluster_name="demo-rc", epochs=2, suspended=True)
    d = step(step({}, plan=suspended).status, plan=suspended, cluster=ClusterView(exists=False))
    assert d.phase == phases.PENDING and "suspended" in d.status["message"]
    assert not any(isinstance(a, phases.CreateCluster) for a in d.actions)
    assert step(d.status, cluster=ClusterView(exists=False)).actions[0] == phases.CreateCluster("demo-rc")


def test_suspend_mid_run_stops_the_job_releases_the_slice_and_reserves_the_next_attempt():
    suspended = Plan(cluster_name="demo-rc", epochs=2, suspended=True)
    d = step(running_status(), plan=suspended, cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.PENDING
    assert phases.StopJob("tft-uid-1-1") in d.actions
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert d.status["jobId"] == "tft-uid-1-2"
    assert cond.find(d.status, cond.CLUSTER_READY)["reason"] == "Suspended"


def test_a_spec_made_invalid_before_submission_fails_and_releases():
    status = step(step({}).status).status
    d = step(status, cluster=ClusterView(exists=True), spec_error="spec.tpu.slices: must be 1 for finetune")
    assert d.phase == phases.FAILED
    assert phases.DeleteCluster("demo-rc") in d.actions
    # Its Failed Event is the step's last, and names the outcome (the metric reads it).
    events = [a.reason for a in d.actions if isinstance(a, phases.RecordEvent)]
    assert events[-1] == "InvalidSpec" and "SpecRefused" not in events, events


def test_a_long_suspend_then_resume_gets_the_whole_provisioning_timeout():
    """Fault 4: the provisioning timer starts when Provisioning is entered, not when
    ClusterReady last flipped (it stays False through the suspend)."""
    suspended = Plan(cluster_name="demo-rc", epochs=2, suspended=True)
    provisioning = step(step({}).status).status
    d = step(provisioning, plan=suspended, now=T0 + timedelta(minutes=1), cluster=ClusterView(exists=True))
    assert d.phase == phases.PENDING
    resumed_at = T0 + timedelta(hours=5)
    d = step(d.status, now=resumed_at, cluster=ClusterView(exists=False))
    assert d.phase == phases.PROVISIONING
    assert d.status["phaseTransitionTime"] == cond.timestamp(resumed_at)
    waiting = ClusterView(exists=True, ready=False)
    d = step(d.status, now=resumed_at + timedelta(minutes=1), cluster=waiting)
    assert d.phase == phases.PROVISIONING
    # ... and the timeout still applies, counted from the resume
    d = step(d.status, now=resumed_at + timedelta(minutes=31), cluster=waiting)
    assert d.phase == phases.FAILED
    assert cond.find(d.status, cond.FAILED)["reason"] == "ProvisioningTimeout"


# ---- fault 11: suspend and spec edits ------------------------------------------------------

RETRY_ONCE = Plan(cluster_name="demo-rc", epochs=2, max_retries=1, cluster_hash="slice-a")
SUSPENDED_RETRY_ONCE = Plan(cluster_name="demo-rc", epochs=2, max_retries=1, cluster_hash="slice-a", suspended=True)
FAILURE = ({"event": "failure", "type": "RuntimeError", "message": "preempted"},)


def resume(status, plan):
    """Suspend mid-run, resume, and run the next attempt."""
    d = step(status, plan=SUSPENDED_RETRY_ONCE, cluster=READY, job=JobView("RUNNING"))
    d = step(d.status, plan=plan, cluster=ClusterView(exists=False))
    d = step(d.status, plan=plan, cluster=READY)
    d = step(d.status, plan=plan, cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING
    return d.status


def test_a_suspend_uses_up_no_retry():
    status = resume(running_status(RETRY_ONCE), RETRY_ONCE)
    assert status["attempt"] == 2
    d = step(status, plan=RETRY_ONCE, cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED)
    assert d.phase == phases.SUBMITTING, d.status["message"]
    assert d.status["retries"] == 1 and d.status["attempt"] == 3


def test_a_suspend_clears_the_stopped_attempts_trainer_failure():
    status = running_status(RETRY_ONCE)
    # The trainer reported a failure as the suspend's stop reached it.
    d = step(status, plan=SUSPENDED_RETRY_ONCE, cluster=READY, job=JobView("RUNNING"),
             events=({"event": "failure", "type": "KeyboardInterrupt", "message": "stopped"},))
    assert "trainerFailure" not in d.status
    d = step(d.status, plan=RETRY_ONCE, cluster=ClusterView(exists=False))
    d = step(d.status, plan=RETRY_ONCE, cluster=READY)
    d = step(d.status, plan=RETRY_ONCE, cluster=READY, job=JobView("RUNNING"))
    # The next attempt's end is judged on its own log, not on the stopped attempt's report.
    d = step(d.status, plan=RETRY_ONCE, cluster=READY, job=JobView("FAILED", "exit 1"))
    assert phases.ReadLogTail("tft-uid-1-2") in d.actions and d.phase == phases.RUNNING


def test_a_retry_after_an_edit_that_changes_the_slice_rebuilds_the_cluster():
    status = running_status(RETRY_ONCE)
    assert status["clusterHash"] == "slice-a"
    edited = Plan(cluster_name="demo-rc", epochs=2, max_retries=1, cluster_hash="slice-b")
    d = step(status, plan=edited, cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED)
    # the next attempt is not submitted to the old cluster ...
    assert d.phase == phases.PENDING
    assert not any(isinstance(a, phases.SubmitJob) for a in d.actions)
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert cond.find(d.status, cond.CLUSTER_READY)["reason"] == "Rebuilding"
    # ... no new one is created while the old one is still going ...
    d = step(d.status, plan=edited, cluster=READY)
    assert d.phase == phases.PENDING and d.actions == [phases.DeleteCluster("demo-rc")]
    # ... then it is built from the edited spec, and the attempt runs on it
    d = step(d.status, plan=edited, cluster=ClusterView(exists=False))
    assert d.phase == phases.PROVISIONING and phases.CreateCluster("demo-rc") in d.actions
    assert d.status["clusterHash"] == "slice-b"
    d = step(d.status, plan=edited, cluster=READY)
    d = step(d.status, plan=edited, cluster=READY, job=None)
    assert d.actions == [phases.SubmitJob("tft-uid-1-2", 2)]


def test_a_retry_after_an_edit_that_keeps_the_slice_reuses_the_cluster():
    status = running_status(RETRY_ONCE)
    d = step(status, plan=RETRY_ONCE, cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED)
    d = step(d.status, plan=RETRY_ONCE, cluster=READY, job=None)
    assert d.actions == [phases.SubmitJob("tft-uid-1-2", 2)]


def test_observed_generation_names_only_an_applied_generation():
    status = running_status(RETRY_ONCE)
    assert status["observedGeneration"] == 3
    edited = Identity("demo", "ns", "uid-1", generation=4)
    # An edit while the job runs applies to the next attempt: not observed yet.
    d = phases.transition(edited, RETRY_ONCE, status, Observations(now=T0, cluster=READY, job=JobView("RUNNING")))
    assert d.status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in d.status["conditions"])
    d = phases.transition(edited, RETRY_ONCE, d.status,
                          Observations(now=T0, cluster=READY, job=JobView("FAILED"), events=FAILURE, **ENDED))
    assert d.status["observedGeneration"] == 3
    # the retry submits with generation 4: now it is applied
    d = phases.transition(edited, RETRY_ONCE, d.status, Observations(now=T0, cluster=READY, job=None))
    assert d.actions == [phases.SubmitJob("tft-uid-1-2", 2)]
    assert d.status["observedGeneration"] == 4
    # a suspend is applied at once
    d = phases.transition(Identity("demo", "ns", "uid-1", generation=5), SUSPENDED_RETRY_ONCE, running_status(RETRY_ONCE),
                          Observations(now=T0, cluster=READY, job=JobView("RUNNING")))
    assert d.status["observedGeneration"] == 5


def test_a_cluster_deleted_under_the_job_is_a_lost_job_retried_on_a_new_cluster():
    plan = Plan(**{**PLAN.__dict__, "max_retries": 1})
    status = running_status()
    d = step(status, plan=plan, cluster=ClusterView(exists=False))
    assert d.phase == phases.PENDING
    assert d.status["attempt"] == 2 and d.status["retries"] == 1 and d.status["jobId"] == "tft-uid-1-2"
    assert "dashboardURL" not in d.status
    assert "deleted outside the operator" in d.status["message"] and "retry 1/1" in d.status["message"]
    assert cond.find(d.status, cond.RUNNING)["reason"] == "ClusterLost"
    assert [(a.type, a.reason) for a in d.actions if isinstance(a, phases.RecordEvent)] == [("Warning", "ClusterLost")]
    d = step(d.status, plan=plan, cluster=ClusterView(exists=False))
    assert d.phase == phases.PROVISIONING and phases.CreateCluster("demo-rc") in d.actions


def test_a_cluster_being_deleted_under_a_job_without_retries_left_fails_the_run_clusterlost():
    going = ClusterView(exists=True, owned=True, ready=False, deleting=True)
    d = step(running_status(), cluster=going, job=JobView("RUNNING"))
    assert d.phase == phases.FAILED
    failed = cond.find(d.status, cond.FAILED)
    assert failed["reason"] == "ClusterLost" and "no retries left" in failed["message"]
    assert phases.DeleteCluster("demo-rc") in d.actions


def test_split_malformed_names_why_each_event_was_dropped():
    bad = [{"event": "epoch", "epoch": "two", "epochs": 2}, {"event": "epoch", "epoch": -1, "epochs": 2},
           {"event": "epoch", "epoch": 1, "epochs": 2, "loss": float("nan")}]
    good = {"event": "progress", "step": 3, "total_steps": 10}
    kept, dropped = split_malformed({"phase": "Running"}, [*bad, good])
    assert kept == [good]
    whys = [why for _, why in dropped]
    assert whys[0].startswith("ValueError") and "two" in whys[0]
    assert "greater than or equal to 0" in whys[1]
    assert "not JSON compliant" in whys[2]


def test_a_refused_raycluster_is_shown_with_the_servers_words_and_times_out():
    status = step(step({}).status).status  # Provisioning: the create was sent
    refusal = "rayclusters.ray.io \"demo-rc\" is forbidden: exceeded quota: no-clusters"
    gone = ClusterView(exists=False)
    d = step(status, cluster=gone, create_refused=refusal, now=T0 + timedelta(minutes=1))
    assert d.phase == phases.PROVISIONING and phases.CreateCluster("demo-rc") in d.actions  # asked again
    ready = cond.find(d.status, cond.CLUSTER_READY)
    assert ready["reason"] == "CreateRefused" and refusal in ready["message"] and refusal in d.status["message"]
    assert [(a.type, a.reason) for a in d.actions if isinstance(a, phases.RecordEvent)] == [("Warning", "CreateRefused")]
    again = step(d.status, cluster=gone, create_refused=refusal, now=T0 + timedelta(minutes=2))
    assert not any(isinstance(a, phases.RecordEvent) for a in again.actions)  # one Event per message
    late = step(again.status, cluster=gone, create_refused=refusal, now=T0 + timedelta(minutes=31))
    assert late.phase == phases.FAILED
    failed = cond.find(late.status, cond.FAILED)
    assert failed["reason"] == "ProvisioningTimeout" and "could not be created in 30 min" in failed["message"]
    assert refusal in failed["message"]


PREFLIGHT = Plan(cluster_name="demo-rc", epochs=2, provision_timeout=timedelta(minutes=30), preflight=True)


def submitting_status(plan=PREFLIGHT):
    d = step({}, plan=plan)
    d = step(d.status, plan=plan)
    d = step(d.status, plan=plan, cluster=READY)
    assert d.phase == phases.SUBMITTING
    return d


def test_preflight_runs_on_the_cluster_before_the_fine_tune_is_submitted():
    d = step(submitting_status().status, plan=PREFLIGHT, cluster=READY)
    assert [a for a in d.actions if isinstance(a, (phases.SubmitPreflight, phases.SubmitJob))] == [
        phases.SubmitPreflight("tft-uid-1-1-preflight", 1)]
    assert d.status["preflight"] == {"phase": "Running", "attempt": 1, "jobId": "tft-uid-1-1-preflight"}
    running = step(d.status, plan=PREFLIGHT, cluster=READY, preflight_job=JobView("RUNNING"))
    assert not [a for a in running.actions if isinstance(a, (phases.SubmitPreflight, phases.SubmitJob))]
    events = ({"event": "collectives", "passed": True, "world_size": 2, "hosts": 2, "bus_bandwidth_gbps": 1.25,
               "devices_per_host": {"127.0.0.3": 1, "127.0.0.4": 1}},)
    passed = step(running.status, plan=PREFLIGHT, cluster=READY, preflight_job=JobView("SUCCEEDED"),
                  preflight_events=events)
    assert phases.SubmitJob("tft-uid-1-1", 1) in passed.actions
    assert passed.status["preflight"]["phase"] == "Passed" and passed.status["preflight"]["busBandwidthGBps"] == 1.25
    assert passed.status["preflight"]["devicesPerHost"] == {"127.0.0.3": 1, "127.0.0.4": 1}
    assert "PreflightPassed" in [a.reason for a in passed.actions if isinstance(a, phases.RecordEvent)]
    checked_status(passed.status)  # the status model takes it


def test_a_failed_preflight_fails_the_run_and_releases_the_slice_without_a_fine_tune():
    d = step(submitting_status().status, plan=PREFLIGHT, cluster=READY)
    events = ({"event": "collectives", "passed": False, "world_size": 8, "hosts": 2,
               "short_hosts": {"127.0.0.4": 0}},
              {"event": "failure", "type": "CollectivesError", "message": "1 host(s) short of TPU devices: ..."})
    failed = step(d.status, plan=PREFLIGHT, cluster=READY, preflight_job=JobView("FAILED"), preflight_events=events)
    assert failed.phase == phases.FAILED
    assert cond.find(failed.status, cond.FAILED)["reason"] == "PreflightFailed"
    assert "short of TPU devices" in failed.status["message"]
    assert failed.status["preflight"]["phase"] == "Failed" and failed.status["preflight"]["shortHosts"] == {"127.0.0.4": 0}
    assert phases.DeleteCluster("demo-rc") in failed.actions
    assert not [a for a in failed.actions if isinstance(a, phases.SubmitJob)]
    (attempt,) = failed.status["attempts"]
    assert attempt["reason"] == "PreflightFailed" and "short of TPU devices" in attempt["message"]
    checked_status(failed.status)


def test_without_preflight_the_fine_tune_is_submitted_at_once():
    d = step(submitting_status(PLAN).status, cluster=READY)
    assert phases.SubmitJob("tft-uid-1-1", 1) in d.actions and "preflight" not in d.status


def test_an_export_that_does_not_load_back_is_the_failed_reason_itself():
    status = running_status()
    events = ({"event": "failure", "type": "ExportUnloadable",
               "message": "gs://b/run/export does not load: model.safetensors truncated"},)
    d = step(status, cluster=READY, job=JobView("FAILED", "exit 1"), events=events, **ENDED)
    assert d.phase == phases.FAILED
    failed = cond.find(d.status, cond.FAILED)
    assert (failed["reason"], failed["message"]) == (
        "ExportUnloadable", "gs://b/run/export does not load: model.safetensors truncated")


def test_a_resume_the_trainer_refuses_is_not_retried_with_retries_left():
    plan = Plan(cluster_name="demo-rc", epochs=2, max_retries=3)
    refusal = ({"event": "failure", "type": "ResumeMismatch",
                "message": "Refusing to resume from gs://b/r/epoch_0001-0: batch_size_per_device 4 -> 8"},)
    d = step(running_status(), plan=plan, cluster=READY, job=JobView("FAILED"), events=refusal, **ENDED)
    assert d.phase == phases.FAILED and int(d.status.get("retries") or 0) == 0
    failed = cond.find(d.status, cond.FAILED)
    assert failed["reason"] == "ResumeMismatch" and "batch_size_per_device" in failed["message"]
    # Any other trainer failure still gets its retry.
    other = ({"event": "failure", "type": "RuntimeError", "message": "preempted"},)
    assert step(running_status(), plan=plan, cluster=READY, job=JobView("FAILED"), events=other,
                **ENDED).phase == phases.SUBMITTING
