"""A run's own metrics, read from its status as the watch sees it (no I/O).

`values(status)` gives one number per per-run gauge that the status has a value for; a
metric the status does not know yet (no progress line, no evaluation) is left out, so its
series is absent rather than a misleading 0. `queue_wait(before, after)` is the time a run
spent Queued, once Kueue admitted it. The adapter (adapters/metrics.py) exports both.
"""

from __future__ import annotations

import math

from tpufinetune.core import conditions as cond

PREFIX = "tpufinetune_run_"
PHASE = PREFIX + "phase"  # {namespace, name, phase} = 1 for the current phase

# name -> help; every one a gauge labelled {namespace, name}.
GAUGES: dict[str, str] = {
    PREFIX + "epoch": "Last completed epoch (status.epoch).",
    PREFIX + "step": "Optimizer steps done (status.progress.step).",
    PREFIX + "progress_ratio": "Fraction of the planned steps done, 0 to 1 (status.progress).",
    PREFIX + "loss": "Training loss of the last progress window, else of the last epoch.",
    PREFIX + "eval_loss": "Evaluation loss of the last evaluation.",
    PREFIX + "learning_rate": "Learning rate of the last step (status.progress.learningRate).",
    PREFIX + "tokens_per_second": "Training throughput of the last window, else of the last epoch.",
    PREFIX + "step_time_seconds": "Mean seconds per optimizer step (status.progress.stepTimeSeconds).",
    PREFIX + "eta_seconds": "Estimated seconds of training left (status.progress.etaSeconds).",
    PREFIX + "attempts": "Attempts so far, the current one included (status.attempt).",
    PREFIX + "chip_seconds": "TPU chip-seconds the run's slices were held so far (status.usage.chipHours x 3600).",
}
# Method dpo's figures of its last epoch (status.history[].dpo): gauge suffix -> the key there.
PREFERENCE_GAUGES: dict[str, tuple[str, str]] = {
    "rewards_chosen": ("rewardsChosen", "Mean beta x (policy - reference) log-probability of the chosen responses"),
    "rewards_rejected": ("rewardsRejected", "The same for the rejected responses"),
    "reward_margin": ("margin", "Mean reward margin, chosen minus rejected"),
    "preference_accuracy": ("accuracy", "Share of pairs whose chosen reward is the higher, 0 to 1"),
}
# Generation metrics of the last epoch evaluated (status.history[].eval): suffix -> key.
GENERATION_GAUGES: dict[str, tuple[str, str]] = {
    "eval_exact_match": ("exactMatch", "Share of held-out answers equal to their response, 0 to 1"),
    "eval_rouge_l": ("rougeL", "Mean ROUGE-L F1 of the held-out answers, 0 to 1"),
    "eval_bleu": ("bleu", "Corpus BLEU of the held-out answers, 0 to 100"),
}
GAUGES.update({PREFIX + suffix: f"{text}, on the training pairs of the last epoch (method dpo)."
               for suffix, (_, text) in PREFERENCE_GAUGES.items()})
GAUGES.update({PREFIX + "eval_" + suffix: f"{text}, on the held-out pairs of the last epoch (method dpo)."
               for suffix, (_, text) in PREFERENCE_GAUGES.items()})
GAUGES.update({PREFIX + suffix: f"{text} (training.evaluation.generate)."
               for suffix, (_, text) in GENERATION_GAUGES.items()})
# The phase series and at most one series per gauge (an SFT run has no preference series,
# a run without evaluation.generate no generation series).
SERIES_PER_RUN = 1 + len(GAUGES)


def values(status: dict | None) -> dict[str, float]:
    """status (camelCase, as the API server holds it) -> {metric name: value}."""
    s = status or {}
    progress = s.get("progress") or {}
    found = {
        "epoch": s.get("epoch"),
        "step": progress.get("step"),
        "progress_ratio": _ratio(progress),
        "loss": _first(progress.get("loss"), s.get("loss")),
        "eval_loss": _last_eval_loss(s),
        "learning_rate": progress.get("learningRate"),
        "tokens_per_second": _first(progress.get("tokensPerSecond"), s.get("tokensPerSecond")),
        "step_time_seconds": progress.get("stepTimeSeconds"),
        "eta_seconds": progress.get("etaSeconds"),
        "attempts": s.get("attempt"),
        "chip_seconds": _times((s.get("usage") or {}).get("chipHours"), 3600),
    }
    preference = _last_of(s, "dpo")
    found.update({suffix: preference.get(key) for suffix, (key, _) in PREFERENCE_GAUGES.items()})
    found.update({"eval_" + suffix: preference.get("eval" + key[0].upper() + key[1:])
                  for suffix, (key, _) in PREFERENCE_GAUGES.items()})
    generation = _last_of(s, "eval")
    found.update({suffix: generation.get(key) for suffix, (key, _) in GENERATION_GAUGES.items()})
    return {PREFIX + key: number for key, value in found.items()
            if (number := _number(value)) is not None}


def queue_wait(before: dict | None, after: dict | None) -> float | None:
    """Seconds between entering Queued and Kueue's admission (Queued -> Provisioning),
    from the two phaseTransitionTimes; None for any other step."""
    before, after = before or {}, after or {}
    if before.get("phase") != "Queued" or after.get("phase") != "Provisioning":
        return None
    entered = cond.parse_time(before.get("phaseTransitionTime"))
    left = cond.parse_time(after.get("phaseTransitionTime"))
    if entered is None or left is None:
        return None
    return max(0.0, (left - entered).total_seconds())


def _ratio(progress: dict) -> float | None:
    step, total = _number(progress.get("step")), _number(progress.get("totalSteps"))
    if step is not None and total:
        return min(1.0, max(0.0, step / total))
    percent = _number(progress.get("percent"))
    return None if percent is None else min(1.0, max(0.0, percent / 100))


def _last_eval_loss(s: dict) -> float | None:
    if _number(s.get("evalLoss")) is not None:
        return s["evalLoss"]
    for record in reversed(s.get("history") or []):
        if isinstance(record, dict) and _number(record.get("evalLoss")) is not None:
            return record["evalLoss"]
    return None


def _last_of(s: dict, key: str) -> dict:
    """status.history's last epoch record that has `key` (dpo, eval): its figures, or {}."""
    for record in reversed(s.get("history") or []):
        if isinstance(record, dict) and isinstance(record.get(key), dict):
            return record[key]
    return {}


def _first(*candidates):
    return next((c for c in candidates if _number(c) is not None), None)


def _times(value, factor: float) -> float | None:
    number = _number(value)
    return None if number is None else number * factor


def _number(value) -> float | None:
    """A finite number, else None (bools, strings and NaN are not a sample)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
