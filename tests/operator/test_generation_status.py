"""Each epoch's generation metrics in status and on the command line (core/runevents.py,
core/evalstatus.py, evaltable.py, `tpufinetune eval`): the trainer's epoch event carries
exact match, ROUGE-L, BLEU, the answers scored and where the samples are (docs/protocol.md);
each epoch's are kept in status.history[].eval, a run without generation has none, a value
the status cannot hold drops its event, and `tpufinetune eval NAME` prints them per epoch
beside the eval loss, or says that the run has none."""

from __future__ import annotations

import copy

import pytest

from tpufinetune import cli
from tpufinetune.core.runevents import GENERATION_KEYS, apply_event, split_malformed
from tpufinetune.core.status import TPUFineTuneStatus, checked_status
from tpufinetune.evaltable import NO_GENERATION, evaluation_table

SAMPLES = "gs://b/runs/r-1/eval-samples/epoch-{}.jsonl"


def epoch(n: int, **figures) -> dict:
    return {"event": "epoch", "epoch": n, "epochs": 3, "step": 4 * n, "loss": 0.6, "eval_loss": 0.55 - 0.1 * n,
            "tokens_per_s": 100.0, "epoch_time_s": 2.0, **figures}


def generated(n: int, exact: float, rouge: float, bleu: float) -> dict:
    return {"eval_exact_match": exact, "eval_rouge_l": rouge, "eval_bleu": bleu, "eval_generated": 64,
            "eval_samples_uri": SAMPLES.format(n), "generate_s": 3.2}


def test_each_epochs_generation_metrics_are_kept_in_its_history_entry():
    status: dict = {}
    apply_event(status, epoch(1, **generated(1, 0.125, 0.41234, 12.3456)))
    apply_event(status, epoch(2, **generated(2, 0.5, 0.7, 30.0)))
    first, second = status["history"]
    assert first["eval"] == {"exactMatch": 0.125, "rougeL": 0.4123, "bleu": 12.3456, "examples": 64,
                             "samplesURI": SAMPLES.format(1)}
    assert (second["eval"]["exactMatch"], second["evalLoss"]) == (0.5, 0.35)
    assert checked_status(status) is status  # every key declared (the API server would prune one that is not)
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["history"] == status["history"]


def test_a_run_without_generation_has_no_eval_entry_and_a_replay_changes_nothing():
    status: dict = {}
    apply_event(status, epoch(1))
    assert "eval" not in status["history"][0]
    once: dict = {}
    apply_event(once, epoch(1, **generated(1, 0.25, 0.5, 10.0)))
    twice = copy.deepcopy(once)
    apply_event(twice, epoch(1, **generated(1, 0.25, 0.5, 10.0), replayed=True))
    assert twice == once
    # The trainer's replay of a restored checkpoint's epochs carries the figures, not the samples' URI.
    replayed = {k: v for k, v in generated(1, 0.25, 0.5, 10.0).items() if k not in ("eval_samples_uri", "generate_s")}
    apply_event(twice, epoch(1, **replayed, replayed=True))
    assert twice == once


def test_a_figure_the_status_cannot_hold_drops_its_event_not_every_later_one():
    kept, dropped = split_malformed({}, [epoch(1, **generated(1, 1.5, 0.5, 10.0)), epoch(2, **generated(2, 0.5, 0.5, 1))])
    assert [e["epoch"] for e in kept] == [2]
    assert len(dropped) == 1 and "exactMatch" in dropped[0][1]


def test_an_eval_key_a_newer_operator_wrote_is_carried_beside_this_versions_entries():
    read_back = {"history": [{"epoch": 1, "loss": 1.0, "eval": {"exactMatch": 0.5, "chrFNewer": 31.0}}]}
    status = copy.deepcopy(read_back)
    apply_event(status, epoch(2, **generated(2, 0.75, 0.8, 20.0)))
    assert status["history"][0]["eval"]["chrFNewer"] == 31.0 and status["history"][1]["eval"]["exactMatch"] == 0.75
    assert checked_status(status, read_back) is status


def test_the_keys_read_are_the_trainers():
    from tpufinetune_trainer import generation

    assert set(GENERATION_KEYS) == set(generation.METRIC_KEYS.values())
    assert {GENERATION_KEYS[key] for key in generation.METRIC_KEYS.values()} == set(generation.METRIC_KEYS)


def status_of(*events: dict) -> dict:
    status: dict = {}
    for event in events:
        apply_event(status, event)
    return status


def test_the_table_has_a_row_per_epoch_with_its_loss_and_metrics():
    status = status_of(epoch(2, **generated(2, 0.5, 0.7, 30.0)), epoch(1, **generated(1, 0.125, 0.41234, 12.3456)))
    table, note = evaluation_table(status)
    assert note == ""
    assert table.splitlines() == [
        "EPOCH  EVAL_LOSS  EXACT_MATCH  ROUGE_L  BLEU   ANSWERS",
        "1      0.4500     0.1250       0.4123   12.35  64",
        "2      0.3500     0.5000       0.7000   30.00  64",
        "samples: gs://b/runs/r-1/eval-samples/",
    ]


def test_the_table_shows_only_the_metrics_the_run_has_and_dashes_for_an_epoch_without():
    only_rouge = {"eval_rouge_l": 0.5, "eval_generated": 8}
    table, _ = evaluation_table(status_of(epoch(1), epoch(2, **only_rouge)))
    assert table.splitlines() == ["EPOCH  EVAL_LOSS  ROUGE_L  ANSWERS", "1      0.4500     -        -",
                                  "2      0.3500     0.5000   8"]


def test_a_run_without_generation_metrics_says_so():
    table, note = evaluation_table(status_of(epoch(1), epoch(2)))
    assert note == NO_GENERATION and "spec.training.evaluation.generate" in note
    assert table.splitlines() == ["EPOCH  EVAL_LOSS", "1      0.4500", "2      0.3500"]
    assert evaluation_table({}) == ("EPOCH  EVAL_LOSS\n", NO_GENERATION)


@pytest.fixture
def run_read(monkeypatch):
    from tpufinetune.adapters import readrun

    found = {}

    def read(name, namespace, kubeconfig):
        if name not in found:
            raise LookupError(f'tpufinetune "{name}" not found in namespace {namespace or "default"}')
        return namespace or "default", found[name]

    monkeypatch.setattr(readrun, "read_tpufinetune", read)
    return found


def test_tpufinetune_eval_prints_the_runs_table(run_read, capsys):
    run_read["tuned"] = {"status": status_of(epoch(1, **generated(1, 0.125, 0.41234, 12.3456)))}
    assert cli.main(["eval", "tuned", "-n", "team"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split() == ["1", "0.4500", "0.1250", "0.4123", "12.35", "64"] and err == ""


def test_tpufinetune_eval_says_when_a_run_has_no_generation_metrics_or_is_not_found(run_read, capsys):
    run_read["plain"] = {"status": status_of(epoch(1))}
    assert cli.main(["eval", "plain"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("EPOCH  EVAL_LOSS") and f"default/plain: {NO_GENERATION}" in err
    assert cli.main(["eval", "missing"]) == 1
    assert "not found" in capsys.readouterr().err
