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

import hashlib
import json
from dataclasses import replace
from datetime import datetime, timedelta

from tpufinetune.core import attempts, phaselmeval
from tpufinetune.core import conditions as cond
from tpufinetune.core import initsource, memplan, memplan_spec
from tpufinetune.core.phaseinit import await_source, waits_for_source
from tpufinetune.core.api import TPUFineTuneSpec
from tpufinetune.core.jobspec import run_logs_root, submission_id
from tpufinetune.core.phaseattempts import (  # noqa: F401  (attempt_reason: part of the API)
    NOT_RETRIED, _count_attempts, _fail, _job_failure, _lost_cluster, _rebuild_or_fail, _release, _retry, _stop_and_fail,
    _succeed, _suspended, attempt_reason,
)
from tpufinetune.core.phasechecks import (  # noqa: F401  (ray_down_since: the driver's)
    _maintenance, _preflight_passed, _ray_clock, _ray_down, _spec_validity, maintenance_time, plan_from_config,
    ray_down_since,
)
from tpufinetune.core.phasemodel import (  # noqa: F401  (re-exported: the driver and tests use phases.X)
    DELETING, FAILED, JOB_ACTIVE, PENDING, PROVISIONING, QUEUED, RUNNING, SUBMITTING, SUCCEEDED, TERMINAL,
    WAITING, ClusterView, CreateCluster, Decision, DeleteCluster, Identity, JobView, Observations, Plan,
    QueueView, ReadLogTail, ReadSliceHealth, RecordEvent, RequestCheckpoint, StopJob, SubmitJob,
    SubmitPreflight, _applied, _copy, _enter, _expired, _note, _set, cluster_lost,
)
from tpufinetune.core.phasequeue import _held_by_kueue, _queued, _to_queue
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.runevents import apply_event
from tpufinetune.core.sizing import raycluster_name, slice_shape


def plan_for(ident: Identity, spec: TPUFineTuneSpec | None, provision_timeout: timedelta,
             submit_timeout: timedelta | None = None, init_from: dict | None = None) -> Plan:
    """The Plan of a spec (None: the spec is invalid, and only the names are known). The
    timeouts are the operator's settings (TPUFT_PROVISION_TIMEOUT, TPUFT_SUBMIT_TIMEOUT);
    `init_from` is status.initFrom (a chained run's source, once resolved)."""
    name = raycluster_name(ident.name)
    if spec is None:
        return Plan(cluster_name=name, epochs=0, provision_timeout=provision_timeout, submit_timeout=submit_timeout)
    raycluster = raycluster_with_pod_settings(ident.name, ident.namespace, ident.uid, spec)
    request = initsource.memory_request(spec, init_from)  # a chained run's: its source's base, once recorded
    memory = memplan.estimate(request) if request is not None else None
    return Plan(
        cluster_name=name,
        epochs=spec.training.epochs,
        max_retries=spec.max_retries,
        provision_timeout=provision_timeout,
        submit_timeout=submit_timeout,
        suspended=spec.suspend,
        cluster_hash=cluster_fingerprint(raycluster),
        hosts=slice_shape(spec).hosts * spec.tpu.slices,
        chips=(slice_shape(spec).chips * spec.tpu.slices) if slice_shape(spec).generation.is_tpu else 0,
        active_deadline=_seconds(spec.active_deadline_seconds),
        ttl_after_finished=timedelta(seconds=spec.ttl_seconds_after_finished),
        no_progress_timeout=_seconds(spec.no_progress_timeout_seconds),
        queue=spec.queue_name or "",
        preflight=spec.mode == "finetune" and spec.preflight is not None and spec.preflight.enabled,
        memory=memplan_spec.status_of(memory) if memory is not None else None,
        # A chained run's export is of its source's base: lm-eval's fit is known once that is recorded.
        does_not_fit=(memory.refusal() if memory is not None and memplan.refuses(memory) else "")
        or phaselmeval.resolved_fit_refusal(spec, init_from),
        memory_request=request,
        lm_eval_tasks=phaselmeval.lm_eval_tasks(spec),
        logs_root=run_logs_root(ident.name, ident.uid, spec), init_from=initsource.request_of(spec),
    )


# What a valid edit not yet applied leaves as it was until the next attempt: the RayCluster
# the attempt holds (its size, which its usage is counted at, and whether Kueue manages
# it). Everything else in the plan acts at once, each for its reason (docs/api.md, "An edit
# to a running run"): spec.suspend (the way to stop a run now), the deadline, the watchdog,
# the TTL and spec.maxRetries (bounds on the run as a whole, which an edit is made to
# change now), preflight and the fit check (they act before the next submit anyway), and
# what a new attempt or cluster is made from (the fingerprint a retry compares, the
# epochs, the logs).
HELD_UNTIL_NEXT_ATTEMPT = ("chips", "hosts", "queue")


