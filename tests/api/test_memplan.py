"""The memory planner (core/memplan.py): which runs fit their slice, and what the refusal
says. Pure: no cluster, no model download (known models are a table)."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
from api_spec_cases import base_spec

from tpufinetune.core import generations as g
from tpufinetune.core import memplan, memplan_spec
from tpufinetune.core.api import parse_spec
from tpufinetune.core.status import TPUFineTuneStatus

GIB = 2**30
# What a spec pins to compare its plan with a Request's (whose defaults these are): the
# plan would otherwise choose (memplan_sharding; tests/api/test_memplan_sharding.py).
FULL_SHARDING = {"sharding": "full"}
KEPT = {"activationCheckpointing": "none"}


def request(model: str, generation: str = "v6e", topology: str = "4x4", method: str = "full", **overrides):
    values = dict(model_id=model, method=method, generation=generation, topology=topology, max_seq_len=512,
                  batch_per_device=4)
    return memplan.Request(**{**values, **overrides})


def spec(model: str, generation: str = "v6e", topology: str = "4x4", **overrides):
    raw = base_spec()
    raw["tpu"] = {"generation": generation, "topology": topology}
    raw["model"] = {"id": model}
    raw.update(overrides)
    return parse_spec({k: v for k, v in raw.items() if v is not None})


def test_31b_full_on_v6e_16_does_not_fit_and_says_what_would():
    plan = memplan.estimate(request("google/gemma-4-31B-it"))
    assert plan.basis == "table" and plan.fits is False and memplan.refuses(plan)
    assert plan.per_chip_bytes > plan.limit_bytes == int(32 * GIB * (1 - memplan.HEADROOM))
    message = plan.refusal()
    figure, limit = re.findall(r"(\d+\.\d) GiB", message)[:2]
    assert float(figure) == round(plan.per_chip_bytes / GIB, 1) and float(limit) == 28.8
    assert "HBM per chip" in message and "v6e 4x4" in message
    assert plan.smallest_fit and plan.smallest_fit in message
    # What it names does fit: the same method on four times the chips, recomputing activations.
    assert plan.smallest_fit == "activationCheckpointing block, topology 8x8 (64 chips)"
    assert memplan.estimate(request("google/gemma-4-31B-it", topology="8x8", activation_checkpointing="block")).fits
    assert not memplan.estimate(request("google/gemma-4-31B-it", topology="8x8")).fits
    assert memplan.estimate(request("google/gemma-4-31B-it", method="lora", batch_per_device=1,
                                    activation_checkpointing="block")).fits


def test_e2b_full_on_v6e_16_fits():
    plan = memplan.estimate(request("google/gemma-4-E2B-it"))
    assert plan.fits is True and not memplan.refuses(plan) and plan.refusal() == ""
    assert 0 < plan.per_chip_bytes <= plan.limit_bytes
    assert plan.breakdown.frozen_tables > 0  # the replicated per-layer embedding table


def test_lora_31b_on_v6e_16_fits_with_activations_recomputed():
    plan = memplan.estimate(request("google/gemma-4-31B-it", method="lora", batch_per_device=1,
                                    activation_checkpointing="block"))
    assert plan.fits is True
    full = memplan.estimate(request("google/gemma-4-31B-it", batch_per_device=1, activation_checkpointing="block"))
    # The frozen base costs 2 B a parameter; AdamW's 16 B only the adapters'.
    assert plan.breakdown.optimizer < full.breakdown.optimizer / 100
    assert plan.breakdown.weights < full.breakdown.weights


def test_lora_with_trained_embeddings_counts_their_master_gradient_and_moments():
    embedding = memplan.known_shape("google/gemma-4-31B-it").embedding
    adapters = memplan.estimate(request("google/gemma-4-31B-it", method="lora", batch_per_device=1))
    embeddings = memplan.estimate(request("google/gemma-4-31B-it", method="lora", batch_per_device=1,
                                          lora_embeddings=True))
    devices = 16
    # Two fp32 moments 8 B, a gradient 4 B per embedding parameter, sharded over the 16 chips; its
    # master in fp32 (4 B) instead of the frozen base's bf16 (2 B).
    for part, per_parameter in (("optimizer", 8), ("grads", 4), ("weights", 2)):
        added = getattr(embeddings.breakdown, part) - getattr(adapters.breakdown, part)
        assert abs(added * devices - per_parameter * embedding) <= 2 * devices, part
    assert embeddings.breakdown.loss_head > adapters.breakdown.loss_head  # the head's gradient
    assert embeddings.per_chip_bytes > adapters.per_chip_bytes
    # From the spec: spec.training.lora.trainEmbeddings reaches the plan.
    on = memplan_spec.plan_spec(spec("google/gemma-4-31B-it", training={"method": "lora", "batchSizePerDevice": 1,
                                                                    "lora": {"trainEmbeddings": True, "dropout": 0},
                                                                    **KEPT, **FULL_SHARDING}))
    off = memplan_spec.plan_spec(spec("google/gemma-4-31B-it", training={"method": "lora", "batchSizePerDevice": 1,
                                                                     "lora": {"dropout": 0}, **KEPT,
                                                                     **FULL_SHARDING}))
    assert on.breakdown == embeddings.breakdown and off.breakdown == adapters.breakdown


def test_a_larger_topology_is_named_when_it_fits():
    plan = memplan.estimate(request("google/gemma-4-31B-it", activation_checkpointing="block"))
    assert plan.fits is False
    assert plan.smallest_fit.startswith("topology ")
    topology = plan.smallest_fit.split()[1]
    assert g.chips_in(topology) > 16 and memplan.estimate(request("google/gemma-4-31B-it", topology=topology,
                                                                  activation_checkpointing="block")).fits


def test_activation_checkpointing_is_named_before_a_larger_topology_when_it_fits():
    """E2B full at 2048 tokens a block with eager attention: the activations, not the state,
    overflow a v6e chip; recomputing them per block fits the same 16 chips."""
    long = dict(max_seq_len=2048, attention="eager")
    plan = memplan.estimate(request("google/gemma-4-E2B-it", **long))
    assert plan.fits is False
    assert plan.smallest_fit == "activationCheckpointing block, topology 4x4 (16 chips)"
    assert memplan.estimate(request("google/gemma-4-E2B-it", activation_checkpointing="block", **long)).fits
    # Already on: not named again; what is named fits.
    on = memplan.estimate(request("google/gemma-4-E4B-it", activation_checkpointing="block", max_seq_len=8192,
                                  attention="eager"))
    assert on.fits is False and "activationCheckpointing" not in on.smallest_fit
    assert on.smallest_fit == "method lora (rank 16), batchSizePerDevice 2, topology 4x4 (16 chips)"
    assert memplan.estimate(request("google/gemma-4-E4B-it", activation_checkpointing="block", max_seq_len=8192,
                                    attention="eager", batch_per_device=2, topology="4x4", method="lora")).fits


def test_v7x_counts_both_devices_of_a_chip():
    one = memplan.device_bytes(memplan.known_shape("google/gemma-4-E2B-it"), "full", 16, 512, 4)
    plan = memplan.estimate(request("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2"))
    assert plan.per_chip_bytes == 2 * one.total  # 8 chips, 16 devices
    assert plan.limit_bytes == int(192 * GIB * (1 - memplan.HEADROOM))


def test_unknown_models_and_the_cpu_stand_in_are_never_refused():
    unknown = memplan.estimate(request("/models/tiny-gemma"))
    assert unknown.basis == "unknown" and unknown.fits is None and not memplan.refuses(unknown)
    assert "not in the planner's table" in unknown.summary()
    rehearsal = memplan.estimate(request("google/gemma-4-31B-it", generation="cpu", topology="2",
                                         host_memory_bytes=2 * GIB))
    assert rehearsal.fits is False and not memplan.refuses(rehearsal)
    assert rehearsal.per_chip_bytes == 0 and rehearsal.host_bytes > 2 * GIB


def test_every_tpu_generation_has_its_hbm_and_the_cpu_none():
    for generation in g.GENERATIONS:
        assert (generation.hbm_gib_per_chip > 0) == generation.is_tpu, generation.name
        assert bool(generation.hbm_source) == generation.is_tpu


def test_the_plan_of_a_spec_reads_its_training_and_worker_memory():
    plan = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training={"maxSeqLen": 2048, "batchSizePerDevice": 1,
                                                                          **KEPT}))
    shorter = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training={"maxSeqLen": 512, "batchSizePerDevice": 1,
                                                                             **KEPT}))
    assert plan.breakdown.activations > 4 * shorter.breakdown.activations  # scores grow with L^2
    assert plan.host_limit_bytes == int(200 * GIB * (1 - memplan.HEADROOM))  # ct6e-standard-4t's pod
    assert memplan_spec.plan_spec(spec("google/gemma-4-31B-it", mode="collectives", checkpoint=None)) is None


def test_status_plan_is_declared_by_the_status_model():
    written = {"plan": memplan_spec.status_of(memplan.estimate(request("google/gemma-4-31B-it")))}
    parsed = TPUFineTuneStatus.model_validate(written).model_dump(by_alias=True, exclude_none=True)
    assert parsed == written
    assert written["plan"]["fits"] is False and written["plan"]["perChipHBMBytes"] > written["plan"]["limitBytes"]
    assert written["plan"]["smallestFit"]


def test_activation_checkpointing_and_sdpa_shrink_the_activations_at_length():
    """At 8k tokens a block on E2B: eager scores dominate; selective drops them and the
    attention's width, block keeps only each block's input; sdpa keeps no scores at all."""
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    at = dict(shape=shape, method="full", devices=16, max_seq_len=8192, batch_per_device=1)
    kept = memplan.device_bytes(**at).activations
    selective = memplan.device_bytes(**at, checkpointing="selective").activations
    block = memplan.device_bytes(**at, checkpointing="block").activations
    sdpa = memplan.device_bytes(**at, eager_attention=False).activations
    assert block < selective < kept and sdpa < kept
    # Each layer keeps its probabilities (heads x L^2 in bf16, and the softmax's fp32 output);
    # one layer's scores, scaled and masked, exist beside them while it runs; sdpa keeps each
    # layer's mask made additive (L^2 in bf16).
    kept_scores = (memplan.SAVED_ATTENTION_MATRICES * 2 + memplan.UPCAST_ATTENTION_MATRICES * 4) \
        * shape.heads * 8192 ** 2
    transient = memplan.EAGER_TRANSIENT_MATRICES * 2 * shape.heads * 8192 ** 2
    workspace = memplan.SDPA_MASK_COPIES * 2 * shape.layers * 8192 ** 2
    masks_difference = 2 * (2 - 1) * 8192 ** 2  # eager's additive bf16 masks against sdpa's boolean ones
    assert kept - sdpa == shape.layers * kept_scores + transient + masks_difference - workspace
    assert selective >= kept_scores
    assert block < kept / 10


def test_sdpa_keeps_each_layers_mask_in_the_compute_dtype_whatever_the_heads():
    """CPU sdpa turns the boolean mask into an additive one in the compute dtype and keeps it
    for the backward in every layer (bench_memplan: 4 B x L^2 a call in fp32, 2 B in bf16,
    with 2 heads or 4): the L^2 bytes of a block are the micro-batch's masks (6 B) and one
    compute-dtype copy per layer, one with activation checkpointing, and heads do not count."""
    from dataclasses import replace

    shape = memplan.known_shape("google/gemma-4-E2B-it")
    narrower = replace(shape, heads=shape.heads * 2, head_dim=shape.head_dim // 2,
                       full_head_dim=shape.full_head_dim // 2)
    assert narrower.attention_width == shape.attention_width

    def per_l2(model, compute_bytes, checkpointing="none"):
        at = dict(shape=model, method="full", devices=16, eager_attention=False, compute_bytes=compute_bytes,
                  checkpointing=checkpointing)
        # The same tokens (8192), once as one block and once as two of 4096: the L^2 terms differ.
        long = memplan.device_bytes(**at, max_seq_len=8192, batch_per_device=1).activations
        short = memplan.device_bytes(**at, max_seq_len=4096, batch_per_device=2).activations
        return (long - short) / (8192 ** 2 - 2 * 4096 ** 2)

    masks = 2 + memplan.MASK_BOOLEANS
    assert per_l2(shape, 4) == masks + 4 * shape.layers
    assert per_l2(shape, 2) == masks + 2 * shape.layers
    assert per_l2(shape, 2, "block") == per_l2(shape, 2, "selective") == masks + 2
    assert per_l2(narrower, 2) == per_l2(shape, 2)


def test_frozen_embeddings_drop_the_head_gradient_and_the_embeddings_optimizer_state():
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    trained = memplan.device_bytes(shape, "full", 16, 512, 4)
    frozen = memplan.device_bytes(shape, "full", 16, 512, 4, freeze_embeddings=True)
    assert trained.loss_head - frozen.loss_head == (2 + 4) * shape.embedding  # bf16 gradient, fp32 reduce copy
    assert trained.optimizer - frozen.optimizer == pytest.approx(8 * shape.embedding / 16, abs=1)
    assert frozen.weights == trained.weights  # the fp32 master copy stays
    with pytest.raises(ValueError, match="activation checkpointing 'all'"):
        memplan.device_bytes(shape, "full", 16, 512, 4, checkpointing="all")


def test_the_loss_head_counts_one_weight_gradient_not_its_product_too():
    shape = memplan.known_shape("google/gemma-4-31B-it")
    head = memplan.device_bytes(shape, "full", 16, 512, 4).loss_head
    chunks_and_rows = 2 * memplan.CHUNK_ROWS * shape.vocab * 4 + 2 * 512 * 4 * shape.hidden * 2
    assert head - chunks_and_rows == (2 + 4) * shape.embedding


def test_the_plan_of_a_spec_reads_its_memory_settings():
    settings = {"maxSeqLen": 8192, "batchSizePerDevice": 1, **KEPT}
    plain = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training=settings))
    lighter = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training={
        **settings, "activationCheckpointing": "block", "attention": "sdpa", "freezeEmbeddings": True}))
    assert lighter.breakdown.activations < plain.breakdown.activations / 10
    assert lighter.breakdown.loss_head < plain.breakdown.loss_head
    assert lighter.per_chip_bytes < plain.per_chip_bytes
    eager_cpu = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", generation="cpu", topology="2",
                                       training={**settings, "attention": "eager"}))
    sdpa_cpu = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", generation="cpu", topology="2", training=settings))
    assert eager_cpu.breakdown.activations > sdpa_cpu.breakdown.activations  # the cpu stand-in's default is sdpa


def stated(path: str, parameters: int, **overrides):
    raw = base_spec()
    raw["tpu"] = {"generation": "v6e", "topology": "4x4"}
    raw["model"] = {"id": path, "parameters": parameters}
    raw.update(overrides)
    return parse_spec(raw)


def test_a_model_the_table_does_not_know_is_checked_on_the_size_its_spec_states():
    path = "gs://models/my-30b"
    unstated = memplan_spec.plan_spec(spec(path))
    assert unstated.basis == "unknown" and unstated.fits is None and not memplan.refuses(unstated)
    big = memplan_spec.plan_spec(stated(path, 30_000_000_000))
    # 16 B a parameter (fp32 weights, gradients, two AdamW moments) over 16 chips: 28 GiB,
    # under a v6e chip's 28.8 usable; doubled it cannot fit, whatever the activations.
    assert (big.basis, big.fits) == ("stated", True), big.summary()
    bigger = memplan_spec.plan_spec(stated(path, 60_000_000_000))
    assert memplan.refuses(bigger)
    message = bigger.refusal()
    assert "55.9 GiB of HBM per chip" in message and "28.8 GiB usable" in message
    assert message.endswith("smallest that fits: topology 4x8 (32 chips)"), message
    assert memplan_spec.status_of(bigger)["basis"] == "stated"
    lora = memplan_spec.plan_spec(stated(path, 60_000_000_000, training={"method": "lora"}))
    assert lora.fits and lora.per_chip_bytes < bigger.per_chip_bytes / 7


def test_every_block_stays_gathered_only_where_the_plan_holds_it_within_the_margin():
    e2b = request("google/gemma-4-E2B-it")
    kept = memplan.estimate(request("google/gemma-4-E2B-it", keep_gathered=True))
    resharded = memplan.estimate(e2b)
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    # Every block's bf16 copy instead of two blocks' at a time.
    assert kept.breakdown.gathered - resharded.breakdown.gathered == 2 * (shape.layers - 2) * shape.block_parameters
    # v6e-16: E2B full fits with 2 blocks gathered, not with all of them.
    assert resharded.fits and not kept.fits and not memplan.keeps_gathered(e2b)
    # Recomputed per block, it holds every block gathered within the margin that covers the estimate's error.
    recomputed = request("google/gemma-4-E2B-it", activation_checkpointing="block")
    assert memplan.keeps_gathered(recomputed)
    within = memplan.estimate(replace(recomputed, keep_gathered=True))
    assert within.per_chip_bytes <= memplan.KEEP_GATHERED_SHARE * within.limit_bytes
    # v7x (96 GiB a device) holds it with room: one all-gather a block fewer per micro-batch.
    assert memplan.keeps_gathered(request("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2"))
    # Nothing to hold it to: a model the table does not know, the cpu stand-in; nor where it does not fit.
    assert not memplan.keeps_gathered(request("/models/tiny-gemma", generation="v7x", topology="2x2x2"))
    assert not memplan.keeps_gathered(request("google/gemma-4-E2B-it", generation="cpu", topology="2"))
    assert not memplan.keeps_gathered(request("google/gemma-4-31B-it", generation="v7x", topology="2x2x2"))
    # A spec's plan is what the trainer will run: kept where jobspec asks for it.
    on_v7x = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2",
                                         training=FULL_SHARDING))
    assert on_v7x.keep_gathered and "every block kept gathered" in on_v7x.summary()
    assert on_v7x.per_chip_bytes == memplan.estimate(request("google/gemma-4-E2B-it", generation="v7x",
                                                             topology="2x2x2", keep_gathered=True)).per_chip_bytes
    assert not memplan_spec.plan_spec(spec("google/gemma-4-E2B-it")).keep_gathered
    # Nor for a run that does not fit its worker pod's memory.
    assert not memplan.keeps_gathered(request("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2",
                                              host_memory_bytes=8 * GIB))


def test_lora_dropout_counts_each_adapted_layers_dropped_input_and_mask():
    """spec.training.lora.dropout > 0 keeps, per adapted layer, a dropped copy of its input
    and the noise it was multiplied by (both in the compute dtype); the default LoRA (no lora
    block) has dropout 0.05."""
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    at = dict(shape=shape, method="lora", devices=16, max_seq_len=512, batch_per_device=4)
    without = memplan.device_bytes(**at)
    dropped = memplan.device_bytes(**at, lora_dropout=0.05)
    inputs = 3 * shape.hidden + shape.attention_width + 2 * shape.hidden + shape.intermediate  # q k v o gate up down
    per_element = (dropped.activations - without.activations) / (shape.layers * 512 * 4 * inputs)
    # In bf16 (2 B an element): more than the dropped copy, less than it and its noise
    # (bench_memplan's l3 against l4: 3.2 B).
    assert 2 < per_element < 4
    default = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training={"method": "lora", **KEPT, **FULL_SHARDING}))
    off = memplan_spec.plan_spec(spec("google/gemma-4-E2B-it", training={"method": "lora", "lora": {"dropout": 0},
                                                                       **KEPT, **FULL_SHARDING}))
    assert default.breakdown.activations - off.breakdown.activations == dropped.activations - without.activations


def test_lora_counts_the_target_modules_the_spec_names():
    shape = memplan.known_shape("google/gemma-4-31B-it")
    seven = memplan.device_bytes(shape, "lora", 16, 512, 1)
    two = memplan.device_bytes(shape, "lora", 16, 512, 1, lora_targets=("q_proj", "v_proj"))
    rank, widths = 16, shape.module_widths()
    defaults = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert seven.optimizer * 16 == pytest.approx(8 * shape.layers * rank * sum(sum(widths[n]) for n in defaults),
                                                 abs=16)
    assert two.optimizer * 16 == pytest.approx(8 * shape.layers * rank * (sum(widths["q_proj"])
                                                                          + sum(widths["v_proj"])), abs=16)
    named = memplan_spec.plan_spec(spec("google/gemma-4-31B-it", training={
        "method": "lora", "batchSizePerDevice": 1, "lora": {"targetModules": ["q_proj", "v_proj"], "dropout": 0}}))
    assert named.breakdown.optimizer == two.optimizer


def test_gemma_4_full_attention_layers_are_wider_and_a_config_wins_over_the_table():
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    assert shape.full_head_dim == 512 and shape.full_layers == 6  # every sixth of 35, and the last
    assert shape.attention_width > shape.heads * shape.head_dim
    config = {"text_config": {"hidden_size": 4096, "num_hidden_layers": 48, "intermediate_size": 16384,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                              "global_head_dim": 256, "vocab_size": 262144, "model_type": "gemma4_text"}}
    table = memplan.estimate(request("google/gemma-4-31B-it", generation="v7x", topology="2x2x4"))
    own = memplan.estimate(request("google/gemma-4-31B-it", generation="v7x", topology="2x2x4", model_config=config))
    assert own.per_chip_bytes != table.per_chip_bytes
    assert own.breakdown.weights * 32 == pytest.approx(4 * memplan.shape_from_config(config).parameters, abs=64)
    assert "widths: gemma-4-31B's config.json" in memplan_spec.status_of(own)["message"]
    assert "Gemma 3 27B's" in memplan_spec.status_of(table)["message"]  # the table names its stand-in
    assert len(memplan_spec.status_of(table)["message"]) <= 1024


def test_the_full_loss_head_is_planned_with_every_positions_logits():
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    labels = memplan.device_bytes(shape, "full", 16, 512, 4)
    full = memplan.device_bytes(shape, "full", 16, 512, 4, loss_head="full")
    assert full.loss_head - labels.loss_head == 4 * shape.vocab * (memplan.FULL_LOGITS * 512 * 4
                                                                   - 2 * memplan.CHUNK_ROWS)
    with pytest.raises(ValueError, match="loss head 'all'"):
        memplan.device_bytes(shape, "full", 16, 512, 4, loss_head="all")


def test_the_benchmark_judges_the_plan_on_settings_it_was_not_fitted_to():
    """benchmarks/bench_memplan.py: a held-out set apart from the fitted one, covering fp32
    and bf16, full and LoRA with and without dropout, eager and sdpa, 512 to 8192 tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_memplan

    fitted, held = bench_memplan.FITTED, bench_memplan.HELD_OUT
    assert not set(fitted) & set(held)
    assert not {repr(c) for c in fitted.values()} & {repr(c) for c in held.values()}
    cases = list(held.values())
    assert {c["dtype"] for c in cases} == {"fp32", "bf16"} and {c["attention"] for c in cases} == {"eager", "sdpa"}
    assert {(c["method"], c["dropout"] > 0) for c in cases} == {("full", False), ("lora", False), ("lora", True)}
    assert min(c["length"] for c in cases) == 512 and max(c["length"] for c in cases) == 8192


