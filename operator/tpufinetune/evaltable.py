"""`tpufinetune eval NAME`'s table: a run's evaluation per epoch, from its status. Pure.

One row per epoch of status.history: its held-out loss and, where the run generated
(spec.training.evaluation.generate), its generation metrics and the answers scored. The
answers themselves are evalsamples.py's (`--samples`).
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
