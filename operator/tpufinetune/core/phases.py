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
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from tpufinetune.core import attempts
from tpufinetune.core import conditions as cond
from tpufinetune.core.jobspec import checkpoint_request_id, preflight_id, submission_id
from tpufinetune.core.api import TPUFineTuneSpec
from tpufinetune.core.podstatus import PodProblem, SliceHealth
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.runevents import apply_event
from tpufinetune.core.sizing import raycluster_name, slice_shape

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
    """What the spec asks for, as the transition needs it (plan_for derives it)."""

    cluster_name: str
    epochs: int
    max_retries: int = 0
    provision_timeout: timedelta = timedelta(minutes=30)
    suspended: bool = False
    cluster_hash: str = ""  # cluster_fingerprint() of the RayCluster the spec renders
    hosts: int = 0  # worker pods of the slice(s), for "hosts ready 3/4"
    chips: int = 0  # TPU chips of the slice(s), for usage.chipHours (0: cpu)
    active_deadline: timedelta | None = None  # spec.activeDeadlineSeconds
    ttl_after_finished: timedelta = timedelta(0)  # spec.ttlSecondsAfterFinished
    no_progress_timeout: timedelta | None = None  # spec.noProgressTimeoutSeconds (None: off)
    queue: str = ""  # spec.queueName: Kueue admits the RayCluster
    preflight: bool = False  # spec.preflight.enabled (mode finetune): collectives first


def plan_for(ident: Identity, spec: TPUFineTuneSpec | None, provision_timeout: timedelta) -> Plan:
    """The Plan of a spec (None: the spec is invalid, and only the names are known)."""
    name = raycluster_name(ident.name)
    if spec is None:
        return Plan(cluster_name=name, epochs=0, provision_timeout=provision_timeout)
    raycluster = raycluster_with_pod_settings(ident.name, ident.namespace, ident.uid, spec)
    return Plan(
        cluster_name=name,
        epochs=spec.training.epochs,
        max_retries=spec.max_retries,
        provision_timeout=provision_timeout,
        suspended=spec.suspend,
        cluster_hash=cluster_fingerprint(raycluster),
        hosts=slice_shape(spec).hosts * spec.tpu.slices,
        chips=(slice_shape(spec).chips * spec.tpu.slices) if slice_shape(spec).generation.is_tpu else 0,
        active_deadline=_seconds(spec.active_deadline_seconds),
        ttl_after_finished=timedelta(seconds=spec.ttl_seconds_after_finished),
        no_progress_timeout=_seconds(spec.no_progress_timeout_seconds),
        queue=spec.queue_name or "",
        preflight=spec.mode == "finetune" and spec.preflight is not None and spec.preflight.enabled,
    )


def _seconds(value: int | None) -> timedelta | None:
    """A spec's seconds field; unset or 0 turns the timer off."""
    return timedelta(seconds=value) if value else None


