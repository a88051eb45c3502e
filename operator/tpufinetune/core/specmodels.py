"""The TPUFineTune spec as types: the models layer of the API (with apimodels.py).

Pydantic models only: the fields, their bounds, patterns and descriptions, which become
the CRD's schema and `kubectl explain` text. No rule across fields, no sizing, no memory
plan: validation.py checks these models, celrules.py holds the schema's CEL rules,
sizing.py and memplan.py read them, and api.py composes the API (TPUFineTuneSpec, which
runs the rules whenever a spec is validated).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .apimodels import DNS_SUBDOMAIN, PRINTABLE, MemorySettings, PodGroup, SecretKeyRef, _Model
from .generations import ALL_GENERATION_NAMES, MAX_CHIPS_PER_HOST, MAX_CPU_WORKERS, MAX_SLICES
from .lmevalspec import ExportEvaluation
from .towersspec import Towers
from .notify import NOTIFY_FIELD, NotifySubscription

# Every value the operator passes to the trainer defaults to the trainer's own default, and
# every closed set is the trainer's: tests/api/test_trainer_agreement.py runs the trainer's
# parser and checks on what the operator passes. (The operator never imports the trainer's
# config: it pulls in the training stack.)
DEFAULT_MODEL_ID = "google/gemma-4-E2B-it"
DEFAULT_DATASET_ID = "databricks/databricks-dolly-15k"
SCORE_ATTRIBUTES = ("auto", "loss", "eval_loss", "tokens_per_s", "epoch")
DEFAULT_RAY_VERSION = "2.60.0"
INT32_MAX = 2**31 - 1  # Kubernetes' int32 seconds fields (a Job's ttlSecondsAfterFinished)
# An hour without a single trainer event: far past any healthy silence (a first XLA
# compile, a large checkpoint, an evaluation pass), and a hung slice costs at most that.
DEFAULT_NO_PROGRESS_TIMEOUT = 3600
MIN_NO_PROGRESS_TIMEOUT = 60
# Seconds the Ray pods get to checkpoint on notice when the spec sets none (sizing writes
# it into the pods): a step and a sharded save of the default model (each host writes its
# own shards) with room to spare.
DEFAULT_TERMINATION_GRACE_SECONDS = 60

GenerationName = Literal[ALL_GENERATION_NAMES]  # type: ignore[valid-type]
# The metrics every epoch reports, so the closed set the trainer accepts is the enum here.
ScoreAttribute = Literal[SCORE_ATTRIBUTES]  # type: ignore[valid-type]


class TPUSlice(_Model):
    generation: GenerationName = Field(
        description="TPU generation. Accepted names: v4; v5e (v5litepod); v5p; v6e "
                    "(trillium); v7x (tpu7x, ironwood); cpu, a CPU stand-in slice for "
                    "rehearsing a pipeline on any cluster (topology = worker count).")
    topology: str = Field(
        min_length=1, max_length=16, pattern=r"^[0-9]{1,3}(x[0-9]{1,3}){0,2}$",
        description="Physical chip arrangement of one slice: AxB for v5e/v6e (e.g. 4x4), "
                    "AxBxC for v4/v5p/v7x (e.g. 2x2x2); for cpu, the number of CPU "
                    f"workers (1-{MAX_CPU_WORKERS}). Invalid shapes are refused with the "
                    "list of valid ones.")
    slices: int = Field(
        1, ge=1, le=MAX_SLICES,
        description="Number of identical slices (worker group replicas, each on its own node "
                    "pool). finetune shards the model inside each slice and replicates it "
                    "across slices (HSDP: gradients all-reduced across slices once per step). "
                    "Refused beyond what one run can span (v5p: 18432 chips in all; cpu: "
                    f"{MAX_CPU_WORKERS} workers in all).")
    chips_per_host: int | None = Field(
        None, ge=1, le=MAX_CHIPS_PER_HOST,
        description="Chips per TPU VM. Unset picks the default machine (4 chips; 1 for a "
                    "1x1 slice). Set 8 for a single-host 2x4 v5e/v6e machine (ct5lp-"
                    "hightpu-8t, ct6e-standard-8t).")
    spot: bool = Field(False, description="Schedule workers on Spot VMs "
                                          "(node selector cloud.google.com/gke-spot).")
    reservation: str | None = Field(
        None, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="Consume this Compute Engine reservation (specific reservation "
                    "affinity) for the workers.")




INIT_FROM_ARTIFACTS = ("export", "checkpoint")  # what of a source run a chained run starts from


class InitFrom(_Model):
    """Another TPUFineTune of the same namespace whose result this run starts from."""

    run: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                     description="Name of a TPUFineTune in this run's namespace (never another namespace). This "
                                 "run holds no RayCluster until it has Succeeded.")
    artifact: Literal[INIT_FROM_ARTIFACTS] = Field(  # type: ignore[valid-type]
        "export", description="export: its exported model (status.exportedModelURI; the merged model of a LoRA "
                              "run). checkpoint: its best checkpoint's weights (status.checkpointURI) loaded into "
                              "its base model (--init-checkpoint), without optimizer state, step or data position.")


class ModelSource(_Model):
    id: str = Field(DEFAULT_MODEL_ID, min_length=1, max_length=512, pattern=PRINTABLE,
                    description="Hugging Face model id, a model directory in a bucket "
                                "(gs://bucket/path, downloaded once per host), or a path inside "
                                "the image or on a shared filesystem. With initFrom: the source run's "
                                "base model is used; left at its default or equal to that base.")
    # No schema default (an older operator, after a rollback, reports it as an unknown field).
    init_from: InitFrom | None = Field(
        None, description="Start from another TPUFineTune's result (an SFT run before a DPO run): wait, "
                          "holding no slice, until it has Succeeded, then record its URI in status.initFrom "
                          "and train every attempt from that. Unset: from id.")
    parameters: int | None = Field(
        None, ge=1, le=10**13,
        description="Parameter count of a model the memory planner does not know (a bucket path "
                    "or another hub id): its sharded weights, gradients and AdamW state are "
                    "checked against the slice's HBM before any pod (activations are not). "
                    "Unset: such a model's memory is not checked. Ignored for the Gemma 4 ids "
                    "the planner knows.")
    token_secret: SecretKeyRef | None = Field(
        None, description="Secret holding a Hugging Face token. The pods read it as the "
                          "HF_TOKEN environment variable (secretKeyRef); the operator and "
                          "the Ray job's runtime environment never see it.")


class DatasetSource(_Model):
    id: str = Field(DEFAULT_DATASET_ID, min_length=1, max_length=512, pattern=PRINTABLE,
                    description="Hugging Face dataset id, a file or directory in a bucket "
                                "(gs://bucket/train.jsonl), or a path to files "
                                "(json/jsonl/csv/parquet) on a shared filesystem.")
    split: str = Field("train[:1024]", min_length=1, max_length=128, pattern=PRINTABLE,
                       description="Dataset split expression, e.g. train[:1024].")


# The Linear layers of each model family's language model a LoRA may adapt (the trainer's
# own table, tpufinetune_trainer/lora.py, agrees: tests/api/test_trainer_agreement.py). The
# vision and audio towers are never adapted. Admission takes any name of any family; the
# trainer checks the names against the family of the model it loads.
LORA_TARGET_MODULES = {
    "gemma4": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "per_layer_input_gate", "per_layer_projection"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
# The attention and MLP projections of the language model (every family has them).
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MODULE_NAMES = tuple(dict.fromkeys(name for names in LORA_TARGET_MODULES.values() for name in names))
LoraModuleName = Literal[LORA_MODULE_NAMES]  # type: ignore[valid-type]
TRAINING_METHODS = ("full", "lora", "dpo")
# The trainer's --dataset-format choices; preference is method dpo's.
DATASET_FORMATS = ("auto", "dolly", "messages", "prompt-completion", "preference")
DPO_LOSSES = ("sigmoid", "ipo")  # the trainer's --dpo-loss choices
# training.evaluation: the scores of each epoch's generations (the trainer's --generate-metrics
# choices) and what keeps the best checkpoint (--keep-best-by).
GENERATION_METRICS = ("exactMatch", "rougeL", "bleu")
KEEP_BEST_BY = ("evalLoss", *GENERATION_METRICS)
DEFAULT_GENERATE_EXAMPLES = 64
DEFAULT_MAX_NEW_TOKENS = 64
MAX_GENERATE_EXAMPLES = 4096
MAX_NEW_TOKENS = 2048
GenerationMetric = Literal[GENERATION_METRICS]  # type: ignore[valid-type]


class LoRA(_Model):
    rank: int = Field(16, ge=1, le=4096, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(32.0, gt=0, le=1e6,
                         description="Scale of the adapter's update: alpha / rank x B A.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[LoraModuleName] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES), min_length=1,
        max_length=len(LORA_MODULE_NAMES), json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Layers of the language model to adapt, by name: "
                    + "; ".join(f"{family}: {', '.join(names)}" for family, names in LORA_TARGET_MODULES.items())
                    + ". Default: the attention and MLP projections. With towers.vision trained, the vision "
                      "tower's projections of these names are adapted too (q_proj, k_proj, v_proj, o_proj, "
                      "gate_proj, up_proj, down_proj); the audio tower is never adapted.")
    export_merged: bool = Field(
        True, description="Also export the base with the adapter merged into it, as a full-"
                          "fine-tune's export (status.exportedModelURI); the adapter alone is "
                          "always exported (status.exportedAdapterURI).")
    # No schema default (an older operator would refuse a stored object carrying it).
    train_embeddings: bool | None = Field(
        None, description="Also train the input embedding in full beside the adapters (and the output "
                          "head where it is tied to the embedding, as Gemma's is): fp32 master, gradient "
                          "and AdamW state for it, in every checkpoint and in the exported adapter (peft's "
                          "modules_to_save; vLLM's LoRA loader refuses that, so serve the merged export "
                          "there). For a base whose embeddings of the chat template's special tokens are "
                          "untrained. Unset: false.")



def _inclusive_maximum(schema: dict) -> None:
    schema["maximum"] = schema.pop("exclusiveMaximum")


class DPO(_Model):
    """Direct preference optimisation's settings (method dpo): the trainer's --dpo-* flags,
    with their defaults."""

    beta: float = Field(0.1, gt=0, le=1e6,
                        description="How far the policy may move from the reference (DPO's beta; IPO's tau).")
    loss: Literal[DPO_LOSSES] = Field(  # type: ignore[valid-type]
        "sigmoid", description="sigmoid (DPO, the log-sigmoid of the scaled reward margin) or ipo (IPO: the "
                               "squared distance of each response's per-token log-ratio margin from 1/(2 beta)).")
    # The schema's bound is maximum 0.5, inclusive, and a CEL rule (celrules.training_rules)
    # refuses 0.5 itself: the apiserver compares a whole-number value (0) with an exclusive
    # fractional maximum cut to an integer (0), and would refuse labelSmoothing: 0.
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, json_schema_extra=_inclusive_maximum,
        description="sigmoid only: the probability that a pair's preference is flipped (conservative DPO), "
                    "in [0, 0.5).")
    reference_free: bool = Field(
        False, description="No reference model: its log-probabilities are taken as 0 (no reference forward, "
                           "nothing computed before the first step).")


class Generate(_Model):
    """Each epoch's generations: after the held-out loss, greedy answers to the first held-out
    prompts, scored against their responses (the trainer's --generate-* flags, their defaults)."""

    examples: int = Field(DEFAULT_GENERATE_EXAMPLES, ge=1, le=MAX_GENERATE_EXAMPLES,
                          description="Held-out prompts answered each epoch (the first ones; fewer when "
                                      "fewer are held out), shared among the devices.")
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS,
                                description="Tokens generated at most per answer (greedy; every device "
                                            "runs this many forwards, whatever its answers' lengths).")
    metrics: list[GenerationMetric] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(GENERATION_METRICS), min_length=1, max_length=len(GENERATION_METRICS),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Scores of the answers against the held-out responses: exactMatch (the share equal "
                    "after stripping whitespace), rougeL (the mean ROUGE-L F1, rouge-score) and bleu "
                    "(corpus BLEU, sacrebleu). Default: all three.")


