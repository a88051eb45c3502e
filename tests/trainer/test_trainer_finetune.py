"""`finetune` for real: Ray Train + FSDP2 on CPU (gloo, 2 workers) on the tiny Gemma 4.

One run is submitted through the Ray Job API (as the operator does) and shared by the
assertions. It checkpoints every few steps and fails once on purpose after step 7:
Ray Train (--max-failures 1) restarts the workers, which resume from the step-5
checkpoint inside the same job. A second run resumes from a checkpoint in the middle of
epoch 1 and must retrace the first run exactly.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tpufinetune_trainer.checkpoint import WRITE_THREADS
from tpufinetune_trainer.data import encode_rows, load_rows, prepare
from tpufinetune_trainer.model import load_causal_lm, load_tokenizer

from harness.waiting import wait_for
from trainer_helpers import Run, events_of, offline_env, run_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EPOCHS = 2
EVERY = 5  # --checkpoint-every-steps
FAIL_AT = 7


def common_args(assets, storage: Path, run_name: str) -> list[str]:
    return ["finetune", "--model-id", str(assets.model), "--dataset", str(assets.data),
            "--dataset-split", "train[:320]", "--num-workers", "2", "--max-seq-len", "512",
            "--learning-rate", "3e-3", "--eval-fraction", "0.1", "--device", "cpu",
            "--storage-path", str(storage), "--run-name", run_name, "--checkpoint-every-steps", str(EVERY),
            "--keep-checkpoints", "20", "--progress-interval", "0.2", "--num-epochs", str(EPOCHS)]


@pytest.fixture(scope="module")
def trained(ray_head, trainer_assets, tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    entrypoint = shlex.join(["tpufinetune-train", *common_args(trainer_assets, storage, "first"),
                             "--max-failures", "1", "--fail-at-step", str(FAIL_AT)])
    client = ray_head.job_client()
    job_id = client.submit_job(entrypoint=entrypoint, submission_id=f"tpuft-test-{int(time.time())}")
    try:
        wait_for(lambda: client.get_job_status(job_id).is_terminal(), 480, "the finetune job to end", interval=2)
    except AssertionError:
        client.stop_job(job_id)
        pytest.fail(f"finetune job hung:\n{client.get_job_logs(job_id)[-4000:]}")
    logs = client.get_job_logs(job_id)
    status = client.get_job_status(job_id)
    assert str(status.value) == "SUCCEEDED", logs[-6000:]
    return Run(0, logs, events_of(logs)), storage


@pytest.fixture(scope="module")
def resumed(ray_head, trainer_assets, trained, tmp_path_factory):
    """A new run from the first run's checkpoint after step 10, inside epoch 1."""
    run, storage = trained
    middle = next(e["uri"] for e in run.of("checkpoint") if e["step"] == 2 * EVERY)
    args = common_args(trainer_assets, storage, "resumed") + ["--resume-from", middle]
    return run_trainer(args, offline_env(ray_head.env()), timeout=480)


def test_events_tell_the_whole_run(trained):
    run, storage = trained
    starts = run.of("start")  # once per worker-group start: the first and the one after the failure
    assert len(starts) == 2 and starts[0] == starts[1]
    start = starts[0]
    assert (start["mode"], start["world_size"], start["backend"], start["device"]) == ("finetune", 2, "gloo", "cpu")
    assert len(start["devices"]) == 2 and start["prompt_format"] == "chat"  # the tokenizer has a template
    assert [e["epoch"] for e in run.of("epoch")] == [1, 2]
    assert not run.of("failure")
    result = run.one("result")
    assert result["best_checkpoint_uri"].startswith(str(storage / "first") + "/")
    assert result["exported_model_uri"] == str(storage / "first" / "export")
    assert result["metrics"]["epoch"] == EPOCHS


def test_the_export_was_loaded_back_and_generated_the_same_tokens_as_a_second_load(trained, trainer_assets):
    from tpufinetune_trainer import export

    run, storage = trained
    proof = run.one("export_proof")
    kinds = [e.kind for e in run.events]
    assert kinds.index("export_proof") < kinds.index("result")
    assert proof["model_uri"] == run.one("result")["exported_model_uri"] and proof["load_s"] > 0
    assert len(proof["sample"]) == export.PROOF_PROMPTS and proof["tokens"] == export.PROOF_TOKENS
    assert all(len(e["completion_ids"]) == export.PROOF_TOKENS and e["completion"] for e in proof["sample"])
    # The same held-out prompts (the run's data, prepared again as the driver did), a second load.
    tokenizer = load_tokenizer(str(trainer_assets.model))
    data = prepare(str(trainer_assets.data), "train[:320]", tokenizer, 512, 0.1, 42)
    prompts = export.proof_prompts(data.eval, data.train)
    again = export.prove(proof["model_uri"], None, str(trainer_assets.model), tokenizer, prompts,
                         getattr(torch, proof["dtype"]))
    assert [e["prompt"] for e in again["sample"]] == [e["prompt"] for e in proof["sample"]]
    assert [e["completion_ids"] for e in again["sample"]] == [e["completion_ids"] for e in proof["sample"]]


