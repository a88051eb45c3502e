"""status.attempts and status.usage: one entry per attempt, why it ended and what it cost.
Pure: the transition calls these with the time it was given.

An attempt begins when the run starts waiting for a slice (or, on a retry that keeps the
cluster, when it takes the slice over) and ends when the transition decides its outcome.
Its usage counts from the slice being ready for it to the slice's release (or its hand-over
to the next attempt); `provisioningSeconds` from its start to the slice being ready. Every
figure is derived from the entry's own times, so deciding a step twice changes nothing.
The totals in status.usage grow by what the entries grew: an entry folded out of the list
(only the last LIMIT are kept) stays counted.
"""

from __future__ import annotations

from datetime import datetime

from tpufinetune.core import conditions as cond
from tpufinetune.core import startup
from tpufinetune.core.jobspec import logs_uri
from tpufinetune.core.runevents import is_step
from tpufinetune.core.status import ATTEMPT_REASONS

LIMIT = 20
MESSAGE_LIMIT = 2048
USAGE_KEYS = ("chipHours", "hostHours", "provisioningSeconds")

# The Failed condition's reason -> the attempt's, for the ends that need no look at the pods.
FAILED_REASONS = {
    "InvalidSpec": "NotStarted",
    "DoesNotFit": "NotStarted",
    "ProvisioningTimeout": "NotStarted",
    "SubmitTimeout": "NotStarted",
    "DeadlineExceeded": "DeadlineExceeded",
    "NoProgress": "NoProgress",
    "RayUnreachable": "ClusterLost",
    "ClusterLost": "ClusterLost",
    "PreflightFailed": "PreflightFailed",
}
# How a job that ended unsuccessfully is counted when its slice shows no disruption.
JOB_END_REASONS = {"JobLost": "ClusterLost", "JobStopped": "Stopped"}  # else AppFailed


def entries(s: dict) -> list[dict]:
    return s.setdefault("attempts", [])


def current(s: dict) -> dict | None:
    """The entry of status.attempt while it has not ended."""
    found = s.get("attempts") or []
    if found and found[-1].get("attempt") == s.get("attempt") and "endTime" not in found[-1]:
        return found[-1]
    return None


def last_ended(s: dict) -> dict | None:
    found = [e for e in s.get("attempts") or [] if "endTime" in e]
    return found[-1] if found else None


def begin(s: dict, now: datetime, took_over: dict | None = None, logs_root: str = "") -> dict:
    """Open the entry of status.attempt (once). `took_over`: the ended attempt whose ready
    slice this one keeps (a retry on the same RayCluster): ready from its start.
    `logs_root`: the run's logs directory (`jobspec.run_logs_root`), '' when it keeps none."""
    entry = current(s)
    if entry is not None:
        link_logs(entry, logs_root)
        return entry
    entry = {"attempt": int(s.get("attempt") or 1), "startTime": cond.timestamp(now)}
    link_logs(entry, logs_root)
    if took_over is not None and took_over.get("sliceReadyTime"):
        entry["sliceReadyTime"] = entry["startTime"]
        if took_over.get("rayClusterUID"):
            entry["rayClusterUID"] = took_over["rayClusterUID"]
    found = entries(s)
    found.append(entry)
    del found[:-LIMIT]
    return entry


def link_logs(entry: dict, logs_root: str) -> None:
    """The attempt's logsURI (once: a spec edit later does not move logs already written)."""
    if logs_root and "logsURI" not in entry:
        entry["logsURI"] = logs_uri(logs_root, int(entry["attempt"]))


def slice_ready(s: dict, now: datetime, cluster_uid: str, hosts_ready: datetime | None = None) -> None:
    """The slice is ready: from when its last host was Ready (the pods say), else now."""
    entry = current(s)
    if entry is not None and "sliceReadyTime" not in entry:
        start = cond.parse_time(entry["startTime"])
        ready = hosts_ready if hosts_ready is not None and start <= hosts_ready <= now else now
        entry["sliceReadyTime"] = cond.timestamp(ready)
        if cluster_uid:
            entry["rayClusterUID"] = cluster_uid


def end(s: dict, now: datetime, reason: str, message: str, keep_slice: bool = False) -> dict | None:
    """End the current attempt. Its slice is handed over (`keep_slice`: the next attempt
    runs on the same RayCluster) or stays held until `release`."""
    assert reason in ATTEMPT_REASONS, reason
    entry = current(s)
    if entry is None:
        return None
    entry.update(endTime=cond.timestamp(now), reason=reason)
    if message:
        entry["message"] = bounded(message)
    if keep_slice and entry.get("sliceReadyTime"):
        entry["sliceReleaseTime"] = cond.timestamp(now)
    _lost_steps(s, entry, succeeded=reason == "Succeeded")
    return entry


def release(s: dict, now: datetime) -> None:
    """The slice is released (deleted, lost, or taken back by Kueue): it costs no more."""
    for entry in s.get("attempts") or []:
        if entry.get("sliceReadyTime") and not entry.get("sliceReleaseTime"):
            entry["sliceReleaseTime"] = cond.timestamp(now)


def resumed_from(s: dict, uri: str) -> None:
    """The current attempt's job is submitted from `uri`: the previous attempt's lost
    steps are those after that checkpoint."""
    entry = current(s)
    if entry is not None and uri:
        entry["resumedFrom"] = uri[:2048]
    previous = last_ended(s)
    if previous is not None and previous.get("reason") != "Succeeded":
        _lost_steps(s, previous)


