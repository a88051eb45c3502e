"""Specs shared by the pure validation tests and the admission tests, so one list proves
that `parse_spec` and the apiserver (schema + CEL) refuse the same things."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tpufinetune.core import validation
from tpufinetune.core.api import CONTROL_MESSAGE, PRINTABLE

IMAGE = "us-docker.pkg.dev/my-project/ray-torchtpu/ray-torchtpu:latest"
V6E_VALID = "1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16"
V7X_VALID = ("2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, 4x8x8, 8x8x8, 8x8x16, 8x16x16, "
             "16x16x16, 16x16x24")


def base_spec() -> dict:
    """A valid finetune spec for v6e 4x4."""
    return {
        "tpu": {"generation": "v6e", "topology": "4x4"},
        "image": IMAGE,
        "checkpoint": {"storagePath": "gs://my-bucket/ray_train_torchtpu"},
    }


def shared_volume(source: dict, mount_path: str = "/mnt/ckpt", **mount: object) -> dict:
    """A pod group that mounts one volume `ckpt` (source) at mount_path."""
    return {"volumes": [{"name": "ckpt", **source}],
            "volumeMounts": [{"name": "ckpt", "mountPath": mount_path, **mount}]}


PVC = {"persistentVolumeClaim": {"claimName": "checkpoints"}}


def spec_with(**changes: object) -> dict:
    """base_spec() with dotted-path changes; a value of None deletes the key."""
    spec = base_spec()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = spec
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return spec


@dataclass(frozen=True)
class Invalid:
    id: str
    spec: dict
    field: str
    message: str
    """parse_spec's message. For CEL twins (admission=None) the apiserver prints exactly
    this text too; otherwise `admission` is the apiserver's own phrase."""
    admission: str | None = None
    python_exact: bool = field(default=True)