def test_bfloat16_counts_the_fp32_copies_of_the_norms_and_the_eager_softmax():
    """In bf16 Gemma 4's RMSNorm and eager softmax keep fp32 copies (bench_memplan b1, b2: 0.79
    and 0.57 of the measured peaks without them): bf16 activations are well over half of fp32's,
    which a count blind to the dtype would give."""
    shape = memplan.known_shape("google/gemma-4-E2B-it")
    at = dict(shape=shape, method="full", devices=16, max_seq_len=1024, batch_per_device=1)
    for eager in (True, False):
        bf16 = memplan.device_bytes(**at, compute_bytes=2, eager_attention=eager).activations
        fp32 = memplan.device_bytes(**at, compute_bytes=4, eager_attention=eager).activations
        assert bf16 > 0.6 * fp32, eager


def test_a_long_sequence_margin_is_added_and_said(monkeypatch):
    """Past LONG_FROM tokens the plan adds LONG_MARGIN x activations where the held-out rows
    need it (0 while they are within 25%), and its message names it."""
    monkeypatch.setattr(memplan, "LONG_MARGIN", 0.2)
    long = memplan.estimate(request("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2", max_seq_len=8192,
                                    batch_per_device=1, activation_checkpointing="block"))
    assert long.breakdown.margin == int(0.2 * long.breakdown.activations) > 0
    assert f"of it the margin measured past {memplan.LONG_FROM} tokens" in long.summary()
    short = memplan.estimate(request("google/gemma-4-E2B-it", generation="v7x", topology="2x2x2"))
    assert short.breakdown.margin == 0 and "margin" not in short.summary()


