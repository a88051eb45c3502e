"""The memory plan of a DPO run (core/memplan.py, memplan_dpo.py, memplan_spec.py): the
reference the trainer holds is counted (none of them a second copy of the weights), the
full logits DPO's loss needs, a refusal naming the figure, and the plan against measured
DPO peaks (benchmarks/bench_memplan_dpo.py). Pure: no cluster, no model download."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from api_spec_cases import base_spec

from tpufinetune.core import memplan, memplan_dpo, memplan_spec
from tpufinetune.core.api import parse_spec
from tpufinetune.core.status import TPUFineTuneStatus

E2B = memplan.known_shape("google/gemma-4-E2B-it")


def dpo_spec(training: dict, generation: str = "v6e", topology: str = "4x4", model: str = "google/gemma-4-E2B-it"):
    raw = base_spec()
    raw["tpu"] = {"generation": generation, "topology": topology}
    raw["model"] = {"id": model}
    raw["training"] = {"method": "dpo", **training}
    return parse_spec(raw)


def bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_memplan_dpo

    return bench_memplan_dpo


@pytest.mark.parametrize("compute_bytes", [2, 4])
def test_dpo_full_holds_no_second_copy_and_pays_for_the_full_logits(compute_bytes):
    """Full DPO's reference is stored log-probabilities: the weights, gradients, AdamW state
    and activations are SFT's (no frozen copy beside the policy); the loss head is the full
    logits' as segment_logps holds them: the softcap's tanh output in the compute dtype, the
    fp32 log-softmax and, at the backward, two fp32 gradients (16 B a logit in fp32, 14 in bf16)."""
    sft = memplan.device_bytes(E2B, "full", 16, 512, 4, compute_bytes=compute_bytes)
    dpo = memplan.device_bytes(E2B, "full", 16, 512, 4, compute_bytes=compute_bytes, dpo_reference="stored")
    assert (dpo.weights, dpo.grads, dpo.optimizer, dpo.gathered, dpo.activations) == \
        (sft.weights, sft.grads, sft.optimizer, sft.gathered, sft.activations)
    assert dpo.weights == -(-4 * E2B.parameters // 16)  # fp32 master only: no bf16 reference copy
    per_logit = {4: 16, 2: 14}[compute_bytes]
    assert dpo.loss_head - sft.loss_head == E2B.vocab * (512 * 4 * per_logit - 2 * memplan.CHUNK_ROWS * 4)


def test_the_lora_reference_forward_is_counted_where_it_exceeds_the_backward(monkeypatch):
    """LoRA's reference (the base, adapters off) runs a no-grad forward while the policy's
    saved logits are held: its logits, their fp32 copy (bf16) and log-softmax beside them.
    In bf16 that is 16 B a logit against the backward's 14: the reference's figure is the
    head's; in fp32 both are 16. Reference-free LoRA has no such forward."""
    tokens = 512 * 4
    for compute_bytes, extra in ((2, 2), (4, 0)):
        off = memplan.device_bytes(E2B, "lora", 16, 512, 4, compute_bytes=compute_bytes, dpo_reference="adapters-off")
        free = memplan.device_bytes(E2B, "lora", 16, 512, 4, compute_bytes=compute_bytes, dpo_reference="none")
        assert off.loss_head - free.loss_head == tokens * E2B.vocab * extra, compute_bytes
        assert off.weights == free.weights  # the same model: no second copy
    monkeypatch.setattr(memplan_dpo, "BACKWARD_GRADS", 3)  # a backward above the reference's 16 B
    off = memplan.device_bytes(E2B, "lora", 16, 512, 4, dpo_reference="adapters-off")
    free = memplan.device_bytes(E2B, "lora", 16, 512, 4, dpo_reference="none")
    assert off == free
    with pytest.raises(ValueError, match="unknown DPO reference 'copy'"):
        memplan.device_bytes(E2B, "lora", 16, 512, 4, dpo_reference="copy")


def test_the_spec_picks_the_reference_the_trainer_holds_and_the_plan_says_it():
    # Sharded alike (the plan would replicate the LoRA run's state: memplan_sharding).
    full = memplan_spec.plan_spec(dpo_spec({"maxSeqLen": 512, "batchSizePerDevice": 1, "sharding": "full"}))
    lora = memplan_spec.plan_spec(dpo_spec({"maxSeqLen": 512, "batchSizePerDevice": 1, "lora": {"rank": 8},
                                            "sharding": "full"}))
    free = memplan_spec.plan_spec(dpo_spec({"maxSeqLen": 512, "batchSizePerDevice": 1, "lora": {},
                                            "dpo": {"referenceFree": True}}))
    assert (full.method, full.reference, lora.reference, free.reference) == ("dpo", "stored", "adapters-off", "none")
    assert lora.breakdown.weights < full.breakdown.weights  # the frozen bf16 base, not the fp32 master
    assert lora.breakdown.optimizer < full.breakdown.optimizer / 100  # adapters only
    status = memplan_spec.status_of(lora)
    assert "the base with the adapters disabled (no second copy)" in status["message"]
    assert "computed once before training" in memplan_spec.status_of(full)["message"]
    TPUFineTuneStatus.model_validate({"plan": status})


def test_a_dpo_run_that_does_not_fit_is_refused_naming_the_figure_and_dpo_with_lora():
    plan = memplan_spec.plan_spec(dpo_spec({"maxSeqLen": 512, "batchSizePerDevice": 4}, generation="v5e",
                                           topology="2x4", model="google/gemma-4-E4B-it"))
    assert plan.fits is False and memplan.refuses(plan)
    refusal = plan.refusal()
    assert refusal.startswith(f"dpo fine-tune of google/gemma-4-E4B-it on v5e 2x4 needs "
                              f"{plan.per_chip_bytes / memplan.GIB:.1f} GiB of HBM per chip")
    assert "smallest that fits: DPO with LoRA (training.lora, rank 16)" in refusal
    lighter = memplan_spec.plan_spec(dpo_spec({"maxSeqLen": 512, "batchSizePerDevice": 4, "lora": {}},
                                              generation="v5e", topology="2x4", model="google/gemma-4-E4B-it"))
    assert lighter.reference == "adapters-off" and lighter.smallest_fit
    assert "DPO with LoRA" not in lighter.smallest_fit  # it already trains adapters


def test_the_dpo_benchmark_holds_out_full_and_lora_rows_of_both_dtypes_and_references():
    rows = bench().HELD_OUT.values()
    for method, reference in (("full", "stored"), ("lora", "adapters-off")):
        mine = [r for r in rows if r["method"] == method and r["reference"] == reference]
        assert len(mine) >= 2 and {r["dtype"] for r in mine} == {"fp32", "bf16"}, method
    assert {r["reference"] for r in rows} == set(memplan_dpo.REFERENCES)


def test_the_dpo_plan_stays_within_25_percent_of_the_measured_peaks():
    """bench_memplan_dpo.py's recorded peaks: every DPO row (none fitted to) within 25% of
    the plan, at least two full and two LoRA rows measured."""
    b = bench()
    assert set(b.MEASURED) <= set(b.CONFIGS)
    measured = {b.CONFIGS[name]["method"] for name in b.MEASURED}
    assert sum(b.CONFIGS[n]["method"] == "full" for n in b.MEASURED) >= 2
    assert sum(b.CONFIGS[n]["method"] == "lora" for n in b.MEASURED) >= 2, measured
    for name, peak in b.MEASURED.items():
        ratio = b.planned(name) / b.MIB / peak
        assert abs(ratio - 1) <= b.TOLERANCE, (name, round(ratio, 2))
