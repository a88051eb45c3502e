"""The Ray job a spec submits: argv built as a list, inert user strings, no secrets in the
runtime env, deterministic ids."""
from __future__ import annotations

import json
import shlex

import pytest
from api_spec_cases import spec_with

from tpufinetune.core.api import parse_spec
from tpufinetune.core.jobspec import (checkpoint_request, job_submission, preflight_submission, run_name,
                                     submission_id, trainer_argv)

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))


def test_finetune_argv_carries_every_setting():
    spec = parse_spec(spec_with(tpu={"generation": "v7x", "topology": "2x2x2"},
                                training={"epochs": 2, "batchSizePerDevice": 8,
                                          "maxSeqLen": 1024, "learningRate": 1e-4,
                                          "weightDecay": 0.0, "seed": 7, "evalFraction": 0.1},
                                checkpoint={"storagePath": "gs://b/p", "keep": 2,
                                            "scoreAttribute": "eval_loss",
                                            "scoreOrder": "min"}))
    argv = trainer_argv(spec, run_name="tft-x-6f1c2a7e", resume_from="gs://b/p/ckpt_1")
    assert argv[:2] == ["tpufinetune-train", "finetune"]
    assert flags(argv) == {
        "model-id": "google/gemma-4-E2B-it", "dataset": "databricks/databricks-dolly-15k",
        "dataset-split": "train[:1024]", "topology": "2x2x2", "accelerator-type": "TPU-V7X",
        "num-workers": "16", "device": "tpu", "num-epochs": "2", "batch-size-per-device": "8",
        "max-seq-len": "1024", "learning-rate": "0.0001", "weight-decay": "0.0", "seed": "7",
        "eval-fraction": "0.1", "storage-path": "gs://b/p", "keep-checkpoints": "2",
        "global-batch-blocks": "0", "lr-schedule": "cosine", "warmup-ratio": "0.05",
        "min-lr-ratio": "0.1", "decay-ratio": "0.2", "max-grad-norm": "1.0", "max-steps": "0", "prompt-format": "auto",
        "dataset-format": "auto", "checkpoint-every-steps": "0", "compile": "auto",
        "max-failures": "0",
        "checkpoint-score-attribute": "eval_loss", "checkpoint-score-order": "min",
        "run-name": "tft-x-6f1c2a7e", "resume-from": "gs://b/p/ckpt_1",
        # The memory plan's choices (spec.training leaves both auto): 1024 tokens x 8 do not fit
        # E2B's activations on v7x, the attention's recomputed do, and two devices hold the state.
        "activation-checkpointing": "selective", "shard-group": "2",
    }


def test_loss_on_is_passed_only_when_set():
    assert "loss-on" not in flags(trainer_argv(parse_spec(spec_with())))
    assert flags(trainer_argv(parse_spec(spec_with(training={"lossOn": "all"}))))["loss-on"] == "all"


@pytest.mark.parametrize("generation,topology,accelerator,workers", [
    ("v4", "2x2x2", "TPU-V4", "8"), ("v5e", "4x4", "TPU-V5LITEPOD", "16"),
    ("v5p", "2x2x4", "TPU-V5P", "16"), ("trillium", "4x4", "TPU-V6E", "16"),
    ("ironwood", "2x2x2", "TPU-V7X", "16"),
])
def test_accelerator_type_and_world_size_per_generation(generation, topology, accelerator,
                                                        workers):
    spec = parse_spec(spec_with(tpu={"generation": generation, "topology": topology}))
    got = flags(trainer_argv(spec))
    assert (got["accelerator-type"], got["num-workers"], got["device"]) == (
        accelerator, workers, "tpu")


def test_collectives_argv_spans_all_slices():
    spec = parse_spec(spec_with(mode="collectives", checkpoint=None,
                                tpu={"generation": "v6e", "topology": "4x4", "slices": 2}))
    assert trainer_argv(spec) == ["tpufinetune-train", "collectives", "--topology=4x4",
                                  "--accelerator-type=TPU-V6E", "--num-workers=32",
                                  "--device=tpu"]


