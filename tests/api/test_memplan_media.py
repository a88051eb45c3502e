"""memplan_media's towers from a model's own vision config (vision_from_config): the shape and
the parameters transformers builds for that config, and the plan on the same path as the
table's entries (benchmarks/bench_memplan_media.py plans its random towers so)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from tpufinetune.core import memplan_media

# A random tower none of the table's entries has: narrow heads, fewer kv heads, a small patch.
RANDOM = dict(num_hidden_layers=3, hidden_size=96, intermediate_size=200, num_attention_heads=4, head_dim=16,
              num_key_value_heads=2, patch_size=4, pooling_kernel_size=2, position_embedding_size=48)


def _built_parameters(config: dict) -> int:
    import torch  # the trainer's stack, a dev dependency (missing, the test fails, never skips)
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    with torch.device("meta"):
        return sum(p.numel() for p in Gemma4VisionModel(Gemma4VisionConfig(**config)).parameters())


def test_a_vision_config_gives_its_own_shape_and_the_parameters_transformers_builds():
    shape = memplan_media.vision_from_config(RANDOM, {"max_soft_tokens": 70})
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.head_dim, shape.kv_heads,
            shape.patch_size, shape.pooling_kernel, shape.position_embeddings, shape.soft_tokens) == (
        3, 96, 200, 4, 16, 2, 4, 2, 48, 70)
    assert shape.patches_per_image == 70 * 4
    assert shape.parameters == _built_parameters(RANDOM)


def test_keys_a_config_lacks_take_transformers_defaults_as_the_table_does():
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    assert memplan_media.vision_from_config(Gemma4VisionConfig().to_dict()) == \
        memplan_media.vision_from_config({}) == \
        dataclasses.replace(memplan_media.VISION_TOWERS["gemma-4-E2B"], source="")
    assert memplan_media.vision_from_config({}).soft_tokens == memplan_media.MAX_SOFT_TOKENS


def test_the_plan_of_a_config_is_the_tables_path():
    towers = memplan_media.towers_from_config(RANDOM, {"max_soft_tokens": 70})
    plan = memplan_media.plan(towers, "trained", 128, "full", 1, 512, 2, 4, eager_attention=False)
    assert plan.tower_parameters == _built_parameters(RANDOM)
    assert plan.tokens_per_image == 72 and plan.images_per_block == 512 // 72
    e2b = memplan_media.MODEL_TOWERS["gemma-4-E2B"]
    same = memplan_media.towers_from_config({}, None, e2b.audio_parameters, e2b.audio_width, e2b.vision.source)
    assert memplan_media.plan(same, "frozen", 1536, "lora", 16, 2048, 2, 2, True) == \
        memplan_media.plan(e2b, "frozen", 1536, "lora", 16, 2048, 2, 2, True)


@pytest.mark.parametrize("key", ["num_key_value_heads", "head_dim", "pooling_kernel_size"])
def test_each_width_of_the_config_is_read(key):
    changed = dict(RANDOM, **{key: RANDOM[key] * 2})
    assert memplan_media.vision_from_config(changed) != memplan_media.vision_from_config(RANDOM)


def _bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_memplan_media

    return bench_memplan_media


def test_the_multimodal_plan_stays_within_25_percent_of_the_measured_peaks():
    """bench_memplan_media.py's recorded peaks (none fitted to): every row within 25% of the
    plan of its own vision config; frozen and trained towers, full and LoRA, one image a block
    and several all measured, and the towers a real share of the plan."""
    b = _bench()
    assert set(b.MEASURED) <= set(b.CONFIGS)
    rows = [b.CONFIGS[name] for name in b.MEASURED]
    assert {c["tower"] for c in rows} == {"frozen", "trained"} and {c["method"] for c in rows} == {"full", "lora"}
    assert {b.images_per_block(c) == 1 for c in rows} == {True, False}
    assert {c["images_per_example"] > 1 for c in rows} == {True, False}
    for name, peak in b.MEASURED.items():
        total, media = b.planned(name)
        assert abs(total / b.MIB / peak - 1) <= b.TOLERANCE, (name, round(total / b.MIB / peak, 2))
    assert max(b.planned(name)[1].bytes / b.MIB / peak for name, peak in b.MEASURED.items()) > 0.5


def test_the_towers_forward_transients_are_gone_before_the_language_models_step_holds_its_own():
    """The vision tower runs first in the step's forward: what only its forward holds (a frozen
    tower's layer-at-a-time activations, any tower's eager scores) is freed before the language
    model's activations and logits exist, so the device holds the larger of the two, not both."""
    towers = memplan_media.towers_from_config(RANDOM, {"max_soft_tokens": 70})
    for mode in ("frozen", "trained"):
        alone = memplan_media.plan(towers, mode, 128, "full", 1, 1024, 2, 4, True)
        forward = alone.forward_bytes
        assert 0 < forward <= alone.activation_bytes
        small = memplan_media.plan(towers, mode, 128, "full", 1, 1024, 2, 4, True, text_step_bytes=forward // 4)
        large = memplan_media.plan(towers, mode, 128, "full", 1, 1024, 2, 4, True, text_step_bytes=10 * forward)
        assert alone.bytes - small.bytes == forward // 4
        assert alone.bytes - large.bytes == forward
    frozen = memplan_media.plan(towers, "frozen", 128, "full", 1, 1024, 2, 4, True)
    trained = memplan_media.plan(towers, "trained", 128, "full", 1, 1024, 2, 4, True)
    assert frozen.forward_bytes > trained.forward_bytes  # a trained tower keeps its layers' activations


def test_the_planner_gives_the_tower_the_language_models_step_it_overlaps():
    from tpufinetune.core import memplan

    plan = memplan.estimate(memplan.Request("google/gemma-4-E2B-it", "lora", "v6e", "4x4", 2048, 2,
                                            vision_tower="frozen"))
    part = plan.breakdown
    assert plan.media.text_step_bytes == part.activations + part.loss_head > 0
    assert part.towers == plan.media.bytes < plan.media.weight_bytes + plan.media.trained_bytes \
        + plan.media.activation_bytes
