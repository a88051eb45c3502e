"""The memory plan of LoRA with the vision tower trained (towers.vision: trained, method lora):
adapters on the tower's projections named in targetModules, counted as transformers' Gemma 4
tower has them, with their fp32 state beside the frozen bf16 base, and the tower's activations
kept for the backward that reaches them."""
from __future__ import annotations

import pytest

from tpufinetune.core import memplan, memplan_media
from tpufinetune.core.towersspec import TOWER_LORA_TARGETS

RANDOM = dict(num_hidden_layers=3, hidden_size=96, intermediate_size=200, num_attention_heads=4, head_dim=16,
              num_key_value_heads=2, patch_size=4, pooling_kernel_size=2, position_embedding_size=48)


def _adapters_transformers_would_get(config: dict, rank: int, targets: tuple[str, ...]) -> int:
    """rank x (in + out) of each Linear of transformers' tower that the trainer adapts: `<name>.linear`."""
    import torch  # the trainer's stack, a dev dependency (missing, the test fails, never skips)
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    with torch.device("meta"):
        model = Gemma4VisionModel(Gemma4VisionConfig(**config))
    return sum(rank * (module.in_features + module.out_features) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name.endswith(".linear")
               and name.split(".")[-2] in targets)


@pytest.mark.parametrize("targets", [TOWER_LORA_TARGETS, ("q_proj", "per_layer_input_gate"), ("per_layer_input_gate",)])
def test_the_towers_adapters_are_those_transformers_tower_has(targets):
    vision = memplan_media.vision_from_config(RANDOM, {"max_soft_tokens": 70})
    want = _adapters_transformers_would_get(RANDOM, 8, targets)
    assert memplan_media.tower_adapter_parameters(vision, 8, targets) == want
    assert (want > 0) == bool(set(targets) & set(TOWER_LORA_TARGETS))


def _media(vision: str, method: str, **changes) -> memplan_media.MediaPlan:
    return memplan.estimate(memplan.Request(**{"model_id": "google/gemma-4-E2B-it", "method": method,
                                               "generation": "v6e", "topology": "4x4", "max_seq_len": 512,
                                               "batch_per_device": 2, "vision_tower": vision, **changes})).media


def test_lora_on_a_trained_tower_adds_its_adapters_state_and_keeps_its_activations():
    frozen, trained = _media("frozen", "lora"), _media("trained", "lora")
    adapters = memplan_media.tower_adapter_parameters(memplan_media.VISION_TOWERS["gemma-4-E2B"], 16,
                                                      TOWER_LORA_TARGETS)
    assert adapters > 0
    # fp32 masters sharded, the gathered copy (bf16), gradient sharded and on its way, AdamW's two moments
    assert trained.weight_bytes - frozen.weight_bytes == pytest.approx(4 * adapters / 16 + 2 * adapters, abs=2)
    assert trained.trained_bytes - frozen.trained_bytes == pytest.approx(12 * adapters / 16 + 6 * adapters, abs=2)
    # Gradients pass through the tower to its adapters: every layer's activations, as a full tower's.
    assert trained.activation_bytes == _media("trained", "full").activation_bytes > 10 * frozen.activation_bytes
    fewer = _media("trained", "lora", lora_targets=("q_proj",))
    assert fewer.trained_bytes < trained.trained_bytes


def test_the_operator_and_the_trainer_adapt_the_same_tower_projections():
    from tpufinetune_trainer import lora

    assert TOWER_LORA_TARGETS == lora.TOWER_TARGET_MODULES