def cluster_fingerprint(raycluster: dict) -> str:
    """What identifies the RayCluster a spec renders (slice, image, pod settings): a retry
    rebuilds the cluster when the spec's fingerprint no longer matches the one it was
    created from."""
    text = json.dumps(raycluster["spec"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    pod_problem: PodProblem | None = None  # the worst pod state while not ready
    hosts_ready: int | None = None  # worker pods Ready; None: pods not looked at
    suspended: bool = False  # spec.suspend: Kueue has not admitted it (or evicted it)
    deleting: bool = False  # metadata.deletionTimestamp is set: it is going away
    queue: QueueView | None = None  # read only for a suspended cluster with a queue
    uid: str = ""  # metadata.uid: which RayCluster an attempt ran on
    hosts_ready_since: str = ""  # when its last worker pod became Ready (read once it is ready)


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
    ray_unreachable: str = ""  # why, once the job's head has not answered for too long
    create_refused: str = ""  # the API server's words when it refused to create the RayCluster
    slice_health: SliceHealth | None = None  # read only once a job ended without success
    # (node, GKE's cloud.google.com/scheduled-maintenance-time value) for the nodes of the
    # run's pods that carry it; read only while Running.
    maintenance: tuple[tuple[str, str], ...] = ()
    # The attempt's preflight job (None: Ray has none) and, once it ended, its events.
    preflight_job: JobView | None = None
    preflight_events: tuple[dict, ...] = ()


# ---- actions (performed by the driver) -------------------------------------------------


@dataclass(frozen=True)
class CreateCluster:
    name: str


@dataclass(frozen=True)
class SubmitJob:
    submission_id: str
    attempt: int


@dataclass(frozen=True)
class SubmitPreflight:
    submission_id: str
    attempt: int


@dataclass(frozen=True)
class StopJob:
    submission_id: str


@dataclass(frozen=True)
class RequestCheckpoint:
    """Ask the running trainer for a step checkpoint now (a short Ray job on the head)."""

    submission_id: str
    attempt: int
    request: int
    reason: str
    detail: str


@dataclass(frozen=True)
class DeleteCluster:
    name: str


@dataclass(frozen=True)
class ReadLogTail:
    """Ask the driver for the log tail (only when a job failed without a failure event)."""

    submission_id: str


@dataclass(frozen=True)
class ReadSliceHealth:
    """Ask the driver for the slice's pods and nodes (once a job ended without success):
    they decide the attempt's reason and whether the retry may keep the RayCluster."""

    since: str  # when the slice was ready for the attempt: a pod newer than this replaced one


@dataclass(frozen=True)
class RecordEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: dict
    actions: list = field(default_factory=list)
    # Step again by then at the latest, even with nothing to do now (a RayCluster kept by
    # spec.ttlSecondsAfterFinished is released then).
    wake_at: datetime | None = None

    @property
    def phase(self) -> str:
        return self.status.get("phase", "")


# ---- the transition --------------------------------------------------------------------


def transition(ident: Identity, plan: Plan, status: dict, obs: Observations) -> Decision:
    new = _copy(status)
    decision = Decision(new)
    for event in obs.events:
        previous = dict(new.get("notice") or {})
        apply_event(new, event)
        if event.get("event") != "notice":
            continue
        if new["notice"] == {k: v for k, v in previous.items() if k != "time"}:
            new["notice"] = previous  # the driver repeats a SIGTERM's (rank 0's line may be lost)
        else:
            # Recorded where `kubectl describe` shows it, and kept in status.notice.
            new["notice"]["time"] = cond.timestamp(obs.now)
            decision.actions.append(RecordEvent(
                "Normal", "CheckpointOnNotice",
                f"{event.get('reason')}{' (' + str(event['requested_by']) + ')' if event.get('requested_by') else ''}: "
                f"checkpoint of step {event.get('step')} written to {event.get('uri')}"[: cond.MESSAGE_LIMIT]))
    phase = new.get("phase") or ""
    if obs.events:
        new["lastEventTime"] = cond.timestamp(obs.now)
        attempts.note_steps(new, obs.events, running=phase == RUNNING)
    if obs.deleting:
        _deleting(ident, new, obs, decision)
    elif phase in TERMINAL:
        _terminal(plan, new, obs, decision)
    elif obs.spec_error and phase in (PENDING, QUEUED, PROVISIONING, SUBMITTING):
        # An edit made the spec invalid before the job started: nothing to run.
        _applied(new, ident)
        _fail(plan, new, obs, decision, "InvalidSpec", obs.spec_error)
    elif plan.suspended and phase:
        _suspended(ident, new, obs, decision)
    elif phase and _past_deadline(plan, new, obs):
        seconds = int(plan.active_deadline.total_seconds())
        _stop_and_fail(plan, new, obs, decision, "DeadlineExceeded",
                       f"spec.activeDeadlineSeconds ({seconds} s) passed; the job was stopped")
    elif plan.queue and phase in (PROVISIONING, SUBMITTING, RUNNING) and _held_by_kueue(obs):
        _to_queue(ident, plan, new, obs, decision)
    elif phase in (SUBMITTING, RUNNING) and cluster_lost(obs.cluster):
        _lost_cluster(ident, plan, new, obs, decision)
    elif obs.ray_unreachable and phase in (SUBMITTING, RUNNING):
        _fail(plan, new, obs, decision, "RayUnreachable", obs.ray_unreachable)
    else:
        STEPS.get(phase, _start)(ident, plan, new, obs, decision)
    if new.get("phase") != phase:
        # Timers of a phase (provisioning timeout, no-progress) count from here.
        new["phaseTransitionTime"] = cond.timestamp(obs.now)
    _count_attempts(plan, status or {}, new, obs, decision, phase)
    return decision


ATTEMPT_PHASES = frozenset({PENDING, QUEUED, PROVISIONING, SUBMITTING, RUNNING})


def _count_attempts(plan: Plan, old: dict, s: dict, obs: Observations, d: Decision, before: str) -> None:
    """An attempt is open whenever the run works towards a result; a slice deleted, lost or
    taken back by Kueue costs no more from now; usage is brought up to now whenever the
    status changes anyway (a phase, the trainer's events, an attempt's end), so a run
    that only waits writes nothing new."""
    cluster = obs.cluster
    if s.get("phase") in ATTEMPT_PHASES and not plan.suspended and s.get("attempt"):
        attempts.begin(s, obs.now)
        if s["phase"] in (SUBMITTING, RUNNING):  # a run an older operator started: ready already
            attempts.slice_ready(s, obs.now, cluster.uid if cluster is not None else "")
    gone = cluster_lost(cluster) and before in (SUBMITTING, RUNNING)
    taken_back = bool(plan.queue) and cluster is not None and cluster.suspended
    if gone or taken_back or any(isinstance(a, DeleteCluster) for a in d.actions):
        attempts.release(s, obs.now)
    if obs.events or s.get("phase") != before or attempts.shape(s) != attempts.shape(old):
        attempts.account(old, s, obs.now, plan.chips, plan.hosts)


def _start(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    _applied(s, ident)
    if obs.spec_error:
        _fail(plan, s, obs, d, "InvalidSpec", obs.spec_error)
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
    name = s["rayClusterName"]
    cluster = obs.cluster
    if cluster is not None and cluster.exists and cluster.owned:
        # The previous RayCluster (suspended, or built from an older spec) is still going:
        # a new one is created only once it is gone, never adopted half-deleted.
        d.actions.append(DeleteCluster(name))
        s["message"] = f"waiting for the previous RayCluster {name} to be deleted"
        return
    # A resume restarts the clock of spec.activeDeadlineSeconds, as for a Job.
    s.setdefault("startTime", cond.timestamp(obs.now))
    _create_cluster(ident, plan, s, d)
    _set(s, obs, cond.CLUSTER_READY, False, "Creating", "creating the RayCluster")
    _enter(s, d, PROVISIONING, "CreatingCluster", f"creating RayCluster {name}")


def _provisioning(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    cluster = obs.cluster
    if cluster is None:
        return
    name = s["rayClusterName"]
    if not cluster.exists:
        if obs.create_refused:
            _refused(ident, plan, s, obs, d)
            return
        _create_cluster(ident, plan, s, d)
        return
    if not cluster.owned:
        message = (
            f"RayCluster {name} exists but is not owned by this TPUFineTune; "
            "delete it or rename the TPUFineTune"
        )
        _note(s, d, obs, cond.CLUSTER_READY, "NotOwned", message, warn=True)
        return
    if plan.queue and not cond.is_true(s, cond.ADMITTED):  # admitted before we saw it queued
        message = f"Kueue admitted RayCluster {name}"
        _set(s, obs, cond.ADMITTED, True, "Admitted", message)
        d.actions.append(RecordEvent("Normal", "Admitted", message))
    if cluster.ready:
        _set(s, obs, cond.CLUSTER_READY, True, "Ready", f"RayCluster {name} is ready")
        attempts.slice_ready(s, obs.now, cluster.uid, cond.parse_time(cluster.hosts_ready_since or None))
        s["dashboardURL"] = cluster.dashboard_url
        _enter(s, d, SUBMITTING, "ClusterReady", f"RayCluster {name} is ready")
        return
    hosts = f"hosts ready {cluster.hosts_ready}/{plan.hosts}" if cluster.hosts_ready is not None and plan.hosts else ""
    if _expired(_provisioning_deadline(plan, s), obs):
        minutes = int(plan.provision_timeout.total_seconds() // 60)
        detail = "; ".join(filter(None, [hosts, cluster.pod_problem and cluster.pod_problem.message, cluster.problem]))
        _fail(plan, s, obs, d, "ProvisioningTimeout",
              f"RayCluster {name} not ready after {minutes} min" + (f": {detail}" if detail else ""))
        return
    if cluster.pod_problem:
        # The worst pod state, as the condition's reason (Unschedulable, ErrImagePull,
        # CrashLoopBackOff ...); an Event only when that reason changes, not with every
        # count the scheduler or the kubelet updates.
        problem = cluster.pod_problem
        message = "; ".join(filter(None, [hosts, problem.message]))
        previous = cond.find(s, cond.CLUSTER_READY) or {}
        _set(s, obs, cond.CLUSTER_READY, False, problem.reason, message)
        s["message"] = message[: cond.MESSAGE_LIMIT]
        if previous.get("reason") != problem.reason:
            d.actions.append(RecordEvent("Warning", problem.reason, message[: cond.MESSAGE_LIMIT]))
    elif cluster.problem:
        _note(s, d, obs, cond.CLUSTER_READY, "Waiting", cluster.problem, warn=True)
    else:
        s["message"] = f"waiting for RayCluster {name} to be ready" + (f": {hosts}" if hosts else "")
        if hosts:
            _set(s, obs, cond.CLUSTER_READY, False, "Waiting", s["message"])


def _refused(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """The API server refused the RayCluster (a webhook, a quota, a policy): shown with its
    words, asked again every step, and counted against the provisioning timeout."""
    name = s["rayClusterName"]
    if _expired(_provisioning_deadline(plan, s), obs):
        minutes = int(plan.provision_timeout.total_seconds() // 60)
        _fail(plan, s, obs, d, "ProvisioningTimeout",
              f"RayCluster {name} could not be created in {minutes} min: {obs.create_refused}")
        return
    _note(s, d, obs, cond.CLUSTER_READY, "CreateRefused",
          f"the API server refused RayCluster {name}: {obs.create_refused}", warn=True)
    _create_cluster(ident, plan, s, d)


def _submitting(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    job_id = s["jobId"]
    if obs.job is None:
        if plan.cluster_hash and s.get("clusterHash") not in (None, plan.cluster_hash):
            _rebuild(s, obs, d)
            return
        if plan.preflight and not _preflight_passed(ident, plan, s, obs, d):
            return
        _applied(s, ident)
        d.actions.append(SubmitJob(job_id, int(s["attempt"])))
        # The driver resumes a later attempt from the last checkpoint reported.
        attempts.resumed_from(s, (s.get("checkpointURI") or "") if int(s["attempt"]) > 1 else "")
        return
    _set(s, obs, cond.JOB_SUBMITTED, True, "Submitted", f"Ray job {job_id}")
    _set(s, obs, cond.RUNNING, True, "JobRunning", f"Ray job {job_id} is {obs.job.status}")
    _enter(s, d, RUNNING, "JobSubmitted", f"Ray job {job_id} submitted (attempt {s['attempt']})")


def _preflight_passed(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> bool:
    """spec.preflight: the collectives check runs on this attempt's cluster first. True once
    it passed; a failure ends the run (reason PreflightFailed) and releases the slice before
    any fine-tune job exists."""
    attempt = int(s["attempt"])
    job_id = preflight_id(ident.uid, attempt)
    result = s.get("preflight") or {}
    if result.get("attempt") == attempt and result.get("phase") == "Passed":
        return True
    if result.get("attempt") != attempt:
        s["preflight"] = {"phase": "Running", "attempt": attempt, "jobId": job_id}
        d.actions.append(SubmitPreflight(job_id, attempt))
        _enter(s, d, SUBMITTING, "Preflight", f"preflight {job_id}: checking the slice before the fine-tune")
        return False
    job = obs.preflight_job
    if job is None or job.status in JOB_ACTIVE:
        if job is None:
            d.actions.append(SubmitPreflight(job_id, attempt))  # level-based: Ray refuses a duplicate
        return False
    result = s["preflight"]
    result.update(_preflight_figures(obs.preflight_events))
    if job.status == "SUCCEEDED" and result.get("message", "").startswith("passed"):
        result["phase"] = "Passed"
        d.actions.append(RecordEvent("Normal", "PreflightPassed", result["message"][: cond.MESSAGE_LIMIT]))
        return True
    result["phase"] = "Failed"
    if not result.get("message"):
        result["message"] = _first_and_last_line(job.message) or f"preflight job {job.status.lower()}"
    _fail(plan, s, obs, d, "PreflightFailed", f"preflight {job_id}: {result['message']}"[:1024])
    return False


def _preflight_figures(events: tuple[dict, ...]) -> dict:
    """status.preflight from the preflight job's collectives and failure events."""
    figures: dict = {}
    failure = ""
    for event in events:
        if event.get("event") == "collectives":
            for key, field in (("bus_bandwidth_gbps", "busBandwidthGBps"),
                               ("min_bus_bandwidth_gbps", "minBusBandwidthGBps"), ("hosts", "hosts"),
                               ("devices_per_host", "devicesPerHost"), ("short_hosts", "shortHosts"),
                               ("world_size", "ranks")):
                if event.get(key) is not None:
                    figures[field] = event[key]
            figures["passed"] = bool(event.get("passed"))
        elif event.get("event") == "failure":
            failure = f"{event.get('type') or 'Error'}: {event.get('message') or ''}"
    passed = figures.pop("passed", False) and not failure
    bandwidth = figures.get("busBandwidthGBps")
    shown = f"all_reduce bus bandwidth {bandwidth} GB/s" if bandwidth is not None else "no bandwidth measured"
    where = f" on {figures['ranks']} ranks, {figures.get('hosts')} hosts" if figures.get("ranks") else ""
    figures["message"] = (f"passed: {shown}{where}" if passed else (failure or f"failed: {shown}{where}"))[:1024]
    return figures


def _rebuild(s: dict, obs: Observations, d: Decision) -> None:
    """The spec was edited in a way that changes the RayCluster (slice, image, pod
    settings): the next attempt runs on a cluster built from it."""
    name = s["rayClusterName"]
    message = f"the spec changed the RayCluster; rebuilding {name} before the next attempt"
    _set(s, obs, cond.CLUSTER_READY, False, "Rebuilding", message)
    s.pop("dashboardURL", None)
    d.actions.append(DeleteCluster(name))
    _enter(s, d, PENDING, "Rebuilding", message)


def _running(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    job = obs.job
    if job is not None and job.status in JOB_ACTIVE:
        silent = _silent_for(s, obs)
        if plan.no_progress_timeout is not None and silent > plan.no_progress_timeout:
            minutes = int(silent.total_seconds() // 60)
            _stop_and_fail(plan, s, obs, d, "NoProgress",
                           f"no trainer event for {minutes} min (spec.noProgressTimeoutSeconds: "
                           f"{int(plan.no_progress_timeout.total_seconds())}); a hung collective "
                           "or a stuck host? The job was stopped")
            return
        if not s.get("message", "").startswith("epoch"):
            s["message"] = f"Ray job {s['jobId']} is {job.status.lower()}"
        _maintenance(ident, s, obs, d)
        return
    if job is not None and job.status == "SUCCEEDED":
        _set(s, obs, cond.RUNNING, False, "Completed", "the job finished")
        _set(s, obs, cond.SUCCEEDED, True, "JobSucceeded", _success_message(s))
        s["completionTime"] = cond.timestamp(obs.now)
        _enter(s, d, SUCCEEDED, "Succeeded", _success_message(s))
        attempts.end(s, obs.now, "Succeeded", _success_message(s))
        _release(plan, s, obs, d)
        return
    # The log's last lines (kept with the attempt: they outlive the cluster) and the
    # slice's pods and nodes (why the attempt ended; whether a retry may keep the slice).
    reads = []
    if job is not None and not obs.log_tail:
        reads.append(ReadLogTail(s["jobId"]))
    if obs.slice_health is None:
        entry = attempts.current(s) or {}
        reads.append(ReadSliceHealth(entry.get("sliceReadyTime") or s.get("phaseTransitionTime") or ""))
    if reads:
        d.actions.extend(reads)
        return
    reason, message = _job_failure(s, job, obs)
    ended_as = attempt_reason(reason, obs.slice_health)
    detail = message
    if obs.log_tail and obs.log_tail not in message:
        detail = f"{message}; log tail: {obs.log_tail}"
    if obs.slice_health.reason or (not obs.slice_health.healthy and obs.slice_health.detail):
        detail = f"{detail}; slice: {obs.slice_health.detail}"
    retries = int(s.get("retries") or 0)
    if retries < plan.max_retries:
        s["retries"] = retries + 1
        s.pop("trainerFailure", None)
        keep = ended_as == "AppFailed" and obs.slice_health.healthy and (
            not plan.cluster_hash or s.get("clusterHash") in (None, plan.cluster_hash))
        ended = attempts.end(s, obs.now, ended_as, detail, keep_slice=keep)
        d.actions.append(RecordEvent("Warning", "AttemptFailed",
                                     attempts.bounded(f"attempt {s['attempt']} ended ({ended_as}): {detail}",
                                                      cond.MESSAGE_LIMIT)))
        _retry(ident, s, obs, d, message, took_over=ended if keep else None)
        return
    _fail(plan, s, obs, d, reason, message, attempt_as=ended_as, attempt_detail=detail)


def attempt_reason(job_reason: str, health: SliceHealth | None) -> str:
    """Why an attempt whose job ended without success ended: what its slice shows (a pod
    taken away with the cloud's reason, a node gone or under maintenance) comes first; a
    job the head lost or someone stopped says so; anything else is the application's."""
    if health is not None and health.reason:
        return health.reason
    return attempts.JOB_END_REASONS.get(job_reason, "AppFailed")


def _maintenance(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """A node of the run's pods has maintenance scheduled (GKE's label): ask the trainer for
    a checkpoint now, once per node and attempt, so the maintenance costs at most the steps
    after it; recorded in status.maintenance and as an Event."""
    attempt = int(s["attempt"])
    seen = s.get("maintenance") or {}
    known = set(seen.get("nodes") or []) if seen.get("attempt") == attempt else set()
    new = [(node, when) for node, when in obs.maintenance if node not in known]
    if not new:
        return
    request = int(seen.get("requests") or 0) + 1 if seen.get("attempt") == attempt else 1
    detail = ", ".join(f"node {node} at {maintenance_time(when)}" for node, when in new)
    message = f"maintenance scheduled ({detail}): asked the trainer for a checkpoint now"
    s["maintenance"] = {"nodes": sorted(known | {node for node, _ in new}), "attempt": attempt,
                        "requests": request, "requestTime": cond.timestamp(obs.now),
                        "message": message[: cond.MESSAGE_LIMIT]}
    d.actions.append(RequestCheckpoint(checkpoint_request_id(ident.uid, attempt, request), attempt, request,
                                       "Maintenance", detail[:512]))
    d.actions.append(RecordEvent("Warning", "Maintenance", message[: cond.MESSAGE_LIMIT]))


def maintenance_time(value: str) -> str:
    """GKE's label value is seconds since the epoch; shown as RFC 3339 (else as it is)."""
    if value.isdigit():
        return cond.timestamp(datetime.fromtimestamp(int(value), tz=timezone.utc))
    return value


def _silent_for(s: dict, obs: Observations) -> timedelta:
    """How long the trainer has said nothing in this attempt."""
    since = [cond.parse_time(s.get("phaseTransitionTime")), cond.parse_time(s.get("lastEventTime"))]
    return obs.now - max((t for t in since if t is not None), default=obs.now)


def _past_deadline(plan: Plan, s: dict, obs: Observations) -> bool:
    """spec.activeDeadlineSeconds has passed (a job that already succeeded keeps its result)."""
    if obs.job is not None and obs.job.status == "SUCCEEDED":
        return False
    return _expired(_active_deadline(plan, s), obs)


def _provisioning_deadline(plan: Plan, s: dict) -> datetime | None:
    """When the provisioning timeout ends, counted from the phase's start (None: not started)."""
    since = cond.parse_time(s.get("phaseTransitionTime"))
    return since + plan.provision_timeout if since is not None else None


def _active_deadline(plan: Plan, s: dict) -> datetime | None:
    """When spec.activeDeadlineSeconds ends, counted from startTime (None: no deadline, or
    its clock is stopped)."""
    started = cond.parse_time(s.get("startTime"))
    return started + plan.active_deadline if plan.active_deadline is not None and started is not None else None


def _expired(deadline: datetime | None, obs: Observations) -> bool:
    return deadline is not None and obs.now > deadline


# Phases in which a run only waits for something the operator watches (its RayCluster, the
# cluster's pods, its Kueue Workload, a spec edit) or for one of its own timers.
WAITING = frozenset({PENDING, QUEUED, PROVISIONING})


def next_timer(plan: Plan, s: dict) -> datetime | None:
    """The earliest moment a waiting run's decision can change with no change to anything
    watched: its provisioning timeout (counted from the phase's start) and
    spec.activeDeadlineSeconds. None when it has no timer."""
    phase = s.get("phase")
    timers = [_provisioning_deadline(plan, s) if phase == PROVISIONING else None,
              _active_deadline(plan, s) if phase and phase not in TERMINAL else None]
    return min((t for t in timers if t is not None), default=None)


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


def cluster_lost(cluster: ClusterView | None) -> bool:
    """The job's RayCluster is gone or going (None: not looked at). In Submitting and
    Running that is never the operator's doing: it deletes one only in other phases."""
    return cluster is not None and (not cluster.exists or not cluster.owned or cluster.deleting)


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


def _terminal(plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    # Nothing expensive is left running: keep asking until the slice is released.
    if obs.cluster is not None and obs.cluster.exists and obs.cluster.owned:
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


def _deleting(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """Release the slice; never wait on Ray. The head lives in the RayCluster and dies
    with it, and so does any job on it: stopping the job first is a courtesy (the trainer
    ends cleanly), not a condition."""
    if s.get("phase") != DELETING:
        attempts.end(s, obs.now, "Stopped", "the TPUFineTune was deleted")
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
        return "JobFailed", f"{_first_and_last_line(job.message) or 'job failed'}; log tail: {obs.log_tail}"
    return "JobFailed", ""


def _first_and_last_line(text: str) -> str:
    """Ray's message of a failed job can hold a whole traceback (a runtime_env that could
    not be set up): its first line says what failed, its last one why."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[1:][-1:])


def _success_message(s: dict) -> str:
    parts = [f"{s.get('epoch', 0)}/{s.get('epochs', 0)} epochs"]
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("checkpointURI"):
        parts.append(f"checkpoint {s['checkpointURI']}")
    if s.get("collectives"):
        parts.append("collectives passed" if s["collectives"].get("passed") else "collectives FAILED")
    return ", ".join(parts)


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


def _create_cluster(ident: Identity, plan: Plan, s: dict, d: Decision) -> None:
    """The RayCluster is built from the current spec: that generation is now applied."""
    _applied(s, ident)
    if plan.cluster_hash:
        s["clusterHash"] = plan.cluster_hash
    d.actions.append(CreateCluster(s["rayClusterName"]))


def _applied(s: dict, ident: Identity) -> None:
    """status.observedGeneration names only a generation acted on: the one a RayCluster
    was created from, a job submitted with, or a suspend applied for. An edit to a running
    job applies to the next attempt, and the status says so by not claiming it yet."""
    s["observedGeneration"] = ident.generation


def _set(s: dict, obs: Observations, type_: str, value: bool, reason: str, message: str) -> None:
    cond.set_condition(s, type_, value, reason, message, obs.now, s.get("observedGeneration"))


def _enter(s: dict, d: Decision, phase: str, reason: str, message: str, warn: bool = False) -> None:
    s["phase"] = phase
    s["message"] = message[: cond.MESSAGE_LIMIT]
    d.actions.append(RecordEvent("Warning" if warn else "Normal", reason, message[: cond.MESSAGE_LIMIT]))


def _note(s, d, obs, type_, reason, message, warn=False) -> None:
    """Update a condition; emit an Event only when the message changes (no event storms)."""
    previous = cond.find(s, type_) or {}
    _set(s, obs, type_, False, reason, message)
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
