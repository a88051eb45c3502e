"""spec.evaluation.lmEval in the state machine (core/phaselmeval.py): after the fine-tune job
succeeded with an export, the run stays Running while its lm-eval job on the same RayCluster
runs, its events fold into status.evaluation, and whatever becomes of the evaluation the run
ends Succeeded, condition Evaluated says how it went, and only then is the slice released."""

from dataclasses import replace
from datetime import timedelta

from phase_helpers import ENDED, IDENT, PLAN, READY, T0, kinds, running_status
from phase_helpers import step as step_with_plan

from tpufinetune.core import conditions as cond
from tpufinetune.core import phaselmeval, phases
from tpufinetune.core.phasemodel import SubmitEvaluation
from tpufinetune.core.phases import ClusterView, JobView

EVAL_PLAN = replace(PLAN, lm_eval_tasks=("hellaswag", "arc_easy"), no_progress_timeout=timedelta(minutes=10))
EXPORT = "gs://bucket/ckpt/tft-demo-uid/export"
LMEVAL_JOB = "tft-uid-1-1-lmeval"
RESULT = {"event": "result", "best_checkpoint_uri": "gs://bucket/ckpt/epoch_0002", "exported_model_uri": EXPORT,
          "metrics": {"loss": 1.2}}
TASKS = (
    {"event": "lmeval_start", "tasks": ["hellaswag", "arc_easy"], "num_fewshot": None, "limit": 8, "model_uri": EXPORT},
    {"event": "lmeval_task", "task": "hellaswag", "samples": 8, "num_fewshot": 0, "version": 1,
     "metrics": [{"metric": "acc", "filter": "none", "value": 0.375, "stderr": 0.18},
                 {"metric": "acc_norm", "filter": "none", "value": 0.5, "stderr": "N/A"}]},
    {"event": "lmeval_task", "task": "arc_easy", "samples": 8, "num_fewshot": 0, "version": "1.0",
     "metrics": [{"metric": "acc", "filter": "none", "value": 0.625, "stderr": 0.17}]},
)
RESULTS = {"event": "lmeval_result", "results_uri": "gs://bucket/ckpt/tft-demo-uid/lmeval/results.json",
           "tasks": ["hellaswag", "arc_easy"], "evaluate_s": 41.25}


def step(status, plan=EVAL_PLAN, **obs):
    return step_with_plan(status, plan=plan, **obs)


def evaluating_status(plan=EVAL_PLAN):
    """A run whose fine-tune job just succeeded with an export: now evaluating it."""
    s = running_status(plan=plan)
    d = step(s, plan=plan, cluster=READY, job=JobView("SUCCEEDED"), events=(RESULT,))
    assert d.phase == phases.RUNNING and phaselmeval.evaluating(d.status), d.status
    return d


def test_a_succeeded_fine_tune_submits_the_lm_eval_job_and_stays_running_saying_so():
    d = evaluating_status()
    s = d.status
    assert [a for a in d.actions if isinstance(a, SubmitEvaluation)] == [
        SubmitEvaluation(LMEVAL_JOB, 1, EXPORT)]
    assert "DeleteCluster" not in kinds(d)  # the slice is kept for the evaluation
    assert s["evaluation"]["state"] == "Running" and s["evaluation"]["modelURI"] == EXPORT
    assert s["message"].startswith("evaluating the export: lm-eval tasks hellaswag, arc_easy")
    running = cond.find(s, cond.RUNNING)
    assert running["status"] == "True" and running["reason"] == "Evaluating"
    assert cond.find(s, cond.SUCCEEDED) is None and "completionTime" not in s
    assert phaselmeval.followed_job(s) == LMEVAL_JOB  # the driver reads and follows it now


def test_a_run_without_lm_eval_succeeds_at_once_as_before():
    s = running_status()
    d = step(s, plan=PLAN, cluster=READY, job=JobView("SUCCEEDED"), events=(RESULT,))
    assert d.phase == phases.SUCCEEDED and "evaluation" not in d.status and "DeleteCluster" in kinds(d)
    assert cond.find(d.status, cond.EVALUATED) is None


