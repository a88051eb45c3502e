"""The export's proof, in one process (a real world-size-1 gloo group) on the tiny Gemma 4:
rank 0 loads what it exported back from where it was written and greedy-generates a few
tokens for held-out prompts; an export that does not load fails the run, the checkpoint kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer import export
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ExportUnloadable
from tpufinetune_trainer.events import parse_text
from tpufinetune_trainer.train import Trainer
from trainer_helpers import BLOCK_LENGTH


def trained_trainer(assets, data, storage: Path, **overrides) -> Trainer:
    """A trainer after one optimizer step, with that step's checkpoint written and recorded."""
    settings = dict(model_id=str(assets.model), storage_path=str(storage), num_workers=1, device="cpu",
                    max_seq_len=BLOCK_LENGTH, learning_rate=3e-3, batch_size_per_device=2, num_epochs=1,
                    run_name="proof")
    cfg = FinetuneConfig(**{**settings, **overrides}).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], data, rank=0, world=1, local_rank=0)
    trainer.train_step(torch.zeros(()))
    trainer.epoch_step += 1
    location = str(storage / "proof" / "step_0000001")
    entry = {"epoch": 1, "step": 1, "loss": 3.0, "eval_loss": 3.0, "uri": location}
    ckpt.save_sharded(trainer.model, trainer.optimizer, location, {"epoch": 1, "step": 1, "history": [entry]},
                      trainer.cpu_group)
    trainer.history, trainer.weights_uri = [entry], location
    return trainer


@pytest.mark.timeout(300)
def test_the_export_is_loaded_back_and_generates_the_same_tokens_each_time(trainer_assets, prepared, process_group,
                                                                          tmp_path, capsys):
    trainer = trained_trainer(trainer_assets, prepared, tmp_path / "storage")
    capsys.readouterr()
    trainer.export()
    events = parse_text(capsys.readouterr().out)
    kinds = [e.kind for e in events]
    assert kinds.index("export_proof") < kinds.index("result")  # proven before the run may succeed
    proof = next(e for e in events if e.kind == "export_proof")
    destination = str(tmp_path / "storage" / "proof" / "export")
    assert proof["model_uri"] == destination and proof["adapter_uri"] is None
    assert proof["tokens"] == export.PROOF_TOKENS and proof["load_s"] > 0
    prompts = export.proof_prompts(prepared["eval"], prepared["train"])
    assert len(proof["sample"]) == len(prompts) == export.PROOF_PROMPTS
    for entry in proof["sample"]:
        assert len(entry["completion_ids"]) == export.PROOF_TOKENS and entry["completion"] and entry["prompt"]
        assert len(entry["prompt"]) <= export.PROOF_TEXT_CHARS
    # The prompts are held out: the first is the start of the first evaluation block, up to its first label.
    held_out = prepared["eval"]
    first_label = int((held_out.labels[0] != -100).argmax())
    assert prompts[0] == held_out.input_ids[0][:first_label].tolist() and first_label > 1
    # A second load of the same export gives the same tokens (greedy, fixed seed).
    again = export.prove(destination, None, str(trainer_assets.model), trainer.tokenizer, prompts,
                          getattr(torch, proof["dtype"]))
    assert [e["completion_ids"] for e in again["sample"]] == [e["completion_ids"] for e in proof["sample"]]


@pytest.mark.timeout(300)
def test_an_export_that_does_not_load_fails_the_run_and_keeps_the_checkpoint(trainer_assets, prepared, process_group,
                                                                            tmp_path, capsys, monkeypatch):
    """A real fault on the real files: the export is written by the real export_hf, then its
    weights are cut short (wrapped here, between the write and the proof), as a failed
    upload or a full disk would leave them."""
    written = ckpt.export_hf

    def export_then_truncate(*args, **kwargs):
        done = written(*args, **kwargs)
        weights = Path(args[2]) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return done

    trainer = trained_trainer(trainer_assets, prepared, tmp_path / "storage")
    monkeypatch.setattr(ckpt, "export_hf", export_then_truncate)
    capsys.readouterr()
    with pytest.raises(ExportUnloadable, match=r"the exported model at \S+/proof/export does not load: "):
        trainer.export()
    kinds = [e.kind for e in parse_text(capsys.readouterr().out)]
    assert "result" not in kinds and "export_proof" not in kinds
    assert ckpt.is_complete(trainer.weights_uri)  # the checkpoint is kept: the export can be written again


def test_held_out_prompts_fall_back_to_the_first_training_examples(prepared):
    prompts = export.proof_prompts(None, prepared["train"], count=2)
    first = list(prepared["train"].input_ids)[:2]
    assert len(prompts) == 2 and all(ids[:len(p)].tolist() == p and 1 <= len(p) < len(ids) for p, ids in zip(prompts, first))


