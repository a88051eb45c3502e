"""spec.model.initFrom in the API, pure: its defaults, the CEL twins in the generated CRD, and
what an operator older than the field does with a chained run (a rollback)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

import older_operator
from api_spec_cases import spec_with
from tpufinetune.core.api import INIT_FROM_SELF_MESSAGE, parse_spec
from tpufinetune.core.validation import INIT_FROM_MODE_MESSAGE

CRD = Path(__file__).resolve().parents[2] / "crds" / "tpufinetunes.tpufinetune.dev.yaml"
# The last operator without spec.model.initFrom.
PRE_INIT_FROM_COMMIT = "ce7dde1543d8d15c7e23bea916fda1d5d538934b"


def test_unset_is_no_chain_and_the_artifact_defaults_to_the_export():
    assert parse_spec(spec_with()).model.init_from is None
    init = parse_spec(spec_with(model={"initFrom": {"run": "sft-e4b"}})).model.init_from
    assert (init.run, init.artifact) == ("sft-e4b", "export")


def test_the_crd_refuses_a_self_chain_on_the_object_and_collectives_on_the_spec_in_the_same_words():
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (own,) = [r for r in schema["x-kubernetes-validations"] if r["fieldPath"] == ".spec.model.initFrom.run"]
    assert own["message"] == INIT_FROM_SELF_MESSAGE and "self.metadata.name" in own["rule"]
    spec_rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    assert [r["message"] for r in spec_rules if r["fieldPath"] == ".model.initFrom"] == [INIT_FROM_MODE_MESSAGE]
    assert "default" not in schema["properties"]["spec"]["properties"]["model"]["properties"]["initFrom"]


def test_an_operator_older_than_init_from_names_it_ignored_rather_than_silently_train_the_base(tmp_path):
    """A rollback: the older operator cannot wait for the source. It drops spec.model.initFrom as
    an unknown field and names it (condition SpecFieldsIgnored, a Warning Event): what it trains
    from is then spec.model.id, which the run's status and Events say."""
    operator = older_operator.extract(PRE_INIT_FROM_COMMIT, tmp_path, "pre-initFrom")
    chained = spec_with(model={"initFrom": {"run": "sft-e4b", "artifact": "export"}})
    answer = older_operator.reads(operator, chained)
    assert answer["ignored"] == ["spec.model.initFrom"]
    assert answer["says"].startswith("this operator version does not know spec.model.initFrom")
    assert [a for a in answer["argv"] if a.startswith("--model-id")] == ["--model-id=google/gemma-4-E2B-it"]
