"""Run configuration: small dataclasses whose checks name the flag to change."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass

from .backends import COMPILE_MODES, COMPUTE_DTYPES
from .data import DATASET_FORMATS, LOSS_ON, PROMPT_FORMATS, BatchPlan
from .errors import ConfigError
from . import generation
from .lora import DEFAULT_TARGET_MODULES, METHODS, MODULE_NAMES, TOWER_TARGET_MODULES, parse_modules, tower_names
from .schedule import SCHEDULES

DEFAULT_MODEL = "google/gemma-4-E2B-it"
DEFAULT_DATASET = "databricks/databricks-dolly-15k"
# Examples per device per optimizer step, the tutorial's batch size (4): the same steps per
# epoch as the tutorial, its padding removed (the step's examples are packed into as few
# blocks as the run's fullest step needs, data.plan_run).
DEFAULT_BATCH_SIZE_PER_DEVICE = 4
# Share of all optimizer steps over which the learning rate decays, at the end; until then
# it holds the peak (warmup-stable-decay). The default peak is the tutorial's constant
# rate, and a fine-tune of a few dozen steps (dolly-15k[:1024] x 3 epochs on 16 devices)
# learns in proportion to the rate it gets: a cosine over every step would give it about
# half the tutorial's rate on average. Holding the peak and annealing over the last 20%
# matches a full cosine at the same length (Hägele et al. 2024; MiniCPM), and 1.0 is the
# classic schedule.
DEFAULT_DECAY_RATIO = 0.2
# The LM head and loss: `labels` at label positions only (loss.py), `full` transformers'
# logits at every position (the reference; a fallback if the first only misbehaves on a slice).
LOSS_HEADS = ("labels", "full")
# How each worker gets the base model: `sharded` builds it on the meta device, shards it and
# reads only its own slices of the safetensors (sharded_load.py); `full` loads the whole
# model in every worker and shards it then (the fallback should the first misbehave).
MODEL_LOADS = ("sharded", "full", "sharded-or-full")
# Activation checkpointing (parallelize.apply_activation_checkpointing): none; block, every
# decoder block recomputed in the backward; selective, each block's self-attention only.
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")
# The attention kernel: auto is the backend's (eager on TPU as the tutorial, sdpa on GPU and CPU).
ATTENTION = ("auto", "eager", "sdpa")


def default_run_name(model_id: str) -> str:
    """`<model>_fsdp2_sft_<utc time>`, e.g. gemma-4-e2b-it_fsdp2_sft_20261013-040810."""
    base = os.path.basename(model_id.rstrip("/")) or "model"
    slug = re.sub(r"[^a-z0-9.-]+", "-", base.lower()).strip("-") or "model"
    return f"{slug}_fsdp2_sft_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def normalise_storage(path: str) -> str:
    """URIs stay as they are; local paths become absolute (Ray needs that)."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


@dataclass
class SliceConfig:
    topology: str = "4x4"
    accelerator_type: str = "TPU-V6E"
    num_workers: int = 16
    device: str = "auto"


