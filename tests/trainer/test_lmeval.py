"""`tpufinetune-train lmeval`: lm-evaluation-harness on an export (docs/trainer.md, "Benchmarks
on the export (lm-eval)"; the events in docs/protocol.md).

The export is the tiny random Gemma 4 of the asset builder (a from_pretrained directory with
its towers, as a multimodal base's export is); the tasks are two of lm-eval's own task format
written here: a multiple-choice task (loglikelihood requests) and a generate_until one, their
data JSONL files beside their YAML, named relative to the include folder. Nothing comes from a
hub. The evaluation runs in this process (lmeval.evaluate with its host part in-process); the
last test runs the CLI as the Ray job does, the host part a Ray task on a local Ray head.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainer_helpers import offline_env, run_trainer, write_jsonl

from tpufinetune_trainer import cli, lmeval
from tpufinetune_trainer.errors import EvaluationFailed
from tpufinetune_trainer.events import parse_text

MC_DOCS = 6
GEN_DOCS = 4
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Say {{answer}}:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 2.0
"""


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    """A folder of two custom tasks, as --include-path names one."""
    folder = tmp_path_factory.mktemp("tasks")
    # Right answers alternate, so a model that prefers one answer scores neither 0 nor 1.
    legs = [("dog", 4), ("spider", 8), ("bee", 6), ("cow", 4), ("crab", 10), ("duck", 2)]
    write_jsonl(folder / "mc.jsonl", [{"question": f"Has a {animal} {n if i % 2 else n + 1} legs?",
                                       "choices": ["yes", "no"], "label": 1 - i % 2}
                                      for i, (animal, n) in enumerate(legs)])
    write_jsonl(folder / "gen.jsonl", [{"answer": word} for word in ("red", "blue", "green", "gold")])
    (folder / "tiny_mc.yaml").write_text(MC_YAML)
    (folder / "tiny_gen.yaml").write_text(GEN_YAML)
    return folder


def _config(assets, include, storage, **overrides) -> lmeval.LmevalConfig:
    settings = dict(run_name="run-1", storage_path=str(storage), model_uri=str(assets.model),
                    tasks=("tiny_mc", "tiny_gen"), include_path=str(include), device="cpu")
    return lmeval.LmevalConfig(**{**settings, **overrides})


def _events(capsys) -> list:
    return parse_text(capsys.readouterr().out)


def _read_results(event) -> dict:
    return json.loads(Path(event["results_uri"]).read_text())


def test_each_task_is_one_event_whose_figures_are_those_of_results_json(trainer_assets, include, tmp_path, capsys):
    lmeval.evaluate(_config(trainer_assets, include, tmp_path / "store", limit=3))
    events = _events(capsys)
    assert [e.kind for e in events] == ["lmeval_start", "lmeval_task", "lmeval_task", "lmeval_result"]
    start, *tasks, result = events
    assert (start["tasks"], start["limit"], start["num_fewshot"], start["model_uri"]) == (
        ["tiny_mc", "tiny_gen"], 3, None, str(trainer_assets.model))
    # Written where the event says, which is where the run's storage keeps it.
    assert result["results_uri"] == str(tmp_path / "store" / "run-1" / "evaluation" / "results.json")
    written = _read_results(result)
    assert result["tasks"] == ["tiny_mc", "tiny_gen"] == [t["task"] for t in tasks]
    assert result["evaluate_s"] == written["tpufinetune"]["evaluate_s"] > 0
    for event in tasks:
        name, rows = event["task"], written["results"][event["task"]]
        assert {(m["metric"], m["filter"]) for m in event["metrics"]} == {
            tuple(key.split(",")) for key in rows if "," in key and "_stderr," not in key}
        for m in event["metrics"]:
            assert m["value"] == rows[f"{m['metric']},{m['filter']}"]
            assert m["stderr"] == rows[f"{m['metric']}_stderr,{m['filter']}"]
        assert event["num_fewshot"] == written["n-shot"][name] == 0
        assert event["version"] == written["versions"][name]
        # --limit 3: three documents of each task, of the 6 and 4 there are.
        assert event["samples"] == written["n-samples"][name]["effective"] == 3
    assert {name: written["n-samples"][name]["original"] for name in ("tiny_mc", "tiny_gen")} == {
        "tiny_mc": MC_DOCS, "tiny_gen": GEN_DOCS}
    assert (tasks[0]["version"], tasks[1]["version"]) == (1.0, 2.0)
    assert 0 < tasks[0]["metrics"][0]["value"] < 1 and tasks[0]["metrics"][0]["stderr"] > 0  # figures worth comparing
    assert written["config"]["limit"] == 3 and written["tpufinetune"]["device"] == "cpu"


