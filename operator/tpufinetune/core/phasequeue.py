"""Kueue (spec.queueName), a part of phases.py's state machine: the RayCluster is created
suspended and Kueue admits it; Provisioning -> Queued while Kueue holds it -> Provisioning
once admitted; an eviction in Submitting or Running goes back to Queued with the next
attempt reserved (not counted against spec.maxRetries). Pure: no I/O.
"""

from __future__ import annotations

from tpufinetune.core import attempts
from tpufinetune.core import conditions as cond
from tpufinetune.core.jobspec import submission_id
from tpufinetune.core.phasemodel import (
    JOB_ACTIVE, PROVISIONING, QUEUED, RUNNING, SUBMITTING,
    Decision, Identity, Observations, Plan, QueueView, RecordEvent, StopJob, _enter, _set,
)


def _held_by_kueue(obs: Observations) -> bool:
    cluster = obs.cluster
    return cluster is not None and cluster.exists and cluster.owned and cluster.suspended


def _to_queue(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """The RayCluster is suspended: not admitted yet, or evicted. A job that was submitted
    has lost its cluster: the next admission runs a new attempt (resuming from the last
    checkpoint) that is not counted as a failure."""
    queue = obs.cluster.queue or QueueView()
    if s["phase"] in (SUBMITTING, RUNNING):
        if obs.job is not None and obs.job.status in JOB_ACTIVE:
            d.actions.append(StopJob(s["jobId"]))
        why = f"evicted by Kueue ({queue.evicted or 'the RayCluster was suspended'})"
        attempts.end(s, obs.now, "Evicted", why)
        attempt = int(s["attempt"]) + 1
        s.update(attempt=attempt, jobId=submission_id(ident.uid, attempt),
                 evictions=int(s.get("evictions") or 0) + 1)
        s.pop("trainerFailure", None)  # the workers died with the eviction, not of their own
        s.pop("startTime", None)  # as for a suspend: the deadline's clock restarts on admission
        for type_ in (cond.CLUSTER_READY, cond.JOB_SUBMITTED, cond.RUNNING):
            if cond.find(s, type_):
                _set(s, obs, type_, False, "Evicted", why)
        message = f"{why}; attempt {attempt} resumes from the last checkpoint once admitted again"
        _set(s, obs, cond.ADMITTED, False, "Evicted", why)
        _enter(s, d, QUEUED, "Evicted", message, warn=True)
        return
    message = _queued_message(plan, s["rayClusterName"], queue)
    _set(s, obs, cond.ADMITTED, False, queue.reason or "Pending", message)
    _set(s, obs, cond.CLUSTER_READY, False, "Queued", message)
    _enter(s, d, QUEUED, "Queued", message)


def _queued(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """Wait for Kueue; once it unsuspends the RayCluster (or the cluster is gone), go on
    provisioning, with the provisioning timeout counted from the admission."""
    cluster = obs.cluster
    if cluster is None:
        return
    if _held_by_kueue(obs):
        message = _queued_message(plan, s["rayClusterName"], cluster.queue or QueueView())
        reason = (cluster.queue.reason if cluster.queue else "") or "Pending"
        previous = (cond.find(s, cond.ADMITTED) or {}).get("message")
        _set(s, obs, cond.ADMITTED, False, reason, message)
        if previous != message:
            s["message"] = message[: cond.MESSAGE_LIMIT]
            d.actions.append(RecordEvent("Normal", "Queued", message[: cond.MESSAGE_LIMIT]))
        return
    # An admission starts the clock of spec.activeDeadlineSeconds again (an eviction
    # stopped it), as a resume after a suspend does.
    s.setdefault("startTime", cond.timestamp(obs.now))
    if cluster.exists and cluster.owned:
        s.pop("trainerFailure", None)  # a late line of an evicted attempt is not this one's
        message = f"Kueue admitted RayCluster {s['rayClusterName']}"
        _set(s, obs, cond.ADMITTED, True, "Admitted", message)
        _set(s, obs, cond.CLUSTER_READY, False, "Creating", "admitted: the pods are starting")
        _enter(s, d, PROVISIONING, "Admitted", message)
        return
    _enter(s, d, PROVISIONING, "CreatingCluster", f"creating RayCluster {s['rayClusterName']}")


def _queued_message(plan: Plan, cluster: str, queue: QueueView) -> str:
    if queue.message:
        return f"queued in {plan.queue}: {queue.message}"
    return f"queued in {plan.queue}: waiting for Kueue to admit RayCluster {cluster}"