@pytest.mark.timeout(300)
def test_a_lora_export_proves_its_adapter_on_the_base_and_its_merged_model(trainer_assets, prepared, process_group,
                                                                          tmp_path, capsys):
    trainer = trained_trainer(trainer_assets, prepared, tmp_path / "storage", method="lora", lora_rank=4)
    capsys.readouterr()
    trainer.export()
    proof = next(e for e in parse_text(capsys.readouterr().out) if e.kind == "export_proof")
    assert proof["adapter_uri"] == str(tmp_path / "storage" / "proof" / "export-adapter")
    assert proof["model_uri"] == str(tmp_path / "storage" / "proof" / "export")
    for entry in proof["sample"]:
        assert len(entry["adapter_completion_ids"]) == len(entry["completion_ids"]) == export.PROOF_TOKENS
    # The adapter alone (--lora-export-merged false) is proven on its own.
    alone = export.prove(None, proof["adapter_uri"], str(trainer_assets.model), trainer.tokenizer,
                         export.proof_prompts(prepared["eval"], prepared["train"]), getattr(torch, proof["dtype"]))
    assert [e["adapter_completion_ids"] for e in alone["sample"]] == \
        [e["adapter_completion_ids"] for e in proof["sample"]]
    assert all("completion" not in e for e in alone["sample"])


def test_a_mixture_of_experts_model_is_refused_by_its_config_field_before_and_at_load(trainer_assets, tmp_path):
    """The tiny Gemma 4 with its MoE block on (the fields transformers' Gemma4TextConfig
    reads: enable_moe_block, num_experts): refused by the driver before any worker starts,
    and by the sharded load; the dense one passes."""
    import json
    import shutil

    from tpufinetune_trainer.errors import ModelError
    from tpufinetune_trainer.finetune import prepare_data
    from tpufinetune_trainer.model import load_config
    from tpufinetune_trainer.sharded_load import check_dense, load_sharded

    moe = tmp_path / "moe"
    shutil.copytree(trainer_assets.model, moe)
    config = json.loads((moe / "config.json").read_text())
    config["text_config"].update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    (moe / "config.json").write_text(json.dumps(config))
    assert load_config(str(moe)).get_text_config().num_experts == 4  # transformers reads these fields
    cfg = FinetuneConfig(model_id=str(moe), dataset=str(trainer_assets.data), storage_path=str(tmp_path / "s"),
                         num_workers=1, device="cpu").validate()
    expected = rf"--model-id {moe} is a mixture-of-experts model \(its config's enable_moe_block is True, 4 experts\)"
    with pytest.raises(ModelError, match=expected) as refused:
        prepare_data(cfg)
    assert "dense model instead" in str(refused.value)
    with pytest.raises(ModelError, match=expected):
        load_sharded(str(moe), "sdpa", None, torch.float32)
    check_dense(load_config(str(trainer_assets.model)), str(trainer_assets.model))  # the dense tiny model passes


@pytest.mark.timeout(300)
def test_the_weights_stream_to_a_uri_in_bounded_shards_that_load_and_are_proven_there(trainer_assets, prepared,
                                                                                     process_group, tmp_path):
    """write_weights to a file:// URI (pyarrow's output streams, as for gs://): bf16 shards of
    at most the bound (a larger tensor alone in its file), an index naming every tensor,
    the values the model's own; the proof then loads it through storage.local_copy."""
    import json

    from safetensors import safe_open

    trainer = trained_trainer(trainer_assets, prepared, tmp_path / "storage")
    directory = tmp_path / "streamed"
    limit = sum(p.numel() * 2 for p in trainer.model.parameters()) // 4  # about four files of bf16
    done = export.write_weights(trainer.model, f"file://{directory}", torch.bfloat16, 0,
                                tied=set(ckpt.tied_weight_copies(trainer.model)), shard_bytes=limit)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == len(done["files"]) > 2 and [f.name for f in files] == sorted(done["files"])
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    expected = {ckpt_name: p for ckpt_name, p in trainer.model.state_dict().items()
                if ckpt_name not in ckpt.tied_weight_copies(trainer.model)}
    assert set(index["weight_map"]) == set(expected) and index["metadata"]["total_size"] == done["bytes"]
    for file in files:
        with safe_open(file, "pt") as f:
            keys = list(f.keys())
            header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
            assert file.stat().st_size - header <= limit or len(keys) == 1
            for key in keys:
                assert index["weight_map"][key] == file.name
                value = expected[key]
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                want = value.to(torch.bfloat16) if value.is_floating_point() else value
                assert torch.equal(f.get_tensor(key), want), key
    trainer.model.config.save_pretrained(directory)
    prompts = export.proof_prompts(prepared["eval"], prepared["train"])
    proof = export.prove(f"file://{directory}", None, str(trainer_assets.model), trainer.tokenizer, prompts,
                         torch.bfloat16)
    assert all(len(e["completion_ids"]) == export.PROOF_TOKENS for e in proof["sample"])