def test_the_plan_states_the_global_batch_and_the_schedule(trained):
    run = trained[0]
    plans = run.of("plan")  # once per worker-group start: the first and the one after the failure
    resumed = [{k: p.pop(k) for k in ("resumed_step", "resumed_from")} for p in plans]
    assert len(plans) == 2 and plans[0] == plans[1]
    # The restart after the failure at step 7 resumed from the step-5 checkpoint.
    assert resumed[0] == {"resumed_step": None, "resumed_from": None}
    assert resumed[1]["resumed_step"] == EVERY
    assert re.search(rf"/first/step_{EVERY:07d}-[^/]+$", resumed[1]["resumed_from"]), resumed[1]
    plan = plans[0]
    steps = run.of("epoch")[-1]["steps"]  # epoch 1 restarted at step 5 and ran only the rest
    # The tutorial's batch: 2 devices x 4 examples; 288 training examples (320 less 10% held out).
    blocks = plan["blocks_per_device"]
    assert (plan["global_batch_examples"], plan["accumulation"]) == (8, 1) and blocks >= 1
    assert (plan["global_batch_blocks"], plan["global_batch_tokens"]) == (2 * blocks, 2 * blocks * 512)
    assert plan["steps_per_epoch"] == steps == 288 // 8 and plan["total_steps"] == EPOCHS * steps
    assert plan["lr_schedule"] == "cosine" and plan["warmup_steps"] >= 1
    assert plan["compute_dtype"] == "float32" and plan["compile"] is False  # CPU defaults
    assert plan["reshard_after_forward"] is True and "; blocks resharded after forward; " in run.output
    assert (f"Plan: 2 devices x 4 examples x 1 accumulation = 8 examples per optimizer step, packed into "
            f"{blocks} blocks of 512 tokens per device per micro-batch ({2 * blocks * 512} tokens per step)"
            in run.output)


def test_a_worker_failure_resumes_from_the_latest_step_checkpoint_in_the_same_job(trained):
    run = trained[0]
    assert f"injected failure after step {FAIL_AT}" in run.output
    assert re.search(rf"Resumed from \S+/first/step_{EVERY:07d}-\S+ at epoch 1 step {EVERY}/\d+ "
                     rf"\(global step {EVERY}\): Ray Train's latest", run.output)
    checkpoints = run.of("checkpoint")
    steps = [e["step"] for e in checkpoints]
    # Step 5 was written before the failure, step 5's successors after it; no step is lost.
    assert steps[0] == EVERY and steps.count(EVERY) == 1
    assert sorted(set(steps)) == steps[:1] + sorted(set(steps[1:])) and steps[-1] == run.of("plan")[0]["total_steps"]
    # Each start of the worker group names its checkpoints its own (<kind>_<n>-<start>): the
    # restart wrote none under a name the first start used.
    starts = [re.fullmatch(r"(epoch_\d{4}|step_\d{7})-(\S+)", Path(e["uri"]).name).group(2) for e in checkpoints]
    assert starts[0] != starts[1] and set(starts[1:]) == {starts[1]}, starts
    assert len({e["uri"] for e in checkpoints}) == len(checkpoints)


def test_progress_events_move_within_an_epoch(trained):
    run = trained[0]
    progress = run.of("progress")
    assert len(progress) >= 3
    total = run.of("plan")[0]["total_steps"]
    for e in progress:
        assert 0 < e["step"] <= total and e["total_steps"] == total
        assert 0 < e["epoch_step"] <= e["epoch_steps"] and e["tokens_per_s"] > 0 and e["step_time_s"] > 0
        assert e["loss"] > 0 and 0 < e["lr"] <= 3e-3 * (1 + 1e-6)  # the peak, as float32
        assert e["grad_norm"] > 0  # the last step's norm before clipping (clipping is on by default)
    assert any(e["epoch_step"] < e["epoch_steps"] for e in progress)  # inside an epoch, not at its end


def test_the_operators_curve_of_the_run_only_moves_forward_across_the_restart(trained):
    """The run's events folded as the operator folds them: the restart after step 7
    repeats steps 6 and 7, and their second report replaces the first (no zig-zag)."""
    from tpufinetune.core.runevents import apply_event

    run, status = trained[0], {}
    for event in run.events:
        apply_event(status, event)
    steps = [p["step"] for p in status["curve"]]
    assert steps == sorted(set(steps)) and steps[-1] == run.of("progress")[-1]["step"]
    last = {}
    for e in run.of("progress"):  # the last report of each step is the one kept
        last[e["step"]] = e
    assert all(p["loss"] == last[p["step"]]["loss"] and p["trainingSeconds"] == round(last[p["step"]]["training_s"], 1)
               for p in status["curve"])
    assert [(h["step"], h["evalLoss"]) for h in status["history"]] == \
        [(e["step"], round(e["eval_loss"], 4)) for e in run.of("epoch")]


