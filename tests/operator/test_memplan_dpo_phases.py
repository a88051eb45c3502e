"""A DPO run's memory plan in the run's phases: one that cannot fit its slice fails with
DoesNotFit before any RayCluster, the message naming the figure and the reference; one
that fits records status.plan with its reference and goes on. Pure (phases.step)."""
from __future__ import annotations

from datetime import timedelta

from phase_helpers import IDENT, kinds, step

from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.core.api import parse_spec
from tpufinetune.core.status import checked_status


def _dpo_plan(training: dict, topology: str = "4x4") -> phases.Plan:
    spec = parse_spec({"tpu": {"generation": "v6e", "topology": topology}, "image": "img",
                       "model": {"id": "google/gemma-4-E4B-it"}, "checkpoint": {"storagePath": "gs://bucket/ckpt"},
                       "training": {"method": "dpo", **training}})
    return phases.plan_for(IDENT, spec, timedelta(minutes=30))


def test_a_dpo_run_that_cannot_fit_fails_naming_the_figure_before_any_raycluster():
    # E4B DPO, every weight trained, 1024 x 4 tokens a device: its full logits alone are 16 GiB.
    d = step({}, plan=_dpo_plan({"maxSeqLen": 1024, "batchSizePerDevice": 4}))
    assert d.phase == phases.FAILED and cond.find(d.status, cond.FAILED)["reason"] == "DoesNotFit"
    message = d.status["message"]
    assert "dpo fine-tune of google/gemma-4-E4B-it on v6e 4x4 needs" in message
    assert "GiB of HBM per chip, more than the 28.8 GiB usable" in message and "smallest that fits" in message
    assert "CreateCluster" not in kinds(d) and "SubmitJob" not in kinds(d)
    plan = d.status["plan"]
    assert plan["method"] == "dpo" and plan["fits"] is False
    assert f"{plan['perChipHBMBytes'] / 2**30:.1f} GiB of HBM per chip" in message
    assert checked_status(d.status) is d.status


def test_a_dpo_lora_run_that_fits_records_its_reference_and_goes_on():
    plan = _dpo_plan({"maxSeqLen": 1024, "batchSizePerDevice": 2, "activationCheckpointing": "block", "lora": {}},
                     topology="2x4")
    d = step({}, plan=plan)
    assert d.phase == phases.PENDING and d.status["plan"]["fits"] is True
    assert "reference: the base with the adapters disabled (no second copy)" in d.status["plan"]["message"]
    assert "CreateCluster" in kinds(step(d.status, plan=plan))