def note_steps(s: dict, events, running: bool) -> None:
    """The highest optimizer step the trainer reported, on the attempt whose job sent it:
    the running one, or (the last lines of a stopped job, read after its end) the last
    one that ended. The running attempt's start-up times (its trainer's `startup`:
    startup.fold). And the step the running attempt restored (its first `plan`): the
    previous attempt's lost steps are counted from it, the trainer's own word, since the
    checkpoint it restored (the run directory's newest complete one) can be newer than the
    last one the previous job reported (a save on notice, or one that landed after its
    driver died)."""
    steps = [e.get("step") for e in events if is_step(e.get("step"))
             and e.get("event") in ("progress", "epoch", "checkpoint", "notice")]
    restored = next((e for e in events if e.get("event") == "plan"), None)
    entry = current(s) if running else last_ended(s)
    if entry is None:
        return
    if running:  # an ended job's late lines tell nothing of how the running attempt started
        startup.fold(entry, s, events)
    if restored is not None and running and "resumedStep" not in entry:
        # The first plan of the attempt: a worker group restarted inside the job (the
        # trainer's --max-failures) plans again from a later step, which is its own loss.
        entry["resumedStep"] = restored["resumed_step"] if is_step(restored.get("resumed_step")) else 0
        if isinstance(restored.get("resumed_from"), str) and restored["resumed_from"]:
            entry["resumedFrom"] = restored["resumed_from"][:2048]
        previous = last_ended(s)
        if previous is not None and previous.get("reason") != "Succeeded":
            _lost_steps(s, previous)
    if not steps:
        return
    entry["lastStep"] = max(steps + [int(entry.get("lastStep") or 0)])
    if "endTime" in entry and entry.get("reason") != "Succeeded":
        _lost_steps(s, entry)


def _lost_steps(s: dict, entry: dict, succeeded: bool = False) -> None:
    """The steps done in `entry` after the checkpoint the next attempt resumes from: the
    step that attempt restored once its trainer said so, until then the step of the last
    checkpoint reported."""
    if succeeded:
        entry["lostSteps"] = 0
        return
    if entry.get("lastStep") is None:
        return
    found = entries(s)
    later = found[found.index(entry) + 1:] if entry in found else []
    restored = next((e["resumedStep"] for e in later if is_step(e.get("resumedStep"))), None)
    base = restored if restored is not None else int(s.get("checkpointStep") or 0)
    entry["lostSteps"] = max(0, int(entry["lastStep"]) - base)


def bounded(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """The first and the last part of a long message: the reason comes first, the log's
    last lines last."""
    if len(message) <= limit:
        return message
    head = limit // 4
    return f"{message[:head]} ... {message[-(limit - head - 5):]}"


# ---- usage --------------------------------------------------------------------------------


def entry_usage(entry: dict, now: datetime, chips: int, hosts: int) -> dict:
    start = cond.parse_time(entry["startTime"])
    ready = cond.parse_time(entry.get("sliceReadyTime"))
    ended = cond.parse_time(entry.get("endTime"))
    waited_until = ready or ended or now
    usage = {"chipHours": 0.0, "hostHours": 0.0,
             "provisioningSeconds": round(max(0.0, (waited_until - start).total_seconds()), 3)}
    if ready is not None:
        held = max(0.0, ((cond.parse_time(entry.get("sliceReleaseTime")) or now) - ready).total_seconds())
        usage.update(chipHours=round(chips * held / 3600, 6), hostHours=round(hosts * held / 3600, 6))
    return usage


def frozen(entry: dict) -> bool:
    """Its usage can no longer change: it ended and holds no slice."""
    return "endTime" in entry and (not entry.get("sliceReadyTime") or bool(entry.get("sliceReleaseTime")))


def account(previous: dict, s: dict, now: datetime, chips: int, hosts: int) -> None:
    """Bring every entry that still counts up to `now`, and add what they grew by to
    status.usage."""
    before = {e.get("attempt"): e.get("usage") or {} for e in previous.get("attempts") or []}
    settled = {e.get("attempt") for e in previous.get("attempts") or [] if frozen(e) and "usage" in e}
    total = dict(s.get("usage") or {key: 0.0 for key in USAGE_KEYS})
    for entry in s.get("attempts") or []:
        if entry["attempt"] in settled and "usage" in entry:
            continue
        entry["usage"] = entry_usage(entry, now, chips, hosts)
        old = before.get(entry["attempt"], {})
        for key in USAGE_KEYS:
            total[key] = round(float(total.get(key) or 0.0) + entry["usage"][key] - float(old.get(key) or 0.0), 6)
    if s.get("attempts"):
        s["usage"] = {key: max(0.0, float(total.get(key) or 0.0)) for key in USAGE_KEYS}


def newly_frozen(previous: dict, s: dict) -> list[dict]:
    """Entries whose usage became final in this step (for the chip-seconds counter)."""
    was = {e.get("attempt") for e in previous.get("attempts") or [] if frozen(e)}
    return [e for e in s.get("attempts") or [] if frozen(e) and e.get("attempt") not in was]


def shape(s: dict) -> list[dict]:
    """The entries without their usage: what, other than time, changed."""
    return [{k: v for k, v in e.items() if k != "usage"} for e in s.get("attempts") or []]