def test_loss_falls_and_eval_loss_is_reported(trained):
    first, second = trained[0].of("epoch")
    assert second["loss"] < 0.9 * first["loss"], (first, second)
    assert first["eval_loss"] is not None and second["eval_loss"] < first["eval_loss"]


def test_throughput_counts_real_tokens_and_batches_have_one_shape(trained):
    run = trained[0]
    for e in run.of("epoch"):
        assert e["batch_shapes"] == [[run.of("plan")[0]["blocks_per_device"], 512]]
        assert 0 < e["tokens_per_s"] <= e["padded_tokens_per_s"]
        assert e["epoch_time_s"] > 0 and e["epochs"] == EPOCHS
    # The tutorial's human line, with the real-token figure and the padded one labelled.
    assert re.search(r"Epoch 1/2 \| loss=\d+\.\d{4} \| epoch_time=\d+\.\d{2}s \| tokens/s=\d+\.\d \| "
                     r"eval_loss=\d+\.\d{4} \| padded_tokens/s=\d+\.\d", run.output)
    assert "Training completed! Final metrics:" in run.output


def test_checkpoints_are_sharded_and_the_best_by_eval_loss_is_exported(trained):
    run, storage = trained
    best = Path(run.one("result")["best_checkpoint_uri"])
    assert sorted(p.name for p in best.iterdir()) == sorted(
        [".metadata", *[f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(WRITE_THREADS)],
         "trainer_state.json"])  # each rank's shards, in WRITE_THREADS files written in parallel
    meta = dcp.FileSystemReader(str(best)).read_metadata().state_dict_metadata
    weight = meta["model.model.language_model.layers.0.mlp.gate_proj.weight"]
    assert len(weight.chunks) == 2  # each rank wrote only its half
    assert weight.properties.dtype == torch.float32  # master weights, whatever the compute dtype
    assert any(k.startswith("optim.") for k in meta)  # optimizer state travels with it
    assert not any("embed_tokens_per_layer" in k for k in meta)  # frozen PLE is not stored
    # eval_loss ranks checkpoints when there is an eval split (score attribute auto).
    last = Path(run.of("checkpoint")[-1]["uri"])
    history = json.loads((last / "trainer_state.json").read_text())["history"]
    assert len(history) == len({e["step"] for e in run.of("checkpoint")})
    assert all(entry["eval_loss"] is not None for entry in history)
    assert str(best) == min(history, key=lambda entry: entry["eval_loss"])["uri"]
    assert "(eval_loss=" in run.output


def _sample_batch(assets) -> torch.Tensor:
    tok = load_tokenizer(str(assets.model))
    enc = encode_rows(load_rows(str(assets.data), "train[:3]"), tok, 512)
    length = min(len(x) for x in enc.input_ids)
    return torch.tensor([x[:length] for x in enc.input_ids])


def test_checkpoint_reloads_into_a_fresh_model_with_identical_outputs(trained, trainer_assets):
    run, _ = trained
    best = run.one("result")["best_checkpoint_uri"]
    fresh = load_causal_lm(str(trainer_assets.model), torch.float32, "sdpa").eval()
    base_state = {k: v.clone() for k, v in fresh.state_dict().items()}
    wanted = dcp.FileSystemReader(best).read_metadata().state_dict_metadata
    state = {"model": {k: v for k, v in fresh.state_dict().items() if f"model.{k}" in wanted}}
    dcp.load(state, checkpoint_id=best)  # in place: these tensors are the model's own
    # The export carries the base's towers (whose audio model has no sdpa); its text model
    # is loaded as the trainer loads a base.
    exported = load_causal_lm(run.one("result")["exported_model_uri"], torch.float32, "sdpa").eval()
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
    assert model.model.vision_tower is not None  # the base's towers: a drop-in for the multimodal base
    assert AutoTokenizer.from_pretrained(export).eos_token_id == 1
    with safe_open(export / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, stored once


def test_a_run_resumed_inside_an_epoch_retraces_the_uninterrupted_run(resumed, trained):
    assert resumed.rc == 0, resumed.tail()
    assert re.search(rf"Resumed from \S+/first/step_{2 * EVERY:07d}-\S+ at epoch 1 step {2 * EVERY}/\d+ "
                     rf"\(global step {2 * EVERY}\): --resume-from", resumed.output)
    first = trained[0].of("epoch")
    again = resumed.of("epoch")
    assert [e["epoch"] for e in again] == [1, 2]
    # Same data order, optimizer state, schedule position and partial-epoch loss: the
    # same numbers as the run that was never stopped there.
    for a, b in zip(first, again):
        assert abs(a["loss"] - b["loss"]) < 2e-3, (a, b)
        assert abs(a["eval_loss"] - b["eval_loss"]) < 2e-3, (a, b)
