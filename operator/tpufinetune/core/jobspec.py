"""The Ray job a spec submits: trainer argv, runtime env, deterministic ids (pure).

The trainer is the `tpufinetune-train` console script inside the image. Its argv is built
as a list; the Ray Job API only takes a string (run through a shell on the head), so the
entrypoint is `shlex.join(argv)`: every user-supplied value stays one inert argument.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from . import initsource
from .memplan import estimate
from .api import TPUFineTuneSpec
from .apimodels import MemorySettings
from .sizing import slice_shape, total_devices

TRAINER = "tpufinetune-train"
# How long Ray Train waits for its workers when it restarts the worker group in the job
# (maxFailures) after a host was lost. Ray's default (60 s) gives up before a replacement
# node can come up (minutes for a TPU host on GKE), and its retry after that restarts the
# group again without waiting for the host either.
WORKER_GROUP_START_TIMEOUT_S = 600
LABEL_PREFIX = "tpufinetune.dev/"
# What every job the operator submits (fine-tune, preflight, checkpoint request) runs with,
# in each of its processes: the driver, Ray Train's controller and every worker.
# - Event lines reach the job log as they are printed.
# - No device-backend autoload: `import torch` would otherwise import torch_tpu (an entry
#   point of the TorchTPU image) and load libtpu in every process, the driver and the
#   controller on CPU hosts included: about 4.6 s and 380 MB each, and libtpu off a TPU
#   host may poll the cloud metadata server. The trainer imports torch_tpu itself, on TPU
#   hosts only, before the `tpu_dist` process group starts (backends.load_tpu_runtime),
#   and after it set the compile cache's place, which torch_tpu reads at import.
JOB_ENV = {"PYTHONUNBUFFERED": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def submission_id(uid: str, attempt: int) -> str:
    """Ray submission id of `attempt` (from 1). Deterministic, so the operator can record
    it in status before submitting and a resubmission after a crash finds the same job."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return f"tft-{uid}-{attempt}"


def checkpoint_request_id(uid: str, attempt: int, request: int) -> str:
    """Ray submission id of the `request`-th (from 1) checkpoint request of `attempt`:
    deterministic, so a request repeated after a crash is refused by Ray as a duplicate."""
    return f"{submission_id(uid, attempt)}-checkpoint-{request}"


def run_name(name: str, uid: str) -> str:
    """Ray Train RunConfig name: the same for every attempt of one resource, so a retry
    resumes the run's checkpoints; the uid part keeps a re-created namesake from resuming
    a stale run in the same storage path."""
    return f"tft-{name}-{uid.split('-')[0]}"


def logs_root(storage_path: str, run: str) -> str:
    """The run's logs directory, beside its checkpoints (so it is kept and removed as they
    are). Each attempt's logs (its driver's and every worker's output) are written there
    by the trainer while it runs (tpufinetune_trainer/logship.py)."""
    return f"{storage_path.rstrip('/')}/{run}/logs"


