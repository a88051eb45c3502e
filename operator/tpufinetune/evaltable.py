"""`tpufinetune eval NAME`'s tables: a run's evaluation per epoch, and lm-eval's on its
export, from its status. Pure.

One row per epoch of status.history: its held-out loss and, where the run generated
(spec.training.evaluation.generate), its generation metrics and the answers scored. The
answers themselves are evalsamples.py's (`--samples`). Then status.evaluation
(spec.evaluation.lmEval): one row per task and metric, value ± stderr, or why there is none.
"""
from __future__ import annotations

NO_GENERATION = ("no generation metrics: the run does not set spec.training.evaluation.generate, or no "
                 "epoch has ended yet")
# (header, key in history[].eval, format)
GENERATION_COLUMNS = (("EXACT_MATCH", "exactMatch", "{:.4f}"), ("ROUGE_L", "rougeL", "{:.4f}"),
                      ("BLEU", "bleu", "{:.2f}"), ("ANSWERS", "examples", "{}"))


def _cell(value, form: str) -> str:
    return "-" if value is None else form.format(value)


def evaluation_table(status: dict) -> tuple[str, str]:
    """(the table, a note for stderr: '' or why there are no generation metrics). The table
    has the generation columns a run has (those of any epoch), and its samples' location."""
    history = sorted(status.get("history") or [], key=lambda entry: entry.get("epoch") or 0)
    columns = [column for column in GENERATION_COLUMNS
               if any((entry.get("eval") or {}).get(column[1]) is not None for entry in history)]
    rows = [["EPOCH", "EVAL_LOSS", *(header for header, _, _ in columns)]]
    for entry in history:
        generated = entry.get("eval") or {}
        rows.append([str(entry.get("epoch")), _cell(entry.get("evalLoss"), "{:.4f}"),
                     *(_cell(generated.get(key), form) for _, key, form in columns)])
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    samples = [entry["eval"]["samplesURI"] for entry in history if (entry.get("eval") or {}).get("samplesURI")]
    if samples:
        lines.append(f"samples: {samples[-1].rsplit('/', 1)[0]}/ (printed by --samples)")
    return "\n".join(lines) + "\n", "" if columns else NO_GENERATION


NO_LM_EVAL = "lm-eval: none (the run does not set spec.evaluation.lmEval)"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def lm_eval_table(status: dict) -> str:
    """status.evaluation as text: a heading saying its state (and why it failed, where it did),
    then each task's metrics, `value ± stderr`, and where lm-eval's whole results are."""
    evaluation = status.get("evaluation") or {}
    state = evaluation.get("state")
    if not state:
        return NO_LM_EVAL + "\n"
    heading = f"lm-eval: {state}"
    if state == "Running":
        heading += f" (job {evaluation.get('jobId')}): {len(evaluation.get('tasks') or [])} task(s) reported so far"
    elif state == "Failed":
        reason, message = evaluation.get("reason") or "Failed", evaluation.get("message") or ""
        heading += f": {message}" if message.startswith(reason) else f" ({reason}): {message}"
    elif evaluation.get("seconds") is not None:
        heading += f" in {evaluation['seconds']:g} s"
    lines = [heading.rstrip()]
    rows = [["TASK", "METRIC", "FILTER", "VALUE", "SAMPLES"]]
    for task in evaluation.get("tasks") or []:
        for index, metric in enumerate(task.get("metrics") or [{}]):
            value = _cell(metric.get("value"), "{:.4f}")
            if metric.get("stderr") is not None:
                value += f" ± {metric['stderr']:.4f}"
            rows.append([task["task"] if index == 0 else "", metric.get("metric") or "-", metric.get("filter") or "-",
                         value, _cell(task.get("samples"), "{}") if index == 0 else ""])
    if len(rows) > 1:
        lines += _table(rows)
    if evaluation.get("resultsURI"):
        lines.append(f"results: {evaluation['resultsURI']}")
    return "\n".join(lines) + "\n"
