"""`finetune --method lora` for real: Ray Train + FSDP2 on CPU (gloo, 2 workers) on the tiny
Gemma 4, its base frozen in bf16 and peft's adapters trained.

One run trains two epochs with step checkpoints and is shared by the assertions: the loss
falls, every checkpoint holds the adapters and their optimizer state only, and the export
writes the adapter in peft's format (PeftModel.from_pretrained loads it) and the merged
model, whose logits equal base + adapter. A second run resumes from a step checkpoint of
the first and continues at its saved step; one with another LoRA rank is refused. A third
trains the embedding beside the adapters (--lora-train-embeddings): its checkpoints hold the
embedding and its moments, and both exports carry it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tpufinetune_trainer import lora
from tpufinetune_trainer.errors import ConfigError, ModelError
from trainer_helpers import offline_env, run_trainer

EVERY = 5  # --checkpoint-every-steps
RANK = 8
WORLD = 2  # --num-workers


def common_args(assets, storage: Path, run_name: str) -> list[str]:
    return ["finetune", "--model-id", str(assets.model), "--dataset", str(assets.data),
            "--dataset-split", "train[:160]", "--num-workers", str(WORLD), "--max-seq-len", "256",
            "--learning-rate", "1e-2", "--eval-fraction", "0.1", "--device", "cpu",
            "--storage-path", str(storage), "--run-name", run_name, "--checkpoint-every-steps", str(EVERY),
            "--keep-checkpoints", "20", "--progress-interval", "0.2", "--num-epochs", "2",
            "--method", "lora", "--lora-rank", str(RANK), "--lora-alpha", "16", "--lora-dropout", "0"]


@pytest.fixture(scope="module")
def trained(ray_head, trainer_assets, tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    run = run_trainer(common_args(trainer_assets, storage, "first"), offline_env(ray_head.env()), timeout=420)
    assert run.rc == 0, run.tail()
    return run, storage


def checkpoint_keys(location: str) -> list[str]:
    return list(dcp.FileSystemReader(location).read_metadata().state_dict_metadata)


def shard_bytes(location: str) -> int:
    return sum(p.stat().st_size for p in Path(location).glob("*.distcp"))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lora_trains_the_adapters_only_and_the_loss_falls(trained):
    run = trained[0]
    assert "master weights float32 for LoRA's adapters only (rank 8, alpha 16" in run.output
    epochs = run.of("epoch")
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[1]["loss"] < epochs[0]["loss"] and epochs[1]["eval_loss"] < epochs[0]["eval_loss"], epochs
    progress = [e["loss"] for e in run.of("progress")]
    assert progress[-1] < progress[0], progress
    assert not run.of("failure")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(trained, trainer_assets):
    run, storage = trained
    adapter = Path(run.one("result")["exported_adapter_uri"])
    from safetensors.torch import load_file

    adapter_params = sum(t.numel() for t in load_file(adapter / "adapter_model.safetensors").values())
    base_bytes = sum(p.stat().st_size for p in trainer_assets.model.glob("*.safetensors"))
    for event in run.of("checkpoint"):
        keys = checkpoint_keys(event["uri"])
        model_params = [k for k in keys if k.startswith("model.") and k.endswith(".weight")]
        assert model_params and all(".lora_A." in k or ".lora_B." in k for k in model_params), model_params
        assert not [k for k in keys if "base_layer" in k or "embed_tokens" in k or "lm_head" in k]
        # AdamW's moments for each adapter, nothing for the frozen base.
        moments = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
        assert moments == {k.removeprefix("model.") for k in model_params}
        # fp32 weights and two fp32 moments per adapter parameter, plus each rank's framing of
        # its part of each item (about 1 KiB: on the tiny model, most of the bytes).
        assert shard_bytes(event["uri"]) <= 3 * 4 * adapter_params + 2048 * len(keys) * WORLD, event["uri"]
        assert shard_bytes(event["uri"]) < base_bytes  # the full fine-tune's is 3x the base's fp32 bytes


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_resume_continues_at_the_saved_step(trained, trainer_assets, ray_head):
    run, storage = trained
    middle = next(e["uri"] for e in run.of("checkpoint") if e["step"] == EVERY)
    # The merged export is not part of the fingerprint: this run exports the adapter only.
    args = common_args(trainer_assets, storage, "resumed") + ["--resume-from", middle, "--lora-export-merged", "false"]
    resumed = run_trainer(args, offline_env(ray_head.env()), timeout=420)
    assert resumed.rc == 0, resumed.tail()
    plan = resumed.of("plan")[0]
    assert (plan["resumed_step"], plan["resumed_from"]) == (EVERY, middle)
    assert f"(global step {EVERY}): --resume-from" in resumed.output
    steps = [e["step"] for e in resumed.of("checkpoint")]
    assert steps[0] == 2 * EVERY and steps[-1] == run.of("checkpoint")[-1]["step"]
    result = resumed.one("result")
    assert result["exported_model_uri"] is None and not (storage / "resumed" / "export").exists()
    assert (Path(result["exported_adapter_uri"]) / "adapter_model.safetensors").is_file()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_resume_with_other_lora_settings_is_refused(trained, trainer_assets, ray_head):
    run, storage = trained
    middle = next(e["uri"] for e in run.of("checkpoint") if e["step"] == EVERY)
    args = common_args(trainer_assets, storage, "other-rank") + ["--resume-from", middle, "--lora-rank", "4"]
    refused = run_trainer(args, offline_env(ray_head.env()), timeout=240)
    assert refused.rc != 0
    message = refused.one("failure")["message"]
    assert "LoRA settings" in message and '"rank": 8' in message and '"rank": 4' in message, message


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_export_is_a_peft_adapter_and_a_merged_model_that_agree(trained, trainer_assets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, storage = trained
    result = run.one("result")
    assert result["exported_adapter_uri"] == str(storage / "first" / "export-adapter")
    assert result["exported_model_uri"] == str(storage / "first" / "export")
    config = json.loads((Path(result["exported_adapter_uri"]) / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, 16)
    assert set(config["target_modules"]) == set(lora.DEFAULT_TARGET_MODULES)

    base = AutoModelForCausalLM.from_pretrained(str(trainer_assets.model), dtype=torch.float32)
    untrained = AutoModelForCausalLM.from_pretrained(str(trainer_assets.model), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in base.parameters():  # the trained base was held in bf16
            param.copy_(param.to(torch.bfloat16).float())
    adapted = PeftModel.from_pretrained(base, result["exported_adapter_uri"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(result["exported_model_uri"], dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter, from_merged = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        before = untrained(input_ids=ids).logits
    scale = with_adapter.abs().max().item()
    assert (with_adapter - from_merged).abs().max().item() < 1e-2 * scale
    assert (with_adapter - before).abs().max().item() > 0.1 * scale  # the adapter changed the model


def test_an_unknown_module_for_the_family_is_refused_naming_the_field_and_the_valid_names():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    lora.check_targets(model, list(lora.DEFAULT_TARGET_MODULES))
    with pytest.raises(ModelError) as caught:
        lora.check_targets(model, ["q_proj", "per_layer_input_gate"])  # a Gemma 4 layer
    message = str(caught.value)
    assert "spec.training.lora.targetModules" in message and "per_layer_input_gate" in message
    assert "valid names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in message


@pytest.mark.parametrize("argv,flag", [
    (["--method", "lora", "--lora-rank", "0"], "--lora-rank"),
    (["--method", "lora", "--lora-target-modules", "q_proj,attn"], "--lora-target-modules"),
    (["--lora-rank", "8"], "--lora-rank"),  # LoRA's settings with --method full
    (["--lora-train-embeddings", "true"], "--lora-train-embeddings"),
    (["--method", "lora", "--lora-train-embeddings", "true", "--freeze-embeddings", "true"],
     "--lora-train-embeddings"),
])
def test_the_trainer_refuses_bad_lora_flags_naming_them(argv, flag):
    from tpufinetune_trainer import cli

    with pytest.raises(ConfigError, match=flag):
        cli._config(cli.build_parser().parse_args(["finetune", "--storage-path", "/x", *argv])).validate()


def test_the_fingerprint_holds_the_method_and_loras_settings():
    from tpufinetune_trainer import resume
    from tpufinetune_trainer.config import FinetuneConfig

    full = FinetuneConfig(storage_path="/x")
    assert lora.settings(full) == {"method": "full"}
    adapted = FinetuneConfig(storage_path="/x", method="lora", lora_rank=4)
    assert lora.settings(adapted)["lora"]["rank"] == 4
    # Absent when off, so a checkpoint written before the flag existed still matches.
    assert "train_embeddings" not in lora.settings(adapted)["lora"]
    embeddings = FinetuneConfig(storage_path="/x", method="lora", lora_rank=4, lora_train_embeddings=True)
    assert lora.settings(embeddings)["lora"]["train_embeddings"] is True
    with pytest.raises(Exception, match="--lora-train-embeddings"):
        resume.check({"fingerprint": {"model_id": "m", **lora.settings(adapted)}},
                     {"model_id": "m", **lora.settings(embeddings)}, "loc")
    saved = {"fingerprint": {"model_id": "m"}}  # an earlier trainer's: a full fine-tune
    assert resume.check(saved, {"model_id": "m", "method": "full"}, "loc")
    with pytest.raises(Exception, match="--method"):
        resume.check(saved, {"model_id": "m", "method": "lora"}, "loc")


def test_a_trained_embedding_is_saved_as_pefts_modules_to_save_and_loads_with_its_tied_head(trainer_assets,
                                                                                             tmp_path):
    """The adapter export's format with --lora-train-embeddings, on an unsharded model: what
    peft loads is the trained embedding, and the tied head follows it (ensure_weight_tying)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tpufinetune_trainer.config import FinetuneConfig

    cfg = FinetuneConfig(storage_path="/x", model_id=str(trainer_assets.model), method="lora", lora_rank=4,
                         lora_alpha=8, lora_dropout=0, lora_train_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(str(trainer_assets.model), dtype=torch.float32)
    lora.inject(model, cfg)
    # What checkpoint.export_adapter gathers: the trainable parameters, a tied head under both names.
    trained = {name: p for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    embedding = model.get_input_embeddings().weight
    assert {name for name in trained if not lora.is_adapter(name)} == {
        name for name, p in model.named_parameters(remove_duplicate=False) if p is embedding}
    assert embedding.dtype == torch.float32 and model.get_output_embeddings().weight is embedding
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in dict(model.named_parameters()).values():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    lora.write_adapter(tmp_path, {name: p.detach() for name, p in trained.items()}, cfg)

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["modules_to_save"], config["ensure_weight_tying"]) == ([lora.EMBEDDING_MODULE], True)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {k for k in saved if ".lora_" not in k} == {"base_model.model." + n for n in trained
                                                         if not lora.is_adapter(n)}
    base = AutoModelForCausalLM.from_pretrained(str(trainer_assets.model), dtype=torch.float32)
    with torch.no_grad():
        for param in base.parameters():  # the trained base was held in bf16
            param.copy_(param.to(torch.bfloat16).float())
    untrained_embedding = base.get_input_embeddings().weight.detach().clone()
    adapted = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    assert torch.equal(adapted.get_input_embeddings().weight, embedding)
    assert torch.equal(adapted.get_output_embeddings().weight, embedding)  # the tied head follows
    assert not torch.equal(untrained_embedding, embedding)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.float().eval()(input_ids=ids).logits
        assert torch.allclose(adapted(input_ids=ids).logits, expected, atol=1e-5 * expected.abs().max().item())


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_trained_embeddings_are_checkpointed_and_carried_by_both_exports(ray_head, trainer_assets,
                                                                         tmp_path_factory):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    storage = tmp_path_factory.mktemp("storage-embeddings")
    args = common_args(trainer_assets, storage, "embeddings") + ["--num-epochs", "1", "--lora-train-embeddings",
                                                                 "true"]
    run = run_trainer(args, offline_env(ray_head.env()), timeout=420)
    assert run.rc == 0, run.tail()
    for event in run.of("checkpoint"):
        keys = checkpoint_keys(event["uri"])
        embedding = [k for k in keys if k.startswith("model.") and "embed_tokens" in k]
        assert embedding and not [k for k in keys if "base_layer" in k], keys
        moments = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
        assert {k.removeprefix("model.") for k in embedding} <= moments  # AdamW state for the embedding

    result = run.one("result")
    saved = load_file(Path(result["exported_adapter_uri"]) / "adapter_model.safetensors")
    trained_embedding = next(v for k, v in saved.items() if k.endswith("embed_tokens.weight"))
    base = AutoModelForCausalLM.from_pretrained(str(trainer_assets.model), dtype=torch.float32)
    with torch.no_grad():
        for param in base.parameters():  # the trained base was held in bf16
            param.copy_(param.to(torch.bfloat16).float())
    assert not torch.allclose(base.get_input_embeddings().weight, trained_embedding)  # it trained
    adapted = PeftModel.from_pretrained(base, result["exported_adapter_uri"]).eval()
    assert torch.equal(adapted.get_output_embeddings().weight, trained_embedding)  # the tied head follows
    merged = AutoModelForCausalLM.from_pretrained(result["exported_model_uri"], dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter, from_merged = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (with_adapter - from_merged).abs().max().item() < 1e-2 * with_adapter.abs().max().item()
