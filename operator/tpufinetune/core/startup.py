"""status.attempts[].startup: an attempt's time before its first optimizer step. Pure.

The operator's own figures (its RayCluster ready, its job submitted) count from the
attempt's start on the operator's clock; the trainer's `startup` event (docs/protocol.md),
sent once after its first step, carries its stages since the job's driver started, that
start on the driver's clock, and what the start did not have to do again (a retry starts
warm: its data from the run's storage, its compiled graphs from the compile cache). The
driver's start is kept between the submission and the moment the event was read, so a
skewed clock cannot put it outside what the operator saw.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from tpufinetune.core import conditions as cond
from tpufinetune.core.startupstatus import DATA_SOURCES

# The event's `<stage>_s` -> startup.trainer's field.
TRAINER_STAGES = {"data_ready_s": "dataReadySeconds", "workers_ready_s": "workersReadySeconds",
                  "model_loaded_s": "modelLoadedSeconds", "first_step_compiled_s": "firstStepCompiledSeconds",
                  "first_step_s": "firstStepSeconds"}
# The event's `data_source` (the trainer's words) -> startup.trainer.dataSource; a value
# this operator does not know (a newer trainer's) is left out.
DATA_SOURCE_NAMES = dict(zip(("tokenized", "local_cache", "published"), DATA_SOURCES))
# The event's durations (seconds, not a stage since the driver's start) -> startup.trainer's field.
TRAINER_DURATIONS = {"resumed_epoch_end_s": "resumedEpochEndSeconds"}
# The event's counts of what the start did (again) -> startup.trainer's field.
TRAINER_COUNTS = {"tokenized_examples": "tokenizedExamples", "compile_cache_hits": "compileCacheHits",
                  "compile_cache_misses": "compileCacheMisses"}


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _trainer(event: dict) -> dict:
    """startup.trainer from the event: its stages, and what the start did not do again."""
    found = {name: round(_number(event.get(key)), 3) for key, name in {**TRAINER_STAGES, **TRAINER_DURATIONS}.items()
             if _number(event.get(key)) is not None}
    source = event.get("data_source")
    if isinstance(source, str) and source in DATA_SOURCE_NAMES:
        found["dataSource"] = DATA_SOURCE_NAMES[source]
    found.update({name: _count(event.get(key)) for key, name in TRAINER_COUNTS.items()
                  if _count(event.get(key)) is not None})
    return found


def _when(epoch_seconds) -> datetime | None:
    """A time in seconds since the epoch; None for anything else (a year past 9999 too)."""
    seconds = _number(epoch_seconds)
    try:
        return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, ValueError, OSError):
        return None


def _since(start: datetime, when: datetime | None) -> float | None:
    return None if when is None else round(max(0.0, (when - start).total_seconds()), 1)


def fold(entry: dict, status: dict, events) -> None:
    """The running attempt `entry`'s startup from its first `startup` event among `events`
    (a worker group Ray Train restarts inside the job reports again: the attempt's first
    counts). `status` is the run's as this step saw it: its phase is Running, entered when
    the job was submitted (phaseTransitionTime), and lastEventTime is when `events` were read."""
    event = next((e for e in events if e.get("event") == "startup"), None)
    if event is None or "startup" in entry:
        return
    start = cond.parse_time(entry["startTime"])
    seen = _since(start, cond.parse_time(status.get("lastEventTime")))
    times = {"clusterReadySeconds": _since(start, cond.parse_time(entry.get("sliceReadyTime"))),
             "jobSubmittedSeconds": _since(start, cond.parse_time(status.get("phaseTransitionTime")))}
    trainer = _trainer(event)
    started = _when(event.get("started_at"))
    if started is not None and seen is not None:
        driver = _since(start, started)
        driver = min(max(driver, times["jobSubmittedSeconds"] or 0.0), seen)
        times["driverStartedSeconds"] = driver
        if "firstStepSeconds" in trainer:
            times["firstStepSeconds"] = round(min(max(driver + trainer["firstStepSeconds"], driver), seen), 1)
    elif seen is not None:  # no mark to count from: when the operator read it
        times["firstStepSeconds"] = seen
    if trainer:
        times["trainer"] = trainer
    entry["startup"] = {k: v for k, v in times.items() if v is not None}


# How each data source reads in a line (summary).
DATA_SOURCE_WORDS = {"Tokenized": "tokenized", "LocalCache": "from the host's cache",
                     "RunStorage": "from the run's storage"}


def summary(entry: dict) -> str:
    """An attempt's startup in one line ('' before its first step): its time to first step from
    its start and from its job's submission, and whether it started warm."""
    times = entry.get("startup") or {}
    first = times.get("firstStepSeconds")
    if first is None:
        return ""
    words = [f"attempt {entry.get('attempt')}: first step {first:g} s after its start"]
    if times.get("jobSubmittedSeconds") is not None:
        words[0] += f" ({max(0.0, first - times['jobSubmittedSeconds']):.1f} s after its job was submitted)"
    trainer = times.get("trainer") or {}
    if trainer.get("dataSource"):
        data = f"data {DATA_SOURCE_WORDS.get(trainer['dataSource'], trainer['dataSource'])}"
        if trainer.get("tokenizedExamples") is not None:
            data += f" ({trainer['tokenizedExamples']} examples tokenized)"
        words.append(data)
    if trainer.get("compileCacheHits") is not None or trainer.get("compileCacheMisses") is not None:
        words.append(f"compile cache {trainer.get('compileCacheHits', 0)} hits, "
                     f"{trainer.get('compileCacheMisses', 0)} misses")
    if trainer.get("resumedEpochEndSeconds") is not None:
        words.append(f"{trainer['resumedEpochEndSeconds']:g} s of them the resumed epoch's end (evaluation)")
    return "; ".join(words)


ATTEMPT_KINDS = ("first", "retry")


def first_steps(before: dict | None, after: dict | None) -> list[tuple[str, float]]:
    """A step from status `before` to `after`: (attempt kind, seconds to its first step) of
    each attempt whose first step it folded (the time-to-first-step histogram observes each
    once). Attempt 1 is `first`, any later one `retry`."""
    had = {e.get("attempt") for e in (before or {}).get("attempts") or []
           if "firstStepSeconds" in (e.get("startup") or {})}
    found = []
    for entry in (after or {}).get("attempts") or []:
        seconds = (entry.get("startup") or {}).get("firstStepSeconds")
        if seconds is not None and entry.get("attempt") not in had:
            found.append((ATTEMPT_KINDS[0] if entry.get("attempt") == 1 else ATTEMPT_KINDS[1], float(seconds)))
    return found
