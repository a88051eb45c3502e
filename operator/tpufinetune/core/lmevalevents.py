"""The lm-eval job's events (docs/protocol.md: lmeval_start, lmeval_task, lmeval_result,
failure) folded into status.evaluation. Pure and idempotent: a task is keyed by its name, so a
log read again (a restarted operator) changes nothing. A value the status cannot hold (a
string where a number goes, a NaN) is left out rather than refused: one odd figure must not
hold back the others, nor the run's release."""
from __future__ import annotations

import math

from tpufinetune.core.lmevalstatus import LM_EVAL_METRIC_LIMIT, LM_EVAL_TASK_LIMIT

TEXT_LIMIT = 128


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value) -> str | None:
    return value[:TEXT_LIMIT] if isinstance(value, str) and value else None


def _metric(raw) -> dict | None:
    if not isinstance(raw, dict) or not _text(raw.get("metric")):
        return None
    stderr = _number(raw.get("stderr"))
    entry = {"metric": _text(raw["metric"]), "filter": _text(raw.get("filter")), "value": _number(raw.get("value")),
             "stderr": stderr if stderr is not None and stderr >= 0 else None}
    return {k: v for k, v in entry.items() if v is not None}


def _task(event: dict) -> dict | None:
    name = _text(event.get("task"))
    if name is None:
        return None
    metrics = [m for m in map(_metric, event.get("metrics") or [] if isinstance(event.get("metrics"), list) else [])
               if m is not None][:LM_EVAL_METRIC_LIMIT]
    entry = {"task": name, "metrics": metrics, "samples": _count(event.get("samples")),
             "numFewshot": _count(event.get("num_fewshot")), "version": _text(str(event["version"]))
             if event.get("version") is not None else None}
    return {k: v for k, v in entry.items() if v is not None}


def fold(evaluation: dict, event: dict) -> None:
    """Apply one event of the lm-eval job to status.evaluation (a dict, changed in place)."""
    kind = event.get("event")
    if kind == "lmeval_task":
        entry = _task(event)
        if entry is None:
            return
        tasks = [t for t in evaluation.get("tasks") or [] if t.get("task") != entry["task"]]
        known = [t.get("task") for t in evaluation.get("tasks") or []]
        if entry["task"] in known:  # the same task again keeps its place
            tasks.insert(known.index(entry["task"]), entry)
        elif len(tasks) < LM_EVAL_TASK_LIMIT:
            tasks.append(entry)
        evaluation["tasks"] = tasks
    elif kind == "lmeval_result":
        uri = event.get("results_uri")
        if isinstance(uri, str) and uri:
            evaluation["resultsURI"] = uri[:4096]
        seconds = _number(event.get("evaluate_s"))
        if seconds is not None and seconds >= 0:
            evaluation["seconds"] = round(seconds, 1)
    elif kind == "failure":  # the job's last event: its end decides with these words
        kind_of = str(event.get("type") or "EvaluationFailed")[:64]
        evaluation["reason"] = kind_of
        evaluation["message"] = f"{kind_of}: {str(event.get('message') or '')}"[:1024]


def summary(evaluation: dict, limit: int = 6) -> str:
    """`hellaswag acc_norm 0.4120, arc_easy acc 0.6010`: each task's first figure, for a message."""
    parts = []
    for task in (evaluation.get("tasks") or [])[:limit]:
        first = next((m for m in task.get("metrics") or [] if m.get("value") is not None), None)
        if first is not None:
            parts.append(f"{task['task']} {first['metric']} {first['value']:.4f}")
    more = len(evaluation.get("tasks") or []) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