def test_the_evaluation_events_fold_and_its_success_ends_the_run_and_then_releases_the_slice():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=JobView("RUNNING"), events=TASKS, now=T0 + timedelta(minutes=1))
    assert d.phase == phases.RUNNING and "2 reported" in d.status["message"]
    assert "trainerFailure" not in d.status and d.status.get("exportedModelURI") == EXPORT  # not the fine-tune's
    d = step(d.status, cluster=READY, job=JobView("SUCCEEDED"), events=(RESULTS,), now=T0 + timedelta(minutes=2))
    s = d.status
    assert d.phase == phases.SUCCEEDED and "DeleteCluster" in kinds(d)
    evaluation = s["evaluation"]
    assert evaluation["state"] == "Succeeded" and evaluation["resultsURI"] == RESULTS["results_uri"]
    assert evaluation["seconds"] == 41.2 or evaluation["seconds"] == 41.3
    hellaswag, arc = evaluation["tasks"]
    assert hellaswag == {"task": "hellaswag", "samples": 8, "numFewshot": 0, "version": "1",
                         "metrics": [{"metric": "acc", "filter": "none", "value": 0.375, "stderr": 0.18},
                                     {"metric": "acc_norm", "filter": "none", "value": 0.5}]}
    assert arc["metrics"][0]["value"] == 0.625
    evaluated = cond.find(s, cond.EVALUATED)
    assert evaluated["status"] == "True" and evaluated["reason"] == "Evaluated"
    assert "hellaswag acc 0.3750" in evaluated["message"]
    assert cond.is_true(s, cond.SUCCEEDED) and s["completionTime"] == "2026-01-01T12:02:00Z"
    assert s["attempts"][-1]["reason"] == "Succeeded"
    recorded = [(a.type, a.reason) for a in d.actions if isinstance(a, phases.RecordEvent)]
    assert recorded[-2:] == [("Normal", "Evaluated"), ("Normal", "Succeeded")]  # the outcome's Event last
    from tpufinetune.core.status import checked_status
    checked_status(s)  # every key declared


def test_a_failed_evaluation_does_not_fail_the_run():
    s = evaluating_status().status
    failure = {"event": "failure", "type": "EvaluationFailed", "message": "task 'nosuch' not found"}
    d = step(s, cluster=READY, job=JobView("FAILED", "exit 1"), events=(failure,), now=T0 + timedelta(minutes=1))
    s = d.status
    assert d.phase == phases.SUCCEEDED and "DeleteCluster" in kinds(d)
    assert s["evaluation"]["state"] == "Failed" and s["evaluation"]["reason"] == "EvaluationFailed"
    evaluated = cond.find(s, cond.EVALUATED)
    assert evaluated["status"] == "False" and "task 'nosuch' not found" in evaluated["message"]
    assert cond.is_true(s, cond.SUCCEEDED) and cond.find(s, cond.FAILED) is None
    assert "trainerFailure" not in s
    assert ("Warning", "EvaluationFailed") in [(a.type, a.reason) for a in d.actions
                                               if isinstance(a, phases.RecordEvent)]


def test_a_job_that_fails_without_a_word_is_decided_from_its_log_tail():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=JobView("FAILED", "runtime_env setup failed"))
    assert kinds(d) == ["ReadLogTail"] and d.actions[0].submission_id == LMEVAL_JOB
    d = step(s, cluster=READY, job=JobView("FAILED", "runtime_env setup failed"), log_tail=ENDED["log_tail"])
    assert d.phase == phases.SUCCEEDED
    assert "RuntimeError: boom" in d.status["evaluation"]["message"]


def test_a_job_that_succeeds_without_its_result_is_not_an_evaluation():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=JobView("SUCCEEDED"), events=TASKS[:2], log_tail="done")
    assert d.phase == phases.SUCCEEDED
    assert d.status["evaluation"]["state"] == "Failed" and "lmeval_result" in d.status["evaluation"]["message"]


def test_a_silent_evaluation_is_stopped_by_the_watchdog_and_the_run_still_succeeds():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=JobView("RUNNING"), now=T0 + timedelta(minutes=11))
    assert d.phase == phases.SUCCEEDED
    assert [a.submission_id for a in d.actions if isinstance(a, phases.StopJob)] == [LMEVAL_JOB]
    assert cond.find(d.status, cond.EVALUATED)["reason"] == "NoProgress"


