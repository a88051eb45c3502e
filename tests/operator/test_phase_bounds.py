"""The pure state machine's bounds: Submitting (the preflight included) ends after
TPUFT_SUBMIT_TIMEOUT, an unreachable head is said in the status while it lasts and is
retried on a new RayCluster under spec.maxRetries once it has lasted too long."""

from datetime import timedelta

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.phases import JobView, Plan
from tpufinetune.core.status import checked_status

from phase_helpers import IDENT, PLAN, READY, T0, running_status, step

BOUND = timedelta(minutes=15)
PREFLIGHT = Plan(**{**PLAN.__dict__, "preflight": True, "submit_timeout": BOUND})


def preflight_running(plan=PREFLIGHT):
    """Submitting since T0 with the attempt's preflight submitted and running."""
    d = step({}, plan=plan)
    d = step(d.status, plan=plan)
    d = step(d.status, plan=plan, cluster=READY)
    assert d.phase == phases.SUBMITTING and d.status["phaseTransitionTime"] == cond.timestamp(T0)
    d = step(d.status, plan=plan, cluster=READY)
    assert d.status["preflight"]["phase"] == "Running"
    return d.status


def events(decision):
    return [(a.type, a.reason) for a in decision.actions if isinstance(a, phases.RecordEvent)]


def test_a_preflight_that_never_ends_fails_the_run_after_the_submit_timeout_and_releases_the_slice():
    status = preflight_running()
    hung = JobView("RUNNING")
    within = step(status, plan=PREFLIGHT, cluster=READY, preflight_job=hung, now=T0 + BOUND - timedelta(seconds=1))
    assert within.phase == phases.SUBMITTING and not within.actions
    assert phases.next_timer(PREFLIGHT, status) == T0 + BOUND  # the loop wakes for it
    late = step(status, plan=PREFLIGHT, cluster=READY, preflight_job=hung, now=T0 + BOUND + timedelta(seconds=1))
    assert late.phase == phases.FAILED
    failed = cond.find(late.status, cond.FAILED)
    assert failed["reason"] == "SubmitTimeout"
    assert "preflight tft-uid-1-1-preflight to end after 900 s in Submitting (TPUFT_SUBMIT_TIMEOUT)" in failed["message"]
    assert "no retries left (spec.maxRetries: 0)" in failed["message"]
    assert phases.StopJob("tft-uid-1-1-preflight") in late.actions
    assert late.status["preflight"]["phase"] == "Failed" and "900 s" in late.status["preflight"]["message"]
    assert phases.DeleteCluster("demo-rc") in late.actions
    assert not any(isinstance(a, phases.SubmitJob) for a in late.actions)
    (attempt,) = late.status["attempts"]
    assert attempt["reason"] == "NotStarted" and "TPUFT_SUBMIT_TIMEOUT" in attempt["message"]
    checked_status(late.status)


def test_a_submit_timeout_with_a_retry_left_runs_the_next_attempt_and_its_preflight_on_a_new_cluster():
    plan = Plan(**{**PREFLIGHT.__dict__, "max_retries": 1})
    late = step(preflight_running(plan), plan=plan, cluster=READY, preflight_job=JobView("RUNNING"),
                now=T0 + BOUND + timedelta(seconds=1))
    assert late.phase == phases.PENDING and not cond.find(late.status, cond.FAILED)
    assert late.status["attempt"] == 2 and late.status["retries"] == 1 and late.status["jobId"] == "tft-uid-1-2"
    assert phases.DeleteCluster("demo-rc") in late.actions and "dashboardURL" not in late.status
    assert ("Warning", "AttemptFailed") in events(late)
    assert late.status["attempts"][0]["reason"] == "NotStarted"
    d = step(late.status, plan=plan, cluster=phases.ClusterView(exists=False), now=T0 + BOUND + timedelta(seconds=2))
    d = step(d.status, plan=plan, cluster=READY, now=T0 + BOUND + timedelta(seconds=3))
    d = step(d.status, plan=plan, cluster=READY, now=T0 + BOUND + timedelta(seconds=4))
    assert phases.SubmitPreflight("tft-uid-1-2-preflight", 2) in d.actions  # a new bound, a new preflight
    checked_status(d.status)


def test_a_job_submitted_just_before_the_bound_is_running_not_timed_out():
    plan = Plan(**{**PLAN.__dict__, "submit_timeout": BOUND})
    d = step(step(step({}, plan=plan).status, plan=plan).status, plan=plan, cluster=READY)
    late = step(d.status, plan=plan, cluster=READY, job=JobView("PENDING"), now=T0 + BOUND + timedelta(seconds=1))
    assert late.phase == phases.RUNNING


def test_without_a_bound_submitting_waits():
    plan = Plan(**{**PREFLIGHT.__dict__, "submit_timeout": None})
    d = step(preflight_running(plan), plan=plan, cluster=READY, preflight_job=JobView("RUNNING"),
             now=T0 + timedelta(days=1))
    assert d.phase == phases.SUBMITTING and phases.next_timer(plan, d.status) is None


def test_plan_for_carries_the_submit_timeout_setting():
    assert phases.plan_for(IDENT, None, timedelta(minutes=30), BOUND).submit_timeout == BOUND


def test_an_unreachable_head_is_said_in_the_status_once_per_reason_and_decides_nothing():
    status = running_status(job="RUNNING")
    why = "Ray unreachable: the Ray token for http://head:8265 could not be derived: Secret x/y has no data.key"
    d = step(status, cluster=READY, ray_down=why)
    assert d.phase == phases.RUNNING and d.status["message"] == why
    assert events(d) == [("Warning", "RayUnreachable")] and len(d.actions) == 1
    again = step(d.status, cluster=READY, ray_down=why)
    assert not again.actions
    # In Submitting: nothing is submitted while the head does not answer.
    s = step(step({}).status)
    s = step(s.status, cluster=READY)
    down = step(s.status, cluster=READY, ray_down=why)
    assert down.phase == phases.SUBMITTING and events(down) == [("Warning", "RayUnreachable")]
    assert not any(isinstance(a, (phases.SubmitJob, phases.SubmitPreflight)) for a in down.actions)


def test_ray_unreachable_is_retried_on_a_new_cluster_under_max_retries():
    plan = Plan(**{**PLAN.__dict__, "max_retries": 1})
    why = "the Ray head at http://head:8265 does not answer: refused; it has not answered for 600 s"
    d = step(running_status(job="RUNNING"), plan=plan, cluster=READY, ray_unreachable=why)
    assert d.phase == phases.PENDING and not cond.find(d.status, cond.FAILED)
    assert d.status["attempt"] == 2 and d.status["retries"] == 1
    assert phases.DeleteCluster("demo-rc") in d.actions
    assert d.status["attempts"][0]["reason"] == "ClusterLost" and why in d.status["attempts"][0]["message"]
    checked_status(d.status)
    # The next attempt's head unreachable too: no retry left, the run fails and releases.
    s = step(d.status, plan=plan, cluster=phases.ClusterView(exists=False))
    s = step(s.status, plan=plan, cluster=READY)
    s = step(s.status, plan=plan, cluster=READY, job=JobView("RUNNING"))
    failed = step(s.status, plan=plan, cluster=READY, ray_unreachable=why)
    assert failed.phase == phases.FAILED
    assert cond.find(failed.status, cond.FAILED)["reason"] == "RayUnreachable"
    assert "no retries left (spec.maxRetries: 1)" in failed.status["message"]
    assert phases.DeleteCluster("demo-rc") in failed.actions
