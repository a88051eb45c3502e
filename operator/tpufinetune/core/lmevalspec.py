"""spec.evaluation: benchmarks run on the fine-tune's export before the slice is released
(the models layer, with specmodels.py). Types, bounds and descriptions only; the rules across
fields are lmevalrules.py's.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .apimodels import PRINTABLE, _Model

# An lm-evaluation-harness task or group name (hellaswag, arc_easy, mmlu, leaderboard_bbh,
# a custom task's name from includePath's YAML): no space, never starting with '-'.
LM_EVAL_TASK = r"^[A-Za-z0-9][A-Za-z0-9_.+:-]*$"
MAX_LM_EVAL_TASKS = 64
MAX_LM_EVAL_LIMIT = 10**9  # documents per task at most (also bounds CEL's int() of it)
LmEvalTask = Annotated[str, Field(min_length=1, max_length=128, pattern=LM_EVAL_TASK)]


class LmEval(_Model):
    """lm-evaluation-harness on the export: the trainer's `lmeval` entry (tpufinetune-train lmeval),
    one Ray job on the run's own RayCluster after the fine-tune job succeeded."""

    tasks: list[LmEvalTask] = Field(
        min_length=1, max_length=MAX_LM_EVAL_TASKS, json_schema_extra={"x-kubernetes-list-type": "set"},
        description="lm-evaluation-harness tasks or groups to run, each once (e.g. hellaswag, arc_easy, mmlu; "
                    "a custom task defined in includePath). Tasks from the Hugging Face Hub need the pods' "
                    "egress to it (and model.tokenSecret for a gated dataset).")
    num_fewshot: int | None = Field(
        None, ge=0, le=128, description="Few-shot examples per prompt (lm-eval's --num_fewshot). Unset: each "
                                        "task's own default.")
    limit: float | None = Field(
        None, gt=0, le=MAX_LM_EVAL_LIMIT,
        description="Documents evaluated per task, as lm-eval's --limit reads it: a fraction of each task's "
                    "documents below 1 (0.1: a tenth), else a whole number of documents (1: one). Unset: every "
                    "document. For a quick check, not a score to report.")
    include_path: str | None = Field(
        None, min_length=1, max_length=1024, pattern=PRINTABLE,
        description="A folder of custom task YAML files (and their data) that lm-eval loads besides its own "
                    "tasks (--include_path): gs://bucket/prefix (downloaded by the evaluating host) or a path "
                    "on a shared filesystem mounted into the Ray pods.")


class ExportEvaluation(_Model):
    """What is evaluated on the fine-tune's export once it is written and proven."""

    lm_eval: LmEval | None = Field(
        None, description="lm-evaluation-harness tasks run on status.exportedModelURI on one worker host of "
                          "the run's RayCluster before it is released (status.evaluation, condition "
                          "Evaluated). An evaluation that fails does not fail the run. Unset: none.")
