"""spec.evaluation.lmEval around the state machine: the lm-eval job's argv and submission
(built as a list, every user string one inert argument; the fine-tune's runtime env), its
events folded into status.evaluation (bounded, odd values left out, idempotent), and
`tpufinetune eval`'s lm-eval table."""
from __future__ import annotations

import copy
import math
import shlex

import pytest
from phase_helpers import spec_with

from tpufinetune import cli
from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import job_submission, lmeval_argv, lmeval_id, lmeval_submission, run_name
from tpufinetune.core.lmevalevents import fold
from tpufinetune.core.lmevalstatus import LM_EVAL_METRIC_LIMIT, LM_EVAL_TASK_LIMIT
from tpufinetune.core.status import checked_status
from tpufinetune.evaltable import NO_LM_EVAL, lm_eval_table

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"
EXPORT = "gs://bucket/ckpt/tft-demo-6f1c2a7e/export"


def lm_eval_spec(**lm_eval):
    return parse_spec(spec_with(evaluation={"lmEval": {"tasks": ["hellaswag", "arc_easy"], **lm_eval}}))


def test_the_argv_names_every_task_and_only_the_settings_given():
    argv = lmeval_argv(lm_eval_spec(), "tft-demo-6f1c2a7e", EXPORT)
    assert argv == ["tpufinetune-train", "lmeval", "--run-name=tft-demo-6f1c2a7e", "--storage-path=gs://bucket/ckpt",
                    f"--model-uri={EXPORT}", "--task=hellaswag", "--task=arc_easy"]
    full = lmeval_argv(lm_eval_spec(numFewshot=5, limit=0.25, includePath="gs://bucket/tasks"), "r", EXPORT)
    assert full[-3:] == ["--num-fewshot=5", "--limit=0.25", "--include-path=gs://bucket/tasks"]
    assert lmeval_argv(lm_eval_spec(limit=16), "r", EXPORT)[-1] == "--limit=16"  # a count, not 16.0
    assert lmeval_argv(lm_eval_spec(numFewshot=0), "r", EXPORT)[-1] == "--num-fewshot=0"


def test_the_submission_is_the_fine_tunes_env_on_a_fixed_id_and_user_text_stays_inert():
    spec = lm_eval_spec(includePath="gs://bucket/my tasks; rm -rf /")
    request = lmeval_submission("demo", "team", UID, spec, 2, EXPORT)
    fine_tune = job_submission("demo", "team", UID, spec, 2)
    assert request.submission_id == lmeval_id(UID, 2) == f"tft-{UID}-2-lmeval"
    assert request.runtime_env == fine_tune.runtime_env  # TPUFINETUNE_ATTEMPT: the logs go beside the attempt's
    assert request.metadata["tpufinetune.dev/lmeval"] == "true" and request.metadata["tpufinetune.dev/attempt"] == "2"
    assert shlex.split(request.entrypoint) == request.entrypoint_argv
    assert "--include-path=gs://bucket/my tasks; rm -rf /" in shlex.split(request.entrypoint)
    assert f"--run-name={run_name('demo', UID)}" in request.entrypoint_argv
    assert "HF_TOKEN" not in str(request.runtime_env)


TASK = {"event": "lmeval_task", "task": "hellaswag", "samples": 8, "num_fewshot": 0, "version": 1.0,
        "metrics": [{"metric": "acc", "filter": "none", "value": 0.375, "stderr": 0.18}]}


def test_folding_keeps_one_entry_per_task_in_order_and_drops_what_the_status_cannot_hold():
    evaluation: dict = {"state": "Running"}
    odd = {"event": "lmeval_task", "task": "arc_easy", "samples": -1, "num_fewshot": True,
           "metrics": [{"metric": "acc", "value": math.nan, "stderr": "N/A"}, {"metric": "", "value": 1},
                       "not a metric", {"metric": "acc_norm", "filter": "none", "value": 0.5, "stderr": -0.1}]}
    for event in (TASK, odd, {**TASK, "samples": 9}, {"event": "lmeval_task", "task": None},
                  {"event": "lmeval_result", "results_uri": "gs://b/r.json", "evaluate_s": math.inf}):
        fold(evaluation, event)
    hellaswag, arc = evaluation["tasks"]
    assert hellaswag["task"] == "hellaswag" and hellaswag["samples"] == 9 and hellaswag["version"] == "1.0"
    assert arc == {"task": "arc_easy", "metrics": [{"metric": "acc"}, {"metric": "acc_norm", "filter": "none",
                                                                        "value": 0.5}]}
    assert evaluation["resultsURI"] == "gs://b/r.json" and "seconds" not in evaluation
    again = copy.deepcopy(evaluation)
    fold(again, TASK)
    fold(again, {**TASK, "samples": 9})
    assert again == evaluation  # a log read again changes nothing
    checked_status({"evaluation": evaluation})