class Evaluation(_Model):
    """What each epoch's evaluation does beyond the held-out loss."""

    generate: Generate | None = Field(
        None, description="Generate and score answers to held-out prompts each epoch (status.history[].eval; "
                          "the prompts, responses and answers in <storagePath>/<run>/eval-samples/). "
                          "Unset: off, nothing generated. Needs evalFraction > 0; not with method dpo or "
                          "lossOn all (no held-out response to score against).")
    keep_best_by: Literal[KEEP_BEST_BY] = Field(  # type: ignore[valid-type]
        "evalLoss", description="What makes a checkpoint the best one (exported, kept): evalLoss, "
                                "checkpoint.scoreAttribute as without evaluation; or one of generate.metrics, "
                                "the highest score wins (checkpoint.scoreAttribute must then be auto, and "
                                "scoreOrder does not apply).")


class Training(MemorySettings):
    # No schema default: a default is filled into every stored object, and an operator older
    # than this field (a rollback) refuses a spec carrying it (docs/architecture.md, "Upgrades
    # and version skew"). Unset means full.
    method: Literal[TRAINING_METHODS] | None = Field(  # type: ignore[valid-type]
        None, description="full (when unset): every weight of the language model is trained (fp32 "
                          "master weights and AdamW state). lora: the base is frozen in bfloat16 and "
                          "only low-rank adapters train (settings in lora); checkpoints hold the "
                          "adapters and their optimizer state only. dpo: preference tuning (direct "
                          "preference optimisation) on chosen/rejected pairs (settings in dpo): every "
                          "weight trains, or with lora set the adapters only.")
    lora: LoRA | None = Field(
        None, description="LoRA settings (method lora, or dpo to train adapters). Unset with method "
                          "lora: rank 16, alpha 32 on the attention and MLP projections. With method dpo: "
                          "set (lora: {} for those defaults) to train adapters, the reference being the "
                          "base with them switched off; unset trains every weight.")
    # No schema default (rollbacks, as method above): unset with method dpo is the defaults.
    dpo: DPO | None = Field(
        None, description="DPO settings (method dpo only). Unset with method dpo: beta 0.1, loss sigmoid, "
                          "no label smoothing, with a reference.")
    epochs: int = Field(3, ge=1, le=1000,
                        description="Number of epochs.")
    batch_size_per_device: int = Field(
        4, ge=1, le=4096,
        description="Examples per device per optimizer step (the tutorial's batch size), packed "
                    "into blocks of maxSeqLen tokens.")
    global_batch_blocks: int = Field(
        0, ge=0, le=1048576,
        description="Examples per optimizer step over all devices: a multiple of devices x "
                    "batchSizePerDevice, the factor being gradient accumulation. 0: devices x "
                    "batchSizePerDevice (no accumulation).")
    # No schema default (rollbacks, as method above): unset is a step of examples.
    tokens_per_step: int | None = Field(
        None, ge=1, le=2**40,
        description="MaxText's way: token positions per optimizer step over all devices, full packed "
                    "blocks of maxSeqLen whatever number of examples they hold (unset: a step is "
                    "batchSizePerDevice examples per device, the tutorial's). A multiple of devices x "
                    "batchSizePerDevice (then blocks per device per micro-batch) x maxSeqLen, the factor "
                    "being gradient accumulation; not with globalBatchBlocks. An epoch is then the steps "
                    "the data's tokens fill.")
    max_seq_len: int = Field(512, ge=8, le=131072,
                             description="Tokens per packed block.")
    learning_rate: float = Field(2e-5, gt=0, le=1,
                                 description="Peak AdamW learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="After linear warmup and the peak held: cosine or linear decay "
                              "over the last decayRatio of steps to minLrRatio x learningRate, "
                              "or constant.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1,
                                description="Share of all optimizer steps spent warming up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1,
                                description="Final learning rate as a fraction of the peak.")
    decay_ratio: float = Field(0.2, gt=0, le=1,
                               description="Share of all optimizer steps, at the end, over which the "
                                           "rate decays; the peak is held until then (1: decay over "
                                           "every step after the warmup).")
    max_grad_norm: float = Field(1.0, ge=0, le=1e6,
                                 description="Gradient clipping by global norm (0: off).")
    max_steps: int = Field(0, ge=0, le=10**9,
                           description="Stop after this many optimizer steps (0: epochs decide).")
    weight_decay: float = Field(0.01, ge=0, le=1,
                                description="AdamW weight decay.")
    seed: int = Field(42, ge=0, le=2**31 - 1, description="Random seed.")
    eval_fraction: float = Field(
        0.05, ge=0, lt=1,
        description="Fraction of the dataset held out for evaluation each epoch (0 "
                    "disables evaluation; checkpoint.scoreAttribute eval_loss needs more "
                    "than 0).")
    prompt_format: Literal["auto", "chat", "tutorial"] = Field(
        "auto", description="chat: the tokenizer's chat template (the loss on assistant turns "
                            "unless lossOn is all); tutorial: 'Instruction: ...\\nResponse: "
                            "...'; auto: chat when the tokenizer has a template.")
    # No schema default, as targetEvalLoss below: unset is the trainer's own, responses.
    loss_on: Literal["responses", "all"] | None = Field(
        None, description="Which tokens the loss is on: responses, the assistant turns only "
                          "(the default); all, every token of an example, prompt included, as "
                          "the tutorial's loop (docs/trainer.md says when that learns more).")
    dataset_format: Literal[DATASET_FORMATS] = Field(  # type: ignore[valid-type]
        "auto", description="dolly (instruction, context, response), messages (role/content "
                            "turns) or prompt-completion; preference (chosen and rejected, with a "
                            "prompt or as conversations sharing one) for method dpo; auto: from the "
                            "columns.")
    checkpoint_every_steps: int = Field(
        0, ge=0, le=10**9,
        description="Also checkpoint every N optimizer steps, so a run can resume inside an "
                    "epoch (0: at the end of every epoch only).")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile each decoder block (auto: on for GPU; off for TPU "
                            "until measured on a slice, and for the cpu stand-in; on: compile "
                            "on any device).")
    max_failures: int = Field(
        0, ge=0, le=100,
        description="Worker failures Ray Train recovers from inside one job, each resuming "
                    "from the latest checkpoint (maxRetries resubmits the whole job).")
    # No schema default (an older operator would report a filled-in default as unknown on
    # every run): unset is off.
    target_eval_loss: float | None = Field(
        None, gt=0, le=1e6,
        description="Stop after the evaluation whose eval loss is at or below this, and export "
                    "the checkpoint it reached; status.timeToTarget says how many seconds of "
                    "training it took. Unset: off. Needs evalFraction > 0.")
    early_stopping_patience: int | None = Field(
        None, ge=1, le=1000,
        description="Stop after this many evaluations in a row without a lower eval loss, and "
                    "export the best checkpoint. Unset: off. Needs evalFraction > 0.")

    # No schema default (rollbacks, as method above): unset is a text-only run.
    towers: Towers | None = Field(
        None, description="Fine-tune on images too (a multimodal run): examples are messages whose content "
                          "holds text and image parts, rendered with the model's own processor. Unset: text only, "
                          "the language model alone is loaded.")

    # No schema default (rollbacks, as method above): unset is the held-out loss only.
    evaluation: Evaluation | None = Field(
        None, description="Each epoch's evaluation beyond the held-out loss: generation metrics, and which "
                          "figure keeps the best checkpoint. Unset: the held-out loss only.")

    def lora_settings(self) -> LoRA | None:
        """The LoRA settings the run uses: the defaults when method lora leaves them unset;
        with method dpo, lora's own when given (adapters train), else None (every weight)."""
        if self.method == "lora":
            return self.lora or LoRA()
        return self.lora if self.method == "dpo" else None

    def dpo_settings(self) -> DPO | None:
        """The DPO settings the run uses (the defaults when method dpo leaves them unset)."""
        return (self.dpo or DPO()) if self.method == "dpo" else None



