"""The state machine with spec.queueName: Queued while Kueue holds the RayCluster suspended,
provisioning after admission (queue time not counted against the provisioning timeout),
eviction back to Queued as a new attempt that is not a failure, release at the end."""

from datetime import timedelta

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.phases import ClusterView, JobView, QueueView

from phase_helpers import ENDED, PLAN, T0, kinds, step

QPLAN = phases.Plan(cluster_name="demo-rc", epochs=2, max_retries=0,
                    provision_timeout=timedelta(minutes=30), queue="tpu-queue")
PENDING_QUOTA = QueueView(
    reason="Pending",
    message="couldn't assign flavors to pod set cpu-16: insufficient unused quota for "
            "google.com/tpu in flavor tpu-v6e-slice, 16 more needed")
HELD = ClusterView(exists=True, suspended=True, queue=PENDING_QUOTA)
ADMITTED = ClusterView(exists=True, ready=False)
READY = ClusterView(exists=True, ready=True, dashboard_url="http://head:8265")
PREEMPTED = QueueView(reason="Pending", message="Workload no longer fits",
                      evicted="Preempted: Preempted to accommodate a workload due to prioritization")


def qstep(status, **obs):
    return step(status, plan=QPLAN, **obs)


def provisioning():
    d = qstep(qstep({}).status)
    assert d.phase == phases.PROVISIONING and phases.CreateCluster("demo-rc") in d.actions
    return d.status


def queued():
    d = qstep(provisioning(), cluster=HELD)
    assert d.phase == phases.QUEUED
    return d.status


