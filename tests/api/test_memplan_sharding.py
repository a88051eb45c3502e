"""What the memory plan chooses (core/memplan_sharding.py): the activation checkpointing and
the shard group of a run whose spec leaves them auto, the collectives a step moves with
each, the refusal of a pinned choice that does not fit, and the trainer flags and status.plan
fields that carry the choice."""
from __future__ import annotations

from pathlib import Path

import pytest
from api_spec_cases import base_spec

from tpufinetune.core import memplan, memplan_sharding, memplan_spec
from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import trainer_argv
from tpufinetune.core.memplan_shapes import known_shape
from tpufinetune.core.render import RenderError, render
from tpufinetune.core.status import TPUFineTuneStatus

E2B, E4B, B31 = "google/gemma-4-E2B-it", "google/gemma-4-E4B-it", "google/gemma-4-31B-it"
SAMPLE = Path(__file__).resolve().parents[2] / "deploy/samples/finetune-v6e-4x4.yaml"


def spec(model: str, generation: str = "v6e", topology: str = "4x4", slices: int = 1, **training):
    raw = base_spec()
    raw["tpu"] = {"generation": generation, "topology": topology, **({"slices": slices} if slices > 1 else {})}
    raw["model"] = {"id": model}
    raw["training"] = training
    return parse_spec(raw)


def plan(model: str, **kwargs) -> memplan.MemoryPlan:
    return memplan_spec.plan_spec(spec(model, **kwargs))


def flags(parsed) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in trainer_argv(parsed, run_name="r") if a.startswith("--"))


def fits_at(model: str, group: int, **kwargs) -> bool:
    """Whether the spec's request (its choices as made) fits with the state over `group` devices."""
    request = memplan_spec.request_of(spec(model, **kwargs))
    return bool(memplan._plan(memplan.replace(request, shard_group=group, keep_gathered=False)).fits)


def test_a_state_that_fits_one_device_is_replicated():
    lora = plan(E4B, method="lora")
    assert lora.fits and (lora.choices.sharding, lora.choices.shard_group, lora.choices.replicas) == ("replicate", 1, 16)
    assert lora.choices.sharding_by == "plan"
    # The state is whole on every device: the weights' bytes are the model's, not a 16th.
    assert lora.breakdown.weights >= 2 * known_shape(E4B).parameters