@dataclass
class FinetuneConfig(SliceConfig):
    model_id: str = DEFAULT_MODEL
    dataset: str = DEFAULT_DATASET
    dataset_split: str = "train[:1024]"
    num_epochs: int = 3
    batch_size_per_device: int = DEFAULT_BATCH_SIZE_PER_DEVICE
    num_slices: int = 1  # --num-slices: HSDP, sharded within a slice, replicated across (slices.py)
    # --shard-group: the devices one copy of the model state is sharded over, within a slice,
    # replicated across the groups (slices.py); 0, the whole slice (plain FSDP on one slice).
    shard_group: int = 0
    global_batch_examples: int = 0  # 0: devices x batch_size_per_device (no accumulation)
    tokens_per_step: int = 0  # --tokens-per-step: a step of full blocks (0: of examples)
    storage_path: str = ""
    max_seq_len: int = 512
    learning_rate: float = 2e-5
    lr_schedule: str = "cosine"
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1
    decay_ratio: float = DEFAULT_DECAY_RATIO
    max_grad_norm: float = 1.0
    max_steps: int = 0  # 0: the epochs decide
    weight_decay: float = 0.01
    seed: int = 42
    eval_fraction: float = 0.05
    keep_checkpoints: int = 1
    checkpoint_every_steps: int = 0  # 0: at the end of every epoch only
    checkpoint_score_attribute: str = "auto"
    checkpoint_score_order: str = "min"
    resume_from: str | None = None
    # --init-checkpoint (spec.model.initFrom): a new run from the weights of a checkpoint of this
    # trainer, on the base of model_id (init_checkpoint.py).
    init_checkpoint: str | None = None
    run_name: str = ""
    long_prompts: str = "skip"
    prompt_format: str = "auto"
    loss_on: str = "responses"
    dataset_format: str = "auto"
    compile: str = "auto"
    compile_cache_dir: str = ""  # "": each process's default (inductor: /tmp; TorchTPU: no persistent cache)
    compute_dtype: str = "auto"
    loss_head: str = "labels"
    model_load: str = MODEL_LOADS[0]
    progress_interval_s: float = 30.0
    max_failures: int = 0
    target_eval_loss: float = 0.0  # 0: off; else stop after the evaluation that reaches it
    early_stopping_patience: int = 0  # 0: off; else evaluations without improvement before stopping
    fail_at_step: int = 0  # fault injection for tests: every rank fails once after this step
    method: str = METHODS[0]
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_target_modules: str = ",".join(DEFAULT_TARGET_MODULES)
    lora_export_merged: bool = True
    lora_train_embeddings: bool = False
    # --method dpo (methods/dpo.py): its loss's settings, and whether adapters train (--dpo-lora).
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    dpo_reference_free: bool = False
    dpo_lora: bool = False
    activation_checkpointing: str = ACTIVATION_CHECKPOINTING[0]
    attention: str = ATTENTION[0]
    freeze_embeddings: bool = False
    # parallelize.apply_fsdp: False keeps every block's gathered copy from forward to backward
    # (one all-gather a block fewer per micro-batch), as the operator asks where the plan fits it.
    reshard_after_forward: bool = True
    # Each epoch's generation metrics (generation.py; spec.training.evaluation): 0 examples is off.
    generate_examples: int = 0
    generate_max_new_tokens: int = generation.DEFAULT_MAX_NEW_TOKENS
    generate_metrics: str = generation.DEFAULT_METRICS
    keep_best_by: str = generation.KEEP_BEST_BY[0]
    # Multimodal (media.py): "" is a text run (the language model only); frozen or trained
    # loads the whole model with its towers and renders the data with its processor.
    vision_tower: str = ""
    audio_tower: str = ""  # accepted, refused: audio fine-tuning is not built yet
    max_images_per_example: int = 1

    @property
    def multimodal(self) -> bool:
        return bool(self.vision_tower)

    def validate_towers(self) -> None:
        """The towers' flags: known settings, audio refused, a multimodal run's limits."""
        from .media import AUDIO_NOT_BUILT, TOWER_SETTINGS

        for flag, value in (("--vision-tower", self.vision_tower), ("--audio-tower", self.audio_tower)):
            if value and value not in TOWER_SETTINGS:
                raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(TOWER_SETTINGS)}")
        if self.audio_tower:
            raise ConfigError(f"--audio-tower {self.audio_tower} (spec.training.towers.audio): {AUDIO_NOT_BUILT}; "
                              "drop it")
        if self.max_images_per_example < 1:
            raise ConfigError(f"--max-images-per-example {self.max_images_per_example}: at least 1")
        if not self.multimodal:
            return
        for given, why in ((self.method == "dpo", "--method dpo"), (self.tokens_per_step > 0, "--tokens-per-step"),
                           (self.loss_on != "responses", "--loss-on all"),
                           (self.prompt_format == "tutorial", "--prompt-format tutorial (images need the model's "
                                                               "chat template)"),
                           (self.dataset_format not in ("auto", "messages"),
                            f"--dataset-format {self.dataset_format} (images come in 'messages' rows)")):
            if given:
                raise ConfigError(f"{why} does not apply to a multimodal run (--vision-tower) yet; drop it")
        if self.method == "lora" and self.vision_tower == "trained" and not tower_names(
                parse_modules(self.lora_target_modules)):
            raise ConfigError(f"--vision-tower trained with --method lora puts adapters on the vision tower's "
                              f"projections, and --lora-target-modules {self.lora_target_modules} names none; add "
                              f"some of {', '.join(TOWER_TARGET_MODULES)} (spec.training.lora.targetModules), or "
                              "use --vision-tower frozen")
        if self.method == "lora" and not self.lora_export_merged:
            raise ConfigError("--lora-export-merged false with --vision-tower: the adapter alone would lack the "
                              "trained vision projector; export merged (the default)")

    @property
    def uses_lora(self) -> bool:
        """LoRA's adapters train on a frozen base: --method lora, or dpo with --dpo-lora."""
        return self.method == "lora" or (self.method == "dpo" and self.dpo_lora)

    def check_dpo(self) -> None:
        """DPO's flags: only with --method dpo, and a combination that can work."""
        from .methods.dpo import settings_of

        given = [flag for flag, value, default in (
            ("--dpo-beta", self.dpo_beta, 0.1), ("--dpo-loss", self.dpo_loss, "sigmoid"),
            ("--dpo-label-smoothing", self.dpo_label_smoothing, 0.0),
            ("--dpo-reference-free", self.dpo_reference_free, False), ("--dpo-lora", self.dpo_lora, False))
            if value != default]
        if self.method != "dpo":
            if given:
                raise ConfigError(f"{given[0]} applies to --method dpo only (spec.training.dpo needs "
                                  "spec.training.method: dpo); pass --method dpo or drop it")
            return
        problems = settings_of(self).problems()
        if problems:
            raise ConfigError("; ".join(problems))
        if self.loss_on != "responses":
            raise ConfigError("--loss-on all does not apply to --method dpo: its loss is on the responses of each "
                              "pair; drop --loss-on")
        if self.tokens_per_step:
            raise ConfigError("--tokens-per-step does not apply to --method dpo: a step is a batch of pairs "
                              "(--global-batch-examples); drop --tokens-per-step")

    def check_generation(self) -> None:
        """The generation metrics' flags (spec.training.evaluation), and --keep-best-by: a metric
        the run generates, which then ranks the checkpoints (the higher the better)."""
        metrics = generation.parse_metrics(self.generate_metrics)
        checks = [
            (0 <= self.generate_examples <= generation.MAX_EXAMPLES,
             f"--generate-examples (spec.training.evaluation.generate.examples) must be in "
             f"[0, {generation.MAX_EXAMPLES}] (0: off)"),
            (1 <= self.generate_max_new_tokens <= generation.MAX_NEW_TOKENS,
             f"--generate-max-new-tokens (spec.training.evaluation.generate.maxNewTokens) must be in "
             f"[1, {generation.MAX_NEW_TOKENS}]"),
            (bool(metrics) and all(m in generation.GENERATION_METRICS for m in metrics)
             and len(set(metrics)) == len(metrics),
             f"--generate-metrics (spec.training.evaluation.generate.metrics) {self.generate_metrics!r}: give "
             f"one or more of {', '.join(generation.GENERATION_METRICS)}, each once"),
            (self.keep_best_by in generation.KEEP_BEST_BY,
             f"--keep-best-by (spec.training.evaluation.keepBestBy) must be one of "
             f"{', '.join(generation.KEEP_BEST_BY)}"),
            (self.keep_best_by == "evalLoss" or (self.generate_examples and self.keep_best_by in metrics),
             f"--keep-best-by {self.keep_best_by} is not a metric the run generates: pass it in --generate-metrics "
             "with --generate-examples > 0, or keep the best by evalLoss"),
            (self.keep_best_by == "evalLoss" or self.checkpoint_score_attribute == "auto",
             f"--keep-best-by {self.keep_best_by} ranks the checkpoints itself: --checkpoint-score-attribute "
             "must be auto (spec.checkpoint.scoreAttribute)"),
        ]
        if self.generate_examples:
            checks += [
                (self.eval_fraction > 0, "--generate-examples needs --eval-fraction > 0: it answers held-out prompts"),
                (self.method != "dpo" and self.loss_on == "responses",
                 "--generate-examples needs held-out responses to score against: not with --method dpo or "
                 "--loss-on all"),
            ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def attn_implementation(self, backend_default: str) -> str:
        """The transformers attention kernel: --attention, or the backend's own under auto."""
        return backend_default if self.attention == "auto" else self.attention

    def validate(self) -> "FinetuneConfig":
        if not self.storage_path:
            raise ConfigError("no checkpoint storage: pass --storage-path or set STORAGE_PATH")
        self.storage_path = normalise_storage(self.storage_path)
        if self.resume_from:
            self.resume_from = normalise_storage(self.resume_from)
        if self.init_checkpoint:
            self.init_checkpoint = normalise_storage(self.init_checkpoint)
        checks = [
            (self.num_epochs >= 1, "--num-epochs must be at least 1"),
            (self.num_slices >= 1 and self.num_workers % self.num_slices == 0,
             f"--num-slices {self.num_slices} must be at least 1 and divide --num-workers {self.num_workers} "
             "(every slice holds as many devices; spec.tpu.slices)"),
            (self.shard_group == 0 or (self.shard_group >= 1 and self.num_slices >= 1
                                       and (self.num_workers // self.num_slices) % self.shard_group == 0),
             f"--shard-group {self.shard_group} must be 0 (the whole slice) or divide the "
             f"{self.num_workers // max(self.num_slices, 1)} devices of a slice (spec.training.sharding)"),
            (self.batch_size_per_device >= 1, "--batch-size-per-device must be at least 1"),
            (self.global_batch_examples >= 0, "--global-batch-examples must be 0 (devices x batch size) or more"),
            (self.tokens_per_step >= 0, "--tokens-per-step must be 0 (a step of examples) or more"),
            (not (self.tokens_per_step and self.global_batch_examples),
             "--tokens-per-step (spec.training.tokensPerStep) and --global-batch-examples "
             "(spec.training.globalBatchBlocks) exclude each other: a step is either tokens or examples"),
            (self.lr_schedule in SCHEDULES, f"--lr-schedule must be one of {', '.join(SCHEDULES)}"),
            (0 <= self.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)"),
            (0 <= self.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
            (0 < self.decay_ratio <= 1, "--decay-ratio must be in (0, 1] (1: decay over every step after warmup)"),
            (self.max_grad_norm >= 0, "--max-grad-norm must not be negative (0 turns clipping off)"),
            (self.max_steps >= 0, "--max-steps must not be negative (0: the epochs decide)"),
            (self.checkpoint_every_steps >= 0, "--checkpoint-every-steps must not be negative"),
            (self.compile in COMPILE_MODES, f"--compile must be one of {', '.join(COMPILE_MODES)}"),
            (not self.compile_cache_dir or os.path.isabs(self.compile_cache_dir),
             f"--compile-cache-dir {self.compile_cache_dir!r} must be an absolute path (a volume mounted on every "
             "worker's pod at the same place)"),
            (self.compute_dtype in COMPUTE_DTYPES, f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}"),
            (self.loss_head in LOSS_HEADS, f"--loss-head must be one of {', '.join(LOSS_HEADS)}"),
            (self.model_load in MODEL_LOADS, f"--model-load must be one of {', '.join(MODEL_LOADS)}"),
            (self.activation_checkpointing in ACTIVATION_CHECKPOINTING,
             f"--activation-checkpointing (spec.training.activationCheckpointing) must be one of "
             f"{', '.join(ACTIVATION_CHECKPOINTING)}"),
            (self.attention in ATTENTION,
             f"--attention (spec.training.attention) must be one of {', '.join(ATTENTION)}"),
            (self.prompt_format in PROMPT_FORMATS, f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}"),
            (self.loss_on in LOSS_ON, f"--loss-on must be one of {', '.join(LOSS_ON)}"),
            (self.dataset_format in DATASET_FORMATS,
             f"--dataset-format must be one of {', '.join(DATASET_FORMATS)}"),
            (self.progress_interval_s > 0, "--progress-interval must be positive"),
            (0 <= self.max_failures <= 100, "--max-failures must be in [0, 100]"),
            (self.max_seq_len >= 8, "--max-seq-len must be at least 8"),
            (self.learning_rate > 0, "--learning-rate must be positive"),
            (self.weight_decay >= 0, "--weight-decay must not be negative"),
            (0 <= self.eval_fraction < 1, "--eval-fraction must be in [0, 1)"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints must be at least 1"),
            (self.checkpoint_score_order in ("min", "max"), "--checkpoint-score-order must be min or max"),
            (self.checkpoint_score_attribute in SCORE_ATTRIBUTES,
             f"--checkpoint-score-attribute must be one of {', '.join(SCORE_ATTRIBUTES)}"),
            (self.long_prompts in ("skip", "fail"), "--long-prompts must be skip or fail"),
            (self.target_eval_loss >= 0, "--target-eval-loss must not be negative (0 turns it off)"),
            (self.early_stopping_patience >= 0, "--early-stopping-patience must not be negative (0 turns it off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.check_lora()
        self.check_dpo()
        self.check_generation()
        self.validate_towers()
        if self.keep_best_by != "evalLoss":  # the named metric ranks the checkpoints, the higher the better
            self.checkpoint_score_attribute = generation.METRIC_KEYS[self.keep_best_by]
            self.checkpoint_score_order = "max"
        if self.checkpoint_score_attribute == "eval_loss" and self.eval_fraction == 0:
            raise ConfigError("--checkpoint-score-attribute eval_loss needs --eval-fraction > 0")
        for flag, value in (("--target-eval-loss", self.target_eval_loss),
                            ("--early-stopping-patience", self.early_stopping_patience)):
            if value and self.eval_fraction == 0:
                raise ConfigError(f"{flag} needs --eval-fraction > 0: it acts on the evaluation loss")
        if self.checkpoint_score_attribute == "auto":
            self.checkpoint_score_attribute = "eval_loss" if self.eval_fraction > 0 else "loss"
        self.batch_plan()
        if not self.run_name:
            self.run_name = default_run_name(self.model_id)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name):
            raise ConfigError(f"--run-name {self.run_name!r}: use letters, digits, '.', '_' and '-' only")
        return self

    def check_lora(self) -> None:
        """LoRA's flags: in range, known module names, and only with --method lora."""
        if self.method not in METHODS:
            raise ConfigError(f"--method must be one of {', '.join(METHODS)}")
        given = [flag for flag, value, default in (
            ("--lora-rank", self.lora_rank, 16), ("--lora-alpha", self.lora_alpha, 32.0),
            ("--lora-dropout", self.lora_dropout, 0.05),
            ("--lora-target-modules", self.lora_target_modules, ",".join(DEFAULT_TARGET_MODULES)),
            ("--lora-export-merged", self.lora_export_merged, True),
            ("--lora-train-embeddings", self.lora_train_embeddings, False)) if value != default]
        if not self.uses_lora and given:
            raise ConfigError(f"{given[0]} applies to --method lora (or dpo with --dpo-lora true) only "
                              "(spec.training.lora needs spec.training.method: lora); pass --method lora or drop it")
        checks = [
            (self.lora_rank >= 1, "--lora-rank (spec.training.lora.rank) must be at least 1"),
            (self.lora_alpha > 0, "--lora-alpha (spec.training.lora.alpha) must be positive"),
            (0 <= self.lora_dropout < 1, "--lora-dropout (spec.training.lora.dropout) must be in [0, 1)"),
            (not (self.lora_train_embeddings and self.freeze_embeddings),
             "--lora-train-embeddings (spec.training.lora.trainEmbeddings) and --freeze-embeddings "
             "(spec.training.freezeEmbeddings) contradict each other; drop one"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        unknown = [name for name in parse_modules(self.lora_target_modules) if name not in MODULE_NAMES]
        if unknown or not parse_modules(self.lora_target_modules):
            raise ConfigError(f"--lora-target-modules (spec.training.lora.targetModules): "
                              f"{', '.join(unknown) or 'none given'} is not a module name any known model "
                              f"family has; use some of {', '.join(MODULE_NAMES)}")

    def batch_plan(self) -> BatchPlan:
        """Examples per optimizer step = devices x examples per device x accumulation steps
        (the blocks per device come from the data: data.plan_run); with --tokens-per-step,
        tokens = devices x blocks per device x --max-seq-len x accumulation steps."""
        micro = self.num_workers * self.batch_size_per_device
        if self.tokens_per_step:
            positions = micro * self.max_seq_len  # one micro-batch of every device
            if self.tokens_per_step % positions:
                raise ConfigError(
                    f"--tokens-per-step {self.tokens_per_step} (spec.training.tokensPerStep) is not a multiple of "
                    f"{self.num_workers} devices x --batch-size-per-device {self.batch_size_per_device} x "
                    f"--max-seq-len {self.max_seq_len} = {positions}; use a multiple of {positions}, e.g. "
                    f"{max(positions, self.tokens_per_step // positions * positions)}")
            return BatchPlan(self.num_workers, self.batch_size_per_device, self.tokens_per_step // positions,
                             blocks=self.batch_size_per_device, tokens_per_step=self.tokens_per_step)
        wanted = self.global_batch_examples or micro
        if wanted % micro:
            raise ConfigError(f"--global-batch-examples {wanted} is not a multiple of {self.num_workers} devices x "
                              f"--batch-size-per-device {self.batch_size_per_device} = {micro}; use a multiple "
                              f"of {micro}, e.g. {max(micro, wanted // micro * micro)}")
        return BatchPlan(self.num_workers, self.batch_size_per_device, wanted // micro)

    def to_dict(self) -> dict:
        return asdict(self)


# Metrics every checkpoint reports, so any of them can rank checkpoints; `auto` is
# eval_loss when there is an eval split, else loss.
SCORE_ATTRIBUTES = ("auto", "loss", "eval_loss", "tokens_per_s", "epoch")


@dataclass
class CollectivesConfig(SliceConfig):
    hidden_dim: int = 128
    batch_size: int = 64
    placement_timeout_s: float = 600.0
    corrupt_rank: int | None = None  # fault injection for tests: perturb this rank's shard
    bandwidth_mib: float = 64.0  # all_reduce size that measures the bus bandwidth (0: not measured)
    min_bus_bandwidth_gbps: float = 0.0  # 0: no floor
    num_slices: int = 1  # --num-slices: also measured within each slice (ICI) and across (DCN)

    def validate(self) -> "CollectivesConfig":
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be at least 1, got {self.num_workers}")
        if self.num_slices < 1 or self.num_workers % self.num_slices:
            raise ConfigError(f"--num-slices {self.num_slices} must be at least 1 and divide --num-workers "
                              f"{self.num_workers} (every slice holds as many devices; spec.tpu.slices)")
        if self.bandwidth_mib < 0 or self.min_bus_bandwidth_gbps < 0:
            raise ConfigError("--bandwidth-mib and --min-bus-bandwidth-gbps must not be negative")
        if self.min_bus_bandwidth_gbps and not self.bandwidth_mib:
            raise ConfigError("--min-bus-bandwidth-gbps needs --bandwidth-mib > 0 (the measurement)")
        if self.corrupt_rank is not None and not 0 <= self.corrupt_rank < self.num_workers:
            raise ConfigError(f"--corrupt-rank {self.corrupt_rank} is not a rank of {self.num_workers} workers")
        return self
