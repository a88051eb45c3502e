"""LoRA with the vision tower trained (--method lora --vision-tower trained): adapters on the
tower's own attention and MLP projections beside the language model's, the projector in
full, every base weight frozen in bf16; the merged export folds the tower's adapters into
its weights and loads whole; the run still learns what only the image tells."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from test_multimodal import (BLOCK, check_export_proof, export_answers, processor, trainer_of,  # noqa: F401
                             vision)  # processor, vision: fixtures

from tpufinetune_trainer import lora, media
from tpufinetune_trainer.errors import ConfigError, ModelError

TOWER_PROJECTION = "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear"


def full(param):
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def exported(directory, name: str):
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


@pytest.mark.timeout(120)
def test_lora_on_a_trained_vision_tower_adapts_its_projections_and_the_export_merges_them(
        vision, processor, process_group, no_ray_report, tmp_path):
    """What trains: the language model's adapters, the tower's adapters on each of its
    attention and MLP projections, and the projector in full; the tower's base is frozen in
    bf16. The merged export holds the tower's q_proj as base + alpha/r x B A."""
    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train[:32]", processor, BLOCK, 0.0, 42)
    trainer = trainer_of(model, data, tmp_path, processor, method="lora", vision_tower="trained", eval_fraction=0.0,
                         num_epochs=1, checkpoint_score_attribute="loss", learning_rate=1e-2)
    parts = media.towers(trainer.model)
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    tower_adapters = {n for n in trained if ".vision_tower." in n}
    assert trained == {n for n in trained if lora.is_adapter(n) or ".embed_vision." in n}, sorted(trained)
    assert {n.split(".")[-5] for n in tower_adapters} == set(lora.TOWER_TARGET_MODULES), sorted(tower_adapters)
    assert all(n.split(".")[-4] == "linear" for n in tower_adapters)
    assert any(".language_model." in n for n in trained) and any(".embed_vision." in n for n in trained)
    assert all(p.dtype == torch.bfloat16 for n, p in parts["vision_tower"].named_parameters() if not lora.is_adapter(n))
    assert not any(p.requires_grad for p in parts["audio_tower"].parameters())
    before = {name: full(p) for name, p in trainer.model.named_parameters()}

    trainer.run()  # one epoch, its checkpoint, the merged export and its proof

    after = {name: full(p) for name, p in trainer.model.named_parameters()}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed <= trained, sorted(changed - trained)
    assert any(".vision_tower." in n and "lora_B" in n for n in changed), sorted(changed)
    base = after[f"{TOWER_PROJECTION}.base_layer.weight"]
    a, b = after[f"{TOWER_PROJECTION}.lora_A.default.weight"], after[f"{TOWER_PROJECTION}.lora_B.default.weight"]
    assert b.abs().max() > 0
    export = tmp_path / "vision" / "export"
    merged = exported(export, f"{TOWER_PROJECTION}.weight")
    want = (base.float() + trainer.cfg.lora_alpha / trainer.cfg.lora_rank * (b.float() @ a.float())).to(merged.dtype)
    assert torch.equal(merged, want)
    assert not torch.equal(merged, base.to(merged.dtype))


@pytest.mark.timeout(240)
def test_lora_with_the_vision_tower_trained_learns_what_only_the_image_tells(vision, processor, process_group,
                                                                           no_ray_report, tmp_path, capsys):
    """3 CPU epochs of LoRA with adapters on the tower: the run's export proof and the export,
    loaded whole with its processor as a user loads it, answer the held-out images right."""
    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train", processor, BLOCK, 0.2, 42)
    trainer = trainer_of(model, data, tmp_path, processor, method="lora", vision_tower="trained")
    trainer.run()
    check_export_proof(capsys.readouterr().out, data_file)
    right, held = export_answers(tmp_path / "vision" / "export", data_file)
    print(f"LoRA with the tower's adapters: the export answers {right} of {held} held-out images right")
    assert right >= 0.8 * held


def test_adapters_on_the_tower_need_one_of_its_projections_named(tmp_path):
    from tpufinetune_trainer.config import FinetuneConfig

    with pytest.raises(ConfigError, match="--lora-target-modules per_layer_input_gate names none; add some of q_proj"):
        FinetuneConfig(model_id="m", storage_path=str(tmp_path), vision_tower="trained", method="lora",
                       lora_target_modules="per_layer_input_gate").validate()
    FinetuneConfig(model_id="m", storage_path=str(tmp_path), vision_tower="trained", method="lora",
                   lora_target_modules="per_layer_input_gate,v_proj").validate()


def test_a_vision_tower_without_gemma_4_s_projections_is_refused_at_load(vision, processor, process_group, tmp_path):
    _, model, data_file = vision
    data = media.prepare_media(str(data_file), "train[:8]", processor, BLOCK, 0.0, 42)
    with pytest.raises(ModelError, match="vision tower has no q_proj projection"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lora, "TOWER_LINEAR", "wrapped")
            trainer_of(model, data, tmp_path, processor, method="lora", vision_tower="trained", eval_fraction=0.0,
                       checkpoint_score_attribute="loss", lora_target_modules="q_proj")
