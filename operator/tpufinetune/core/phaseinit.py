"""A chained run's wait for its source (spec.model.initFrom; a part of phases.py's state machine).

The run stays Pending holding nothing (no identities reserved, no RayCluster, no attempt open,
so no usage and no deadline clock) while the source has not Succeeded; status.message and the
InitFromReady condition say what it waits for. Once the source has Succeeded, status.initFrom
is recorded, once: from then on every attempt trains from it (phases._start then plans and
reserves as for any run). A source that failed, or succeeded without what was asked for, ends
the run. Pure: no I/O.
"""
from __future__ import annotations

from tpufinetune.core import conditions as cond
from tpufinetune.core.initsource import outcome
from tpufinetune.core.phaseattempts import _fail
from tpufinetune.core.phasemodel import PENDING, Decision, Identity, Observations, Plan, RecordEvent, _applied, _enter, _set
from tpufinetune.core.api import INIT_FROM_SELF_MESSAGE


def waits_for_source(plan: Plan, s: dict) -> bool:
    """The run has a source to wait for and has not recorded it yet (only before its first
    RayCluster: a run that has one is past the wait)."""
    return plan.init_from is not None and not s.get("initFrom") and s.get("phase", "") in ("", PENDING)


def await_source(ident: Identity, plan: Plan, s: dict, obs: Observations, d: Decision) -> None:
    request = plan.init_from
    first = not s.get("phase")
    _applied(s, ident)
    if request.run == ident.name:  # admission refuses it (the object's CEL rule); an older CRD may not
        _fail(plan, s, obs, d, "InitFromInvalid", f"spec.model.initFrom.run: {INIT_FROM_SELF_MESSAGE}",
              attempt_as="NotStarted")
        return
    found = outcome(ident.namespace, request, obs.init_source)
    message = found.message[: cond.MESSAGE_LIMIT]
    previous = cond.find(s, cond.INIT_FROM_READY) or {}
    _set(s, obs, cond.INIT_FROM_READY, found.recorded is not None, found.reason, message)
    if found.failed:
        _fail(plan, s, obs, d, found.reason, message, attempt_as="NotStarted")
        return
    event = "InitFromResolved" if found.recorded is not None else "WaitingForSource"
    if found.recorded is not None:
        s["initFrom"] = found.recorded
        d.wake_at = obs.now  # the next step plans the source's model and reserves the slice's names at once
    if first:
        _enter(s, d, PENDING, event, message)
        return
    s["message"] = message
    if previous.get("reason") != found.reason:
        # One Event when what it waits on changes (the source's phase), not at each of its epochs.
        d.actions.append(RecordEvent("Normal", event, message))
