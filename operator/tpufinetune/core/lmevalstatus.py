"""status.evaluation: lm-evaluation-harness on the export (spec.evaluation.lmEval), part of the
status (status.py). Bounded: a group such as mmlu reports dozens of subtasks, and the whole
results JSON stays at resultsURI."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpufinetune.core.statusbase import _Status

LM_EVAL_TASK_LIMIT = 64  # tasks (and group rows) kept in status; the rest are in resultsURI
LM_EVAL_METRIC_LIMIT = 16  # metrics kept per task
LM_EVAL_STATES = ("Running", "Succeeded", "Failed")


class LmEvalMetric(_Status):
    """One figure of a task, as lm-eval reports it."""

    metric: str = Field(max_length=128, description="The metric, e.g. acc, acc_norm, exact_match.")
    filter: str | None = Field(None, max_length=128, description="lm-eval's filter of the answers it scored "
                                                                 "(none, strict-match, flexible-extract ...).")
    value: float | None = Field(None, description="Its value.")
    stderr: float | None = Field(None, ge=0, description="Its standard error (absent where lm-eval gives none).")


class LmEvalTask(_Status):
    """One task's (or group's) figures."""

    task: str = Field(max_length=128, description="The task or group name.")
    metrics: list[LmEvalMetric] | None = Field(None, max_length=LM_EVAL_METRIC_LIMIT, description="Its figures.")
    samples: int | None = Field(None, ge=0, description="Documents evaluated.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt.")
    version: str | None = Field(None, max_length=64, description="The task's version.")


class LmEvalStatus(_Status):
    """lm-evaluation-harness run on the export before the slice was released."""

    state: Literal[LM_EVAL_STATES] | None = Field(  # type: ignore[valid-type]
        None, description="Running, Succeeded or Failed (a failed evaluation does not fail the run).")
    attempt: int | None = Field(None, ge=1, description="The attempt whose export it evaluates.")
    job_id: str | None = Field(None, max_length=128, description="Its Ray submission id, tft-<uid>-<attempt>-lmeval.")
    model_uri: str | None = Field(None, alias="modelURI", max_length=4096, description="The export evaluated.")
    tasks: list[LmEvalTask] | None = Field(None, max_length=LM_EVAL_TASK_LIMIT,
                                           description="Each task's figures, in the order reported.")
    results_uri: str | None = Field(None, alias="resultsURI", max_length=4096,
                                    description="lm-eval's whole results JSON (every task, config and version).")
    seconds: float | None = Field(None, ge=0, description="Seconds lm-eval took.")
    reason: str | None = Field(None, max_length=64, description="Why it failed (the Evaluated condition's reason).")
    message: str | None = Field(None, max_length=1024, description="What it is doing, or why it failed.")
    start_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                   description="When it was submitted (its no-progress watchdog counts from here).")
    completion_time: str | None = Field(None, json_schema_extra={"format": "date-time"}, description="When it ended.")
