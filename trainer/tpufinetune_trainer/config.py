"""Run configuration: small dataclasses whose checks name the flag to change."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass

from .errors import ConfigError

DEFAULT_MODEL = "google/gemma-4-E2B-it"
DEFAULT_DATASET = "databricks/databricks-dolly-15k"


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
    batch_size_per_device: int = 4
    storage_path: str = ""
    max_seq_len: int = 512
    learning_rate: float = 2e-5
    weight_decay: float = 0.01
    seed: int = 42
    eval_fraction: float = 0.05
    keep_checkpoints: int = 1
    checkpoint_score_attribute: str = "loss"
    checkpoint_score_order: str = "min"
    resume_from: str | None = None
    run_name: str = ""
    long_prompts: str = "skip"

    def validate(self) -> "FinetuneConfig":
        if not self.storage_path:
            raise ConfigError("no checkpoint storage: pass --storage-path or set STORAGE_PATH")
        self.storage_path = normalise_storage(self.storage_path)
        if self.resume_from:
            self.resume_from = normalise_storage(self.resume_from)
        checks = [
            (self.num_epochs >= 1, "--num-epochs must be at least 1"),
            (self.batch_size_per_device >= 1, "--batch-size-per-device must be at least 1"),
            (self.max_seq_len >= 8, "--max-seq-len must be at least 8"),
            (self.learning_rate > 0, "--learning-rate must be positive"),
            (self.weight_decay >= 0, "--weight-decay must not be negative"),
            (0 <= self.eval_fraction < 1, "--eval-fraction must be in [0, 1)"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints must be at least 1"),
            (self.checkpoint_score_order in ("min", "max"), "--checkpoint-score-order must be min or max"),
            (self.checkpoint_score_attribute in SCORE_ATTRIBUTES,
             f"--checkpoint-score-attribute must be one of {', '.join(SCORE_ATTRIBUTES)}"),
            (self.long_prompts in ("skip", "fail"), "--long-prompts must be skip or fail"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.checkpoint_score_attribute == "eval_loss" and self.eval_fraction == 0:
            raise ConfigError("--checkpoint-score-attribute eval_loss needs --eval-fraction > 0")
        if not self.run_name:
            self.run_name = default_run_name(self.model_id)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name):
            raise ConfigError(f"--run-name {self.run_name!r}: use letters, digits, '.', '_' and '-' only")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


# Metrics every epoch reports, so any of them can rank checkpoints.
SCORE_ATTRIBUTES = ("loss", "eval_loss", "tokens_per_s", "epoch")


@dataclass
class CollectivesConfig(SliceConfig):
    hidden_dim: int = 128
    batch_size: int = 64
    placement_timeout_s: float = 600.0
    corrupt_rank: int | None = None  # fault injection for tests: perturb this rank's shard

    def validate(self) -> "CollectivesConfig":
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be at least 1, got {self.num_workers}")
        if self.corrupt_rank is not None and not 0 <= self.corrupt_rank < self.num_workers:
            raise ConfigError(f"--corrupt-rank {self.corrupt_rank} is not a rank of {self.num_workers} workers")
        return self
