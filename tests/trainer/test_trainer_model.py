"""Model loading and FSDP2 sharding in one process (a real world-size-1 gloo group)."""

from __future__ import annotations

import pytest
import torch

from tpufinetune_trainer.model import decoder_blocks, export_dtype, is_weight_file, load_causal_lm, per_layer_embeddings
from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
from trainer_helpers import single_process_group


@pytest.fixture
def process_group():
    with single_process_group():
        yield


def _train_step(model) -> float:
    ids = torch.randint(3, 200, (2, 32))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def test_any_causal_lm_is_sharded_per_decoder_block(tmp_path, process_group):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path), torch.float32, "sdpa")
    assert per_layer_embeddings(model) is None
    blocks = decoder_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    apply_fsdp(model, build_mesh("cpu", 1), torch.float32)
    assert all(type(b).__name__.startswith("FSDP") for b in blocks)  # each block is its own unit
    assert type(model).__name__.startswith("FSDP")
    assert torch.isfinite(torch.tensor(_train_step(model)))


def test_gemma4_per_layer_embeddings_are_frozen_and_left_out_of_fsdp(trainer_assets, process_group):
    from torch.distributed.tensor import DTensor

    model = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa")
    table = per_layer_embeddings(model)
    assert table is model.model.language_model.embed_tokens_per_layer
    apply_fsdp(model, build_mesh("cpu", 1), torch.float32)
    assert not table.weight.requires_grad and not isinstance(table.weight, DTensor)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in sharded
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in sharded  # whole blocks, not just MLPs
    before = table.weight.detach().clone()
    _train_step(model)
    assert torch.equal(table.weight, before)


@pytest.mark.parametrize("config,dtype", [
    ({}, torch.bfloat16), ({"dtype": "bfloat16"}, torch.bfloat16), ({"torch_dtype": "float32"}, torch.float32),
    ({"dtype": "float16"}, torch.float16), ({"text_config": {"dtype": "float32"}}, torch.float32),
    ({"dtype": "int8"}, torch.bfloat16), ({"dtype": "nonsense"}, torch.bfloat16)])
def test_the_export_is_saved_in_the_bases_floating_dtype_else_bf16(config, dtype):
    assert export_dtype(config) == dtype


def test_weight_files_are_told_from_the_files_an_export_copies_from_its_base():
    assert all(map(is_weight_file, ["model.safetensors", "model-00001-of-00002.safetensors",
                                    "model.safetensors.index.json", "pytorch_model.bin"]))
    assert not any(map(is_weight_file, ["processor_config.json", "tokenizer.json", "chat_template.jinja",
                                        "generation_config.json", "preprocessor_config.json"]))


def test_a_multimodal_bases_towers_are_added_only_under_the_trained_models_own_names(tmp_path):
    from safetensors.torch import save_file

    from tpufinetune_trainer.checkpoint import add_base_towers

    base = {"model.language_model.w": torch.zeros(2), "model.vision_tower.w": torch.ones(3),
            "model.audio_tower.w": torch.full((4,), 2.0)}
    save_file(base, str(tmp_path / "model.safetensors"))
    multimodal = {"vision_config": {"hidden_size": 8}, "audio_config": None}
    trained = {"model.language_model.w": torch.full((2,), 5.0)}
    assert add_base_towers(trained, tmp_path, multimodal, set()) == 2
    assert torch.equal(trained["model.vision_tower.w"], base["model.vision_tower.w"])
    assert torch.equal(trained["model.language_model.w"], torch.full((2,), 5.0))  # the trained one stays
    assert add_base_towers({"model.language_model.w": torch.zeros(2)}, tmp_path, {"text_config": {}}, set()) == 0
    renamed = {"model.layers.w": torch.zeros(2)}  # not the base's names: the base's text weights would return
    assert add_base_towers(renamed, tmp_path, multimodal, set()) == 0 and list(renamed) == ["model.layers.w"]
