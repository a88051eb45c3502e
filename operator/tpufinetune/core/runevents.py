"""Fold the trainer's machine events (docs/protocol.md) into the resource status. Pure.

Applying the same event twice gives the same status (history is keyed by epoch), so
re-reading a log after an operator restart cannot double-count anything.
"""

from __future__ import annotations

import copy
import json

from tpufinetune.core.evalstatus import (GENERATION_SAMPLE_LIMIT, GENERATION_TEXT_LIMIT, IMAGE_PATH_LIMIT,
                                         PROMPT_IMAGE_LIMIT)
from tpufinetune.core.status import CURVE_LIMIT, EXPORT_SAMPLE_LIMIT, EXPORT_TEXT_LIMIT, checked_status

HISTORY_LIMIT = 20  # enough for `kubectl get -o yaml`; the full record is in the job log


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def _history_entry(status: dict, epoch: int) -> dict:
    history = status.setdefault("history", [])
    for entry in history:
        if entry.get("epoch") == epoch:
            return entry
    entry = {"epoch": epoch}
    history.append(entry)
    history.sort(key=lambda e: e["epoch"])
    del history[:-HISTORY_LIMIT]
    return entry


def _on_start(status: dict, event: dict) -> None:
    devices = event.get("world_size")
    backend = event.get("backend", "")
    status["message"] = f"{event.get('mode', 'run')} started on {devices} workers ({backend})"


def _on_epoch(status: dict, event: dict) -> None:
    epoch = int(event["epoch"])
    epochs = int(event.get("epochs") or status.get("epochs") or epoch)
    metrics = {
        "step": event.get("step") if is_step(event.get("step")) else None,
        "loss": _round(event.get("loss"), 4),
        "evalLoss": _round(event.get("eval_loss"), 4),
        "tokensPerSecond": _round(event.get("tokens_per_s"), 1),
        "epochTimeSeconds": _round(event.get("epoch_time_s"), 2),
    }
    metrics = {k: v for k, v in metrics.items() if v is not None}
    entry = _history_entry(status, epoch)
    entry.update(metrics)
    preference = _preference(event)
    if preference:
        entry["dpo"] = preference
    generated = _generation(event)
    if generated:  # merged: a replayed epoch (after a restore) carries no samplesURI
        entry["eval"] = {**entry.get("eval", {}), **generated}
    if epoch >= int(status.get("epoch") or 0):
        status.update({k: v for k, v in metrics.items() if k != "step"}, epoch=epoch, epochs=epochs, epochProgress=f"{epoch}/{epochs}")
        loss = f"loss={metrics['loss']}" if "loss" in metrics else ""
        status["message"] = f"epoch {epoch}/{epochs} done {loss}".strip()


# Method dpo's epoch figures (docs/protocol.md, `epoch`): the event's key -> history[].dpo's.
PREFERENCE_KEYS = {"rewards_chosen": "rewardsChosen", "rewards_rejected": "rewardsRejected", "margin": "margin",
                   "accuracy": "accuracy"}
PREFERENCE_KEYS.update({f"eval_{key}": "eval" + name[0].upper() + name[1:] for key, name in PREFERENCE_KEYS.items()})


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(event: dict, keys: dict[str, str]) -> dict:
    """The numbers `event` carries under `keys`' names, renamed to their values, 4 decimals."""
    return {name: _round(event[key], 4) for key, name in keys.items() if _is_number(event.get(key))}


def _preference(event: dict) -> dict:
    """history[].dpo of an epoch event: the numbers it carries (none for SFT)."""
    return _numbers(event, PREFERENCE_KEYS)


# Generation metrics of an epoch (docs/protocol.md, `epoch`): the event's key -> history[].eval's.
GENERATION_KEYS = {"eval_exact_match": "exactMatch", "eval_rouge_l": "rougeL", "eval_bleu": "bleu"}


def _generation(event: dict) -> dict:
    """history[].eval of an epoch event: its generation metrics, the answers scored and where
    they are (none without training.evaluation.generate)."""
    found = _numbers(event, GENERATION_KEYS)
    if not found:
        return {}
    if is_step(event.get("eval_generated")):  # a count, as a step is
        found["examples"] = event["eval_generated"]
    if isinstance(event.get("eval_samples_uri"), str):
        found["samplesURI"] = event["eval_samples_uri"]
    samples = [_generation_sample(s) for s in event.get("eval_samples") or [] if isinstance(s, dict)]
    if samples:
        found["samples"] = samples[:GENERATION_SAMPLE_LIMIT]
    return found


def _generation_sample(sample: dict) -> dict:
    """history[].eval.samples[]: an answer and its reference, each its start, and a multimodal
    run's images (which images the prompt was asked with), each its end."""
    kept = {k: str(sample[k])[:GENERATION_TEXT_LIMIT] for k in ("output", "reference") if sample.get(k) is not None}
    kept.setdefault("output", "")
    if isinstance(sample.get("images"), list):
        kept["images"] = _image_ends(sample["images"])
    return kept


def _image_ends(images: list) -> list[str]:
    """A multimodal prompt's images as status shows them: its first ones, each its end."""
    return [str(image)[-IMAGE_PATH_LIMIT:] for image in images[:PROMPT_IMAGE_LIMIT]]


