"""spec.training.evaluation (generation metrics each epoch, keepBestBy) in the API, pure: what
parse_spec refuses (api_spec_cases.GENERATION_INVALID) and accepts (GENERATION_ACCEPTED); the
real apiserver runs both lists against the generated CRD's CEL rules in test_crd_admission.py.
Here: every generation message has its CEL rule in the CRD, an older operator ignores the block
by name, and the run's defaults need nothing new stored in every object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import older_operator as older_operator_package
from api_spec_cases import GENERATION_ACCEPTED, GENERATION_INVALID, spec_with

from tpufinetune import crdgen
from tpufinetune.core import validation
from tpufinetune.core.api import parse_spec

MESSAGES = {validation.GENERATE_EVAL_MESSAGE, validation.GENERATE_METHOD_MESSAGE,
            validation.KEEP_BEST_METRIC_MESSAGE, validation.KEEP_BEST_SCORE_MESSAGE}


def generation_rules() -> list[tuple[str, dict]]:
    """(where: spec or training, rule) of the CRD's rules that carry the generation messages."""
    spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = [("spec", rule) for rule in spec.get("x-kubernetes-validations", [])]
    found += [("training", rule) for rule in spec["properties"]["training"].get("x-kubernetes-validations", [])]
    return [(where, rule) for where, rule in found if rule.get("message") in MESSAGES]


def test_every_generation_message_has_its_cel_twin_in_the_crd():
    assert {rule["message"] for _, rule in generation_rules()} == MESSAGES


@pytest.mark.parametrize("case", GENERATION_INVALID, ids=lambda c: c.id)
def test_parse_spec_refuses_each_generation_case_naming_its_field(case):
    with pytest.raises(validation.SpecError) as caught:
        parse_spec(case.spec)
    assert caught.value.field == case.field


@pytest.mark.parametrize("spec", GENERATION_ACCEPTED, ids=str)
def test_parse_spec_accepts_each_generation_spec(spec):
    parse_spec(spec)


def test_generate_unset_is_off_and_its_defaults_are_the_documented_ones():
    assert parse_spec(spec_with()).training.evaluation is None
    evaluation = parse_spec(spec_with(training={"evaluation": {"generate": {}}})).training.evaluation
    assert (evaluation.generate.examples, evaluation.generate.max_new_tokens, evaluation.generate.metrics,
            evaluation.keep_best_by) == (64, 64, ["exactMatch", "rougeL", "bleu"], "evalLoss")


# The last operator without training.evaluation.
PRE_EVALUATION_COMMIT = "e5796e6e118ae4f6101934e9ca4b16b3f7b80bbe"


@pytest.fixture(scope="module")
def older_operator(tmp_path_factory) -> Path:
    return older_operator_package.extract(PRE_EVALUATION_COMMIT, tmp_path_factory.mktemp("pre-evaluation"),
                                          "pre-evaluation")


def test_an_operator_older_than_evaluation_runs_the_spec_without_it_and_names_it_ignored(older_operator):
    """A rollback: the older operator drops training.evaluation as an unknown field and says so
    (the IgnoredFields condition), and the run trains as before, with no generation."""
    spec = spec_with(training={"evaluation": {"generate": {"examples": 8}, "keepBestBy": "rougeL"}})
    parse_spec(spec)  # this operator runs it
    answer = older_operator_package.reads(older_operator, spec)
    assert answer["ignored"] == ["spec.training.evaluation"]
    assert not [a for a in answer["argv"] if a.startswith(("--generate-", "--keep-best-by"))]


def test_an_older_operator_folds_a_newer_trainers_epoch_and_carries_this_versions_eval_entries(older_operator):
    """A newer trainer image's epoch event (eval_* keys) and a status this version wrote
    (history[].eval): the older operator folds the event without them and writes its status
    beside the carried entries, refusing nothing."""
    from tpufinetune.core.runevents import apply_event

    written: dict = {}
    apply_event(written, {"event": "epoch", "epoch": 1, "epochs": 2, "loss": 1.0, "eval_loss": 0.9,
                          "eval_exact_match": 0.5, "eval_rouge_l": 0.6, "eval_bleu": 10.0, "eval_generated": 8,
                          "eval_samples_uri": "gs://b/r/eval-samples/epoch-1.jsonl"})
    assert written["history"][0]["eval"]["examples"] == 8
    probe = ("import copy, json, sys\nfrom tpufinetune.core.runevents import apply_event\n"
             "from tpufinetune.core.status import checked_status\n"
             "previous = json.loads(sys.argv[1]); status = copy.deepcopy(previous)\n"
             "apply_event(status, {'event': 'epoch', 'epoch': 2, 'epochs': 2, 'loss': 0.5, 'eval_loss': 0.4,"
             " 'eval_exact_match': 0.75, 'eval_rouge_l': 0.8, 'eval_bleu': 20.0, 'eval_generated': 8})\n"
             "checked_status(status, previous)\nprint(json.dumps(status['history']))\n")
    first, second = older_operator_package.run(older_operator, probe, json.dumps(written))
    assert first["eval"] == written["history"][0]["eval"] and "eval" not in second
