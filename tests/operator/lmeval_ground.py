"""spec.evaluation.lmEval on the test ground: a custom lm-eval task written to the ground's
bucket (includePath), the spec that names it, and what a run that ran it must show
(status.evaluation, the Evaluated condition, the results JSON in the bucket)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# lm-eval's own task format, multiple choice (loglikelihoods only: nothing generated), a few
# documents from a JSONL beside the YAML, both in the bucket.
TASK = "tft_ground_choice"
LIMIT = 4
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: docs.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
DOCS = [("The sky on a clear day is", " blue", " green"), ("Two plus two is", " four", " seven"),
        ("Ice is made of", " water", " sand"), ("The opposite of hot is", " cold", " loud"),
        ("A cat says", " meow", " moo"), ("The sun rises in the", " east", " west")]


def upload_task(gcs, folder: Path) -> str:
    """Writes the task's YAML and documents into `folder`, uploads them to a fresh prefix of
    the ground's bucket and returns it (the includePath)."""
    (folder / f"{TASK}.yaml").write_text(TASK_YAML)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"question": q, "choices": [right, wrong], "label": 0}) + "\n"
                                               for q, right, wrong in DOCS))
    return gcs.upload(folder, gcs.unique_uri("lmeval-tasks"))


def lm_eval_spec(include: str) -> dict:
    """spec.evaluation running the task on LIMIT of its documents."""
    return {"lmEval": {"tasks": [TASK], "includePath": include, "limit": LIMIT}}


def check_evaluated(status: dict, gcs) -> None:
    """The run Succeeded after lm-eval ran on its own RayCluster (the last attempt's) on its
    export: the task's figures in status.evaluation, its whole results in the bucket at
    resultsURI, condition Evaluated True, and the slice released only after the evaluation."""
    print(json.dumps({"evaluation": status.get("evaluation"), "conditions": status.get("conditions")}))
    evaluation = status.get("evaluation") or {}
    assert status["phase"] == "Succeeded" and evaluation.get("state") == "Succeeded", evaluation
    assert evaluation["jobId"] == f"{status['jobId']}-lmeval" and evaluation["attempt"] == status["attempt"]
    assert evaluation["modelURI"] == status["exportedModelURI"]
    [task] = evaluation["tasks"]
    assert task["task"] == TASK and task["samples"] == LIMIT, task
    acc = next(m for m in task["metrics"] if m["metric"] == "acc")
    assert acc["filter"] == "none" and 0 <= acc["value"] <= 1 and acc["value"] * LIMIT == round(
        acc["value"] * LIMIT), acc  # a share of LIMIT documents
    results = json.loads(gcs.read(evaluation["resultsURI"]))
    assert results["results"][TASK]["acc,none"] == pytest.approx(acc["value"]), results["results"]
    evaluated = next(c for c in status["conditions"] if c["type"] == "Evaluated")
    assert evaluated["status"] == "True" and evaluated["reason"] == "Evaluated", evaluated
    succeeded = next(c for c in status["conditions"] if c["type"] == "Succeeded")
    assert succeeded["status"] == "True"
    # The slice was held through the evaluation: released after it ended, never before.
    last = status["attempts"][-1]
    assert last["attempt"] == status["attempt"], status["attempts"]
    assert evaluation["startTime"] <= evaluation["completionTime"] <= status["completionTime"]
    assert last.get("sliceReleaseTime", status["completionTime"]) >= evaluation["completionTime"]