def _on_checkpoint(status: dict, event: dict) -> None:
    uri = event.get("uri")
    if not uri:
        return
    status["checkpointURI"] = uri
    _checkpoint_step(status, event.get("step"))
    # A step checkpoint inside an epoch is not that epoch's checkpoint.
    if event.get("epoch") is not None and event.get("epoch_end", True):
        _history_entry(status, int(event["epoch"]))["checkpointURI"] = uri


def is_step(step) -> bool:
    """A step count an event can carry (JSON: an int, not a bool, not negative)."""
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _checkpoint_step(status: dict, step) -> None:
    """The step of checkpointURI (a new checkpoint without one has none known)."""
    if is_step(step):
        status["checkpointStep"] = step
    else:
        status.pop("checkpointStep", None)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def _on_progress(status: dict, event: dict) -> None:
    """Movement inside an epoch; the estimate of the time left is steps left x the mean
    step time of the trainer's last window (checkpoints and evaluation come on top)."""
    step, total = event.get("step"), event.get("total_steps")
    if not isinstance(step, int) or not isinstance(total, int) or total <= 0:
        return
    progress = {"step": step, "totalSteps": total, "percent": round(100.0 * min(step, total) / total, 1)}
    for key, field, digits in (("epoch_step", "epochStep", None), ("epoch_steps", "epochSteps", None),
                               ("loss", "loss", 4), ("lr", "learningRate", 10),
                               ("tokens_per_s", "tokensPerSecond", 1), ("step_time_s", "stepTimeSeconds", 4),
                               ("grad_norm", "gradNorm", 4)):
        value = event.get(key)
        if _is_number(value):
            progress[field] = int(value) if digits is None else round(float(value), digits)
    summary = f"{progress['percent']:g}% {step}/{total}"
    step_time = progress.get("stepTimeSeconds")
    if step_time is not None:
        progress["etaSeconds"] = int(round(max(total - step, 0) * step_time))
        summary += f" ETA {_duration(progress['etaSeconds'])}"
    progress["summary"] = summary
    status["progress"] = progress
    point = {"step": step, "loss": progress.get("loss"), "learningRate": progress.get("learningRate"),
             "tokensPerSecond": progress.get("tokensPerSecond"),
             "trainingSeconds": _round(event.get("training_s"), 1)}
    status["curve"] = add_curve_point(status.get("curve") or [], {k: v for k, v in point.items() if v is not None})
    if event.get("epoch") is not None and event.get("epochs"):
        status["message"] = f"epoch {event['epoch']}/{event['epochs']}: step {step}/{total}" + (
            f" loss={progress['loss']}" if "loss" in progress else "")


def add_curve_point(curve: list[dict], point: dict, limit: int = CURVE_LIMIT) -> list[dict]:
    """`curve` with `point` added; steps stay strictly increasing. A point at or before
    the last one's step (a resumed attempt repeating the steps after its checkpoint, or the
    same event read twice) replaces the points from its step on, so the curve shows the
    attempt that counts and never zig-zags. Past `limit`, every other point is dropped,
    keeping the first and the newest: deterministic, and the shape of a long run stays."""
    if limit < 2:
        raise ValueError(f"a curve keeps at least its first and newest points, not {limit}")
    curve = [p for p in curve if p["step"] < point["step"]] + [point]
    while len(curve) > limit:
        curve = curve[:-1:2] + curve[-1:]
    return curve


def _on_plan(status: dict, event: dict) -> None:
    if isinstance(event.get("tensorboard_uri"), str) and event["tensorboard_uri"]:
        status["tensorboardURI"] = event["tensorboard_uri"]
    total = event.get("total_steps")
    if isinstance(total, int) and total > 0 and not status.get("progress"):
        status["progress"] = {"step": 0, "totalSteps": total, "percent": 0.0, "summary": f"0% 0/{total}"}


def _on_result(status: dict, event: dict) -> None:
    progress = status.get("progress")
    if isinstance(progress, dict) and progress.get("totalSteps"):
        total = progress["totalSteps"]
        progress.update(step=total, percent=100.0, etaSeconds=0, summary=f"100% {total}/{total}")
    if event.get("best_checkpoint_uri"):
        status["checkpointURI"] = event["best_checkpoint_uri"]
        _checkpoint_step(status, event.get("best_step"))
    if event.get("exported_model_uri"):
        status["exportedModelURI"] = event["exported_model_uri"]
    if event.get("exported_adapter_uri"):
        status["exportedAdapterURI"] = event["exported_adapter_uri"]


def _on_export_proof(status: dict, event: dict) -> None:
    sample = []
    for entry in event.get("sample") or []:
        texts = {"prompt": entry.get("prompt"), "completion": entry.get("completion"),
                 "adapterCompletion": entry.get("adapter_completion")}
        kept = {k: str(v)[:EXPORT_TEXT_LIMIT] for k, v in texts.items() if v is not None}
        if isinstance(entry.get("images"), list):  # a multimodal run's: which images the prompt was asked with
            kept["images"] = _image_ends(entry["images"])
        sample.append(kept)
    proof = {"sample": sample[:EXPORT_SAMPLE_LIMIT], "tokens": event.get("tokens"),
             "loadSeconds": _round(event.get("load_s"), 3), "dtype": event.get("dtype")}
    status["export"] = {k: v for k, v in proof.items() if v is not None}


