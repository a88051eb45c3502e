"""The checks around a job (a part of phases.py's state machine): spec.preflight, the
collectives check run on the attempt's cluster before its fine-tune, and a checkpoint asked
for when a node of the run's pods has maintenance scheduled; the run's head not answering
(its unreachable clock, kept in condition RayReachable) and an edit the operator's checks
refuse (condition SpecValid); the memory plan made again from the model's own config.json
once the trainer has read it. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime, timezone

from tpufinetune.core import conditions as cond
from tpufinetune.core import memplan, memplan_spec
from tpufinetune.core.memplan_shapes import config_from_event
from tpufinetune.core.jobspec import checkpoint_request_id, preflight_id
from tpufinetune.core.phaseattempts import _fail
from tpufinetune.core.phasemodel import (
    JOB_ACTIVE, SUBMITTING, TERMINAL, Decision, Identity, Observations, Plan, RecordEvent, RequestCheckpoint,
    SubmitPreflight, _enter, _first_and_last_line, _set,
)
from tpufinetune.core.runevents import link_bandwidths, links_summary


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
            links = link_bandwidths(event)
            if links:
                figures["links"] = links
            figures["passed"] = bool(event.get("passed"))
        elif event.get("event") == "failure":
            failure = f"{event.get('type') or 'Error'}: {event.get('message') or ''}"
    passed = figures.pop("passed", False) and not failure
    bandwidth = figures.get("busBandwidthGBps")
    shown = (f"all_reduce bus bandwidth {bandwidth} GB/s{links_summary(figures.get('links'))}"
             if bandwidth is not None else "no bandwidth measured")
    where = f" on {figures['ranks']} ranks, {figures.get('hosts')} hosts" if figures.get("ranks") else ""
    figures["message"] = (f"passed: {shown}{where}" if passed else (failure or f"failed: {shown}{where}"))[:1024]
    return figures


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


def _ray_down(s: dict, obs: Observations, d: Decision) -> None:
    """The head does not answer, or its token cannot be derived: nothing is decided without
    Ray until it does or TPUFT_RAY_UNREACHABLE_TIMEOUT ends the attempt. Said in the status
    (condition RayReachable, False since the head stopped answering: the clock a restarted
    operator goes on from) and in one Warning Event per new reason."""
    message = obs.ray_down[: cond.MESSAGE_LIMIT]
    _set(s, obs, cond.RAY_REACHABLE, False, "NotAnswering", message)
    if s.get("message") != message:
        s["message"] = message
        d.actions.append(RecordEvent("Warning", "RayUnreachable", message))


def _ray_clock(old: dict, s: dict, obs: Observations) -> None:
    """RayReachable holds the unreachable clock of one phase and attempt: an answer stops
    it (True), a new phase or attempt drops it (its head is asked afresh there)."""
    if cond.find(s, cond.RAY_REACHABLE) is None:
        return
    if (s.get("phase"), s.get("attempt")) != (old.get("phase"), old.get("attempt")):
        cond.remove(s, cond.RAY_REACHABLE)
    elif obs.ray_answered and not obs.ray_down and not cond.is_true(s, cond.RAY_REACHABLE):
        _set(s, obs, cond.RAY_REACHABLE, True, "Answering", "the Ray head answers again")


def _spec_validity(ident: Identity, s: dict, obs: Observations, d: Decision) -> None:
    """An edit the operator's checks refuse (admission let it in) is shown by condition
    SpecValid, False naming the field, and one Warning Event per new refusal; the applied
    generation's plan stays in force (plan_in_force). True again once the spec is valid."""
    if obs.spec_error:
        applied = s.get("observedGeneration")
        kept = (f"generation {applied}'s plan (watchdog, deadline, TTL, retries) stays in force"
                if applied and applied != ident.generation else "the run cannot go on with it")
        message = (f"generation {ident.generation} is refused: {obs.spec_error}; {kept}; "
                   "fix the field or revert the edit")[: cond.MESSAGE_LIMIT]
        previous = cond.find(s, cond.SPEC_VALID) or {}
        _set(s, obs, cond.SPEC_VALID, False, "InvalidSpec", message)
        # A run that ended on it already has its Failed Event (InvalidSpec), the last one
        # of the step: the outcome metric takes its reason from it.
        if previous.get("message") != message and s.get("phase") not in TERMINAL:
            d.actions.append(RecordEvent("Warning", "SpecRefused", message))
    elif cond.find(s, cond.SPEC_VALID) is not None and not cond.is_true(s, cond.SPEC_VALID):
        _set(s, obs, cond.SPEC_VALID, True, "Valid", f"generation {ident.generation} passes the operator's checks")


def ray_down_since(s: dict) -> datetime | None:
    """Since when the head has not answered in this phase and attempt, as the status
    records it (None: it answered, or nothing is recorded)."""
    found = cond.find(s, cond.RAY_REACHABLE)
    if found is None or found.get("status") != "False":
        return None
    since = cond.parse_time(found.get("lastTransitionTime"))
    entered = cond.parse_time(s.get("phaseTransitionTime"))
    return since if since is not None and (entered is None or since >= entered) else None


def plan_from_config(plan: Plan, s: dict, event: dict, d: Decision) -> str:
    """The trainer read the model's config.json (its `model` event, before any weight is
    loaded): status.plan is planned again from its widths, which win over the table's.
    Returns why the run cannot fit ('' when it can, or nothing was planned)."""
    config = config_from_event(event.get("config"))
    if plan.memory_request is None or config is None:
        return ""
    memory = memplan_spec.with_model_config(plan.memory_request, config)
    planned = memplan_spec.status_of(memory)
    if s.get("plan") == planned:
        return ""  # the same event read again (a restart re-reads the log)
    s["plan"] = planned
    d.actions.append(RecordEvent("Normal", "PlannedFromModelConfig", memory.summary()[: cond.MESSAGE_LIMIT]))
    if not memplan.refuses(memory):
        return ""
    return f"{memory.refusal()} (planned from the model's config.json, which the trainer read)"
