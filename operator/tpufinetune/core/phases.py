"""The run's state machine: one pure function from (status, observations) to
(new status, actions). No I/O here: the driver gathers observations, performs the
actions and writes the status in one place.

    Pending ─► Provisioning ─► Submitting ─► Running ─► Succeeded
       │            │              ▲            │
       └────────────┴──► Failed ◄──┴─(retry)────┘          any ─► Deleting

With spec.queueName the RayCluster is created suspended and Kueue admits it:
Provisioning ─► Queued ─(admitted)─► Provisioning; an eviction (preemption) in Submitting or
Running goes back to Queued, and the next admission runs a new attempt that resumes from
the last checkpoint and does not count against maxRetries.

Identities (RayCluster name, submission id, attempt) are written into status in
Pending, before anything exists, so a crash between two steps resumes instead of
duplicating. Every phase is level-based: it looks at what exists and asks for what is
missing (create the cluster again if it vanished, attach to a job that already exists),
so repeating a step is harmless.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tpufinetune.core import conditions as cond
from tpufinetune.core.jobspec import submission_id
from tpufinetune.core.runevents import apply_event

PENDING = "Pending"
PROVISIONING = "Provisioning"
QUEUED = "Queued"
SUBMITTING = "Submitting"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
DELETING = "Deleting"
TERMINAL = frozenset({SUCCEEDED, FAILED})

JOB_ACTIVE = frozenset({"PENDING", "RUNNING"})


# ---- observations (gathered by the driver) -------------------------------------------


@dataclass(frozen=True)
class Identity:
    name: str
    namespace: str
    uid: str
    generation: int = 1


@dataclass(frozen=True)
class Plan:
    """What the spec asks for, as the transition needs it (derived by the driver)."""

    cluster_name: str
    epochs: int
    max_retries: int = 0
    provision_timeout: timedelta = timedelta(minutes=30)
    suspended: bool = False
    queue: str = ""  # spec.queueName: Kueue admits the RayCluster


@dataclass(frozen=True)
class QueueView:
    """Kueue's Workload for a suspended RayCluster: why it waits, or why it was evicted."""

    reason: str = ""  # e.g. Pending, Inadmissible
    message: str = ""  # Kueue's own words, e.g. "couldn't assign flavors to pod set ..."
    evicted: str = ""  # the eviction's reason and message while it is evicted


@dataclass(frozen=True)
class ClusterView:
    exists: bool
    owned: bool = True
    ready: bool = False
    problem: str = ""  # e.g. KubeRay's ReplicaFailure message: shown, not fatal
    dashboard_url: str = ""
    suspended: bool = False  # spec.suspend: Kueue has not admitted it (or evicted it)
    queue: QueueView | None = None  # read only for a suspended cluster with a queue


@dataclass(frozen=True)
class JobView:
    status: str  # Ray's JobStatus: PENDING RUNNING STOPPED SUCCEEDED FAILED
    message: str = ""


@dataclass(frozen=True)
class Observations:
    now: datetime
    spec_error: str = ""  # non-empty when the spec failed validation
    cluster: ClusterView | None = None  # None: not looked at this tick
    job: JobView | None = None  # None: Ray has no job with status.jobId
    events: tuple[dict, ...] = ()  # new trainer events, in order
    log_tail: str = ""  # last lines of the job log, read only once a job failed
    deleting: bool = False


# ---- actions (performed by the driver) -------------------------------------------------


@dataclass(frozen=True)
class CreateCluster:
    name: str


@dataclass(frozen=True)
class SubmitJob:
    submission_id: str
    attempt: int


@dataclass(frozen=True)
class StopJob:
    submission_id: str


@dataclass(frozen=True)
class DeleteCluster:
    name: str


@dataclass(frozen=True)
class ReadLogTail:
    """Ask the driver for the log tail (only when a job failed without a failure event)."""

    submission_id: str


@dataclass(frozen=True)
class RecordEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: dict
    actions: list = field(default_factory=list)

    @property
    def phase(self) -> str:
        return self.status.get("phase", "")


# ---- the transition --------------------------------------------------------------------


def transition(ident: Identity, plan: Plan, status: dict, obs: Observations) -> Decision:
    new = _copy(status)
    decision = Decision(new)
    for event in obs.events:
        apply_event(new, event)
    phase = new.get("phase") or ""
    if obs.deleting:
        _deleting(ident, new, obs, decision)
    elif phase in TERMINAL:
        _terminal(new, obs, decision)
    elif obs.spec_error and phase in (PENDING, QUEUED, PROVISIONING, SUBMITTING):
        # An edit made the spec invalid before the job started: nothing to run.
        _fail(new, obs, decision, ident, "InvalidSpec", obs.spec_error)
    elif plan.suspended and phase:
        _suspended(ident, new, obs, decision)
    elif plan.queue and phase in (PROVISIONING, SUBMITTING, RUNNING) and _held_by_kueue(obs):
        _to_queue(ident, plan, new, obs, decision)
    else:
        STEPS.get(phase, _start)(ident, plan, new, obs, decision)
    new["observedGeneration"] = ident.generation
    return decision