def _on_failure(status: dict, event: dict) -> None:
    status["trainerFailure"] = {
        "type": str(event.get("type") or "Error")[:128],
        "message": str(event.get("message") or "")[:1024],
    }


LINK_CLASSES = ("ici", "dcn")


def link_bandwidths(event: dict) -> dict | None:
    """`links` of status.collectives and status.preflight from a collectives event's
    (None when it has none: an older trainer, or no bandwidth measured)."""
    links = event.get("links")
    if not isinstance(links, dict):
        return None
    out = {}
    for link in LINK_CLASSES:
        figure = links.get(link)
        if isinstance(figure, dict):
            entry = {"busBandwidthGBps": _round(figure.get("bus_bandwidth_gbps"), 3),
                     "groups": figure.get("groups"), "ranksPerGroup": figure.get("ranks_per_group")}
            out[link] = {k: v for k, v in entry.items() if v is not None}
    return out or None


def links_summary(links: dict | None) -> str:
    """'; within a slice (ICI) x GB/s, across slices (DCN) y GB/s' with several slices, else ''."""
    if not links or "dcn" not in links:
        return ""
    ici, dcn = links.get("ici", {}), links["dcn"]
    return (f"; within a slice (ICI) {ici.get('busBandwidthGBps')} GB/s, across slices (DCN) "
            f"{dcn.get('busBandwidthGBps')} GB/s")


def _on_collectives(status: dict, event: dict) -> None:
    passed = bool(event.get("passed"))
    world = event.get("world_size")
    links = link_bandwidths(event)
    if passed:
        message = (f"all_reduce sum {event.get('all_reduce_sum')} and tensor-parallel parity OK on {world} ranks"
                   f"{links_summary(links)}")
    else:
        message = f"ranks {event.get('failed_ranks')} disagree (expected sum {event.get('expected_sum')})"
    status["collectives"] = {"passed": passed, "ranks": world, "message": message}
    if links:
        status["collectives"]["links"] = links


def _on_notice(status: dict, event: dict) -> None:
    notice = {"reason": event.get("reason"), "requestedBy": event.get("requested_by"),
              "detail": event.get("detail"), "step": event.get("step"), "checkpointURI": event.get("uri"),
              "saveSeconds": _round(event.get("save_s"), 3)}
    status["notice"] = {k: v for k, v in notice.items() if v is not None}
    if event.get("uri"):
        # The checkpoint event before it may have been lost with rank 0's pod: the next
        # attempt resumes from this one.
        status["checkpointURI"] = event["uri"]
        _checkpoint_step(status, event.get("step"))


def _on_early_stop(status: dict, event: dict) -> None:
    stop = {"reason": event.get("reason"), "step": event.get("step"), "evalLoss": _round(event.get("eval_loss"), 4),
            "checkpointURI": event.get("uri")}
    status["earlyStop"] = {k: v for k, v in stop.items() if v is not None}
    if event.get("reason") == "TargetEvalLoss" and event.get("training_s") is not None:
        status["timeToTarget"] = _round(event["training_s"], 1)


HANDLERS = {
    "notice": _on_notice,
    "early_stop": _on_early_stop,
    "start": _on_start,
    "plan": _on_plan,
    "progress": _on_progress,
    "epoch": _on_epoch,
    "checkpoint": _on_checkpoint,
    "result": _on_result,
    "failure": _on_failure,
    "export_proof": _on_export_proof,
    "collectives": _on_collectives,
}


def apply_event(status: dict, event: dict) -> None:
    """Fold one event into status in place; unknown event kinds are ignored so an older
    operator keeps working with a newer trainer."""
    handler = HANDLERS.get(event.get("event", ""))
    if handler is not None:
        handler(status, event)


def split_malformed(status: dict, events: list[dict]) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(the events that fold into a status the API server takes, [(event, why)] for the
    others): a wrong type, a value the status model refuses or a NaN, kept, would fail
    every later step and hold back every later event. Each is tried on top of the events
    kept before it. A status that is refused already is no judge: every event is kept."""
    if _refused(status):
        return list(events), []
    kept, dropped, current = [], [], status
    for event in events:
        trial = copy.deepcopy(current)
        try:
            apply_event(trial, event)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            dropped.append((event, f"{type(error).__name__}: {error}"))
            continue
        why = _refused(trial)
        if why:
            dropped.append((event, why))
            continue
        kept.append(event)
        current = trial
    return kept, dropped


def _refused(status: dict) -> str:
    """Why the API server (or the status model before it) would refuse `status`; ''."""
    try:
        checked_status(status)
        json.dumps(status, allow_nan=False)
    except ValueError as error:  # pydantic's ValidationError and UndeclaredStatusKey are ValueErrors
        return " ".join(str(error).split())[:300] or type(error).__name__
    return ""
