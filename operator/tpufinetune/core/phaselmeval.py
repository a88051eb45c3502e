"""lm-evaluation-harness on the export (spec.evaluation.lmEval), a part of phases.py's state
machine. Pure: no I/O.

Once the fine-tune job succeeded with an export, the run stays Running (condition Running,
reason Evaluating; status.evaluation.state Running) while a second Ray job on the same
RayCluster, `tft-<uid>-<attempt>-lmeval`, evaluates it; the driver follows that job instead
(`followed_job`): its log, the no-progress watchdog, a delete. Its end, whatever it is, ends
the run Succeeded (the fine-tune did), with condition Evaluated True or False and why, and
only then is the slice released (spec.ttlSecondsAfterFinished counts from there). Whatever
would end or interrupt a running attempt (a suspend, the deadline, a Kueue eviction, the
cluster lost, the head unreachable past its bound, no event for noProgressTimeoutSeconds)
ends the evaluation instead, as Evaluated False with that reason: the export is kept, and a
retry would train again for nothing.

Phase Running rather than a phase of its own: an operator older than this (a rollback)
reads such a run as one whose job succeeded, ends it Succeeded and releases the slice.
"""

from __future__ import annotations

from datetime import timedelta

from tpufinetune.core import conditions as cond
from tpufinetune.core import lmevalevents
from tpufinetune.core.jobspec import lmeval_id
from tpufinetune.core.lmevalrules import lm_eval_tasks, resolved_fit_refusal  # noqa: F401  (plan_for's, from here)
from tpufinetune.core.phaseattempts import _succeed
from tpufinetune.core.phasechecks import _ray_down
from tpufinetune.core.phasemodel import (
    JOB_ACTIVE, RUNNING, Decision, Identity, Observations, Plan, ReadLogTail, RecordEvent, StopJob,
    SubmitEvaluation, _first_and_last_line, _set, cluster_lost,
)
from tpufinetune.core.phasequeue import _held_by_kueue

EVALUATING = "Running"  # status.evaluation.state while its job is followed


def _lm_eval_job(s: dict) -> str:
    """The attempt's lm-eval job while it runs ('' when none does)."""
    evaluation = s.get("evaluation") or {}
    running = evaluation.get("state") == EVALUATING and evaluation.get("attempt") == s.get("attempt")
    return str(evaluation.get("jobId") or "") if running else ""


def evaluating(s: dict) -> bool:
    """The run's export is being evaluated: its lm-eval job is the one to follow."""
    return s.get("phase") == RUNNING and bool(_lm_eval_job(s))


def followed_job(s: dict) -> str:
    """The Ray job a step reads, follows and stops: the lm-eval job while the export is
    evaluated (and while such a run is deleted), else the attempt's fine-tune job."""
    return _lm_eval_job(s) or str(s.get("jobId") or "")


def fold_evaluation_events(s: dict, events: tuple[dict, ...]) -> tuple[dict, ...]:
    """While the export is evaluated, the step's events are the lm-eval job's: folded into
    status.evaluation, and none is left for the fine-tune's status. Otherwise all are left."""
    if not evaluating(s):
        return events
    for event in events:
        lmevalevents.fold(s["evaluation"], event)
    return ()


