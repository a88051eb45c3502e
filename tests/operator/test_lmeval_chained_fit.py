"""lm-eval's fit for a chained run (spec.model.initFrom with spec.evaluation.lmEval): the export
lm-eval loads is of the source's base model (status.initFrom.modelId), not spec.model.id (left
at its default). Admission could check only spec.model.id; once the source is recorded, a base
whose export cannot be evaluated on one device ends the run before it asks for a slice."""
from __future__ import annotations

from datetime import timedelta

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core import lmevalrules, phases
from tpufinetune.core.api import SpecError, parse_spec
from tpufinetune.core.phases import Identity, Observations, plan_for

from phase_helpers import T0

IDENT = Identity("dpo", "team-a", "uid-dpo", generation=1)
E4B = "google/gemma-4-E4B-it"  # its export needs more than a v5e chip holds; E2B's fits
CHAINED = {"tpu": {"generation": "v5e", "topology": "4x4"}, "image": "example.com/trainer:1",
           "checkpoint": {"storagePath": "gs://bucket/runs"}, "model": {"initFrom": {"run": "sft"}},
           "dataset": {"id": "gs://bucket/pairs.jsonl", "split": "train"},
           "training": {"method": "dpo", "lora": {}, "epochs": 1, "batchSizePerDevice": 1,
                        "activationCheckpointing": "block"},
           "evaluation": {"lmEval": {"tasks": ["hellaswag"]}}}


def recorded(model_id: str) -> dict:
    return {"run": "sft", "uid": "uid-sft", "artifact": "export", "uri": "gs://bucket/runs/sft/export",
            "modelId": model_id}


def test_a_chained_run_is_checked_with_its_sources_base_once_recorded():
    spec = parse_spec(CHAINED)  # admitted: spec.model.id is the default, whose export fits
    assert lmevalrules.evaluated_model(spec) == spec.model.id
    assert lmevalrules.evaluated_model(spec, recorded(E4B)) == E4B
    plan = plan_for(IDENT, spec, timedelta(minutes=30), init_from=recorded(E4B))
    assert plan.does_not_fit.startswith(f"spec.evaluation.lmEval: {E4B} in bfloat16 needs "), plan.does_not_fit
    assert "v5e chip" in plan.does_not_fit
    # The same refusal as a spec that names that model itself gets at admission.
    with pytest.raises(SpecError) as named:
        parse_spec({**CHAINED, "model": {"id": E4B}})
    assert plan.does_not_fit == str(named.value)
    status = {"phase": "Pending", "initFrom": recorded(E4B)}
    d = phases.transition(IDENT, plan, status, Observations(now=T0))
    assert d.phase == phases.FAILED and "rayClusterName" not in d.status  # no slice asked for
    failed = cond.find(d.status, "Failed")
    assert failed["reason"] == "DoesNotFit" and E4B in failed["message"], failed
    assert not any(isinstance(a, phases.CreateCluster) for a in d.actions)


def test_a_base_that_fits_and_a_run_without_lm_eval_go_on():
    spec = parse_spec(CHAINED)
    assert plan_for(IDENT, spec, timedelta(minutes=30), init_from=recorded("google/gemma-4-E2B-it")).does_not_fit == ""
    without = parse_spec({k: v for k, v in CHAINED.items() if k != "evaluation"})
    assert lmevalrules.resolved_fit_refusal(without, recorded(E4B)) == ""
    # Not chained: admission already checked spec.model.id, the model it trains.
    assert lmevalrules.evaluated_model(parse_spec({**CHAINED, "model": {}}), recorded(E4B)) == spec.model.id