def logs_uri(root: str, attempt: int) -> str:
    """Where `attempt`'s logs are kept under the run's `logs_root` (status.attempts[]
    .logsURI, `tpufinetune logs`). The trainer finds the same place from what the job
    already gives it, --storage-path, --run-name and TPUFINETUNE_ATTEMPT, so no new flag
    reaches an older trainer image (tests/operator/test_logs_cli.py holds the two to the
    same answer)."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return f"{root}/attempt-{attempt}"


def run_logs_root(name: str, uid: str, spec: TPUFineTuneSpec) -> str:
    """`logs_root` of a resource; '' for a run that keeps none (mode collectives: no storage)."""
    if spec.mode != "finetune" or not spec.checkpoint.storage_path:
        return ""
    return logs_root(spec.checkpoint.storage_path, run_name(name, uid))


def _device(spec: TPUFineTuneSpec) -> str:
    return "tpu" if slice_shape(spec).generation.is_tpu else "cpu"


def _slice_flags(spec: TPUFineTuneSpec) -> list[str]:
    gen = slice_shape(spec).generation
    flags = [f"--topology={spec.tpu.topology}"]
    if gen.ray_accelerator_type:
        flags.append(f"--accelerator-type={gen.ray_accelerator_type}")
    flags += [f"--num-workers={total_devices(spec)}", f"--device={_device(spec)}"]
    if spec.mode == "finetune" and spec.tpu.slices > 1:
        # Only when several: a trainer image older than HSDP knows no such flag.
        flags.append(f"--num-slices={spec.tpu.slices}")
    return flags


def memory_flags(memory: MemorySettings, choices=None) -> list[str]:
    """The trainer flags of spec.training's memory fields, only those away from the trainer's
    default (an older trainer image knows none of them). `choices` (memplan_sharding.Choices,
    the plan's): the activation checkpointing and shard group the plan chose or kept."""
    flags = []
    checkpointing = choices.checkpointing if choices is not None else memory.activation_checkpointing
    if checkpointing not in (None, "none", "auto"):
        flags.append(f"--activation-checkpointing={checkpointing}")
    if choices is not None and choices.group_flag:  # not for full: the trainer's default
        flags.append(f"--shard-group={choices.group_flag}")
    if memory.attention is not None:
        flags.append(f"--attention={memory.attention}")
    if memory.freeze_embeddings:
        flags.append("--freeze-embeddings=true")
    return flags


def evaluation_flags(training) -> list[str]:
    """The trainer flags of spec.training.evaluation, only when it is set (an older trainer
    image knows none of them): the generations' settings, and the keep-best metric when not
    the loss."""
    evaluation = training.evaluation
    if evaluation is None:
        return []
    flags = []
    if evaluation.generate is not None:
        generate = evaluation.generate
        flags += [f"--generate-examples={generate.examples}", f"--generate-max-new-tokens={generate.max_new_tokens}",
                  f"--generate-metrics={','.join(generate.metrics)}"]
    if evaluation.keep_best_by != "evalLoss":
        flags.append(f"--keep-best-by={evaluation.keep_best_by}")
    return flags


def trainer_argv(spec: TPUFineTuneSpec, run_name: str | None = None,
                 resume_from: str | None = None, init_from: dict | None = None) -> list[str]:
    """The trainer command for `spec`. `--flag=value` keeps a value that starts with '-'
    from being read as an option. `init_from`: status.initFrom, a chained run's source resolved."""
    if spec.mode == "collectives":
        return [TRAINER, "collectives", *_slice_flags(spec)]
    training, checkpoint = spec.training, spec.checkpoint
    argv = [
        TRAINER, "finetune",
        *initsource.model_flags(spec, init_from),
        f"--dataset={spec.dataset.id}",
        f"--dataset-split={spec.dataset.split}",
        *_slice_flags(spec),
        f"--num-epochs={training.epochs}",
        f"--batch-size-per-device={training.batch_size_per_device}",
        f"--global-batch-blocks={training.global_batch_blocks}",
        f"--max-seq-len={training.max_seq_len}",
        f"--learning-rate={training.learning_rate!r}",
        f"--lr-schedule={training.lr_schedule}",
        f"--warmup-ratio={training.warmup_ratio!r}",
        f"--min-lr-ratio={training.min_lr_ratio!r}",
        f"--decay-ratio={training.decay_ratio!r}",
        f"--max-grad-norm={training.max_grad_norm!r}",
        f"--max-steps={training.max_steps}",
        f"--weight-decay={training.weight_decay!r}",
        f"--seed={training.seed}",
        f"--eval-fraction={training.eval_fraction!r}",
        f"--prompt-format={training.prompt_format}",
        f"--dataset-format={training.dataset_format}",
        f"--checkpoint-every-steps={training.checkpoint_every_steps}",
        f"--compile={training.compile}",
        f"--max-failures={training.max_failures}",
        f"--storage-path={checkpoint.storage_path}",
        f"--keep-checkpoints={checkpoint.keep}",
        f"--checkpoint-score-attribute={checkpoint.score_attribute}",
        f"--checkpoint-score-order={checkpoint.score_order}",
    ]
    lora, dpo = training.lora_settings(), training.dpo_settings()
    if lora is not None or dpo is not None:  # nothing for full: an older trainer image knows no --method
        argv.append(f"--method={training.method}")
    if dpo is not None:  # DPO trains adapters (--dpo-lora) exactly when training.lora is given
        argv += [f"--dpo-beta={dpo.beta!r}", f"--dpo-loss={dpo.loss}",
                 f"--dpo-label-smoothing={dpo.label_smoothing!r}",
                 f"--dpo-reference-free={'true' if dpo.reference_free else 'false'}",
                 f"--dpo-lora={'true' if lora is not None else 'false'}"]
    if lora is not None:
        argv += [f"--lora-rank={lora.rank}", f"--lora-alpha={lora.alpha!r}",
                 f"--lora-dropout={lora.dropout!r}", f"--lora-target-modules={','.join(lora.target_modules)}",
                 f"--lora-export-merged={'true' if lora.export_merged else 'false'}"]
        if lora.train_embeddings:  # only when on: an older trainer image knows no such flag
            argv.append("--lora-train-embeddings=true")
    request = initsource.memory_request(spec, init_from)
    plan = estimate(request) if request is not None else None  # status.plan's: the flags and the figures shown are one decision
    argv += memory_flags(training, plan.choices if plan is not None else None)
    if plan is not None and plan.keep_gathered:  # only then: an older trainer knows no such flag
        argv.append("--reshard-after-forward=false")
    if training.tokens_per_step is not None:  # only when set: an older trainer image knows no such flag
        argv.append(f"--tokens-per-step={training.tokens_per_step}")
    if training.loss_on is not None:
        argv.append(f"--loss-on={training.loss_on}")
    if training.target_eval_loss is not None:
        argv.append(f"--target-eval-loss={training.target_eval_loss!r}")
    if training.early_stopping_patience is not None:
        argv.append(f"--early-stopping-patience={training.early_stopping_patience}")
    argv += evaluation_flags(training)
    if training.towers is not None:  # only for a multimodal run: a text run's argv is as before
        argv += [f"--vision-tower={training.towers.vision}",
                 f"--max-images-per-example={training.towers.max_images_per_example}"]
    if run_name:
        argv.append(f"--run-name={run_name}")
    if resume_from:
        argv.append(f"--resume-from={resume_from}")
    return argv


@dataclass(frozen=True)
class JobSubmission:
    """Arguments for `JobSubmissionClient.submit_job(...)`."""

    submission_id: str
    entrypoint_argv: list[str]
    entrypoint: str
    runtime_env: dict = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


def preflight_id(uid: str, attempt: int) -> str:
    """Ray submission id of `attempt`'s preflight (the collectives check before it)."""
    return f"{submission_id(uid, attempt)}-preflight"


def preflight_submission(name: str, namespace: str, uid: str, spec: TPUFineTuneSpec,
                         attempt: int) -> JobSubmission:
    """The collectives check on the run's own slice, before `attempt`'s fine-tune."""
    argv = [TRAINER, "collectives", *_slice_flags(spec)]
    floor = spec.preflight.min_bus_bandwidth_gbps if spec.preflight else None
    if floor is not None:
        argv.append(f"--min-bus-bandwidth-gbps={floor!r}")
    return JobSubmission(
        submission_id=preflight_id(uid, attempt),
        entrypoint_argv=argv,
        entrypoint=shlex.join(argv),
        runtime_env={"env_vars": dict(JOB_ENV)},
        metadata={f"{LABEL_PREFIX}name": name, f"{LABEL_PREFIX}namespace": namespace, f"{LABEL_PREFIX}uid": uid,
                  f"{LABEL_PREFIX}attempt": str(attempt), f"{LABEL_PREFIX}preflight": "true"},
    )


def lmeval_id(uid: str, attempt: int) -> str:
    """Ray submission id of `attempt`'s lm-eval job (spec.evaluation.lmEval, on its export)."""
    return f"{submission_id(uid, attempt)}-lmeval"


def lmeval_argv(spec: TPUFineTuneSpec, run: str, model_uri: str) -> list[str]:
    """`tpufinetune-train lmeval` on the export at `model_uri`: one --task= per task, and the
    optional settings only when set (lm-eval's own defaults otherwise)."""
    lm_eval = spec.evaluation.lm_eval
    argv = [TRAINER, "lmeval", f"--run-name={run}", f"--storage-path={spec.checkpoint.storage_path}",
            f"--model-uri={model_uri}", *(f"--task={task}" for task in lm_eval.tasks)]
    if lm_eval.num_fewshot is not None:
        argv.append(f"--num-fewshot={lm_eval.num_fewshot}")
    if lm_eval.limit is not None:  # a whole number of documents, or a fraction of them below 1
        limit = lm_eval.limit
        argv.append(f"--limit={int(limit) if limit >= 1 else limit!r}")
    if lm_eval.include_path is not None:
        argv.append(f"--include-path={lm_eval.include_path}")
    return argv


def lmeval_submission(name: str, namespace: str, uid: str, spec: TPUFineTuneSpec, attempt: int,
                      model_uri: str) -> JobSubmission:
    """The lm-eval job on the run's own RayCluster once `attempt`'s fine-tune succeeded: the
    fine-tune's runtime env (its logs shipped beside the attempt's, as the trainer finds them
    from --storage-path, --run-name and TPUFINETUNE_ATTEMPT) and the same token."""
    fine_tune = job_submission(name, namespace, uid, spec, attempt)
    argv = lmeval_argv(spec, run_name(name, uid), model_uri)
    return JobSubmission(
        submission_id=lmeval_id(uid, attempt),
        entrypoint_argv=argv,
        entrypoint=shlex.join(argv),
        runtime_env=fine_tune.runtime_env,
        metadata={**fine_tune.metadata, f"{LABEL_PREFIX}lmeval": "true"},
    )


def checkpoint_request(name: str, namespace: str, uid: str, attempt: int, request: int, reason: str,
                       detail: str) -> JobSubmission:
    """A short job on the run's head that asks its running trainer for a step checkpoint
    now (the trainer's `checkpoint-now`: a key in Ray's internal KV store that rank 0 reads
    at most once a second)."""
    argv = [TRAINER, "checkpoint-now", f"--run-name={run_name(name, uid)}", f"--reason={reason}",
            f"--detail={detail}"]
    return JobSubmission(
        submission_id=checkpoint_request_id(uid, attempt, request),
        entrypoint_argv=argv,
        entrypoint=shlex.join(argv),
        runtime_env={"env_vars": dict(JOB_ENV)},
        metadata={f"{LABEL_PREFIX}name": name, f"{LABEL_PREFIX}namespace": namespace, f"{LABEL_PREFIX}uid": uid,
                  f"{LABEL_PREFIX}attempt": str(attempt), f"{LABEL_PREFIX}checkpoint-request": str(request)},
    )


def job_submission(name: str, namespace: str, uid: str, spec: TPUFineTuneSpec,
                   attempt: int, resume_from: str | None = None, init_from: dict | None = None) -> JobSubmission:
    """The job for `attempt` (from 1); pass `resume_from` (a checkpoint URI) on retries, and
    `init_from` (status.initFrom) for a chained run."""
    argv = trainer_argv(spec, run_name=run_name(name, uid), resume_from=resume_from, init_from=init_from)
    # Only non-secret settings: the runtime env is visible in the Ray dashboard and job
    # API. The Hugging Face token reaches the trainer through the pods' environment.
    env_vars = {
        **JOB_ENV,
        "TPUFINETUNE_NAME": name,
        "TPUFINETUNE_NAMESPACE": namespace,
        "TPUFINETUNE_ATTEMPT": str(attempt),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(WORKER_GROUP_START_TIMEOUT_S),
    }
    metadata = {
        f"{LABEL_PREFIX}name": name,
        f"{LABEL_PREFIX}namespace": namespace,
        f"{LABEL_PREFIX}uid": uid,
        f"{LABEL_PREFIX}attempt": str(attempt),
    }
    return JobSubmission(
        submission_id=submission_id(uid, attempt),
        entrypoint_argv=argv,
        entrypoint=shlex.join(argv),
        runtime_env={"env_vars": env_vars},
        metadata=metadata,
    )
