"""Each epoch's generation metrics in status and on the command line (core/runevents.py,
core/evalstatus.py, evaltable.py, `tpufinetune eval`): the trainer's epoch event carries
exact match, ROUGE-L, BLEU, the answers scored and where the samples are (docs/protocol.md);
each epoch's are kept in status.history[].eval, a run without generation has none, a value
the status cannot hold drops its event, and `tpufinetune eval NAME` prints them per epoch
beside the eval loss, or says that the run has none; `tpufinetune eval NAME --samples` prints
an epoch's prompts, references and answers from the file the trainer wrote (its own writer's
format), or says why it cannot."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from tpufinetune import cli
from tpufinetune.core.runevents import GENERATION_KEYS, apply_event, split_malformed
from tpufinetune.core.status import TPUFineTuneStatus, checked_status
from tpufinetune.evalsamples import (PROMPT_TAIL_CHARS, answer_matches, first_lines, parse_samples,
                                     samples_epoch, samples_listing)
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


def test_an_epochs_first_answers_are_kept_with_the_images_a_multimodal_prompt_was_asked_with():
    from tpufinetune.core.evalstatus import (GENERATION_SAMPLE_LIMIT, GENERATION_TEXT_LIMIT, IMAGE_PATH_LIMIT,
                                             PROMPT_IMAGE_LIMIT)

    image = "gs://b/data/images/00007.png"
    answers = [{"prompt": "What colour is this picture?", "reference": "The picture is red.",
                "output": "The picture is red.", "images": [image]},
               {"prompt": "p", "reference": "r" * 999, "output": "o",
                "images": ["gs://b/" + "d/" * 400 + "x.png"] * 99}] + \
              [{"prompt": "p", "reference": "r", "output": f"answer {k}", "images": []} for k in range(9)]
    status = status_of(epoch(1, **generated(1, 0.5, 0.7, 30.0), eval_samples=answers),
                       epoch(2, **generated(2, 0.5, 0.7, 30.0), eval_samples=[{"output": "text", "reference": "t"}]))
    first = status["history"][0]["eval"]["samples"]
    assert len(first) == GENERATION_SAMPLE_LIMIT
    assert first[0] == {"output": "The picture is red.", "reference": "The picture is red.", "images": [image]}
    assert len(first[1]["reference"]) == GENERATION_TEXT_LIMIT and len(first[1]["images"]) == PROMPT_IMAGE_LIMIT
    assert first[1]["images"][0].endswith("/d/x.png") and len(first[1]["images"][0]) == IMAGE_PATH_LIMIT
    assert status["history"][1]["eval"]["samples"] == [{"output": "text", "reference": "t"}]  # a text run's: no images
    assert checked_status(status) is status  # every key declared (the API server would prune one that is not)
    dumped = TPUFineTuneStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["history"] == status["history"]


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
        "samples: gs://b/runs/r-1/eval-samples/ (printed by --samples)",
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


# `tpufinetune eval NAME --samples`: an epoch's prompts, references and answers, read from the
# samplesURI its status names, in the trainer's own format (generation.samples_text).

def history_with_samples(*epochs: int, without: tuple[int, ...] = ()) -> list[dict]:
    """Entries for `epochs`, those in `without` with figures but no samplesURI (a write that failed)."""
    status: dict = {}
    for n in epochs:
        figures = generated(n, 0.5, 0.5, 10.0)
        if n in without:
            figures.pop("eval_samples_uri")
        apply_event(status, epoch(n, **figures))
    return status["history"]


def test_the_samples_shown_are_the_last_epochs_that_has_them_or_the_one_asked_for():
    history = history_with_samples(2, 1, 3, without=(3,))
    assert samples_epoch(history, None) == (2, SAMPLES.format(2))
    assert samples_epoch(history, 1) == (1, SAMPLES.format(1))
    with pytest.raises(LookupError, match=r"epoch 3 has no generation samples \(epochs with samples: 1, 2\)"):
        samples_epoch(history, 3)
    for none in (None, [], status_of(epoch(1), epoch(2))["history"]):
        with pytest.raises(LookupError, match="spec.training.evaluation.generate"):
            samples_epoch(none, None)


def sample_lines(*samples: tuple[str, str, str]) -> str:
    from tpufinetune_trainer import generation

    prompts, references, outputs = (list(column) for column in zip(*samples))
    return generation.samples_text(prompts, references, outputs)


def test_each_sample_shows_the_prompts_end_the_reference_the_answer_and_whether_they_match():
    long_prompt = "<start_of_turn>user\n" + "context " * 40 + "What is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    text = sample_lines((long_prompt, "4", " 4\n"), ("Greet", "hello\nthere", "hi\x1b[2J"), ("Say nothing", "", ""))
    listing = samples_listing(3, "gs://b/r/eval-samples/epoch-3.jsonl", parse_samples(text), None)
    tail = long_prompt[-PROMPT_TAIL_CHARS:].splitlines()
    assert listing.splitlines() == [
        "epoch 3: 3 answers, 2 equal to their reference",
        "(gs://b/r/eval-samples/epoch-3.jsonl)",
        "",
        "#1  exact match",  # whitespace stripped, as the trainer's exactMatch
        f"  prompt     ...{tail[0]}",
        f"             {tail[1]}",
        "  reference  4",
        "  answer      4",
        "",
        "#2  differs",
        "  prompt     Greet",
        "  reference  hello",
        "             there",
        "  answer     hi\\x1b[2J",  # a generated escape sequence is written out, never sent to the terminal
        "",
        "#3  exact match",
        "  prompt     Say nothing",
        "  reference  (empty)",
        "  answer     (empty)",
    ]
    first = samples_listing(3, "u", parse_samples(text), 1).splitlines()
    assert first[0] == "epoch 3: 3 answers, 2 equal to their reference; the first 1 below"
    assert "#2  differs" not in first
    assert first_lines(text, 2) == "".join(text.splitlines(keepends=True)[:2])
    assert first_lines(text, None) == text
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        parse_samples(text.splitlines()[0] + "\n{truncated")


def test_a_multimodal_sample_shows_the_images_its_prompt_was_asked_with():
    from tpufinetune_trainer import generation

    images = ["gs://b/data/images/00007.png", "gs://b/data/images/00008.png"]
    text = generation.samples_text(["What colour is this picture?", "Say hi"], ["The picture is red."] + ["hi"],
                                   ["The picture is red.", "hi"], [images, None])
    listing = samples_listing(1, "u", parse_samples(text), None).splitlines()
    assert listing[3:9] == ["#1  exact match", "  prompt     What colour is this picture?",
                            f"  images     {images[0]}", f"             {images[1]}",
                            "  reference  The picture is red.", "  answer     The picture is red."]
    assert listing[9:] == ["", "#2  exact match", "  prompt     Say hi", "  reference  hi", "  answer     hi"]


def test_the_match_marked_is_the_trainers_exact_match():
    from tpufinetune_trainer import generation

    pairs = [("4", " 4\n"), ("Paris", "paris"), ("a b", "a  b"), ("", " "), ("yes", "yes.")]
    for reference, answer in pairs:
        assert answer_matches(answer, reference) == (generation.score([answer], [reference], ["exactMatch"])[
            "exactMatch"] == 1.0), (reference, answer)


def run_with_samples(tmp_path, epochs: int = 2) -> tuple[dict, dict[int, str]]:
    """A run whose trainer wrote each epoch's samples to a local storage path, as it does (generation.py)."""
    from tpufinetune_trainer import generation

    uris = {}
    status: dict = {}
    for n in range(1, epochs + 1):
        uris[n] = generation.samples_uri(str(tmp_path / "storage"), "tuned-6f1c", n)
        generation.write_samples(uris[n], sample_lines((f"Question {n}?", f"answer {n}", f"answer {n}"),
                                                       ("Other?", "yes", "no")))
        figures = {**generated(n, 0.5, 0.5, 10.0), "eval_samples_uri": uris[n]}
        apply_event(status, epoch(n, **figures))
    return {"status": status}, uris