def _start(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    if obs.spec_error:
        _fail(s, obs, d, ident, "InvalidSpec", obs.spec_error)
        return
    attempt = int(s.get("attempt") or 1)
    s.update(
        attempt=attempt,
        rayClusterName=plan.cluster_name,
        jobId=submission_id(ident.uid, attempt),
        epochs=plan.epochs,
        epochProgress=f"0/{plan.epochs}",
        startTime=cond.timestamp(obs.now),
    )
    _enter(s, d, PENDING, "Accepted", f"RayCluster {plan.cluster_name} and job {s['jobId']} reserved")


def _pending(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    d.actions.append(CreateCluster(s["rayClusterName"]))
    cond.set_condition(s, cond.CLUSTER_READY, False, "Creating", "creating the RayCluster", obs.now, ident.generation)
    _enter(s, d, PROVISIONING, "CreatingCluster", f"creating RayCluster {s['rayClusterName']}")


def _provisioning(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    cluster = obs.cluster
    if cluster is None:
        return
    name = s["rayClusterName"]
    if not cluster.exists:
        d.actions.append(CreateCluster(name))
        return
    if not cluster.owned:
        message = (
            f"RayCluster {name} exists but is not owned by this TPUFineTune; "
            "delete it or rename the TPUFineTune"
        )
        _note(s, d, obs, ident, cond.CLUSTER_READY, "NotOwned", message, warn=True)
        return
    if plan.queue and not cond.is_true(s, cond.ADMITTED):  # admitted before we saw it queued
        message = f"Kueue admitted RayCluster {name}"
        cond.set_condition(s, cond.ADMITTED, True, "Admitted", message, obs.now, ident.generation)
        d.actions.append(RecordEvent("Normal", "Admitted", message))
    if cluster.ready:
        cond.set_condition(s, cond.CLUSTER_READY, True, "Ready", f"RayCluster {name} is ready", obs.now, ident.generation)
        s["dashboardURL"] = cluster.dashboard_url
        _enter(s, d, SUBMITTING, "ClusterReady", f"RayCluster {name} is ready")
        return
    waited_since = _provisioning_since(s) or obs.now
    if obs.now - waited_since > plan.provision_timeout:
        minutes = int(plan.provision_timeout.total_seconds() // 60)
        detail = f": {cluster.problem}" if cluster.problem else ""
        _fail(s, obs, d, ident, "ProvisioningTimeout", f"RayCluster {name} not ready after {minutes} min{detail}")
        return
    if cluster.problem:
        _note(s, d, obs, ident, cond.CLUSTER_READY, "Waiting", cluster.problem, warn=True)
    else:
        s["message"] = f"waiting for RayCluster {name} to be ready"


def _submitting(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    job_id = s["jobId"]
    if obs.job is None:
        d.actions.append(SubmitJob(job_id, int(s["attempt"])))
        return
    cond.set_condition(s, cond.JOB_SUBMITTED, True, "Submitted", f"Ray job {job_id}", obs.now, ident.generation)
    cond.set_condition(s, cond.RUNNING, True, "JobRunning", f"Ray job {job_id} is {obs.job.status}", obs.now, ident.generation)
    _enter(s, d, RUNNING, "JobSubmitted", f"Ray job {job_id} submitted (attempt {s['attempt']})")


def _running(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    job = obs.job
    if job is not None and job.status in JOB_ACTIVE:
        if not s.get("message", "").startswith("epoch"):
            s["message"] = f"Ray job {s['jobId']} is {job.status.lower()}"
        return
    if job is not None and job.status == "SUCCEEDED":
        cond.set_condition(s, cond.RUNNING, False, "Completed", "the job finished", obs.now, ident.generation)
        cond.set_condition(s, cond.SUCCEEDED, True, "JobSucceeded", _success_message(s), obs.now, ident.generation)
        s["completionTime"] = cond.timestamp(obs.now)
        _enter(s, d, SUCCEEDED, "Succeeded", _success_message(s))
        d.actions.append(DeleteCluster(s["rayClusterName"]))
        return
    reason, message = _job_failure(s, job, obs)
    if not message:
        d.actions.append(ReadLogTail(s["jobId"]))
        return
    if int(s["attempt"]) - int(s.get("evictions") or 0) <= plan.max_retries:
        s.pop("trainerFailure", None)
        _retry(ident, s, obs, d, message)
        return
    _fail(s, obs, d, ident, reason, message)


def _retry(ident: Identity, s: dict, obs: Observations, d: Decision, message: str) -> None:
    attempt = int(s["attempt"]) + 1
    s["attempt"] = attempt
    s["jobId"] = submission_id(ident.uid, attempt)
    cond.set_condition(s, cond.RUNNING, False, "Retrying", message, obs.now, ident.generation)
    _enter(s, d, SUBMITTING, "Retrying", f"attempt {attempt - 1} failed ({message}); resubmitting as {s['jobId']}", warn=True)


def _suspended(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """spec.suspend: no RayCluster exists while it is true. A running job is stopped and
    the next attempt (resuming from the last checkpoint) starts once it is false again."""
    if s["phase"] in (SUBMITTING, RUNNING):
        if obs.job is not None and obs.job.status in JOB_ACTIVE:
            d.actions.append(StopJob(s["jobId"]))
        attempt = int(s["attempt"]) + (1 if obs.job is not None else 0)
        s.update(attempt=attempt, jobId=submission_id(ident.uid, attempt))
        for type_ in (cond.JOB_SUBMITTED, cond.RUNNING):
            if cond.find(s, type_):
                cond.set_condition(s, type_, False, "Suspended", "spec.suspend is true", obs.now, ident.generation)
    if s["phase"] != PENDING:
        cond.set_condition(s, cond.CLUSTER_READY, False, "Suspended", "spec.suspend is true", obs.now, ident.generation)
        _enter(s, d, PENDING, "Suspended", "suspended: the slice is released until spec.suspend is false")
    else:
        s["message"] = "suspended: no RayCluster is created until spec.suspend is false"
    if obs.cluster is not None and obs.cluster.exists and obs.cluster.owned:
        d.actions.append(DeleteCluster(s["rayClusterName"]))


# ---- Kueue (spec.queueName) ------------------------------------------------------------


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
        attempt = int(s["attempt"]) + 1
        s.update(attempt=attempt, jobId=submission_id(ident.uid, attempt),
                 evictions=int(s.get("evictions") or 0) + 1)
        s.pop("trainerFailure", None)  # the workers died with the eviction, not of their own
        why = f"evicted by Kueue ({queue.evicted or 'the RayCluster was suspended'})"
        for type_ in (cond.CLUSTER_READY, cond.JOB_SUBMITTED, cond.RUNNING):
            if cond.find(s, type_):
                cond.set_condition(s, type_, False, "Evicted", why, obs.now, ident.generation)
        message = f"{why}; attempt {attempt} resumes from the last checkpoint once admitted again"
        _admission(s, obs, ident, "Evicted", why)
        _enter(s, d, QUEUED, "Evicted", message, warn=True)
        return
    message = _queued_message(plan, s["rayClusterName"], queue)
    _admission(s, obs, ident, queue.reason or "Pending", message)
    cond.set_condition(s, cond.CLUSTER_READY, False, "Queued", message, obs.now, ident.generation)
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
        _admission(s, obs, ident, reason, message)
        if previous != message:
            s["message"] = message[: cond.MESSAGE_LIMIT]
            d.actions.append(RecordEvent("Normal", "Queued", message[: cond.MESSAGE_LIMIT]))
        return
    if cluster.exists and cluster.owned:
        s.pop("trainerFailure", None)  # a late line of an evicted attempt is not this one's
        message = f"Kueue admitted RayCluster {s['rayClusterName']}"
        cond.set_condition(s, cond.ADMITTED, True, "Admitted", message, obs.now, ident.generation)
        cond.set_condition(s, cond.CLUSTER_READY, False, "Creating", "admitted: the pods are starting",
                           obs.now, ident.generation)
        _enter(s, d, PROVISIONING, "Admitted", message)
        return
    _enter(s, d, PROVISIONING, "CreatingCluster", f"creating RayCluster {s['rayClusterName']}")


def _queued_message(plan: Plan, cluster: str, queue: QueueView) -> str:
    if queue.message:
        return f"queued in {plan.queue}: {queue.message}"
    return f"queued in {plan.queue}: waiting for Kueue to admit RayCluster {cluster}"


def _admission(s: dict, obs: Observations, ident: Identity, reason: str, message: str) -> None:
    cond.set_condition(s, cond.ADMITTED, False, reason, message, obs.now, ident.generation)


def _provisioning_since(s: dict) -> datetime | None:
    """When the wait for a ready cluster began: time spent queued does not count."""
    times = [cond.since(s, cond.CLUSTER_READY)]
    if cond.is_true(s, cond.ADMITTED):
        times.append(cond.since(s, cond.ADMITTED))
    return max((t for t in times if t is not None), default=None)


def _terminal(s: dict, obs: Observations, d: Decision) -> None:
    # Nothing expensive is left running: keep asking until the slice is released.
    if obs.cluster is not None and obs.cluster.exists and obs.cluster.owned:
        d.actions.append(DeleteCluster(s["rayClusterName"]))


def _deleting(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """Release the slice; never wait on Ray. The head lives in the RayCluster and dies
    with it, and so does any job on it: stopping the job first is a courtesy (the trainer
    ends cleanly), not a condition."""
    if s.get("phase") != DELETING:
        _enter(s, d, DELETING, "Deleting", "stopping the job and releasing the RayCluster")
    cluster_up = obs.cluster is not None and obs.cluster.exists and obs.cluster.owned
    if cluster_up and obs.job is not None and obs.job.status in JOB_ACTIVE and s.get("jobId"):
        d.actions.append(StopJob(s["jobId"]))
    if s.get("rayClusterName") and (obs.cluster is None or cluster_up):
        d.actions.append(DeleteCluster(s["rayClusterName"]))


def deletion_complete(obs: Observations) -> bool:
    """The finalizer may go once no owned RayCluster remains (its head, and every job on
    it, went with it). Ray is never asked: a dead head must not keep the finalizer."""
    return obs.cluster is None or not obs.cluster.exists or not obs.cluster.owned


# ---- helpers ---------------------------------------------------------------------------


def _job_failure(s: dict, job: JobView | None, obs: Observations) -> tuple[str, str]:
    """Reason and message for a job that is no longer active; message '' if we still
    need the log tail to explain it."""
    failure = s.get("trainerFailure") or {}
    if failure.get("message"):
        kind = failure.get("type") or "Error"
        return "TrainerFailed", f"{kind}: {failure['message']}"
    if job is None:
        return "JobLost", f"Ray has no job {s['jobId']} (was the head restarted?)"
    if job.status == "STOPPED":
        return "JobStopped", f"Ray job {s['jobId']} was stopped outside the operator"
    if obs.log_tail:
        return "JobFailed", f"{job.message or 'job failed'}; log tail: {obs.log_tail}"
    return "JobFailed", ""


def _success_message(s: dict) -> str:
    parts = [f"{s.get('epoch', 0)}/{s.get('epochs', 0)} epochs"]
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("checkpointURI"):
        parts.append(f"checkpoint {s['checkpointURI']}")
    if s.get("collectives"):
        parts.append("collectives passed" if s["collectives"].get("passed") else "collectives FAILED")
    return ", ".join(parts)


def _fail(s: dict, obs: Observations, d: Decision, ident: Identity, reason: str, message: str) -> None:
    cond.set_condition(s, cond.FAILED, True, reason, message, obs.now, ident.generation)
    if cond.find(s, cond.RUNNING):
        cond.set_condition(s, cond.RUNNING, False, reason, message, obs.now, ident.generation)
    s["completionTime"] = cond.timestamp(obs.now)
    _enter(s, d, FAILED, reason, message, warn=True)
    if s.get("rayClusterName"):
        d.actions.append(DeleteCluster(s["rayClusterName"]))


def _enter(s: dict, d: Decision, phase: str, reason: str, message: str, warn: bool = False) -> None:
    s["phase"] = phase
    s["message"] = message[: cond.MESSAGE_LIMIT]
    d.actions.append(RecordEvent("Warning" if warn else "Normal", reason, message[: cond.MESSAGE_LIMIT]))


def _note(s, d, obs, ident, type_, reason, message, warn=False) -> None:
    """Update a condition; emit an Event only when the message changes (no event storms)."""
    previous = cond.find(s, type_) or {}
    cond.set_condition(s, type_, False, reason, message, obs.now, ident.generation)
    s["message"] = message[: cond.MESSAGE_LIMIT]
    if previous.get("message") != message[: cond.MESSAGE_LIMIT]:
        d.actions.append(RecordEvent("Warning" if warn else "Normal", reason, message[: cond.MESSAGE_LIMIT]))


def _copy(status: dict) -> dict:
    # kopf keeps its own bookkeeping under status.kopf; it is not ours to rewrite.
    return copy.deepcopy({k: v for k, v in (status or {}).items() if k != "kopf"})


STEPS = {
    PENDING: _pending,
    QUEUED: _queued,
    PROVISIONING: _provisioning,
    SUBMITTING: _submitting,
    RUNNING: _running,
}
