"""The export's proof is sized to rank 0's host: loading the export holds all of it there
(31B's bf16 weights: 57 GiB, in no pod's plan), so where the host cannot give what the proof
needs it is streamed instead: every weight the export's config names is in its files with
its shape, and every byte is read back a block at a time. A small host is given as the
free memory the proof compares with (a host short of memory is not something this machine
can be made into); the export and its faults are real files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpufinetune_trainer import export
from tpufinetune_trainer.errors import ExportUnloadable
from tpufinetune_trainer.model import load_causal_lm, load_tokenizer
from tpufinetune_trainer.sharded_load import stored_tensors


@pytest.fixture
def exported(trainer_assets, tmp_path):
    """The tiny model saved as the export saves it (bf16 safetensors beside its config)."""
    model = load_causal_lm(str(trainer_assets.model), torch.bfloat16, "sdpa")
    directory = tmp_path / "export"
    model.save_pretrained(directory)
    return directory


def test_the_proof_needs_the_export_in_its_dtype_and_the_plan_can_count_it():
    assert export.proof_host_bytes(30_700_000_000) == 30_700_000_000 * 2 + export.PROOF_OVERHEAD_BYTES
    assert 57 <= (export.proof_host_bytes(30_700_000_000) - export.PROOF_OVERHEAD_BYTES) / 2**30 < 58
    assert export.proof_host_bytes(10, adapter_params=5, dtype_bytes=4) == 60 + export.PROOF_OVERHEAD_BYTES
    free = export.host_memory_free()
    assert free is None or free > 0


def test_a_proof_the_host_cannot_hold_is_streamed_and_one_it_can_hold_generates(trainer_assets, exported):
    tokenizer = load_tokenizer(str(trainer_assets.model))
    prompts = [[2, 100, 200, 300]]
    weights = sum(t.rows * t.row_bytes for t in stored_tensors(exported).values())
    need = export.proof_need(exported, None, None, torch.bfloat16)
    assert need == weights + export.PROOF_OVERHEAD_BYTES
    small = export.prove_sized(str(exported), None, str(trainer_assets.model), tokenizer, prompts, torch.bfloat16,
                               free_bytes=need - 1)
    assert small["mode"] == "streamed" and small["need_bytes"] == need and small["free_bytes"] == need - 1
    assert small["tensors"] == len(stored_tensors(exported)) and small["bytes_read"] == weights
    assert small["sample"] == [] and "streamed, not loaded" in export.proof_words(small)
    large = export.prove_sized(str(exported), None, str(trainer_assets.model), tokenizer, prompts, torch.bfloat16,
                               free_bytes=need)
    assert large["mode"] == "generated" and len(large["sample"][0]["completion_ids"]) == export.PROOF_TOKENS


def test_the_streamed_proof_fails_a_renamed_weight_a_torn_file_and_a_value_that_is_not_finite(trainer_assets,
                                                                                               exported):
    file = exported / "model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    base = str(trainer_assets.model)

    renamed = dict(tensors)
    renamed[name.replace("down_proj", "down_projection")] = renamed.pop(name)
    save_file(renamed, file, metadata={"format": "pt"})
    with pytest.raises(ExportUnloadable, match=f"does not load: the checkpoint has no {name}"):
        export.prove_streamed(str(exported), None, base, torch.bfloat16)

    poisoned = dict(tensors)
    poisoned[name] = poisoned[name].clone()
    poisoned[name][0, 0] = float("nan")
    save_file(poisoned, file, metadata={"format": "pt"})
    with pytest.raises(ExportUnloadable, match=f"{name} holds values that are not finite"):
        export.prove_streamed(str(exported), None, base, torch.bfloat16)

    save_file(tensors, file, metadata={"format": "pt"})
    assert export.prove_streamed(str(exported), None, base, torch.bfloat16)["tensors"] == len(tensors)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])  # a torn file
    with pytest.raises(ExportUnloadable):
        export.prove_streamed(str(exported), None, base, torch.bfloat16)
    (exported / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ExportUnloadable, match="does not load"):
        export.prove_streamed(str(exported), None, base, torch.bfloat16)


def test_the_streamed_proof_of_an_adapter_checks_its_layers_are_the_bases(trainer_assets, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = str(trainer_assets.model)
    model = load_causal_lm(base, torch.float32, "sdpa")
    directory = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(directory)
    proof = export.prove_streamed(None, str(directory), base, torch.bfloat16)
    assert proof["mode"] == "streamed" and proof["tensors"] > 0
    file = directory / "adapter_model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if ".lora_A." in k)
    tensors[name.replace("q_proj", "no_such_proj")] = tensors.pop(name)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ExportUnloadable, match="no_such_proj, which .* does not have"):
        export.prove_streamed(None, str(directory), base, torch.bfloat16)