class Preflight(_Model):
    enabled: bool = Field(
        False, description="Before the fine-tune, run the collectives check on the same "
                           "RayCluster: every host holds its devices, tensor-parallel parity and "
                           "an all_reduce agree, and the all_reduce bus bandwidth is measured "
                           "(status.preflight). A failure ends the run (reason PreflightFailed) "
                           "and releases the slice before any fine-tune starts.")
    min_bus_bandwidth_gbps: float | None = Field(
        None, gt=0, le=1e6, alias="minBusBandwidthGBps",
        description="Fail the preflight when the all_reduce bus bandwidth (GB/s, as NCCL's tests "
                    "define it) is under this. Unset: measured and shown, not checked.")


class Checkpoint(_Model):
    storage_path: str | None = Field(
        None, min_length=1, max_length=1024, pattern=PRINTABLE,
        description="Where Ray Train writes checkpoints: gs://bucket/prefix or a shared "
                    "filesystem path. Required for mode finetune.")
    keep: int = Field(1, ge=1, le=100,
                      description="Checkpoints to keep (Ray Train num_to_keep).")
    score_attribute: ScoreAttribute = Field(
        "auto",
        description="Metric that ranks checkpoints: "
                    f"{', '.join(SCORE_ATTRIBUTES)} (auto: eval_loss when "
                    "training.evalFraction > 0, else loss; eval_loss needs "
                    "training.evalFraction > 0).")
    score_order: Literal["min", "max"] = Field(
        "min",
        description="Whether a lower (min) or higher (max) score is better.")