def begin(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> bool:
    """The fine-tune job succeeded: True when its export is now to be evaluated (the run stays
    Running); False when the run succeeds at once (no lmEval, or this attempt's evaluation ended)."""
    if not plan.lm_eval_tasks or (s.get("evaluation") or {}).get("attempt") == s.get("attempt"):
        return False
    attempt = int(s["attempt"])
    model = s.get("exportedModelURI") or ""
    s["evaluation"] = {"attempt": attempt, "startTime": cond.timestamp(obs.now)}
    if not model:
        _end(s, obs, d, "Failed", "NoExport",
             "the fine-tune reported no exported model (status.exportedModelURI): nothing to evaluate")
        return False
    job_id = lmeval_id(ident.uid, attempt)
    s["evaluation"].update(state=EVALUATING, jobId=job_id, modelURI=model)
    message = f"evaluating the export: lm-eval tasks {', '.join(plan.lm_eval_tasks)} (job {job_id})"
    s["evaluation"]["message"] = s["message"] = message[: cond.MESSAGE_LIMIT]
    _set(s, obs, cond.RUNNING, True, "Evaluating", message)
    d.actions.append(SubmitEvaluation(job_id, attempt, model))
    d.actions.append(RecordEvent("Normal", "Evaluating", message[: cond.MESSAGE_LIMIT]))
    return True


def step(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """A step while the export is evaluated (`evaluating(s)`): obs.job is the lm-eval job."""
    evaluation = s["evaluation"]
    job_id, job = evaluation["jobId"], obs.job
    interrupted = _interrupted(plan, s, obs)
    if interrupted:
        reason, message = interrupted
        if job is not None and job.status in JOB_ACTIVE and not cluster_lost(obs.cluster):
            d.actions.append(StopJob(job_id))
        _end(s, obs, d, "Failed", reason, message, succeed=plan)
        return
    if obs.ray_down:
        _ray_down(s, obs, d)
        return
    if job is None or job.status in JOB_ACTIVE:
        silent = _silent_for(s, obs)
        if plan.no_progress_timeout is not None and silent > plan.no_progress_timeout:
            if job is not None:
                d.actions.append(StopJob(job_id))
            _end(s, obs, d, "Failed", "NoProgress",
                 f"no event from lm-eval job {job_id} for {int(silent.total_seconds() // 60)} min "
                 f"(spec.noProgressTimeoutSeconds: {int(plan.no_progress_timeout.total_seconds())}); it was "
                 "stopped", succeed=plan)
            return
        if job is None:  # not submitted yet, or a crash between the write and the submit
            d.actions.append(SubmitEvaluation(job_id, int(evaluation["attempt"]), evaluation.get("modelURI") or ""))
        done = len(evaluation.get("tasks") or [])
        message = (f"evaluating the export: lm-eval tasks {', '.join(plan.lm_eval_tasks) or '(as applied)'} "
                   f"(job {job_id}{', ' + str(done) + ' reported' if done else ''})")[: cond.MESSAGE_LIMIT]
        s["message"] = message
        if not evaluation.get("reason"):
            evaluation["message"] = message
        return
    if job.status == "SUCCEEDED" and evaluation.get("resultsURI") and not evaluation.get("reason"):
        _end(s, obs, d, "Succeeded", "Evaluated",
             f"lm-eval: {lmevalevents.summary(evaluation) or 'no figures'}; results {evaluation['resultsURI']}",
             succeed=plan)
        return
    why = evaluation.get("message") if evaluation.get("reason") else ""
    if not why and not obs.log_tail and job.status != "STOPPED":
        d.actions.append(ReadLogTail(job_id))  # the trainer said nothing: its last lines say why
        return
    if not why:
        detail = _first_and_last_line(job.message) or f"job {job.status.lower()}"
        if job.status == "SUCCEEDED":
            detail = "the job ended without its lmeval_result event"
        why = f"lm-eval job {job_id}: {detail}" + (f"; log tail: {obs.log_tail}" if obs.log_tail else "")
    _end(s, obs, d, "Failed", evaluation.get("reason") or "EvaluationFailed", why, succeed=plan)


def _interrupted(plan: Plan, s: dict, obs: Observations) -> tuple[str, str] | None:
    """What ends the evaluation early, as (the Evaluated condition's reason, why)."""
    if plan.suspended:
        return "Suspended", "spec.suspend was set while the export was evaluated: the evaluation was stopped"
    started = cond.parse_time(s.get("startTime"))
    if plan.active_deadline is not None and started is not None and obs.now > started + plan.active_deadline:
        return ("DeadlineExceeded", f"spec.activeDeadlineSeconds ({int(plan.active_deadline.total_seconds())} s) "
                                    "passed while the export was evaluated: the evaluation was stopped")
    if plan.queue and _held_by_kueue(obs):
        return "Evicted", "Kueue took the slice back while the export was evaluated"
    if cluster_lost(obs.cluster):
        return "ClusterLost", f"RayCluster {s.get('rayClusterName')} was deleted while the export was evaluated"
    if obs.ray_unreachable:
        return "RayUnreachable", obs.ray_unreachable
    return None


def _silent_for(s: dict, obs: Observations) -> timedelta:
    """How long the lm-eval job has said nothing: since its submit or its last event."""
    since = [cond.parse_time((s.get("evaluation") or {}).get("startTime")), cond.parse_time(s.get("lastEventTime"))]
    return obs.now - max((t for t in since if t is not None), default=obs.now)


def _end(s: dict, obs: Observations, d: Decision, state: str, reason: str, message: str,
         succeed: Plan | None = None) -> None:
    """The evaluation ended: status.evaluation, condition Evaluated and its Event; with `succeed`
    (the plan) the run then succeeds and its slice is released."""
    evaluation = s["evaluation"]
    message = message[: cond.MESSAGE_LIMIT]
    evaluation.update(state=state, message=message, completionTime=cond.timestamp(obs.now))
    if state == "Failed":
        evaluation["reason"] = reason[:64]
    else:
        evaluation.pop("reason", None)
    _set(s, obs, cond.EVALUATED, state == "Succeeded", reason, message)
    d.actions.append(RecordEvent("Normal" if state == "Succeeded" else "Warning",
                                 "Evaluated" if state == "Succeeded" else "EvaluationFailed", message))
    if succeed is not None:
        _succeed(succeed, s, obs, d)