def test_cpu_stand_in_runs_on_cpu_with_one_worker_per_pod():
    spec = parse_spec(spec_with(tpu={"generation": "cpu", "topology": "2"},
                                checkpoint={"storagePath": "gs://b/ckpt"}))
    got = flags(trainer_argv(spec))
    assert (got["device"], got["num-workers"], got["topology"]) == ("cpu", "2", "2")
    assert "accelerator-type" not in got


@pytest.mark.parametrize("hostile", ["x; rm -rf /", "$(reboot)", "a'b\"c", "-h", "`id` && x"])
def test_user_strings_stay_one_inert_argument(hostile):
    spec = parse_spec(spec_with(model={"id": hostile}, dataset={"id": hostile},
                                checkpoint={"storagePath": f"gs://b/{hostile}"}))
    job = job_submission("run", "ns", UID, spec, attempt=1)
    assert f"--model-id={hostile}" in job.entrypoint_argv
    assert f"--storage-path=gs://b/{hostile}" in job.entrypoint_argv
    # What the Ray head's shell will split the entrypoint into is exactly the argv.
    assert shlex.split(job.entrypoint) == job.entrypoint_argv


def test_runtime_env_never_carries_the_token():
    spec = parse_spec(spec_with(model={"tokenSecret": {"name": "hf-secret",
                                                       "key": "hf_api_token"}}))
    job = job_submission("run", "ns", UID, spec, attempt=1)
    text = json.dumps(job.runtime_env) + job.entrypoint
    assert "HF_TOKEN" not in text and "hf-secret" not in text and "hf_api_token" not in text
    assert job.runtime_env == {"env_vars": {
        "PYTHONUNBUFFERED": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPUFINETUNE_NAME": "run",
        "TPUFINETUNE_NAMESPACE": "ns", "TPUFINETUNE_ATTEMPT": "1", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}}


def test_every_job_runs_without_torchs_device_backend_autoload():
    """`import torch` in the TorchTPU image would import torch_tpu and load libtpu in each of
    a job's processes (the driver and controller on CPU hosts too); the trainer loads it itself
    on TPU hosts (backends.load_tpu_runtime)."""
    spec = parse_spec(spec_with())
    jobs = [job_submission("run", "ns", UID, spec, attempt=1), preflight_submission("run", "ns", UID, spec, 1),
            checkpoint_request("run", "ns", UID, 1, 1, "maintenance", "node n")]
    for job in jobs:
        assert job.runtime_env["env_vars"]["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0", job.submission_id


def test_ids_are_deterministic_and_attempts_share_the_run_name():
    spec = parse_spec(spec_with())
    first = job_submission("run", "ns", UID, spec, attempt=1)
    second = job_submission("run", "ns", UID, spec, attempt=2, resume_from="gs://b/c")
    assert first == job_submission("run", "ns", UID, spec, attempt=1)
    assert (first.submission_id, second.submission_id) == (f"tft-{UID}-1", f"tft-{UID}-2")
    assert submission_id(UID, 2) == second.submission_id
    assert flags(first.entrypoint_argv)["run-name"] == flags(second.entrypoint_argv)["run-name"]
    assert run_name("run", UID) == "tft-run-6f1c2a7e"
    assert "resume-from" not in flags(first.entrypoint_argv)
    assert flags(second.entrypoint_argv)["resume-from"] == "gs://b/c"
    assert second.metadata == {"tpufinetune.dev/name": "run", "tpufinetune.dev/namespace": "ns",
                               "tpufinetune.dev/uid": UID, "tpufinetune.dev/attempt": "2"}


def test_a_recreated_namesake_gets_a_different_run():
    assert run_name("run", UID) != run_name("run", "0a1b2c3d-0000-0000-0000-000000000000")


def test_attempts_count_from_one():
    with pytest.raises(ValueError, match="attempt must be >= 1, got 0"):
        submission_id(UID, 0)