def test_rank_0s_host_holds_the_export_proof():
    """The trainer's export proof loads the exported model on rank 0's host
    (export.proof_host_bytes): the plan's host figure counts it, with the trainer's allowance."""
    from tpufinetune_trainer import export

    assert memplan.PROOF_OVERHEAD_BYTES == export.PROOF_OVERHEAD_BYTES
    shape = memplan.known_shape("google/gemma-4-31B-it")
    plan = memplan.estimate(request("google/gemma-4-31B-it", method="lora", batch_per_device=1,
                                    activation_checkpointing="block"))
    part = plan.breakdown
    training = 4 * (memplan.RUNTIME_BYTES_PER_DEVICE + part.weights + part.optimizer)  # 4 chips a v6e host
    proof = export.proof_host_bytes(shape.parameters, 2, shape.lora_parameters(16))
    assert plan.host_bytes == training + proof and proof > 57 * GIB


def test_the_plan_stays_within_its_tolerance_of_the_recorded_peaks():
    """bench_memplan.py's recorded measurements: every held-out configuration within 25% of
    the plan (the issue's bar), the fitted ones within 15% (what their fit reached: s3 0.89).
    A constant refitted without rerunning the benchmark moves these."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_memplan

    assert set(bench_memplan.MEASURED) <= set(bench_memplan.CONFIGS)
    for name, measured in bench_memplan.MEASURED.items():
        bound = bench_memplan.TOLERANCE if name in bench_memplan.HELD_OUT else 0.15
        ratio = bench_memplan.planned(name)[0] / bench_memplan.MIB / measured
        assert abs(ratio - 1) <= bound, (name, round(ratio, 2))