def test_a_fraction_limit_and_a_figure_without_stderr(trainer_assets, include, tmp_path, capsys):
    """--limit 0.25 of tiny_gen's 4 documents is one; lm-eval's "N/A" standard error (one
    document has none) is null in the event, "N/A" in results.json."""
    lmeval.evaluate(_config(trainer_assets, include, tmp_path, tasks=("tiny_gen",), limit=0.25, num_fewshot=1))
    events = _events(capsys)
    task = next(e for e in events if e.kind == "lmeval_task")
    written = _read_results(events[-1])
    assert task["samples"] == written["n-samples"]["tiny_gen"]["effective"] == 1
    assert task["num_fewshot"] == written["n-shot"]["tiny_gen"] == 1
    assert [(m["metric"], m["stderr"]) for m in task["metrics"]] == [("exact_match", None)]
    assert written["results"]["tiny_gen"]["exact_match_stderr,none"] == "N/A"


def _cli(argv: list[str], capsys) -> tuple[int, list]:
    rc = cli.main(["lmeval", *argv])
    return rc, _events(capsys)


def test_an_unknown_task_fails_naming_it_and_its_close_names(trainer_assets, include, tmp_path, capsys):
    rc, events = _cli(["--run-name=r", f"--storage-path={tmp_path}", f"--model-uri={trainer_assets.model}",
                       "--task=tiny_mc", "--task=tiny_mcq", "--task=hellaswg", f"--include-path={include}"], capsys)
    assert rc == cli.EXIT_FAILURE
    assert [e.kind for e in events] == ["failure"]  # found before anything is loaded
    failure = events[0]
    assert failure["type"] == "EvaluationFailed"
    message = failure["message"]
    assert "tiny_mcq (close names: tiny_mc" in message and "hellaswg (close names: hellaswag" in message
    assert str(include) in message and "--include-path" in message
    assert "tiny_mc (" not in message  # the known one is not named


def test_an_include_path_that_cannot_be_read_fails_naming_it(trainer_assets, tmp_path, capsys):
    missing = tmp_path / "no-such-folder"
    rc, events = _cli(["--run-name=r", f"--storage-path={tmp_path}", f"--model-uri={trainer_assets.model}",
                       "--task=tiny_mc", f"--include-path={missing}"], capsys)
    assert rc == cli.EXIT_FAILURE and [e.kind for e in events] == ["failure"]
    assert events[0]["type"] == "EvaluationFailed"
    assert f"--include-path {missing}: no such folder" in events[0]["message"]