def plan_in_force(latest: Plan, applied: Plan | None, refused: bool) -> Plan:
    """The plan a step goes by. An edit the operator's checks refuse (`refused`: the latest
    generation's spec is invalid) changes nothing: the applied generation's plan stays in
    force whole (watchdog, deadline, TTL, retries). A valid edit not yet applied is in
    force at once except HELD_UNTIL_NEXT_ATTEMPT: the attempt's usage goes on at the
    applied generation's chips and hosts (what it already cost is never rescaled), and its
    cluster stays Kueue's or not as it was created. `applied` None: not known, the latest."""
    if applied is None:
        return latest
    if refused:
        return applied
    return replace(latest, **{name: getattr(applied, name) for name in HELD_UNTIL_NEXT_ATTEMPT})


def _seconds(value: int | None) -> timedelta | None:
    """A spec's seconds field; unset or 0 turns the timer off."""
    return timedelta(seconds=value) if value else None


def cluster_fingerprint(raycluster: dict) -> str:
    """What identifies the RayCluster a spec renders (slice, image, pod settings): a retry
    rebuilds the cluster when the spec's fingerprint no longer matches the one it was
    created from."""
    text = json.dumps(raycluster["spec"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- the transition --------------------------------------------------------------------


def transition(ident: Identity, plan: Plan, status: dict, obs: Observations) -> Decision:
    new = _copy(status)
    decision = Decision(new)
    refused_by_config = ""
    evaluating = phaselmeval.evaluating(new)
    for event in phaselmeval.fold_evaluation_events(new, obs.events):  # the rest: the fine-tune's
        if event.get("event") == "model":
            refused_by_config = plan_from_config(plan, new, event, decision) or refused_by_config
            continue
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
    elif evaluating:
        phaselmeval.step(ident, plan, new, obs, decision)
    elif obs.spec_error and phase in (PENDING, QUEUED, PROVISIONING, SUBMITTING):
        # An edit made the spec invalid before the job started: nothing to run.
        _applied(new, ident)
        _fail(plan, new, obs, decision, "InvalidSpec", obs.spec_error)
    elif plan.does_not_fit and phase in (PENDING, QUEUED, PROVISIONING, SUBMITTING):
        # An edit made the run too big for its slice before the job started.
        _applied(new, ident)
        new["plan"] = plan.memory
        _fail(plan, new, obs, decision, "DoesNotFit", plan.does_not_fit)
    elif refused_by_config and phase in (SUBMITTING, RUNNING):
        # The model's own config.json says the run cannot fit: stopped before it trains.
        _stop_and_fail(plan, new, obs, decision, "DoesNotFit", refused_by_config)
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
    elif phase == SUBMITTING and obs.job is None and _expired(_submitting_deadline(plan, new), obs):
        _submit_timeout(ident, plan, new, obs, decision)
    elif obs.ray_unreachable and phase in (SUBMITTING, RUNNING):
        _rebuild_or_fail(ident, plan, new, obs, decision, "RayUnreachable", obs.ray_unreachable)
    elif obs.ray_down and phase in (SUBMITTING, RUNNING):
        _ray_down(new, obs, decision)
    elif waits_for_source(plan, new):
        await_source(ident, plan, new, obs, decision)
    else:
        STEPS.get(phase if new.get("rayClusterName") else "", _start)(ident, plan, new, obs, decision)
    if new.get("phase") != phase:
        # Timers of a phase (provisioning timeout, no-progress) count from here.
        new["phaseTransitionTime"] = cond.timestamp(obs.now)
    _ray_clock(status or {}, new, obs)
    _spec_validity(ident, new, obs, decision)
    _count_attempts(plan, status or {}, new, obs, decision, phase)
    return decision


def _start(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    _applied(s, ident)
    if obs.spec_error:
        _fail(plan, s, obs, d, "InvalidSpec", obs.spec_error)
        return
    if plan.memory is not None:
        s["plan"] = plan.memory
    if plan.does_not_fit:
        # Refused before anything exists: the slice is never asked for.
        _fail(plan, s, obs, d, "DoesNotFit", plan.does_not_fit)
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
        if _expired(_provisioning_deadline(plan, s), obs):  # never ours: the bound still holds
            minutes = int(plan.provision_timeout.total_seconds() // 60)
            _fail(plan, s, obs, d, "ProvisioningTimeout", f"no RayCluster of its own after {minutes} min: {message}")
            return
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
        detail = "; ".join(filter(None, [hosts, cluster.routine_wait]))
        s["message"] = (f"waiting for RayCluster {name} to be ready" + (f": {detail}" if detail else ""))[: cond.MESSAGE_LIMIT]
        if detail:
            _set(s, obs, cond.CLUSTER_READY, False, "Waiting", s["message"])


def _refused(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """Creating the RayCluster failed: the API server refused it (a webhook, a quota, a
    policy), answered anything else (the KubeRay CRD missing: 404; a webhook failing: 500)
    or did not answer. Shown with its answer (code and message), asked again every step,
    and counted against the provisioning timeout: no failure to create waits for ever."""
    name = s["rayClusterName"]
    if _expired(_provisioning_deadline(plan, s), obs):
        minutes = int(plan.provision_timeout.total_seconds() // 60)
        _fail(plan, s, obs, d, "ProvisioningTimeout",
              f"RayCluster {name} could not be created in {minutes} min: {obs.create_refused}")
        return
    _note(s, d, obs, cond.CLUSTER_READY, "CreateRefused",
          f"creating RayCluster {name} failed: {obs.create_refused}", warn=True)
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


def _submit_timeout(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    """Submitting (the preflight, the submit) passed TPUFT_SUBMIT_TIMEOUT: a preflight that
    never ends (a hung all_reduce, a stuck host) must not hold the slice. Its job is stopped
    and the attempt ends; the next one runs on a new RayCluster."""
    seconds = int(plan.submit_timeout.total_seconds())
    preflight = s.get("preflight") or {}
    waiting_for = "the fine-tune job to be submitted"
    if preflight.get("attempt") == s.get("attempt") and preflight.get("phase") == "Running":
        waiting_for = f"preflight {preflight.get('jobId')} to end"
        preflight.update(phase="Failed", message=f"did not end within {seconds} s (TPUFT_SUBMIT_TIMEOUT)")
        if obs.preflight_job is not None and obs.preflight_job.status in JOB_ACTIVE:
            d.actions.append(StopJob(preflight["jobId"]))
    _rebuild_or_fail(ident, plan, s, obs, d, "SubmitTimeout",
                     f"still waiting for {waiting_for} after {seconds} s in Submitting (TPUFT_SUBMIT_TIMEOUT)")


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
        if not phaselmeval.begin(ident, plan, s, obs, d):  # else its export is evaluated first
            _succeed(plan, s, obs, d)
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
    if retries < plan.max_retries and reason not in NOT_RETRIED:
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


def _submitting_deadline(plan: Plan, s: dict) -> datetime | None:
    """When Submitting's bound ends, counted from the phase's start (None: no bound)."""
    since = cond.parse_time(s.get("phaseTransitionTime"))
    return since + plan.submit_timeout if since is not None and plan.submit_timeout is not None else None


def _active_deadline(plan: Plan, s: dict) -> datetime | None:
    """When spec.activeDeadlineSeconds ends, counted from startTime (None: no deadline, or
    its clock is stopped)."""
    started = cond.parse_time(s.get("startTime"))
    return started + plan.active_deadline if plan.active_deadline is not None and started is not None else None


def next_timer(plan: Plan, s: dict) -> datetime | None:
    """The earliest moment a run's decision can change with no change to anything watched:
    its provisioning or submitting timeout (counted from the phase's start) and
    spec.activeDeadlineSeconds. None when it has no timer."""
    phase = s.get("phase")
    timers = [_provisioning_deadline(plan, s) if phase == PROVISIONING else None,
              _submitting_deadline(plan, s) if phase == SUBMITTING else None,
              _active_deadline(plan, s) if phase and phase not in TERMINAL else None]
    return min((t for t in timers if t is not None), default=None)


def _terminal(plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    # Nothing expensive is left running: keep asking until the slice is released.
    if obs.cluster is not None and obs.cluster.exists and obs.cluster.owned:
        _release(plan, s, obs, d)


def _deleting(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """Release the slice; never wait on Ray. The head lives in the RayCluster and dies
    with it, and so does any job on it: stopping the job first is a courtesy (the trainer
    ends cleanly), not a condition. A finished run that holds nothing (its RayCluster
    released) has nothing to stop or release: it keeps the phase it ended with and no Event
    is posted, and the finalizer goes (a namespace being deleted has already lost the
    operator's RoleBinding, so an Event there would be refused)."""
    cluster_up = obs.cluster is not None and obs.cluster.exists and obs.cluster.owned
    cluster_unknown = bool(s.get("rayClusterName")) and obs.cluster is None
    if s.get("phase") in TERMINAL and not cluster_up and not cluster_unknown:
        return
    if s.get("phase") != DELETING:
        attempts.end(s, obs.now, "Stopped", "the TPUFineTune was deleted")
        _enter(s, d, DELETING, "Deleting", "stopping the job and releasing the RayCluster")
    if cluster_up and obs.job is not None and obs.job.status in JOB_ACTIVE and s.get("jobId"):
        d.actions.append(StopJob(phaselmeval.followed_job(s)))
    if s.get("rayClusterName") and (cluster_unknown or cluster_up):
        d.actions.append(DeleteCluster(s["rayClusterName"]))


def _create_cluster(ident: Identity, plan: Plan, s: dict, d: Decision) -> None:
    """The RayCluster is built from the current spec: that generation is now applied."""
    _applied(s, ident)
    if plan.cluster_hash:
        s["clusterHash"] = plan.cluster_hash
    d.actions.append(CreateCluster(s["rayClusterName"]))


STEPS = {
    PENDING: _pending,
    QUEUED: _queued,
    PROVISIONING: _provisioning,
    SUBMITTING: _submitting,
    RUNNING: _running,
}
