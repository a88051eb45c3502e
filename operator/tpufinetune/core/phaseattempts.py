"""How an attempt ends (a part of phases.py's state machine): failed, retried on the same
RayCluster or on a new one, lost with its cluster, suspended; and the attempt's bookkeeping
in status.attempts that every step brings up to date. Pure: no I/O.
"""

from __future__ import annotations

from tpufinetune.core import attempts
from tpufinetune.core import conditions as cond
from tpufinetune.core import lmevalevents
from tpufinetune.core.jobspec import submission_id
from tpufinetune.core.phasemodel import (
    JOB_ACTIVE, PENDING, PROVISIONING, QUEUED, RUNNING, SUBMITTING, SUCCEEDED, FAILED,
    Decision, DeleteCluster, Identity, JobView, Observations, Plan, RecordEvent, StopJob,
    _applied, _enter, _first_and_last_line, _set, cluster_lost,
)
from tpufinetune.core.podstatus import SliceHealth

ATTEMPT_PHASES = frozenset({PENDING, QUEUED, PROVISIONING, SUBMITTING, RUNNING})
# A head that refuses the token of every key in the signing keyring (its cluster's key was
# removed before the run ended: docs/gke.md, "Rotating the signing key") ends the attempt at
# once, as RayUnreachable with these words; the rebuild that follows uses no retry the
# first time for each current key (a rotation), and one the next time (a key removed again
# too early, or a head that takes no token at all: not a loop).
TOKEN_REFUSED = "the Ray head refused the run's token"


def token_refused(current_key: str, detail: str) -> str:
    """Why an attempt ended on a refused token (runray.RayAuthRefused's message)."""
    return f"{TOKEN_REFUSED} (current key {current_key}): {detail}"


def _free_rebuild(s: dict, why: str) -> bool:
    """The first rebuild for a refused token under this current key: it costs no retry."""
    if not why.startswith(TOKEN_REFUSED):
        return False
    head = why.split(":", 1)[0]
    return not any(str(e.get("message") or "").startswith(head) for e in s.get("attempts") or []
                   if "endTime" in e)


def _count_attempts(plan: Plan, old: dict, s: dict, obs: Observations, d: Decision, before: str) -> None:
    """An attempt is open whenever the run works towards a result; a slice deleted, lost or
    taken back by Kueue costs no more from now; usage is brought up to now whenever the
    status changes anyway (a phase, the trainer's events, an attempt's end), so a run
    that only waits writes nothing new."""
    cluster = obs.cluster
    if s.get("phase") in ATTEMPT_PHASES and not plan.suspended and s.get("attempt"):
        attempts.begin(s, obs.now, logs_root=plan.logs_root)  # also links one _retry opened
        if s["phase"] in (SUBMITTING, RUNNING):  # a run an older operator started: ready already
            attempts.slice_ready(s, obs.now, cluster.uid if cluster is not None else "")
    gone = cluster_lost(cluster) and before in (SUBMITTING, RUNNING)
    taken_back = bool(plan.queue) and cluster is not None and cluster.suspended
    if gone or taken_back or any(isinstance(a, DeleteCluster) for a in d.actions):
        attempts.release(s, obs.now)
    if obs.events or s.get("phase") != before or attempts.shape(s) != attempts.shape(old):
        attempts.account(old, s, obs.now, plan.chips, plan.hosts)


def attempt_reason(job_reason: str, health: SliceHealth | None) -> str:
    """Why an attempt whose job ended without success ended: what its slice shows (a pod
    taken away with the cloud's reason, a node gone or under maintenance) comes first; a
    job the head lost or someone stopped says so; anything else is the application's."""
    if health is not None and health.reason:
        return health.reason
    return attempts.JOB_END_REASONS.get(job_reason, "AppFailed")


# Trainer failures whose type is the Failed condition's reason as it is (docs/api.md).
OWN_REASONS = ("ExportUnloadable", "ResumeMismatch")
# Those a retry cannot change: the next attempt would resume from the same checkpoint with
# the same spec and be refused again, holding the slice for nothing.
NOT_RETRIED = ("ResumeMismatch",)


def _job_failure(s: dict, job: JobView | None, obs: Observations) -> tuple[str, str]:
    """Reason and message for a job that is no longer active; message '' if we still
    need the log tail to explain it."""
    failure = s.get("trainerFailure") or {}
    if failure.get("message"):
        kind = failure.get("type") or "Error"
        if kind in OWN_REASONS:  # a failure with its own reason in the API's table
            return kind, failure["message"]
        return "TrainerFailed", f"{kind}: {failure['message']}"
    if job is None:
        return "JobLost", f"Ray has no job {s['jobId']} (was the head restarted?)"
    if job.status == "STOPPED":
        return "JobStopped", f"Ray job {s['jobId']} was stopped outside the operator"
    if obs.log_tail:
        return "JobFailed", f"{_first_and_last_line(job.message) or 'job failed'}; log tail: {obs.log_tail}"
    return "JobFailed", ""


