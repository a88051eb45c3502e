"""spec.activeDeadlineSeconds, spec.ttlSecondsAfterFinished and the no-progress watchdog
in the pure state machine, and the Plan the driver derives from a spec."""

from datetime import timedelta

import pytest
from phase_helpers import ENDED, IDENT, READY, T0, running_status, spec_with, step

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.api import parse_spec
from tpufinetune.core.phases import ClusterView, JobView, Plan

DEADLINE = Plan(cluster_name="demo-rc", epochs=2, active_deadline=timedelta(hours=2))
TTL = Plan(cluster_name="demo-rc", epochs=2, ttl_after_finished=timedelta(minutes=10))
WATCHDOG = Plan(cluster_name="demo-rc", epochs=2, no_progress_timeout=timedelta(minutes=30))
PROGRESS = ({"event": "progress", "epoch": 1, "epochs": 2, "step": 5, "total_steps": 20},)


def failed_reason(d):
    return cond.find(d.status, cond.FAILED)["reason"]


# ---- spec.activeDeadlineSeconds ---------------------------------------------------------


def test_the_deadline_stops_the_job_fails_and_releases_the_slice():
    status = running_status(DEADLINE, job="RUNNING")
    assert step(status, plan=DEADLINE, now=T0 + timedelta(hours=2), cluster=READY,
                job=JobView("RUNNING")).phase == phases.RUNNING
    d = step(status, plan=DEADLINE, now=T0 + timedelta(hours=2, seconds=1), cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.FAILED
    assert failed_reason(d) == "DeadlineExceeded"
    assert "spec.activeDeadlineSeconds (7200 s)" in d.status["message"]
    stop, delete = d.actions.index(phases.StopJob("tft-uid-1-1")), d.actions.index(phases.DeleteCluster("demo-rc"))
    assert stop < delete  # the job is asked to stop before its cluster goes


def test_the_deadline_also_bounds_a_cluster_that_never_gets_ready():
    status = step(step({}, plan=DEADLINE).status, plan=DEADLINE).status
    long_provisioning = Plan(cluster_name="demo-rc", epochs=2, active_deadline=timedelta(minutes=5),
                             provision_timeout=timedelta(hours=1))
    d = step(status, plan=long_provisioning, now=T0 + timedelta(minutes=6), cluster=ClusterView(exists=True))
    assert d.phase == phases.FAILED and failed_reason(d) == "DeadlineExceeded"
    assert d.actions[-1] == phases.DeleteCluster("demo-rc")
    assert not any(isinstance(a, phases.StopJob) for a in d.actions)


def test_a_suspend_stops_the_deadlines_clock_and_a_resume_restarts_it():
    suspended = Plan(cluster_name="demo-rc", epochs=2, active_deadline=timedelta(hours=2), suspended=True)
    d = step(running_status(DEADLINE, job="RUNNING"), plan=suspended, now=T0 + timedelta(hours=1), cluster=READY, job=JobView("RUNNING"))
    d = step(d.status, plan=suspended, now=T0 + timedelta(hours=5), cluster=ClusterView(exists=False))
    assert d.phase == phases.PENDING  # no deadline while suspended
    resumed = T0 + timedelta(hours=6)
    d = step(d.status, plan=DEADLINE, now=resumed, cluster=ClusterView(exists=False))
    assert d.phase == phases.PROVISIONING and d.status["startTime"] == cond.timestamp(resumed)
    d = step(d.status, plan=DEADLINE, now=resumed + timedelta(hours=1), cluster=READY)
    assert d.phase == phases.SUBMITTING


def test_a_job_that_succeeded_before_the_deadline_was_seen_keeps_its_result():
    d = step(running_status(DEADLINE, job="RUNNING"), plan=DEADLINE, now=T0 + timedelta(hours=3), cluster=READY, job=JobView("SUCCEEDED"))
    assert d.phase == phases.SUCCEEDED


def test_no_deadline_by_default():
    plan = Plan(cluster_name="demo-rc", epochs=2)
    d = step(running_status(plan, job="RUNNING"), plan=plan, now=T0 + timedelta(days=30), cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING


# ---- spec.ttlSecondsAfterFinished -------------------------------------------------------


def test_by_default_the_cluster_is_released_at_once():
    plan = Plan(cluster_name="demo-rc", epochs=2)
    d = step(running_status(plan, job="RUNNING"), plan=plan, cluster=READY, job=JobView("SUCCEEDED"))
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert d.wake_at is None and "rayClusterReleaseTime" not in d.status


@pytest.mark.parametrize("end", ["SUCCEEDED", "FAILED"])
def test_the_ttl_keeps_the_cluster_then_releases_it(end):
    events = ({"event": "failure", "type": "RuntimeError", "message": "boom"},) if end == "FAILED" else ()
    d = step(running_status(TTL, job="RUNNING"), plan=TTL, cluster=READY, job=JobView(end), events=events, **ENDED)
    assert d.phase in phases.TERMINAL
    assert not any(isinstance(a, phases.DeleteCluster) for a in d.actions)
    release = T0 + timedelta(minutes=10)
    assert d.status["rayClusterReleaseTime"] == cond.timestamp(release)
    assert d.wake_at == release  # the driver must come back then, with nothing else to do
    kept = step(d.status, plan=TTL, now=release - timedelta(seconds=1), cluster=READY)
    assert kept.actions == [] and kept.wake_at == release
    d = step(d.status, plan=TTL, now=release, cluster=READY)
    assert d.actions == [phases.DeleteCluster("demo-rc")]
    gone = step(d.status, plan=TTL, now=release + timedelta(seconds=5), cluster=ClusterView(exists=False))
    assert gone.actions == [] and gone.wake_at is None  # done: the driver may stop


def test_deleting_the_resource_releases_a_kept_cluster_at_once():
    done = step(running_status(TTL, job="RUNNING"), plan=TTL, cluster=READY, job=JobView("SUCCEEDED")).status
    d = step(done, plan=TTL, cluster=READY, deleting=True)
    assert phases.DeleteCluster("demo-rc") in d.actions


# ---- the no-progress watchdog -----------------------------------------------------------


def test_no_trainer_event_for_the_timeout_stops_the_job_and_fails_with_no_progress():
    status = running_status(WATCHDOG, job="RUNNING")
    d = step(status, plan=WATCHDOG, now=T0 + timedelta(minutes=20), cluster=READY, job=JobView("RUNNING"), events=PROGRESS)
    assert d.status["lastEventTime"] == cond.timestamp(T0 + timedelta(minutes=20))
    # 30 min after the last event, not after entering Running
    quiet = step(d.status, plan=WATCHDOG, now=T0 + timedelta(minutes=50), cluster=READY, job=JobView("RUNNING"))
    assert quiet.phase == phases.RUNNING
    d = step(d.status, plan=WATCHDOG, now=T0 + timedelta(minutes=51), cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.FAILED and failed_reason(d) == "NoProgress"
    assert "no trainer event for 31 min" in d.status["message"]
    assert d.actions.index(phases.StopJob("tft-uid-1-1")) < d.actions.index(phases.DeleteCluster("demo-rc"))


def test_the_watchdog_counts_from_entering_running_before_the_first_event():
    d = step(running_status(WATCHDOG, job="RUNNING"), plan=WATCHDOG, now=T0 + timedelta(minutes=31), cluster=READY, job=JobView("PENDING"))
    assert failed_reason(d) == "NoProgress"


def test_each_attempt_gets_its_own_watchdog_time():
    plan = Plan(cluster_name="demo-rc", epochs=2, max_retries=1, no_progress_timeout=timedelta(minutes=30))
    late = T0 + timedelta(minutes=29)
    d = step(running_status(plan, job="RUNNING"), plan=plan, now=late, cluster=READY, job=JobView("FAILED"),
             events=({"event": "failure", "type": "RuntimeError", "message": "x"},), **ENDED)
    d = step(d.status, plan=plan, now=late, cluster=READY, job=None)
    d = step(d.status, plan=plan, now=late + timedelta(minutes=5), cluster=READY, job=JobView("RUNNING"))
    d = step(d.status, plan=plan, now=late + timedelta(minutes=20), cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING


def test_the_watchdog_is_off_when_unset():
    plan = Plan(cluster_name="demo-rc", epochs=2)
    d = step(running_status(plan, job="RUNNING"), plan=plan, now=T0 + timedelta(days=3), cluster=READY, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING


# ---- the Plan of a spec -------------------------------------------------------------------


def test_plan_for_carries_the_new_fields_and_a_fingerprint_of_the_cluster():
    spec = parse_spec(spec_with(activeDeadlineSeconds=600, ttlSecondsAfterFinished=120))
    plan = phases.plan_for(IDENT, spec, timedelta(minutes=30))
    assert (plan.active_deadline, plan.ttl_after_finished) == (timedelta(minutes=10), timedelta(minutes=2))
    assert plan.no_progress_timeout == timedelta(hours=1)  # on by default
    assert plan.hosts == 4  # v6e 4x4: four 4-chip hosts
    off = phases.plan_for(IDENT, parse_spec(spec_with(noProgressTimeoutSeconds=0)), timedelta(minutes=30))
    assert off.no_progress_timeout is None and off.active_deadline is None
    assert off.ttl_after_finished == timedelta(0)
    # the fingerprint follows what the RayCluster is built from, and nothing else
    assert off.cluster_hash == plan.cluster_hash
    for change in ({"image": "example.com/other:1"}, {"tpu": {"generation": "v6e", "topology": "2x2"}},
                   {"workers": {"labels": {"team": "b"}}}):
        edited = phases.plan_for(IDENT, parse_spec({**spec_with(), **change}), timedelta(minutes=30))
        assert edited.cluster_hash != plan.cluster_hash, change
    epochs = phases.plan_for(IDENT, parse_spec(spec_with(training={"epochs": 9})), timedelta(minutes=30))
    assert epochs.cluster_hash == plan.cluster_hash
    assert phases.plan_for(IDENT, None, timedelta(minutes=30)).cluster_hash == ""
