"""`finetune` for real: Ray Train + FSDP2 on CPU (gloo, 2 workers) on the tiny Gemma 4.

One run is submitted through the Ray Job API (as the operator does) and shared by the
assertions; a second run resumes from its checkpoint.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tpufinetune_trainer.data import encode_rows, load_rows
from tpufinetune_trainer.model import load_causal_lm, load_tokenizer

from trainer_helpers import Run, events_of, offline_env, run_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EPOCHS = 2


def common_args(assets, storage: Path, run_name: str) -> list[str]:
    return ["finetune", "--model-id", str(assets.model), "--dataset", str(assets.data),
            "--dataset-split", "train[:320]", "--num-workers", "2", "--batch-size-per-device", "4",
            "--max-seq-len", "512", "--learning-rate", "3e-3", "--eval-fraction", "0.1", "--device", "cpu",
            "--storage-path", str(storage), "--run-name", run_name]


@pytest.fixture(scope="module")
def trained(ray_head, trainer_assets, tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    entrypoint = shlex.join(["tpufinetune-train", *common_args(trainer_assets, storage, "first"),
                             "--num-epochs", str(EPOCHS)])
    client = ray_head.job_client()
    job_id = client.submit_job(entrypoint=entrypoint, submission_id=f"tpuft-test-{int(time.time())}")
    deadline = time.monotonic() + 480
    while not client.get_job_status(job_id).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"finetune job hung:\n{client.get_job_logs(job_id)[-4000:]}")
        time.sleep(2)
    logs = client.get_job_logs(job_id)
    status = client.get_job_status(job_id)
    assert str(status.value) == "SUCCEEDED", logs[-6000:]
    return Run(0, logs, events_of(logs)), storage


@pytest.fixture(scope="module")
def resumed(ray_head, trainer_assets, trained, tmp_path_factory):
    run, storage = trained
    best = run.one("result")["best_checkpoint_uri"]
    args = common_args(trainer_assets, storage, "resumed") + ["--num-epochs", str(EPOCHS + 1), "--resume-from", best]
    return run_trainer(args, offline_env(ray_head.env()), timeout=480)


def test_events_tell_the_whole_run(trained):
    run, storage = trained
    start = run.one("start")
    assert (start["mode"], start["world_size"], start["backend"], start["device"]) == ("finetune", 2, "gloo", "cpu")
    assert len(start["devices"]) == 2
    assert [e["epoch"] for e in run.of("epoch")] == [1, 2]
    assert [e["epoch"] for e in run.of("checkpoint")] == [1, 2]
    assert not run.of("failure")
    result = run.one("result")
    assert result["best_checkpoint_uri"] == str(storage / "first" / "epoch_0002")
    assert result["exported_model_uri"] == str(storage / "first" / "export")
    assert result["metrics"]["epoch"] == EPOCHS


def test_loss_falls_and_eval_loss_is_reported(trained):
    first, second = trained[0].of("epoch")
    assert second["loss"] < 0.9 * first["loss"], (first, second)
    assert first["eval_loss"] is not None and second["eval_loss"] < first["eval_loss"]


def test_throughput_counts_real_tokens_and_batches_have_one_shape(trained):
    run = trained[0]
    for e in run.of("epoch"):
        assert e["batch_shapes"] == [[4, 512]]
        assert 0 < e["tokens_per_s"] <= e["padded_tokens_per_s"]
        assert e["epoch_time_s"] > 0 and e["epochs"] == EPOCHS
    # The tutorial's human line, with the real-token figure and the padded one labelled.
    assert re.search(r"Epoch 1/2 \| loss=\d+\.\d{4} \| epoch_time=\d+\.\d{2}s \| tokens/s=\d+\.\d \| "
                     r"eval_loss=\d+\.\d{4} \| padded_tokens/s=\d+\.\d", run.output)
    assert "Training completed! Final metrics:" in run.output


def test_checkpoints_are_sharded_and_retention_keeps_the_best(trained):
    run, storage = trained
    best = Path(run.one("result")["best_checkpoint_uri"])
    assert sorted(p.name for p in best.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                      "trainer_state.json"]
    assert not (storage / "first" / "epoch_0001").exists()  # --keep-checkpoints 1 (Ray Train retention)
    meta = dcp.FileSystemReader(str(best)).read_metadata().state_dict_metadata
    weight = meta["model.model.language_model.layers.0.mlp.gate_proj.weight"]
    assert len(weight.chunks) == 2  # each rank wrote only its half
    assert any(k.startswith("optim.") for k in meta)  # optimizer state travels with it
    assert not any("embed_tokens_per_layer" in k for k in meta)  # frozen PLE is not stored


def _sample_batch(assets) -> torch.Tensor:
    tok = load_tokenizer(str(assets.model))
    enc = encode_rows(load_rows(str(assets.data), "train[:3]"), tok, 512)
    length = min(len(x) for x in enc.input_ids)
    return torch.tensor([x[:length] for x in enc.input_ids])


def test_checkpoint_reloads_into_a_fresh_model_with_identical_outputs(trained, trainer_assets):
    from transformers import AutoModelForCausalLM

    run, _ = trained
    best = run.one("result")["best_checkpoint_uri"]
    fresh = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa").eval()
    base_state = {k: v.clone() for k, v in fresh.state_dict().items()}
    wanted = dcp.FileSystemReader(best).read_metadata().state_dict_metadata
    state = {"model": {k: v for k, v in fresh.state_dict().items() if f"model.{k}" in wanted}}
    dcp.load(state, checkpoint_id=best)  # in place: these tensors are the model's own
    exported = AutoModelForCausalLM.from_pretrained(run.one("result")["exported_model_uri"],
                                                    dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = _sample_batch(trainer_assets)
    with torch.no_grad():
        reloaded, exported_logits = fresh(input_ids=ids).logits, exported(input_ids=ids).logits
    assert torch.equal(reloaded, exported_logits)
    changed = [k for k, v in fresh.state_dict().items() if not torch.equal(v, base_state[k])]
    assert len(changed) > 10  # training moved the weights; the checkpoint is not the base model


def test_exported_directory_loads_with_from_pretrained(trained):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(trained[0].one("result")["exported_model_uri"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.model.vision_tower is None  # the text-only model that was trained
    assert AutoTokenizer.from_pretrained(export).eos_token_id == 1
    with safe_open(export / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, stored once


def test_resumed_run_continues_at_the_next_epoch(resumed, trained):
    assert resumed.rc == 0, resumed.tail()
    assert [e["epoch"] for e in resumed.of("epoch")] == [EPOCHS + 1]
    previous = trained[0].of("epoch")[-1]
    # Model and optimizer came back: the next epoch improves on the last one instead of
    # starting again from the random model's loss.
    assert resumed.one("epoch")["loss"] < previous["loss"]
    assert f"at epoch {EPOCHS}" in resumed.output
    result = resumed.one("result")
    assert result["best_epoch"] == EPOCHS + 1 and result["best_checkpoint_uri"].endswith("resumed/epoch_0003")