def test_a_group_with_many_subtasks_is_bounded_in_status():
    evaluation: dict = {}
    for n in range(LM_EVAL_TASK_LIMIT + 10):
        fold(evaluation, {"event": "lmeval_task", "task": f"mmlu_{n}",
                          "metrics": [{"metric": f"m{k}", "value": 0.5} for k in range(LM_EVAL_METRIC_LIMIT + 4)]})
    assert len(evaluation["tasks"]) == LM_EVAL_TASK_LIMIT
    assert all(len(t["metrics"]) == LM_EVAL_METRIC_LIMIT for t in evaluation["tasks"])
    checked_status({"evaluation": evaluation})


def test_a_failure_event_is_kept_as_the_evaluations_reason():
    evaluation: dict = {"state": "Running"}
    fold(evaluation, {"event": "failure", "type": "EvaluationFailed", "message": "no task named 'nosuch'"})
    assert evaluation["reason"] == "EvaluationFailed" and "nosuch" in evaluation["message"]


SUCCEEDED = {"evaluation": {"state": "Succeeded", "seconds": 41.2, "resultsURI": "gs://b/lmeval/results.json",
                            "tasks": [{"task": "hellaswag", "samples": 8, "metrics": [
                                {"metric": "acc", "filter": "none", "value": 0.375, "stderr": 0.18},
                                {"metric": "acc_norm", "filter": "none", "value": 0.5}]}]}}


def test_the_table_shows_each_metric_with_its_stderr_and_where_the_results_are():
    lines = lm_eval_table(SUCCEEDED).splitlines()
    assert lines[0] == "lm-eval: Succeeded in 41.2 s"
    assert lines[1].split() == ["TASK", "METRIC", "FILTER", "VALUE", "SAMPLES"]
    assert lines[2].split() == ["hellaswag", "acc", "none", "0.3750", "±", "0.1800", "8"]
    assert lines[3].split() == ["acc_norm", "none", "0.5000"]
    assert lines[-1] == "results: gs://b/lmeval/results.json"


def test_the_table_says_when_none_was_asked_for_or_it_failed():
    assert lm_eval_table({}) == NO_LM_EVAL + "\n"
    failed = {"evaluation": {"state": "Failed", "reason": "NoProgress", "message": "no event for 61 min"}}
    assert lm_eval_table(failed) == "lm-eval: Failed (NoProgress): no event for 61 min\n"


@pytest.fixture
def run_read(monkeypatch):
    from tpufinetune.adapters import readrun

    found = {}
    monkeypatch.setattr(readrun, "read_tpufinetune", lambda name, namespace, kubeconfig: (namespace or "default",
                                                                                       found[name]))
    return found


def test_tpufinetune_eval_prints_the_lm_eval_table_after_the_epochs(run_read, capsys):
    run_read["tuned"] = {"status": {"history": [{"epoch": 1, "evalLoss": 0.45}], **SUCCEEDED}}
    assert cli.main(["eval", "tuned"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("EPOCH  EVAL_LOSS\n1      0.4500\n\nlm-eval: Succeeded")
    assert "hellaswag  acc" in out
    run_read["plain"] = {"status": {"history": [{"epoch": 1, "evalLoss": 0.45}]}}
    assert cli.main(["eval", "plain"]) == 0
    assert capsys.readouterr().out.endswith(NO_LM_EVAL + "\n")


@pytest.mark.parametrize("lm_eval", [{}, {"numFewshot": 5, "limit": 0.25, "includePath": "gs://bucket/tasks"},
                                     {"limit": 16, "numFewshot": 0}], ids=["tasks", "every-setting", "a-count"])
def test_the_trainers_lmeval_parser_reads_the_argv_as_meant(lm_eval):
    """The argv the operator builds, parsed and checked by the trainer's own `lmeval` entry."""
    from tpufinetune_trainer import cli as trainer_cli

    spec = lm_eval_spec(**lm_eval)
    argv = lmeval_argv(spec, "tft-demo-6f1c2a7e", EXPORT)
    config = trainer_cli._lmeval_config(trainer_cli.build_parser().parse_args(argv[1:]))
    config.validate()
    settings = spec.evaluation.lm_eval
    assert (config.run_name, config.storage_path, config.model_uri) == ("tft-demo-6f1c2a7e", "gs://bucket/ckpt", EXPORT)
    assert config.tasks == ("hellaswag", "arc_easy")
    assert (config.num_fewshot, config.include_path) == (settings.num_fewshot, settings.include_path)
    assert config.limit == settings.limit
    if settings.limit is not None and settings.limit >= 1:
        assert isinstance(config.limit, int)  # a count of documents, as lm-eval reads --limit
