"""Loading the base model already sharded (sharded_load.py): built on the meta device,
sharded by FSDP2, each rank reading only its own slices of the safetensors, gives the
model the full load gives, tensor for tensor, on one rank and on two (gloo, two real
processes on the CPU); a checkpoint it cannot read by name or shape is refused, naming the
mismatch, unless --model-load sharded-or-full lets it fall back to the full load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tpufinetune_trainer import sharded_load
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ConfigError, ModelError
from tpufinetune_trainer.model import load_causal_lm
from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
from trainer_helpers import load_differences, run_rank_processes, single_process_group

WORKER = Path(__file__).with_name("trainer_load_worker.py")


@pytest.fixture(scope="module")
def process_group():
    with single_process_group():
        yield


def both_loads(model_dir, compute_dtype=torch.float32, **options):
    mesh = build_mesh("cpu", 1)
    old = apply_fsdp(load_causal_lm(str(model_dir), torch.float32, "sdpa"), mesh, compute_dtype)
    new, how = sharded_load.load_sharded(str(model_dir), "sdpa", mesh, compute_dtype, **options)
    return old, new, how


def same_logits(old, new) -> bool:
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return bool(torch.equal(old(input_ids=ids).logits, new(input_ids=ids).logits))


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_one_rank_reads_the_model_the_full_load_makes(trainer_assets, process_group, compute_dtype):
    old, new, how = both_loads(trainer_assets.model, compute_dtype)
    assert re.fullmatch(r"each rank read its own slices \(\d+ MiB\) in [\d.]+ s; peak RSS \d+ MiB", how), how
    assert load_differences(old, new) == []
    table = new.model.language_model.embed_tokens_per_layer.weight
    assert table.dtype == compute_dtype and not table.requires_grad  # frozen, in the compute dtype, as before
    assert new.lm_head.weight is new.model.language_model.embed_tokens.weight  # still tied
    assert {p.dtype for p in new.parameters() if p.requires_grad} == {torch.float32}
    assert same_logits(old, new)


def run_ranks(model: Path, out_prefix: Path, world: int, compute_dtype: str = "float32") -> list[dict]:
    run_rank_processes(WORKER, world, lambda rank, port: [str(model), str(out_prefix), str(port), str(rank),
                                                          str(world), compute_dtype])
    return [json.loads(Path(f"{out_prefix}.{rank}.json").read_text()) for rank in range(world)]


def test_two_ranks_each_read_their_own_slices_of_the_model_the_full_load_makes(trainer_assets, tmp_path):
    one = run_ranks(trainer_assets.model, tmp_path / "one", world=1)
    two = run_ranks(trainer_assets.model, tmp_path / "two", world=2)
    for rank in one + two:
        assert rank["differences"] == [] and rank["same_logits"], rank
        assert rank["how"].startswith("each rank read its own slices"), rank["how"]
    # What every rank reads whole: the frozen per-layer table (not sharded) and the
    # persistent buffers; every sharded weight is read once over both ranks.
    stored = sharded_load.stored_tensors(trainer_assets.model)
    replicated = sum(t.rows * t.row_bytes for name, t in stored.items()
                     if name.startswith("model.language_model.") and
                     ("embed_tokens_per_layer" in name or name.endswith("layer_scalar")))
    assert two[0]["bytes_read"] + two[1]["bytes_read"] == one[0]["bytes_read"] + replicated
    assert max(r["bytes_read"] for r in two) < 0.75 * one[0]["bytes_read"]


def llama_directory(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_any_causal_lm_with_safetensors_is_read_in_slices(tmp_path, process_group):
    old, new, how = both_loads(llama_directory(tmp_path / "llama"))
    assert how.startswith("each rank read its own slices"), how
    assert load_differences(old, new) == [] and same_logits(old, new)


def test_a_checkpoint_without_safetensors_takes_the_full_load_only_when_allowed(tmp_path, process_group):
    directory = llama_directory(tmp_path / "llama")
    from safetensors.torch import load_file

    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"cannot read its checkpoint by name and shape \(no safetensors weights\)"):
        both_loads(directory)
    old, new, how = both_loads(directory, fallback=True)
    assert "every rank loaded the whole model (no safetensors weights)" in how
    assert load_differences(old, new) == []


def test_a_renamed_tensor_fails_the_sharded_load_naming_it_and_the_full_loads_bytes(tmp_path, process_group):
    """A weight the file holds under another name: the sharded load cannot place it, and
    falling back silently would put the whole fp32 model in every worker (31B: 4 x 114 GiB
    on a host). Refused, naming the weight, the bytes and the flag; the flag falls back."""
    from safetensors.torch import load_file, save_file

    directory = llama_directory(tmp_path / "llama")
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors["model.layers.1.mlp.down_proj.renamed"] = tensors.pop(name)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    full_bytes = sum(t.numel() * 4 for t in tensors.values())
    with pytest.raises(ModelError) as refused:
        sharded_load.load_sharded(str(directory), "sdpa", build_mesh("cpu", 1), torch.float32)
    message = str(refused.value)
    assert f"(the checkpoint has no {name})" in message, message
    assert f"{full_bytes / 2**30:.1f} GiB" in message and "--model-load sharded-or-full" in message, message
    _, how = sharded_load.load_sharded(str(directory), "sdpa", build_mesh("cpu", 1), torch.float32, fallback=True)
    assert f"every rank loaded the whole model (the checkpoint has no {name})" in how


def test_model_load_full_takes_the_full_load(trainer_assets, process_group):
    old, new, how = both_loads(trainer_assets.model, full=True)
    assert "every rank loaded the whole model (--model-load full)" in how
    assert load_differences(old, new) == []
    with pytest.raises(ConfigError, match="--model-load must be one of sharded, full"):
        FinetuneConfig(storage_path="/nonexistent", model_load="lazy").validate()


def test_a_weight_the_checkpoint_lacks_shapes_otherwise_or_quantizes_is_named(trainer_assets):
    model = sharded_load.build_on_meta(str(trainer_assets.model), "sdpa")
    stored = sharded_load.stored_tensors(trainer_assets.model)
    assert sharded_load.mismatch(model, stored) is None
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    lacking = {k: v for k, v in stored.items() if k != name}
    assert sharded_load.mismatch(model, lacking) == f"the checkpoint has no {name}"
    reshaped = dict(stored, **{name: sharded_load.StoredTensor(stored[name].file, torch.float32, (1, 2), 0)})
    assert "is [1, 2] in the checkpoint" in sharded_load.mismatch(model, reshaped)
    quantized = dict(stored, **{name: sharded_load.StoredTensor(stored[name].file, torch.int8, stored[name].shape,
                                                                 0)})
    assert sharded_load.mismatch(model, quantized) == f"{name} is torch.int8 in the checkpoint, torch.float32 in the model"
    unknown = dict(stored, **{name: sharded_load.StoredTensor(stored[name].file, None, stored[name].shape, 0)})
    assert sharded_load.mismatch(model, unknown) == f"{name} is in a safetensors dtype this loader does not read"


def test_rows_are_read_in_blocks_and_cast_to_the_target(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    weights = {"matrix": torch.randn(37, 5).to(torch.bfloat16), "vector": torch.randn(11), "scalar": torch.tensor(3.5)}
    save_file(weights, tmp_path / "model.safetensors")
    stored = sharded_load.stored_tensors(tmp_path)
    monkeypatch.setattr(sharded_load, "READ_CHUNK_BYTES", 3 * 5 * 2)  # 3 rows of the bf16 matrix per read
    out = torch.empty(20, 5, dtype=torch.float32)
    sharded_load.read_rows(stored["matrix"], 9, 29, out)
    assert torch.equal(out, weights["matrix"][9:29].float())
    same_dtype = torch.empty(20, 5, dtype=torch.bfloat16)  # straight into the target
    sharded_load.read_rows(stored["matrix"], 9, 29, same_dtype)
    assert torch.equal(same_dtype, weights["matrix"][9:29])
    vector, scalar = torch.empty(4), torch.empty(())
    sharded_load.read_rows(stored["vector"], 7, 11, vector)
    sharded_load.read_rows(stored["scalar"], 0, 1, scalar)
    assert torch.equal(vector, weights["vector"][7:]) and float(scalar) == 3.5