def _success_message(s: dict) -> str:
    parts = [f"{s.get('epoch', 0)}/{s.get('epochs', 0)} epochs"]
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("checkpointURI"):
        parts.append(f"checkpoint {s['checkpointURI']}")
    if s.get("collectives"):
        parts.append("collectives passed" if s["collectives"].get("passed") else "collectives FAILED")
    evaluation = s.get("evaluation") or {}
    if evaluation.get("state") == "Succeeded":
        parts.append(f"lm-eval: {lmevalevents.summary(evaluation) or 'no figures'}")
    elif evaluation.get("state") == "Failed":
        parts.append(f"lm-eval not done ({evaluation.get('reason') or 'Failed'})")
    return ", ".join(parts)


def _succeed(plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """The run succeeded (its fine-tune job, and any evaluation of its export, ended): the
    attempt ends and the slice is released (or kept for spec.ttlSecondsAfterFinished from now)."""
    _set(s, obs, cond.RUNNING, False, "Completed", "the job finished")
    _set(s, obs, cond.SUCCEEDED, True, "JobSucceeded", _success_message(s))
    s["completionTime"] = cond.timestamp(obs.now)
    _enter(s, d, SUCCEEDED, "Succeeded", _success_message(s))
    attempts.end(s, obs.now, "Succeeded", _success_message(s))
    _release(plan, s, obs, d)


def _fail(plan: Plan, s: dict, obs: Observations, d: Decision, reason: str, message: str,
          attempt_as: str = "", attempt_detail: str = "") -> None:
    if attempts.end(s, obs.now, attempt_as or attempts.FAILED_REASONS.get(reason, "AppFailed"),
                    attempt_detail or message) is not None and attempt_detail:
        d.actions.append(RecordEvent("Warning", "AttemptFailed", attempts.bounded(
            f"attempt {s['attempt']} ended ({attempt_as}): {attempt_detail}", cond.MESSAGE_LIMIT)))
    _set(s, obs, cond.FAILED, True, reason, message)
    if cond.find(s, cond.RUNNING):
        _set(s, obs, cond.RUNNING, False, reason, message)
    s["completionTime"] = cond.timestamp(obs.now)
    _enter(s, d, FAILED, reason, message, warn=True)
    _release(plan, s, obs, d)


def _release(plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """Delete the RayCluster of a finished run, or keep it until spec.ttlSecondsAfterFinished
    has passed (status.rayClusterReleaseTime says when) and ask to be woken then."""
    if not s.get("rayClusterName"):
        return
    if plan.ttl_after_finished:
        release_at = (cond.parse_time(s.get("completionTime")) or obs.now) + plan.ttl_after_finished
        s["rayClusterReleaseTime"] = cond.timestamp(release_at)
        if obs.now < release_at:
            d.wake_at = release_at
            return
    d.actions.append(DeleteCluster(s["rayClusterName"]))


def _stop_and_fail(plan: Plan, s: dict, obs: Observations, d: Decision, reason: str, message: str) -> None:
    if s.get("phase") in (SUBMITTING, RUNNING) and obs.job is not None and obs.job.status in JOB_ACTIVE:
        d.actions.append(StopJob(s["jobId"]))
    _fail(plan, s, obs, d, reason, message)


def _retry(ident: Identity, s: dict, obs: Observations, d: Decision, message: str,
           took_over: dict | None = None) -> None:
    """The next attempt: on the same RayCluster after an application failure on a healthy
    slice (`took_over`: the ended attempt that hands it over), else on a new one (a pod or
    node lost, a slice not well, a spec that changes the cluster)."""
    attempt = int(s["attempt"]) + 1
    s["attempt"] = attempt
    s["jobId"] = submission_id(ident.uid, attempt)
    _set(s, obs, cond.RUNNING, False, "Retrying", message)
    if took_over is not None:
        attempts.begin(s, obs.now, took_over=took_over)
        _enter(s, d, SUBMITTING, "Retrying", f"attempt {attempt - 1} failed ({message}); resubmitting as "
               f"{s['jobId']} on the same RayCluster", warn=True)
        return
    name = s["rayClusterName"]
    _set(s, obs, cond.CLUSTER_READY, False, "Rebuilding", f"attempt {attempt} runs on a new RayCluster {name}")
    s.pop("dashboardURL", None)
    d.actions.append(DeleteCluster(name))
    _enter(s, d, PENDING, "Retrying", f"attempt {attempt - 1} failed ({message}); attempt {attempt} runs "
           f"on a new RayCluster", warn=True)


def _lost_cluster(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """Someone else deleted the RayCluster under the job: the job is lost with it. A new
    attempt runs on a new cluster (resuming from the last checkpoint), counted against
    spec.maxRetries; with none left the run fails, reason ClusterLost."""
    name = s["rayClusterName"]
    why = f"RayCluster {name} was deleted outside the operator while job {s['jobId']} was {s['phase'].lower()}"
    retries = int(s.get("retries") or 0)
    if retries >= plan.max_retries:
        _fail(plan, s, obs, d, "ClusterLost", f"{why}; no retries left (spec.maxRetries: {plan.max_retries})")
        return
    attempts.end(s, obs.now, "ClusterLost", why)
    attempt = int(s["attempt"]) + 1
    s.update(retries=retries + 1, attempt=attempt, jobId=submission_id(ident.uid, attempt))
    s.pop("trainerFailure", None)  # the workers died with the cluster, not of their own
    s.pop("dashboardURL", None)  # the new cluster's head is read when it is ready
    for type_ in (cond.CLUSTER_READY, cond.JOB_SUBMITTED, cond.RUNNING):
        if cond.find(s, type_):
            _set(s, obs, type_, False, "ClusterLost", why)
    _enter(s, d, PENDING, "ClusterLost", f"{why}; attempt {attempt} runs on a new RayCluster "
           f"(retry {retries + 1}/{plan.max_retries})", warn=True)


def _suspended(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """spec.suspend: no RayCluster exists while it is true. A running job is stopped and
    the next attempt (resuming from the last checkpoint) starts once it is false again.
    A suspend is not a failure: it uses up no retry, and the stopped attempt's failure
    report (if any) goes with it."""
    _applied(s, ident)
    s.pop("trainerFailure", None)
    s.pop("startTime", None)  # the deadline's clock stops, and restarts on resume
    ended = attempts.end(s, obs.now, "Stopped", "spec.suspend is true")
    if s["phase"] in (SUBMITTING, RUNNING) or ended is not None:
        if obs.job is not None and obs.job.status in JOB_ACTIVE:
            d.actions.append(StopJob(s["jobId"]))
        # An ended attempt's number is not used again (its entry keeps it).
        attempt = int(s["attempt"]) + (1 if obs.job is not None or ended is not None else 0)
        s.update(attempt=attempt, jobId=submission_id(ident.uid, attempt))
        for type_ in (cond.JOB_SUBMITTED, cond.RUNNING):
            if cond.find(s, type_):
                _set(s, obs, type_, False, "Suspended", "spec.suspend is true")
    if s["phase"] != PENDING:
        _set(s, obs, cond.CLUSTER_READY, False, "Suspended", "spec.suspend is true")
        _enter(s, d, PENDING, "Suspended", "suspended: the slice is released until spec.suspend is false")
    else:
        s["message"] = "suspended: no RayCluster is created until spec.suspend is false"
    if obs.cluster is not None and obs.cluster.exists and obs.cluster.owned:
        d.actions.append(DeleteCluster(s["rayClusterName"]))


def _rebuild_or_fail(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision, reason: str,
                     why: str) -> None:
    """The attempt ended on a slice that is not to be trusted again (its head stopped
    answering, or Submitting passed its bound): the next attempt runs on a new RayCluster,
    resuming from the last checkpoint, counted against spec.maxRetries (a refused token:
    see TOKEN_REFUSED); with none left the run fails with `reason` and the slice is released."""
    retries = int(s.get("retries") or 0)
    free = _free_rebuild(s, why)
    if retries >= plan.max_retries and not free:
        _stop_and_fail(plan, s, obs, d, reason, f"{why}; no retries left (spec.maxRetries: {plan.max_retries})")
        return
    if obs.job is not None and obs.job.status in JOB_ACTIVE:
        d.actions.append(StopJob(s["jobId"]))
    s["retries"] = retries + (0 if free else 1)
    s.pop("trainerFailure", None)
    ended_as = attempts.FAILED_REASONS[reason]
    attempts.end(s, obs.now, ended_as, why)
    d.actions.append(RecordEvent("Warning", "AttemptFailed", attempts.bounded(
        f"attempt {s['attempt']} ended ({ended_as}, {reason}): {why}", cond.MESSAGE_LIMIT)))
    _retry(ident, s, obs, d, f"{reason}: {why}")