def test_the_smallest_group_that_fits_is_chosen_hybrid():
    e4b = plan(E4B, batchSizePerDevice=4, maxSeqLen=512)
    assert e4b.fits and (e4b.choices.sharding, e4b.choices.shard_group, e4b.choices.replicas) == ("hybrid", 8, 2)
    assert not fits_at(E4B, 4, batchSizePerDevice=4, maxSeqLen=512)  # the next smaller does not
    assert not fits_at(E4B, 1, batchSizePerDevice=4, maxSeqLen=512)
    assert e4b.breakdown.optimizer == -(-8 * known_shape(E4B).parameters // 8)  # AdamW's moments over 8


def test_a_state_that_fits_no_smaller_group_is_sharded_over_the_whole_slice():
    e2b = plan(E2B, batchSizePerDevice=4, maxSeqLen=512)
    assert e2b.fits and (e2b.choices.sharding, e2b.choices.shard_group, e2b.choices.replicas) == ("full", 16, 1)
    assert not fits_at(E2B, 8, batchSizePerDevice=4, maxSeqLen=512)
    assert "--shard-group" not in flags(spec(E2B, batchSizePerDevice=4, maxSeqLen=512))  # the trainer's default


def test_several_slices_replicate_across_slices_and_groups_and_hold_the_same_per_device():
    one, two = plan(E4B, batchSizePerDevice=4), plan(E4B, batchSizePerDevice=4, slices=2)
    assert (two.choices.sharding, two.choices.shard_group, two.choices.replicas) == ("hybrid", 8, 4)
    assert two.per_chip_bytes == one.per_chip_bytes
    full = plan(E2B, batchSizePerDevice=4, slices=2)
    assert (full.choices.sharding, full.choices.replicas) == ("full", 2)
    # Across slices, once a step: the gradient shard all-reduced between the two copies.
    shape = known_shape(E2B)
    assert full.choices.collectives.all_reduce == int(2 * 4 * shape.parameters / 16 * (2 - 1) / 2)


def test_the_collectives_of_a_step_are_counted_for_each_mode():
    shape = known_shape(E4B)
    params, embedding = shape.parameters, shape.embedding
    request = memplan.Request(E4B, "full", "v6e", "4x4", 512, 4, activation_checkpointing="block")
    by = {group: memplan_sharding.collectives_of(request, group, 16) for group in (1, 8, 16)}
    # Replicate: nothing gathered or scattered, the whole fp32 gradient all-reduced over 16.
    assert by[1] == memplan_sharding.Collectives(0, 0, int(2 * 4 * params * 15 / 16))
    # Full, one slice: the bf16 weights gathered for the forward and each block's again for
    # its backward (the embedding stays gathered), the fp32 gradients reduce-scattered; no all-reduce.
    assert by[16] == memplan_sharding.Collectives(int(2 * (2 * params - embedding) * 15 / 16),
                                                  int(4 * params * 15 / 16), 0)
    # Hybrid 8: within 8, then the shard all-reduced across the 2 groups.
    assert by[8] == memplan_sharding.Collectives(int(2 * (2 * params - embedding) * 7 / 8), int(4 * params * 7 / 8),
                                                 int(2 * 4 * params / 8 / 2))
    # Every micro-batch gathers and scatters again; the all-reduce stays once a step.
    twice = memplan_sharding.collectives_of(request, 8, 16, micro_batches=2)
    assert (twice.all_gather, twice.reduce_scatter, twice.all_reduce) == (
        2 * by[8].all_gather, 2 * by[8].reduce_scatter, by[8].all_reduce)
    kept = memplan_sharding.collectives_of(memplan.replace(request, keep_gathered=True), 16, 16)
    assert kept.all_gather == int(2 * params * 15 / 16)  # gathered once a micro-batch
    # LoRA reduces only the adapters' gradients.
    lora = memplan_sharding.collectives_of(memplan.replace(request, method="lora"), 16, 16)
    assert lora.reduce_scatter == int(4 * shape.lora_parameters(16) * 15 / 16)
    # globalBatchBlocks of two micro-batches reaches the count from the spec.
    accumulated = plan(E4B, batchSizePerDevice=4, globalBatchBlocks=2 * 16 * 4)
    assert accumulated.choices.micro_batches == 2


def test_auto_checkpointing_keeps_activations_when_they_fit_else_the_cheapest_that_does():
    e4b = plan(E4B, batchSizePerDevice=4, maxSeqLen=512)
    assert (e4b.choices.checkpointing, e4b.choices.checkpointing_by) == ("block", "plan")
    assert flags(spec(E4B, batchSizePerDevice=4, maxSeqLen=512))["activation-checkpointing"] == "block"
    small = plan(E2B, batchSizePerDevice=1, maxSeqLen=512)
    assert (small.choices.checkpointing, small.choices.checkpointing_by) == ("none", "plan")
    assert "--activation-checkpointing" not in flags(spec(E2B, batchSizePerDevice=1, maxSeqLen=512))
    # Between them: the attention recomputed is enough.
    middle = plan(E2B, method="lora", batchSizePerDevice=4, maxSeqLen=512)
    assert middle.choices.checkpointing == "selective"
    assert plan(E2B, method="lora", batchSizePerDevice=4, maxSeqLen=512, activationCheckpointing="none",
                sharding="full").fits is False
    # "auto" written out is unset.
    assert plan(E4B, activationCheckpointing="auto", sharding="auto").choices == e4b.choices


def test_the_e4b_sample_renders_with_block_chosen_and_shown():
    text = SAMPLE.read_text().replace("gemma-4-E2B-it", "gemma-4-E4B-it")
    out = render([__import__("yaml").safe_load(text)], "e4b.yaml", jobs=True)
    assert "--activation-checkpointing=block" in out and "--shard-group=8" in out
    assert "activation checkpointing block (chosen by the plan)" in out
    status = memplan_spec.status_of(plan(E4B, batchSizePerDevice=4, maxSeqLen=512))
    assert status["activationCheckpointing"] == {"mode": "block", "chosenBy": "plan"}
    assert status["sharding"]["mode"] == "hybrid" and status["sharding"]["shardGroup"] == 8
    assert status["sharding"]["chosenBy"] == "plan"
    assert status["sharding"]["collectiveBytesPerStep"] == (status["sharding"]["allGatherBytes"]
                                                            + status["sharding"]["reduceScatterBytes"]
                                                            + status["sharding"]["allReduceBytes"])
    assert TPUFineTuneStatus.model_validate({"plan": status}).plan.sharding.shard_group == 8


def test_a_pinned_value_is_kept_and_refused_when_it_does_not_fit_naming_what_fits():
    replicated = plan(E4B, batchSizePerDevice=4, sharding="replicate")
    assert replicated.fits is False and replicated.choices.sharding_by == "spec"
    assert memplan.refuses(replicated)
    assert replicated.smallest_fit == "sharding hybrid (training.sharding; shard group 8 of 16 devices)"
    assert "smallest that fits: sharding hybrid (training.sharding" in replicated.refusal()
    with pytest.raises(RenderError, match="training.sharding"):
        render([{"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "r"},
                 "spec": {**base_spec(), "model": {"id": E4B},
                          "training": {"batchSizePerDevice": 4, "sharding": "replicate"}}}], "r.yaml")
    # Pinned full where hybrid would do: kept, fits.
    full = plan(E4B, batchSizePerDevice=4, sharding="full")
    assert full.fits and (full.choices.sharding, full.choices.sharding_by) == ("full", "spec")
    # Pinned hybrid: the smallest group that fits.
    assert plan(E4B, batchSizePerDevice=4, sharding="hybrid").choices.shard_group == 8
    # Pinned checkpointing: as today, refused with the smallest fit named.
    kept = plan(E4B, batchSizePerDevice=4, activationCheckpointing="none")
    assert kept.fits is False and kept.choices.checkpointing_by == "spec"
    assert kept.smallest_fit.startswith("activationCheckpointing block")
    # A pinned replicate that fits is passed as one device's group.
    assert flags(spec(E4B, method="lora", sharding="replicate"))["shard-group"] == "1"


def test_nothing_is_chosen_without_figures_to_choose_by():
    """The cpu stand-in and a model the plan does not know: auto is none and full."""
    for parsed in (spec(E4B, generation="cpu", topology="2"), spec("/models/tiny-gemma")):
        chosen = memplan_spec.plan_spec(parsed).choices
        assert (chosen.checkpointing, chosen.sharding) == ("none", "full"), parsed.tpu
        assert not {"activation-checkpointing", "shard-group"} & set(flags(parsed))
    # Pinned there: kept as written.
    assert flags(spec(E4B, generation="cpu", topology="2", sharding="replicate"))["shard-group"] == "1"
    assert flags(spec(E4B, generation="cpu", topology="4", sharding="hybrid"))["shard-group"] == "2"
    assert "shard-group" not in flags(spec(E4B, generation="cpu", topology="2", sharding="hybrid"))  # no group below 2


def test_the_model_config_keeps_the_choices_the_run_started_with_and_says_what_it_would_choose():
    request = memplan_spec.request_of(spec(E4B, batchSizePerDevice=4, maxSeqLen=512))
    small = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000, "model_type": "gemma4_text"}
    replanned = memplan_spec.with_model_config(request, small)
    assert (replanned.choices.checkpointing, replanned.choices.shard_group) == ("block", 8)  # what the trainer runs
    assert "would choose activation checkpointing none, sharding replicate (group 1)" in replanned.choices.replanned
    assert memplan_spec.status_of(replanned)["replanned"] == replanned.choices.replanned
    assert replanned.choices.collectives.total < request.choices.collectives.total / 100  # the config's widths
    same = memplan_spec.with_model_config(request, {"num_hidden_layers": 42, "hidden_size": 2560,
                                                    "intermediate_size": 10240, "num_attention_heads": 8,
                                                    "num_key_value_heads": 2, "head_dim": 256,
                                                    "vocab_size": 262144, "model_type": "gemma4_text",
                                                    "hidden_size_per_layer_input": 256})
    assert not same.choices.replanned and "replanned" not in memplan_spec.status_of(same)