def test_the_watchdog_counts_from_the_evaluations_submit_not_the_fine_tunes_last_event():
    s = evaluating_status().status
    s["lastEventTime"] = "2026-01-01T10:00:00Z"  # the fine-tune's, long before
    d = step(s, cluster=READY, job=JobView("RUNNING"), now=T0 + timedelta(minutes=5))
    assert d.phase == phases.RUNNING


def test_a_suspend_deadline_or_lost_cluster_ends_the_evaluation_not_the_run():
    s = evaluating_status().status
    cases = {
        "Suspended": (replace(EVAL_PLAN, suspended=True), {"cluster": READY, "job": JobView("RUNNING")}),
        "DeadlineExceeded": (replace(EVAL_PLAN, active_deadline=timedelta(seconds=30)),
                             {"cluster": READY, "job": JobView("RUNNING"), "now": T0 + timedelta(minutes=1)}),
        "ClusterLost": (EVAL_PLAN, {"cluster": ClusterView(exists=False)}),
        "RayUnreachable": (EVAL_PLAN, {"cluster": READY, "ray_unreachable": "the head did not answer for 300 s"}),
    }
    for reason, (plan, obs) in cases.items():
        d = step(s, plan=plan, **obs)
        assert d.phase == phases.SUCCEEDED, (reason, d.status)
        assert cond.find(d.status, cond.EVALUATED)["reason"] == reason
        assert d.status["evaluation"]["state"] == "Failed"
        assert int(d.status.get("retries") or 0) == 0  # no retry trains again


def test_a_head_that_does_not_answer_for_a_while_is_waited_for():
    s = evaluating_status().status
    d = step(s, cluster=READY, ray_down="Ray unreachable: connection refused")
    assert d.phase == phases.RUNNING and d.status["evaluation"]["state"] == "Running"


def test_a_job_ray_does_not_know_is_submitted_again_level_based():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=None)
    assert kinds(d) == ["SubmitEvaluation"] and d.phase == phases.RUNNING


def test_deleting_while_evaluating_stops_the_lm_eval_job():
    s = evaluating_status().status
    d = step(s, cluster=READY, job=JobView("RUNNING"), deleting=True)
    assert [a.submission_id for a in d.actions if isinstance(a, phases.StopJob)] == [LMEVAL_JOB]
    assert "DeleteCluster" in kinds(d)


def test_no_export_is_said_and_the_run_succeeds():
    s = running_status(plan=EVAL_PLAN)
    d = step(s, plan=EVAL_PLAN, cluster=READY, job=JobView("SUCCEEDED"))
    assert d.phase == phases.SUCCEEDED
    assert cond.find(d.status, cond.EVALUATED)["reason"] == "NoExport"


def test_the_ttl_counts_from_the_evaluations_end():
    plan = replace(EVAL_PLAN, ttl_after_finished=timedelta(minutes=5))
    s = evaluating_status(plan).status
    end = T0 + timedelta(minutes=20)
    d = step(s, plan=plan, cluster=READY, job=JobView("SUCCEEDED"), events=TASKS + (RESULTS,),
             now=end - timedelta(minutes=1))
    d = step(d.status, plan=plan, cluster=READY, job=JobView("SUCCEEDED"), now=end - timedelta(minutes=1))
    assert d.status["rayClusterReleaseTime"] == "2026-01-01T12:24:00Z"


def test_plan_for_reads_the_tasks_and_an_ident_is_unchanged():
    from tpufinetune.core.api import parse_spec
    from phase_helpers import spec_with
    spec = parse_spec(spec_with(evaluation={"lmEval": {"tasks": ["hellaswag", "mmlu"]}}))
    plan = phases.plan_for(IDENT, spec, timedelta(minutes=30))
    assert plan.lm_eval_tasks == ("hellaswag", "mmlu")
    assert phases.plan_for(IDENT, parse_spec(spec_with()), timedelta(minutes=30)).lm_eval_tasks == ()