def running(status):
    d = qstep(status, cluster=ADMITTED)
    d = qstep(d.status, cluster=READY)
    d = qstep(d.status, cluster=READY)
    assert d.actions[-1] == phases.SubmitJob(d.status["jobId"], d.status["attempt"])
    d = qstep(d.status, cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING
    return d.status


def test_a_suspended_cluster_is_queued_with_kueues_own_message():
    d = qstep(provisioning(), cluster=HELD)
    assert d.phase == phases.QUEUED
    assert d.status["message"] == f"queued in tpu-queue: {PENDING_QUOTA.message}"
    admitted = cond.find(d.status, cond.ADMITTED)
    assert admitted["status"] == "False" and admitted["reason"] == "Pending"
    assert "16 more needed" in admitted["message"]
    assert cond.find(d.status, cond.CLUSTER_READY)["reason"] == "Queued"
    assert not any(isinstance(a, (phases.CreateCluster, phases.DeleteCluster)) for a in d.actions)


def test_before_kueue_writes_a_workload_the_run_says_what_it_waits_for():
    d = qstep(provisioning(), cluster=ClusterView(exists=True, suspended=True))
    assert d.phase == phases.QUEUED
    assert d.status["message"] == "queued in tpu-queue: waiting for Kueue to admit RayCluster demo-rc"


def test_queued_follows_kueues_message_with_one_event_per_change():
    status = queued()
    same = qstep(status, cluster=HELD)
    assert same.phase == phases.QUEUED and kinds(same) == []
    other = QueueView(reason="Inadmissible", message="LocalQueue tpu-queue doesn't exist")
    changed = qstep(status, cluster=ClusterView(exists=True, suspended=True, queue=other))
    assert changed.status["message"] == "queued in tpu-queue: LocalQueue tpu-queue doesn't exist"
    assert cond.find(changed.status, cond.ADMITTED)["reason"] == "Inadmissible"
    assert kinds(changed) == ["RecordEvent"]


def test_the_queue_wait_does_not_count_against_the_provisioning_timeout():
    status = queued()
    hours_later = T0 + timedelta(hours=5)
    d = qstep(status, cluster=HELD, now=hours_later)
    assert d.phase == phases.QUEUED
    d = qstep(d.status, cluster=ADMITTED, now=hours_later)
    assert d.phase == phases.PROVISIONING
    assert cond.is_true(d.status, cond.ADMITTED)
    d = qstep(d.status, cluster=ADMITTED, now=hours_later + timedelta(minutes=10))
    assert d.phase == phases.PROVISIONING
    d = qstep(d.status, cluster=ADMITTED, now=hours_later + timedelta(minutes=31))
    assert d.phase == phases.FAILED and "not ready after 30 min" in d.status["message"]


def test_admission_runs_the_first_attempt():
    status = running(queued())
    assert status["attempt"] == 1 and "evictions" not in status


def test_eviction_goes_back_to_queued_as_a_new_attempt_that_is_not_a_failure():
    status = running(queued())
    evicted = ClusterView(exists=True, suspended=True, queue=PREEMPTED)
    d = qstep(status, cluster=evicted, job=JobView("RUNNING"))
    assert d.phase == phases.QUEUED
    assert phases.StopJob("tft-uid-1-1") in d.actions
    assert not any(isinstance(a, phases.DeleteCluster) for a in d.actions)
    assert d.status["attempt"] == 2 and d.status["jobId"] == "tft-uid-1-2"
    assert d.status["evictions"] == 1
    assert "Preempted" in d.status["message"] and "resumes from the last checkpoint" in d.status["message"]
    assert cond.find(d.status, cond.RUNNING)["reason"] == "Evicted"
    assert cond.find(d.status, cond.ADMITTED)["status"] == "False"
    assert not cond.is_true(d.status, cond.FAILED)
    # Readmitted: the second attempt is submitted; with maxRetries 0 its own failure ends
    # the run (the eviction took nothing from the retries, which were none).
    resumed = running(d.status)
    assert resumed["attempt"] == 2
    failed = qstep(resumed, cluster=READY, job=JobView("FAILED"), **ENDED)
    assert failed.phase == phases.FAILED


def test_an_evicted_attempt_leaves_max_retries_untouched():
    plan = phases.Plan(**{**QPLAN.__dict__, "max_retries": 1})
    d = step(provisioning(), plan=plan, cluster=HELD)
    status = running(d.status)
    d = step(status, plan=plan, cluster=ClusterView(exists=True, suspended=True, queue=PREEMPTED))
    status = running(d.status)
    # attempt 2 fails: one retry is left, because attempt 1 was evicted, not failed
    d = step(status, plan=plan, cluster=READY, job=JobView("FAILED"), **ENDED)
    assert d.phase == phases.SUBMITTING and d.status["attempt"] == 3


def test_a_job_that_ended_with_its_evicted_cluster_is_an_eviction_not_a_failure():
    status = running(queued())
    d = qstep(status, cluster=ClusterView(exists=True, suspended=True, queue=PREEMPTED), job=None,
              events=({"event": "failure", "type": "ActorDiedError", "message": "worker died"},))
    assert d.phase == phases.QUEUED
    assert "trainerFailure" not in d.status
    assert not cond.is_true(d.status, cond.FAILED)


def test_without_a_queue_a_suspended_cluster_is_not_kueues_business():
    status = step(step({}).status).status
    d = step(status, cluster=ClusterView(exists=True, suspended=True))
    assert d.phase == phases.PROVISIONING
    assert PLAN.queue == ""


def test_terminal_and_deleted_queued_runs_release_the_cluster():
    status = queued()
    d = qstep(status, cluster=HELD, deleting=True)
    assert d.phase == phases.DELETING and phases.DeleteCluster("demo-rc") in d.actions
    assert qstep(d.status, cluster=HELD, deleting=True).actions.count(phases.DeleteCluster("demo-rc")) == 1
    done = running(queued())
    d = qstep(done, cluster=READY, job=JobView("SUCCEEDED"))
    assert d.phase == phases.SUCCEEDED and phases.DeleteCluster("demo-rc") in d.actions


def test_a_queued_run_made_invalid_fails_and_releases():
    d = qstep(queued(), cluster=HELD, spec_error="spec.tpu.topology: bad")
    assert d.phase == phases.FAILED and phases.DeleteCluster("demo-rc") in d.actions


def test_a_cluster_admitted_before_it_was_seen_queued_is_marked_admitted():
    d = qstep(provisioning(), cluster=ADMITTED)
    assert d.phase == phases.PROVISIONING
    assert cond.is_true(d.status, cond.ADMITTED)
    assert kinds(d) == ["RecordEvent"]
    again = qstep(d.status, cluster=ADMITTED)
    assert kinds(again) == []


def test_the_evicted_attempts_last_checkpoint_is_taken_while_queued():
    status = running(queued())
    d = qstep(status, cluster=ClusterView(exists=True, suspended=True, queue=PREEMPTED))
    late = ({"event": "checkpoint", "uri": "/ckpt/step_0000010", "epoch": 1, "epoch_end": False},
            {"event": "failure", "type": "JobStopped", "message": "stopped"})
    d = qstep(d.status, cluster=ClusterView(exists=True, suspended=True, queue=PREEMPTED), events=late)
    assert d.phase == phases.QUEUED and d.status["checkpointURI"] == "/ckpt/step_0000010"
    # Admitted again: the stopped attempt's failure line is not the next attempt's.
    d = qstep(d.status, cluster=ADMITTED)
    assert d.phase == phases.PROVISIONING and "trainerFailure" not in d.status


def test_the_active_deadline_applies_again_after_an_eviction():
    plan = phases.Plan(**{**QPLAN.__dict__, "active_deadline": timedelta(hours=1)})
    status = running(step(provisioning(), plan=plan, cluster=HELD).status)
    d = step(status, plan=plan, cluster=ClusterView(exists=True, suspended=True, queue=PREEMPTED))
    assert d.phase == phases.QUEUED and "startTime" not in d.status  # the clock stops
    later = T0 + timedelta(hours=3)
    d = step(d.status, plan=plan, cluster=ADMITTED, now=later)
    assert d.phase == phases.PROVISIONING
    assert cond.parse_time(d.status["startTime"]) == later  # and restarts on admission
    d = step(d.status, plan=plan, cluster=READY, now=later + timedelta(minutes=30))
    assert d.phase == phases.SUBMITTING
    d = step(d.status, plan=plan, cluster=READY, job=JobView("RUNNING"), now=later + timedelta(minutes=61))
    assert d.phase == phases.FAILED
    assert cond.find(d.status, cond.FAILED)["reason"] == "DeadlineExceeded"
    assert phases.StopJob(d.status["jobId"]) in d.actions