def test_tpufinetune_eval_samples_prints_an_epochs_samples_from_the_runs_storage(run_read, tmp_path, capsys):
    run_read["tuned"], uris = run_with_samples(tmp_path)
    assert cli.main(["eval", "tuned", "-n", "team", "--samples"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[:2] == ["epoch 2: 2 answers, 1 equal to their reference", f"({uris[2]})"]
    assert "  prompt     Question 2?" in out.splitlines() and "#2  differs" in out.splitlines()
    assert cli.main(["eval", "tuned", "--samples", "--epoch", "1", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "  reference  answer 1" in out.splitlines() and "#2" not in out
    assert cli.main(["eval", "tuned", "--samples", "--json"]) == 0
    assert capsys.readouterr().out == Path(uris[2]).read_text()  # the lines as the trainer wrote them


def test_tpufinetune_eval_samples_says_why_it_has_none(run_read, tmp_path, capsys):
    run_read["tuned"], uris = run_with_samples(tmp_path)
    run_read["plain"] = {"status": status_of(epoch(1))}
    assert cli.main(["eval", "plain", "--samples"]) == 1
    assert "default/plain: it has no generation samples" in (err := capsys.readouterr().err)
    assert "spec.training.evaluation.generate" in err
    assert cli.main(["eval", "tuned", "--samples", "--epoch", "5"]) == 1
    assert "epoch 5 has no generation samples (epochs with samples: 1, 2)" in capsys.readouterr().err
    Path(uris[2]).unlink()  # removed from the bucket (a lifecycle rule), still named in status
    assert cli.main(["eval", "tuned", "--samples"]) == 1
    assert f"default/tuned: epoch 2: cannot read {uris[2]}: " in capsys.readouterr().err
    Path(uris[1]).write_text('{"prompt": "cut sho')
    assert cli.main(["eval", "tuned", "--samples", "--epoch", "1"]) == 1
    assert f"cannot read {uris[1]}: line 1 is not JSON" in capsys.readouterr().err


def test_tpufinetune_eval_refuses_sample_options_without_samples_before_reaching_anything(capsys):
    for argv, refusal in ((["--epoch", "1"], "go with --samples"), (["--json"], "go with --samples"),
                          (["--samples", "--epoch", "0"], "--epoch must be 1 or more"),
                          (["--samples", "--limit", "0"], "--limit must be 1 or more")):
        assert cli.main(["eval", "demo", *argv]) == cli.EXIT_INVALID
        assert refusal in capsys.readouterr().err