def test_an_export_that_does_not_load_fails_naming_it(trainer_assets, include, tmp_path, capsys):
    broken = tmp_path / "export"
    shutil.copytree(trainer_assets.model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    with pytest.raises(EvaluationFailed) as failed:
        lmeval.evaluate(_config(trainer_assets, include, tmp_path, model_uri=str(broken), limit=1))
    assert f"the export at --model-uri {broken} does not load" in str(failed.value)
    assert [e.kind for e in _events(capsys)] == ["lmeval_start"]
    assert not (tmp_path / "run-1" / "evaluation" / "results.json").exists()


# After the tests of the include folder on disk: its task index is the one kept.
def test_the_export_the_tasks_and_the_results_in_a_bucket(gcs, trainer_assets, include, tmp_path, monkeypatch,
                                                         capsys):
    """gs:// throughout, as the operator passes them: the export and the include folder copied
    to this host with the trainer's storage code, results.json written to the run's bucket."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = gcs.unique_uri("lmeval")
    cfg = _config(trainer_assets, include, f"{base}/runs", tasks=("tiny_mc",), limit=2,
                  model_uri=gcs.upload(trainer_assets.model, f"{base}/runs/run-1/export"),
                  include_path=gcs.upload(include, f"{base}/tasks"))
    lmeval.evaluate(cfg)
    events = _events(capsys)
    assert [e.kind for e in events] == ["lmeval_start", "lmeval_task", "lmeval_result"]
    assert events[-1]["results_uri"] == f"{base}/runs/run-1/evaluation/results.json"
    written = json.loads(gcs.read(events[-1]["results_uri"]))
    assert events[1]["metrics"][0]["value"] == written["results"]["tiny_mc"]["acc,none"]
    assert events[1]["samples"] == written["n-samples"]["tiny_mc"]["effective"] == 2
    assert written["tpufinetune"]["model_uri"] == cfg.model_uri
    # A prefix with nothing under it is named as the folder that cannot be read.
    with pytest.raises(EvaluationFailed, match=f"--include-path {base}/no-tasks: cannot read it: FileNotFoundError"):
        lmeval.evaluate(_config(trainer_assets, include, f"{base}/runs", include_path=f"{base}/no-tasks"))


def test_the_jobs_driver_output_is_kept_with_the_attempts_logs(trainer_assets, tmp_path):
    """Under the operator's attempt number, as the fine-tune driver's: its failure event too."""
    env = offline_env(dict(os.environ, TPUFINETUNE_ATTEMPT="2"))
    run = run_trainer(["lmeval", "--run-name=run-l", f"--storage-path={tmp_path}",
                       f"--model-uri={trainer_assets.model}", "--task=tiny_mc",
                       f"--include-path={tmp_path / 'no-such-folder'}"], env, timeout=120)
    assert run.rc == cli.EXIT_FAILURE and [e.kind for e in run.events] == ["failure"], run.tail()
    kept = "".join(p.read_text() for p in sorted((tmp_path / "run-l" / "logs" / "attempt-2" / "driver").glob("*.log")))
    assert parse_text(kept) == run.events


@pytest.mark.ray
def test_the_job_evaluates_on_a_worker_through_ray(ray_head, trainer_assets, include, tmp_path):
    """The entrypoint the operator submits: the driver's checks, then the host part as a Ray task."""
    run = run_trainer(["lmeval", "--run-name=run-ray", f"--storage-path={tmp_path}",
                       f"--model-uri={trainer_assets.model}", "--task=tiny_mc", "--limit=2",
                       f"--include-path={include}"], offline_env(ray_head.env()), timeout=300)
    assert run.rc == 0, run.tail()
    assert [e.kind for e in run.events] == ["lmeval_start", "lmeval_task", "lmeval_result"], run.tail()
    task, result = run.events[1], run.events[2]
    written = _read_results(result)
    assert task["samples"] == written["n-samples"]["tiny_mc"]["effective"] == 2
    assert task["metrics"][0]["value"] == written["results"]["tiny_mc"]["acc,none"]
    assert "(lmeval pid=" in run.output  # the task's own process, its lines forwarded by Ray


@pytest.mark.parametrize("lm_eval, read", [
    ({"tasks": ["hellaswag", "arc_easy"]}, dict(tasks=("hellaswag", "arc_easy"), num_fewshot=None, limit=None,
                                                include_path=None)),
    ({"tasks": ["tiny_mc"], "numFewshot": 5, "limit": 0.1, "includePath": "gs://bucket/tasks"},
     dict(tasks=("tiny_mc",), num_fewshot=5, limit=0.1, include_path="gs://bucket/tasks")),
    ({"tasks": ["mmlu"], "limit": 20}, dict(tasks=("mmlu",), num_fewshot=None, limit=20, include_path=None)),
])
def test_the_operators_lmeval_job_is_read_as_its_spec_says(lm_eval, read):
    """jobspec.lmeval_argv's command line, parsed by this trainer's own parser."""
    from tpufinetune.core.api import parse_spec
    from tpufinetune.core.jobspec import lmeval_argv

    spec = parse_spec({"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "example.com/trainer:1",
                       "checkpoint": {"storagePath": "gs://bucket/runs"}, "evaluation": {"lmEval": lm_eval}})
    argv = lmeval_argv(spec, "run-7", "gs://bucket/runs/run-7/export")
    assert argv[:2] == ["tpufinetune-train", "lmeval"]
    cfg = cli._lmeval_config(cli.build_parser().parse_args(argv[1:]))
    cfg.validate()
    assert (cfg.run_name, cfg.storage_path, cfg.model_uri) == ("run-7", "gs://bucket/runs",
                                                               "gs://bucket/runs/run-7/export")
    assert {name: getattr(cfg, name) for name in read} == read
    assert type(cfg.limit) is type(read["limit"])  # a whole number stays a count of documents
    assert cfg.results_uri() == "gs://bucket/runs/run-7/evaluation/results.json"


def test_a_groups_rows_come_after_what_was_asked_for_with_lm_evals_gaps_as_null():
    """A group (mmlu-like): the row asked for first, then its subtasks in lm-eval's order;
    "N/A" (no standard error, a group's version) is null, a figure that is not a number too."""
    import numpy as np

    results = lmeval.json_safe({
        "results": {"sub_a": {"alias": " - a", "acc,none": np.float64(0.5), "acc_stderr,none": "N/A"},
                    "grp": {"alias": "grp", "acc,none": 0.25, "acc_stderr,none": 0.1, "sample_len": 7},
                    "sub_b": {"acc,none": float("nan"), "acc_stderr,none": np.float32(0.5),
                              "f1,strict-match": "x", "f1_stderr,strict-match": 0.2}},
        "versions": {"grp": "N/A", "sub_a": 1, "sub_b": "2.1"}, "n-shot": {"sub_a": 0, "sub_b": 5},
        "n-samples": {"sub_a": {"original": 9, "effective": 4}, "sub_b": {"original": 3, "effective": np.int64(3)}}})
    assert json.loads(json.dumps(results, allow_nan=False)) == results
    assert lmeval.task_reports(results, ["grp"]) == [
        {"task": "grp", "metrics": [{"metric": "acc", "filter": "none", "value": 0.25, "stderr": 0.1}],
         "samples": 7, "num_fewshot": None, "version": None},
        {"task": "sub_a", "metrics": [{"metric": "acc", "filter": "none", "value": 0.5, "stderr": None}],
         "samples": 4, "num_fewshot": 0, "version": 1},
        {"task": "sub_b", "metrics": [{"metric": "acc", "filter": "none", "value": None, "stderr": 0.5},
                                      {"metric": "f1", "filter": "strict-match", "value": None, "stderr": 0.2}],
         "samples": 3, "num_fewshot": 5, "version": "2.1"}]
