"""The checks around a job (a part of phases.py's state machine): spec.preflight, the
collectives check run on the attempt's cluster before its fine-tune, and a checkpoint asked
for when a node of the run's pods has maintenance scheduled. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime, timezone

from tpufinetune.core import conditions as cond
from tpufinetune.core.jobspec import checkpoint_request_id, preflight_id
from tpufinetune.core.phaseattempts import _fail
from tpufinetune.core.phasemodel import (
    JOB_ACTIVE, SUBMITTING, Decision, Identity, Observations, Plan, RecordEvent, RequestCheckpoint,
    SubmitPreflight, _enter, _first_and_last_line,
)


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