def _object_default(model: type[BaseModel], description: str) -> Any:
    # default {} in the schema makes the apiserver fill the nested defaults as well.
    return Field(default_factory=model, description=description,
                 json_schema_extra={"default": {}})


class SpecFields(_Model):
    """The fields of a TPUFineTune spec. api.TPUFineTuneSpec is this type with the rules
    run on every validation; the rules, sizing and the plan read this one."""

    tpu: TPUSlice = Field(description="The TPU slice to provision.")
    mode: Literal["finetune", "collectives"] = Field(
        "finetune", description="finetune: FSDP2 fine-tune with Ray Train. collectives: "
                                "an interconnect check (DTensor tensor parallelism and "
                                "all_reduce across every device) with Ray Core.")
    image: str = Field(min_length=1, max_length=512, pattern=PRINTABLE,
                       description="Trainer image (Ray, the trainer and the TPU runtime).")
    ray_version: str = Field(DEFAULT_RAY_VERSION, max_length=32,
                             pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
                             description="Ray version inside the image; 2.52.0 or newer (each run's head requires its own Ray token).")
    model: ModelSource = _object_default(ModelSource, "Model to fine-tune.")
    dataset: DatasetSource = _object_default(DatasetSource, "Training data.")
    training: Training = _object_default(Training, "Training hyperparameters.")
    checkpoint: Checkpoint = _object_default(Checkpoint, "Checkpointing.")
    head: PodGroup = _object_default(PodGroup, "Ray head pod settings.")
    workers: PodGroup = _object_default(PodGroup, "TPU (or CPU stand-in) worker pod settings.")
    service_account_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the Ray pods (e.g. one bound to a GCS bucket via "
                    "Workload Identity).")
    preflight: Preflight | None = Field(
        None, description="Check the slice with the collectives entrypoint before the fine-tune "
                          "(mode finetune). Unset: no preflight.")
    evaluation: ExportEvaluation | None = Field(
        None, description="Benchmarks run on the export after the fine-tune, on the same RayCluster before "
                          "it is released (status.evaluation). Unset: none.")
    max_retries: int = Field(0, ge=0, le=10,
                             description="Times a failed job is resubmitted; a retry "
                                         "resumes from the latest checkpoint.")
    suspend: bool = Field(False, description="When true, no RayCluster exists: the slice is "
                                             "released and nothing runs until false. A "
                                             "suspend uses up no retry.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, le=INT32_MAX,
        description="Seconds the run may be active, counted from status.startTime (a "
                    "suspend stops the clock and a resume restarts it, as for a Job). When "
                    "it passes, the job is stopped, the run ends Failed with reason "
                    "DeadlineExceeded and the RayCluster is released. Unset: no deadline.")
    ttl_seconds_after_finished: int = Field(
        0, ge=0, le=INT32_MAX,
        description="Keep the RayCluster this many seconds after the run ends (Succeeded "
                    "or Failed), e.g. to debug on its Ray dashboard; "
                    "status.rayClusterReleaseTime says when it goes. 0: released at once. "
                    "Deleting the TPUFineTune releases it at once.")
    termination_grace_period_seconds: int | None = Field(
        None, ge=1, le=3600,
        description="Grace period of the Ray pods (terminationGracePeriodSeconds). On notice "
                    "(the pod is deleted, its node drained or preempted) the trainer finishes "
                    "its step, writes a step checkpoint and stops within it. Unset: "
                    f"{DEFAULT_TERMINATION_GRACE_SECONDS}, a step plus a sharded save of the "
                    "default model with room to spare; a Spot VM's preemption gives at most "
                    "what GKE's graceful node shutdown allows, whatever is set here.")
    no_progress_timeout_seconds: int = Field(
        DEFAULT_NO_PROGRESS_TIMEOUT, ge=0, le=INT32_MAX,
        description="No-progress watchdog: when the trainer reports nothing (no progress, "
                    "epoch or checkpoint event) for this many seconds while Running, e.g. "
                    "a hung collective, the job is stopped and the run ends Failed with "
                    "reason NoProgress. While it trains the trainer reports progress about "
                    "every 30 s (once a step, when a step takes longer); the default leaves "
                    "room for a long compile, model download, checkpoint or evaluation. 0 "
                    f"turns it off; otherwise at least {MIN_NO_PROGRESS_TIMEOUT}.")
    queue_name: str | None = Field(
        None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Kueue LocalQueue of this namespace to queue the slice in. The RayCluster "
                    "is created suspended with the kueue.x-k8s.io/queue-name label and starts "
                    "once Kueue admits it; the run shows phase Queued until then.")
    workload_priority_class_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Kueue WorkloadPriorityClass of the queued RayCluster (label "
                    "kueue.x-k8s.io/priority-class): a higher one may preempt lower ones. "
                    "Needs queueName.")
    notify: list[NotifySubscription] | None = Field(
        None, **NOTIFY_FIELD,
        description="Notices of the run's end, sent as CloudEvents to sinks the cluster admin "
                    "configured, named here (docs/api.md, \"Notices\"); delivery is shown in "
                    "status.notifications.")