INVALID: list[Invalid] = [
    # CEL twins: the apiserver and parse_spec print the same message.
    Invalid("v6e-3x3", spec_with(tpu__topology="3x3"), "spec.tpu.topology",
            f'"3x3" is not a valid v6e topology; valid: {V6E_VALID}'),
    Invalid("trillium-3d-shape", spec_with(tpu__generation="trillium", tpu__topology="2x2x2"),
            "spec.tpu.topology", f'"2x2x2" is not a valid v6e topology; valid: {V6E_VALID}'),
    Invalid("ironwood-2d-shape", spec_with(tpu__generation="ironwood", tpu__topology="4x4"),
            "spec.tpu.topology", f'"4x4" is not a valid v7x topology; valid: {V7X_VALID}'),
    Invalid("cpu-zero-workers", spec_with(tpu__generation="cpu", tpu__topology="0"),
            "spec.tpu.topology",
            '"0" is not a valid cpu topology; use a worker count from 1 to 64'),
    Invalid("cpu-2d-shape", spec_with(tpu__generation="cpu", tpu__topology="2x2"),
            "spec.tpu.topology",
            '"2x2" is not a valid cpu topology; use a worker count from 1 to 64'),
    Invalid("chips-per-host-8-on-4x4", spec_with(tpu__chipsPerHost=8),
            "spec.tpu.chipsPerHost", "8 does not fit a v6e 4x4 slice; valid: 4"),
    Invalid("chips-per-host-1-on-2x4", spec_with(tpu__topology="2x4", tpu__chipsPerHost=1),
            "spec.tpu.chipsPerHost", "1 does not fit a v6e 2x4 slice; valid: 4, 8"),
    Invalid("chips-per-host-on-cpu",
            spec_with(tpu__generation="cpu", tpu__topology="2", tpu__chipsPerHost=4),
            "spec.tpu.chipsPerHost", "applies to TPU generations only; remove it for cpu"),
    Invalid("v5p-slices-past-the-multislice-ceiling",
            spec_with(tpu={"generation": "v5p", "topology": "16x16x24", "slices": 4}),
            "spec.tpu.slices", validation.SLICES_MESSAGE),
    Invalid("collectives-slices-past-the-ceiling",
            spec_with(mode="collectives", checkpoint=None,
                      tpu={"generation": "v5p", "topology": "8x16x16", "slices": 10}),
            "spec.tpu.slices", validation.SLICES_MESSAGE),
    Invalid("cpu-slices-past-the-worker-total",
            spec_with(tpu={"generation": "cpu", "topology": "40", "slices": 2}),
            "spec.tpu.slices", validation.SLICES_MESSAGE),
    Invalid("global-batch-two-slices",
            spec_with(tpu__slices=2, training={"globalBatchBlocks": 64}),
            "spec.training.globalBatchBlocks",
            f"{validation.GLOBAL_BATCH_MESSAGE}: 64 is not a multiple of 16 devices x 2 slices x 4 = 128",
            admission=validation.GLOBAL_BATCH_MESSAGE),
    Invalid("finetune-without-storage", spec_with(checkpoint=None),
            "spec.checkpoint.storagePath", validation.STORAGE_MESSAGE),
    Invalid("local-storage-no-volume", spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("file-uri-no-volume", spec_with(checkpoint={"storagePath": "file:///mnt/ckpt/run"}),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("local-storage-head-volume-only",
            spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}, head=shared_volume(PVC)),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("local-storage-two-claims",
            spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}, head=shared_volume(PVC),
                      workers=shared_volume({"persistentVolumeClaim": {"claimName": "other"}})),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("local-storage-pod-own-emptydir",
            spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}, head=shared_volume({"emptyDir": {}}),
                      workers=shared_volume({"emptyDir": {}})),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("local-storage-read-only-mount",
            spec_with(checkpoint={"storagePath": "/mnt/ckpt/run"}, head=shared_volume(PVC),
                      workers=shared_volume(PVC, readOnly=True)),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("local-storage-beside-the-mount",
            spec_with(checkpoint={"storagePath": "/mnt/ckpt2/run"}, head=shared_volume(PVC),
                      workers=shared_volume(PVC)),
            "spec.checkpoint.storagePath", validation.SHARED_STORAGE_MESSAGE),
    Invalid("eval-loss-without-evaluation",
            spec_with(checkpoint={"storagePath": "gs://b/p", "scoreAttribute": "eval_loss"},
                      training={"evalFraction": 0}),
            "spec.checkpoint.scoreAttribute", validation.EVAL_SCORE_MESSAGE),
    Invalid("target-eval-loss-without-evaluation",
            spec_with(training={"targetEvalLoss": 1.5, "evalFraction": 0}),
            "spec.training.targetEvalLoss", validation.EARLY_STOP_MESSAGE),
    Invalid("patience-without-evaluation",
            spec_with(training={"earlyStoppingPatience": 3, "evalFraction": 0}),
            "spec.training.earlyStoppingPatience", validation.EARLY_STOP_MESSAGE),
    Invalid("negative-target-eval-loss", spec_with(training={"targetEvalLoss": -1.0}),
            "spec.training.targetEvalLoss", "must be greater than 0",
            admission="should be greater than 0", python_exact=False),
    Invalid("zero-bandwidth-floor", spec_with(preflight={"enabled": True, "minBusBandwidthGBps": 0}),
            "spec.preflight.minBusBandwidthGBps", "must be greater than 0",
            admission="should be greater than 0", python_exact=False),
    Invalid("global-batch-not-a-multiple", spec_with(training={"globalBatchBlocks": 24}),
            "spec.training.globalBatchBlocks",
            f"{validation.GLOBAL_BATCH_MESSAGE}: 24 is not a multiple of 16 devices x 4 = 64",
            admission=validation.GLOBAL_BATCH_MESSAGE),
    Invalid("global-batch-v7x-two-devices-per-chip",
            spec_with(tpu={"generation": "ironwood", "topology": "2x2x2"},
                      training={"globalBatchBlocks": 40, "batchSizePerDevice": 2}),
            "spec.training.globalBatchBlocks",
            f"{validation.GLOBAL_BATCH_MESSAGE}: 40 is not a multiple of 16 devices x 2 = 32",
            admission=validation.GLOBAL_BATCH_MESSAGE),
    Invalid("global-batch-cpu-workers",
            spec_with(tpu={"generation": "cpu", "topology": "2"}, training={"globalBatchBlocks": 3}),
            "spec.training.globalBatchBlocks",
            f"{validation.GLOBAL_BATCH_MESSAGE}: 3 is not a multiple of 2 devices x 4 = 8",
            admission=validation.GLOBAL_BATCH_MESSAGE),
    Invalid("tokens-per-step-not-a-multiple", spec_with(training={"tokensPerStep": 40000}),
            "spec.training.tokensPerStep",
            f"{validation.TOKENS_PER_STEP_MESSAGE}: 40000 is not a multiple of 16 devices x 4 x 512 = 32768; "
            "e.g. 32768", admission=validation.TOKENS_PER_STEP_MESSAGE),
    Invalid("tokens-per-step-two-slices-and-block-length",
            spec_with(tpu__slices=2, training={"tokensPerStep": 49152, "maxSeqLen": 1024, "batchSizePerDevice": 1}),
            "spec.training.tokensPerStep",
            f"{validation.TOKENS_PER_STEP_MESSAGE}: 49152 is not a multiple of 16 devices x 2 slices x 1 x 1024 "
            "= 32768; e.g. 32768",
            admission=validation.TOKENS_PER_STEP_MESSAGE),
    Invalid("tokens-per-step-with-global-batch",
            spec_with(training={"tokensPerStep": 32768, "globalBatchBlocks": 64}),
            "spec.training.tokensPerStep",
            f"{validation.TOKENS_PER_STEP_MESSAGE}: globalBatchBlocks is 64; give one of the two",
            admission=validation.TOKENS_PER_STEP_MESSAGE),
    Invalid("workload-priority-without-queue",
            spec_with(workloadPriorityClassName="high"),
            "spec.workloadPriorityClassName", validation.PRIORITY_QUEUE_MESSAGE),
    Invalid("tpu-in-worker-overrides",
            spec_with(workers={"resources": {"limits": {"google.com/tpu": 8}}}),
            "spec.workers.resources.limits", validation.TPU_OVERRIDE_MESSAGE),
    # Pod settings never replace what the slice and the spec decide.
    Invalid("env-value-and-secret",
            spec_with(workers={"env": [{"name": "A", "value": "1", "valueFrom": {
                "secretKeyRef": {"name": "s", "key": "k"}}}]}),
            "spec.workers.env[0]", validation.ENV_VALUE_MESSAGE),
    Invalid("env-hf-token", spec_with(head={"env": [{"name": "HF_TOKEN", "value": "x"}]}),
            "spec.head.env[0].name", validation.ENV_RESERVED_MESSAGE),
    # A user's RAY_AUTH_TOKEN would replace the run's own token (KubeRay keeps the first).
    Invalid("env-ray-auth-token",
            spec_with(workers={"env": [{"name": "RAY_AUTH_TOKEN", "value": "mine"}]}),
            "spec.workers.env[0].name", validation.ENV_RESERVED_MESSAGE),
    Invalid("env-tpu-worker-id",
            spec_with(workers={"env": [{"name": "TPU_WORKER_ID", "value": "0"}]}),
            "spec.workers.env[0].name", validation.ENV_RESERVED_MESSAGE),
    Invalid("env-slice-index",
            spec_with(workers={"env": [{"name": "TPUFT_SLICE_INDEX", "value": "0"}]}),
            "spec.workers.env[0].name", validation.ENV_RESERVED_MESSAGE),
    Invalid("volume-two-sources",
            spec_with(workers={"volumes": [{"name": "v", "emptyDir": {},
                                            "persistentVolumeClaim": {"claimName": "c"}}]}),
            "spec.workers.volumes[0]", validation.VOLUME_SOURCE_MESSAGE),
    Invalid("volume-no-source", spec_with(workers={"volumes": [{"name": "v"}]}),
            "spec.workers.volumes[0]", validation.VOLUME_SOURCE_MESSAGE),
    Invalid("volume-named-dshm",
            spec_with(workers={"volumes": [{"name": "dshm", "emptyDir": {}}]}),
            "spec.workers.volumes[0].name", validation.SHM_VOLUME_MESSAGE),
    Invalid("mount-on-dev-shm",
            spec_with(workers={"volumes": [{"name": "v", "emptyDir": {}}],
                               "volumeMounts": [{"name": "v", "mountPath": "/dev/shm"}]}),
            "spec.workers.volumeMounts[0].mountPath", validation.SHM_MOUNT_MESSAGE),
    Invalid("mount-of-no-volume",
            spec_with(head={"volumeMounts": [{"name": "ckpt", "mountPath": "/mnt/c"}]}),
            "spec.head.volumeMounts", validation.MOUNT_VOLUME_MESSAGE),
    Invalid("ray-io-label", spec_with(workers={"labels": {"ray.io/node-type": "head"}}),
            "spec.workers.labels", validation.LABEL_MESSAGE),
    Invalid("duplicate-env-name",
            spec_with(workers={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
            "spec.workers.env[1]", "Duplicate value", admission="Duplicate value",
            python_exact=False),
    Invalid("node-selector-override",
            spec_with(workers={"nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2"}}),
            "spec.workers.nodeSelector", "unknown field",
            admission='unknown field "spec.workers.nodeSelector"'),
    Invalid("env-secret-without-key",
            spec_with(workers={"env": [{"name": "A", "valueFrom": {
                "secretKeyRef": {"name": "s"}}}]}),
            "spec.workers.env[0].valueFrom.secretKeyRef.key", "is required",
            admission="Required value"),
    Invalid("ray-without-token-auth", spec_with(rayVersion="2.51.9"),
            "spec.rayVersion", validation.RAY_VERSION_MESSAGE),
    Invalid("ray-1-x", spec_with(rayVersion="1.99.0"),
            "spec.rayVersion", validation.RAY_VERSION_MESSAGE),
    Invalid("no-progress-timeout-too-short", spec_with(noProgressTimeoutSeconds=30),
            "spec.noProgressTimeoutSeconds", validation.NO_PROGRESS_MESSAGE),
    # Schema checks: same field refused, each side in its own words.
    Invalid("zero-active-deadline", spec_with(activeDeadlineSeconds=0),
            "spec.activeDeadlineSeconds", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("negative-ttl", spec_with(ttlSecondsAfterFinished=-1),
            "spec.ttlSecondsAfterFinished", "must be greater than or equal to 0",
            admission="should be greater than or equal to 0", python_exact=False),
    Invalid("negative-no-progress-timeout", spec_with(noProgressTimeoutSeconds=-5),
            "spec.noProgressTimeoutSeconds", "must be greater than or equal to 0",
            admission="should be greater than or equal to 0", python_exact=False),
    Invalid("unknown-generation", spec_with(tpu__generation="v9"), "spec.tpu.generation",
            '"v9" is not valid', admission='Unsupported value: "v9"', python_exact=False),
    Invalid("unknown-mode", spec_with(mode="train"), "spec.mode", '"train" is not valid',
            admission='Unsupported value: "train"', python_exact=False),
    Invalid("zero-epochs", spec_with(training={"epochs": 0}), "spec.training.epochs",
            "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("zero-learning-rate", spec_with(training={"learningRate": 0}),
            "spec.training.learningRate", "must be greater than 0",
            admission="should be greater than 0", python_exact=False),
    Invalid("zero-batch-size", spec_with(training={"batchSizePerDevice": 0}),
            "spec.training.batchSizePerDevice", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("max-seq-len-7", spec_with(training={"maxSeqLen": 7}),
            "spec.training.maxSeqLen", "must be greater than or equal to 8",
            admission="should be greater than or equal to 8", python_exact=False),
    Invalid("negative-learning-rate", spec_with(training={"learningRate": -1e-5}),
            "spec.training.learningRate", "must be greater than 0",
            admission="should be greater than 0", python_exact=False),
    Invalid("negative-weight-decay", spec_with(training={"weightDecay": -0.1}),
            "spec.training.weightDecay", "must be greater than or equal to 0",
            admission="should be greater than or equal to 0", python_exact=False),
    Invalid("negative-eval-fraction", spec_with(training={"evalFraction": -0.1}),
            "spec.training.evalFraction", "must be greater than or equal to 0",
            admission="should be greater than or equal to 0", python_exact=False),
    Invalid("keep-no-checkpoint", spec_with(checkpoint={"storagePath": "gs://b/p", "keep": 0}),
            "spec.checkpoint.keep", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("zero-slices", spec_with(mode="collectives", tpu__slices=0), "spec.tpu.slices",
            "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("missing-image", spec_with(image=None), "spec.image", "is required",
            admission="Required value"),
    Invalid("bad-quantity", spec_with(workers={"resources": {"requests": {"cpu": "lots"}}}),
            "spec.workers.resources.requests.cpu", '"lots" is not a Kubernetes quantity',
            admission="should match", python_exact=False),
    Invalid("bad-secret-name",
            spec_with(model={"tokenSecret": {"name": "HF_Secret", "key": "token"}}),
            "spec.model.tokenSecret.name", "must match pattern",
            admission="should match", python_exact=False),
    Invalid("bad-score-order", spec_with(checkpoint={"storagePath": "gs://b/p",
                                                     "scoreOrder": "lowest"}),
            "spec.checkpoint.scoreOrder", '"lowest" is not valid',
            admission='Unsupported value: "lowest"', python_exact=False),
    Invalid("unknown-score-attribute",
            spec_with(checkpoint={"storagePath": "gs://b/p", "scoreAttribute": "accuracy"}),
            "spec.checkpoint.scoreAttribute", '"accuracy" is not valid',
            admission='Unsupported value: "accuracy"', python_exact=False),
    Invalid("unknown-loss-on", spec_with(training={"lossOn": "prompts"}), "spec.training.lossOn",
            '"prompts" is not valid', admission='Unsupported value: "prompts"', python_exact=False),
    Invalid("eval-fraction-one", spec_with(training={"evalFraction": 1}),
            "spec.training.evalFraction", "must be less than 1",
            admission="should be less than 1", python_exact=False),
    Invalid("unknown-field", spec_with(epochs=3), "spec.epochs", "unknown field",
            admission='unknown field "spec.epochs"'),
    # LoRA (training.method lora, training.lora).
    Invalid("lora-rank-zero", spec_with(training={"method": "lora", "lora": {"rank": 0}}),
            "spec.training.lora.rank", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("lora-unknown-module",
            spec_with(training={"method": "lora", "lora": {"targetModules": ["q_proj", "attn"]}}),
            "spec.training.lora.targetModules[1]", '"attn" is not valid',
            admission='Unsupported value: "attn"', python_exact=False),
    Invalid("lora-with-method-full", spec_with(training={"lora": {"rank": 8}}), "spec.training.lora",
            "applies to method lora or dpo only; set method: lora (or dpo), or remove lora"),
    Invalid("lora-train-embeddings-and-freeze-embeddings",
            spec_with(training={"method": "lora", "lora": {"trainEmbeddings": True}, "freezeEmbeddings": True}),
            "spec.training.lora.trainEmbeddings", "contradicts freezeEmbeddings: true; drop one of them"),
    Invalid("unknown-method", spec_with(training={"method": "qlora"}), "spec.training.method",
            '"qlora" is not valid', admission='Unsupported value: "qlora"', python_exact=False),
]

# DPO (training.method dpo, training.dpo): each of what the trainer's check_dpo refuses.
DPO_INVALID: list[Invalid] = [
    Invalid("dpo-with-method-full", spec_with(training={"dpo": {"beta": 0.2}}), "spec.training.dpo",
            validation.DPO_METHOD_MESSAGE),
    Invalid("dpo-with-method-lora", spec_with(training={"method": "lora", "dpo": {"beta": 0.2}}),
            "spec.training.dpo", validation.DPO_METHOD_MESSAGE),
    Invalid("dpo-ipo-with-label-smoothing",
            spec_with(training={"method": "dpo", "dpo": {"loss": "ipo", "labelSmoothing": 0.1}}),
            "spec.training.dpo.labelSmoothing", validation.IPO_SMOOTHING_MESSAGE),
    Invalid("dpo-beta-zero", spec_with(training={"method": "dpo", "dpo": {"beta": 0}}),
            "spec.training.dpo.beta", "must be greater than 0",
            admission="should be greater than 0", python_exact=False),
    Invalid("dpo-label-smoothing-half", spec_with(training={"method": "dpo", "dpo": {"labelSmoothing": 0.5}}),
            "spec.training.dpo.labelSmoothing", "must be less than 0.5",
            admission=validation.LABEL_SMOOTHING_MESSAGE, python_exact=False),
    Invalid("dpo-label-smoothing-negative", spec_with(training={"method": "dpo", "dpo": {"labelSmoothing": -0.1}}),
            "spec.training.dpo.labelSmoothing", "must be greater than or equal to 0",
            admission="should be greater than or equal to 0", python_exact=False),
    Invalid("dpo-unknown-loss", spec_with(training={"method": "dpo", "dpo": {"loss": "hinge"}}),
            "spec.training.dpo.loss", '"hinge" is not valid', admission='Unsupported value: "hinge"',
            python_exact=False),
    Invalid("dpo-loss-on-all", spec_with(training={"method": "dpo", "lossOn": "all"}), "spec.training.lossOn",
            validation.DPO_LOSS_ON_MESSAGE),
    Invalid("dpo-tokens-per-step", spec_with(training={"method": "dpo", "tokensPerStep": 65536}),
            "spec.training.tokensPerStep", validation.DPO_TOKENS_MESSAGE),
    Invalid("dpo-supervised-format", spec_with(training={"method": "dpo", "datasetFormat": "dolly"}),
            "spec.training.datasetFormat", validation.DPO_FORMAT_MESSAGE),
    Invalid("preference-format-without-dpo", spec_with(training={"method": "lora", "datasetFormat": "preference"}),
            "spec.training.datasetFormat", validation.DPO_FORMAT_MESSAGE),
]
INVALID += DPO_INVALID


def _evaluation(**evaluation) -> dict:
    return {"evaluation": evaluation}


# training.evaluation (generation metrics, keepBestBy): each of what the trainer's check_generation refuses.
GENERATION_INVALID: list[Invalid] = [
    Invalid("generate-unknown-metric", spec_with(training=_evaluation(generate={"metrics": ["rougeL", "chrF"]})),
            "spec.training.evaluation.generate.metrics[1]", '"chrF" is not valid',
            admission='Unsupported value: "chrF"', python_exact=False),
    Invalid("generate-metric-twice", spec_with(training=_evaluation(generate={"metrics": ["bleu", "bleu"]})),
            "spec.training.evaluation.generate.metrics", validation.METRICS_TWICE_MESSAGE,
            admission='Duplicate value: "bleu"'),
    Invalid("generate-no-metric", spec_with(training=_evaluation(generate={"metrics": []})),
            "spec.training.evaluation.generate.metrics", "at least 1 item",
            admission="should have at least 1 items", python_exact=False),
    Invalid("generate-examples-zero", spec_with(training=_evaluation(generate={"examples": 0})),
            "spec.training.evaluation.generate.examples", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("generate-examples-too-many", spec_with(training=_evaluation(generate={"examples": 5000})),
            "spec.training.evaluation.generate.examples", "must be less than or equal to 4096",
            admission="should be less than or equal to 4096", python_exact=False),
    Invalid("generate-max-new-tokens-too-many", spec_with(training=_evaluation(generate={"maxNewTokens": 4096})),
            "spec.training.evaluation.generate.maxNewTokens", "must be less than or equal to 2048",
            admission="should be less than or equal to 2048", python_exact=False),
    Invalid("keep-best-by-unknown", spec_with(training=_evaluation(generate={}, keepBestBy="accuracy")),
            "spec.training.evaluation.keepBestBy", '"accuracy" is not valid',
            admission='Unsupported value: "accuracy"', python_exact=False),
    Invalid("keep-best-by-metric-not-generated",
            spec_with(training=_evaluation(generate={"metrics": ["exactMatch"]}, keepBestBy="rougeL")),
            "spec.training.evaluation.keepBestBy", validation.KEEP_BEST_METRIC_MESSAGE),
    Invalid("keep-best-by-without-generate", spec_with(training=_evaluation(keepBestBy="bleu")),
            "spec.training.evaluation.keepBestBy", validation.KEEP_BEST_METRIC_MESSAGE),
    Invalid("keep-best-by-with-a-score-attribute",
            spec_with(checkpoint={"storagePath": "gs://b/p", "scoreAttribute": "loss"},
                      training=_evaluation(generate={"metrics": ["rougeL"]}, keepBestBy="rougeL")),
            "spec.training.evaluation.keepBestBy", validation.KEEP_BEST_SCORE_MESSAGE),
    Invalid("generate-without-held-out", spec_with(training={"evalFraction": 0, **_evaluation(generate={})}),
            "spec.training.evaluation.generate", validation.GENERATE_EVAL_MESSAGE),
    Invalid("generate-with-dpo", spec_with(training={"method": "dpo", **_evaluation(generate={})}),
            "spec.training.evaluation.generate", validation.GENERATE_METHOD_MESSAGE),
    Invalid("generate-with-loss-on-all", spec_with(training={"lossOn": "all", **_evaluation(generate={})}),
            "spec.training.evaluation.generate", validation.GENERATE_METHOD_MESSAGE),
]
INVALID += GENERATION_INVALID

# Accepted by parse_spec and by the apiserver (test_crd_admission.py's VALID).
GENERATION_ACCEPTED = [
    spec_with(training={"evaluation": {"generate": {}}}),
    spec_with(training={"evaluation": {"generate": {"metrics": ["bleu"]}, "keepBestBy": "bleu"}}),
    spec_with(training={"evaluation": {"keepBestBy": "evalLoss"}}),
    spec_with(training={"evaluation": {"generate": {"examples": 1, "maxNewTokens": 2048}}}),
    spec_with(training={"evalFraction": 0, "evaluation": {}}),
    spec_with(training={"method": "dpo", "evaluation": {"keepBestBy": "evalLoss"}}),
]

# spec.training's memory fields (apimodels.MemorySettings, which Training takes them from).
MEMORY_INVALID: list[Invalid] = [
    Invalid("unknown-activation-checkpointing", spec_with(training={"activationCheckpointing": "full"}),
            "spec.training.activationCheckpointing", '"full" is not valid',
            admission='Unsupported value: "full"', python_exact=False),
    Invalid("unknown-sharding", spec_with(training={"sharding": "zero3"}), "spec.training.sharding",
            '"zero3" is not valid', admission='Unsupported value: "zero3"', python_exact=False),
    Invalid("unknown-attention", spec_with(training={"attention": "flash"}), "spec.training.attention",
            '"flash" is not valid', admission='Unsupported value: "flash"', python_exact=False),
    Invalid("freeze-embeddings-not-a-bool", spec_with(training={"freezeEmbeddings": "sometimes"}),
            "spec.training.freezeEmbeddings", "valid boolean",
            admission="must be of type boolean", python_exact=False),
]
INVALID += MEMORY_INVALID

# spec.model.initFrom (a chained run): naming itself is the object's rule, test_crd_admission's.
INIT_FROM_INVALID = [
    # A CEL twin: the apiserver and parse_spec print the same words.
    Invalid("init-from-with-collectives",
            spec_with(mode="collectives", checkpoint=None, model={"initFrom": {"run": "sft"}}),
            "spec.model.initFrom", validation.INIT_FROM_MODE_MESSAGE),
    Invalid("init-from-unknown-artifact", spec_with(model={"initFrom": {"run": "sft", "artifact": "weights"}}),
            "spec.model.initFrom.artifact", '"weights" is not valid',
            admission='Unsupported value: "weights"', python_exact=False),
    Invalid("init-from-run-not-a-name", spec_with(model={"initFrom": {"run": "Team-A/sft"}}),
            "spec.model.initFrom.run", "must match pattern", admission="should match", python_exact=False),
    # Never another namespace: there is no field for one.
    Invalid("init-from-other-namespace", spec_with(model={"initFrom": {"run": "sft", "namespace": "team-b"}}),
            "spec.model.initFrom.namespace", "unknown field", admission='unknown field "spec.model.initFrom.namespace"'),
    Invalid("init-from-without-run", spec_with(model={"initFrom": {"artifact": "export"}}),
            "spec.model.initFrom.run", "is required", admission="Required value"),
]
INVALID += INIT_FROM_INVALID

# Ids, URIs and paths with a control character: a line break in one would become a line of
# its own wherever it is printed (`tpufinetune render`'s comments, logs, command lines).
CONTROL_ADMISSION = f"should match '{PRINTABLE}'"


def control_case(case_id: str, field: str, spec: dict, admission: str = CONTROL_ADMISSION) -> Invalid:
    return Invalid(case_id, spec, field, CONTROL_MESSAGE, admission=admission, python_exact=False)


CONTROL_INVALID: list[Invalid] = [
    control_case("model-id-newline", "spec.model.id",
                 spec_with(model__id="google/gemma-4-E2B-it\ninjected: true")),
    control_case("dataset-id-carriage-return", "spec.dataset.id", spec_with(dataset__id="org/data\rinjected: true")),
    control_case("dataset-split-tab", "spec.dataset.split", spec_with(dataset__split="train\t[:10]")),
    control_case("storage-path-line-separator", "spec.checkpoint.storagePath",
                 spec_with(checkpoint__storagePath="gs://b/ckpt\u2028injected: true")),
    control_case("image-escape", "spec.image", spec_with(image=IMAGE + "\x1b[2J")),
    control_case("nfs-path-next-line", "spec.workers.volumes[0].nfs.path",
                 spec_with(workers__volumes=[{"name": "export", "nfs": {"server": "10.0.0.2", "path": "/export\x85x"}}]),
                 admission="should match '^/[^"),
]
INVALID += CONTROL_INVALID

# spec.training.towers (a multimodal run): each of what the trainer's multimodal path refuses at its start.
TOWERS_INVALID: list[Invalid] = [
    Invalid("towers-audio", spec_with(training={"towers": {"audio": "frozen"}}),
            "spec.training.towers.audio", validation.TOWERS_AUDIO_MESSAGE),
    Invalid("towers-audio-trained", spec_with(training={"towers": {"vision": "trained", "audio": "trained"}}),
            "spec.training.towers.audio", validation.TOWERS_AUDIO_MESSAGE),
    Invalid("towers-with-collectives", spec_with(mode="collectives", checkpoint=None, training={"towers": {}}),
            "spec.training.towers", validation.TOWERS_MODE_MESSAGE),
    # Gemma 4's processor: 282 tokens an image at most; the default maxSeqLen (512) holds one.
    Invalid("towers-two-images-in-512-tokens", spec_with(training={"towers": {"maxImagesPerExample": 2}}),
            "spec.training.towers.maxImagesPerExample",
            f"{validation.MEDIA_TOKENS_MESSAGE}: 2 x 282 = 564 tokens, more than maxSeqLen 512",
            admission=validation.MEDIA_TOKENS_MESSAGE),
    Invalid("towers-e4b-image-past-a-short-block",
            spec_with(model={"id": "Google/Gemma-4-E4B-it"}, training={"maxSeqLen": 256, "towers": {}}),
            "spec.training.towers.maxImagesPerExample",
            f"{validation.MEDIA_TOKENS_MESSAGE}: 1 x 282 = 282 tokens, more than maxSeqLen 256",
            admission=validation.MEDIA_TOKENS_MESSAGE),
    Invalid("towers-with-dpo", spec_with(training={"method": "dpo", "towers": {}}),
            "spec.training.towers", validation.TOWERS_WITH_MESSAGE),
    Invalid("towers-with-tokens-per-step", spec_with(training={"tokensPerStep": 32768, "towers": {}}),
            "spec.training.towers", validation.TOWERS_WITH_MESSAGE),
    Invalid("towers-with-loss-on-all", spec_with(training={"lossOn": "all", "towers": {}}),
            "spec.training.towers", validation.TOWERS_WITH_MESSAGE),
    # With LoRA a trained vision tower takes adapters on its projections named in targetModules.
    Invalid("towers-trained-with-lora-on-no-tower-projection",
            spec_with(training={"method": "lora", "lora": {"targetModules": ["per_layer_input_gate"]},
                                "towers": {"vision": "trained"}}),
            "spec.training.lora.targetModules", validation.TOWERS_TRAINED_MESSAGE),
    Invalid("towers-lora-adapter-only-export",
            spec_with(training={"method": "lora", "lora": {"exportMerged": False}, "towers": {}}),
            "spec.training.lora.exportMerged", validation.TOWERS_EXPORT_MESSAGE),
    Invalid("towers-unknown-vision-mode", spec_with(training={"towers": {"vision": "lora"}}),
            "spec.training.towers.vision", '"lora" is not valid', admission='Unsupported value: "lora"',
            python_exact=False),
    Invalid("towers-no-image", spec_with(training={"towers": {"maxImagesPerExample": 0}}),
            "spec.training.towers.maxImagesPerExample", "must be greater than or equal to 1",
            admission="should be greater than or equal to 1", python_exact=False),
    Invalid("towers-too-many-images", spec_with(training={"maxSeqLen": 32768, "towers": {"maxImagesPerExample": 65}}),
            "spec.training.towers.maxImagesPerExample", "must be less than or equal to 64",
            admission="should be less than or equal to 64", python_exact=False),
    Invalid("towers-unknown-tower", spec_with(training={"towers": {"video": "frozen"}}),
            "spec.training.towers.video", "unknown field", admission='unknown field "spec.training.towers.video"'),
]
INVALID += TOWERS_INVALID

# Accepted by parse_spec and by the apiserver (test_crd_admission.py's VALID).
TOWERS_ACCEPTED = [
    spec_with(training={"towers": {}}),
    spec_with(training={"method": "full", "maxSeqLen": 2048, "towers": {"vision": "trained", "maxImagesPerExample": 7}}),
    spec_with(training={"method": "lora", "towers": {"vision": "frozen"}}),
    # LoRA with the vision tower trained: adapters on its projections too.
    spec_with(training={"method": "lora", "towers": {"vision": "trained"}}),
    spec_with(training={"method": "lora", "lora": {"targetModules": ["per_layer_input_gate", "q_proj"]},
                        "towers": {"vision": "trained"}}),
    # A model the table does not know: its processor's tokens are the trainer's to check.
    spec_with(model={"id": "gs://my-bucket/models/my-gemma"}, training={"towers": {"maxImagesPerExample": 64}}),
    spec_with(model={"initFrom": {"run": "sft-vision"}}, training={"maxSeqLen": 564, "towers": {"maxImagesPerExample": 2}}),
    # Each epoch's answers to held-out image prompts, asked with their images.
    spec_with(training={"evaluation": {"generate": {"examples": 16}, "keepBestBy": "exactMatch"}, "towers": {}}),
]
