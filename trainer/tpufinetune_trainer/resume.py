"""Resume only the same run: what a checkpoint must match to be continued, and where.

Every checkpoint carries the fingerprint of the run that wrote it (`fingerprint`): what
decides the data order, the step count and the optimizer state's shape. A resume whose
fingerprint differs is refused (`check`), naming each field that differs, old -> new:
DCP would load it (it reshards across world sizes, and a model of the same shapes loads
silently), and training would go on from a step that means something else here: other
examples in another order, the learning rate at another point of another schedule.

The step a resume continues from is the saved one, never one derived from this run's
plan (`position`): a checkpoint whose saved step is not where its epoch position puts it
in this plan is refused too.

Names: every trainer start (each attempt, and each restart of the worker group inside a
job) writes its checkpoints under names of its own (`checkpoint_name`, `new_start_id`),
so no start ever rewrites a directory another wrote, and Ray Train's retention, which
deletes a checkpoint by its path, can only delete the one it registered.
"""

from __future__ import annotations

import json
import secrets
import time

from . import data, lora
from .data import Examples, epoch_step_count
from .errors import ResumeMismatch

# The run's settings in its fingerprint (FinetuneConfig fields), each shown as its flag.
# Left out on purpose: what changes neither the examples, their order, the step count nor
# the optimizer state's shape (weight decay, clipping, compute dtype, loss head, model
# load, compile, checkpoint cadence and scoring, early stopping, storage).
SETTINGS = ("model_id", "dataset", "dataset_split", "dataset_format", "prompt_format", "loss_on", "long_prompts",
            "eval_fraction", "seed", "batch_size_per_device", "global_batch_examples", "max_seq_len", "num_epochs",
            "max_steps", "learning_rate", "lr_schedule", "warmup_ratio", "decay_ratio", "min_lr_ratio")
# Also the method (--method) and, for LoRA, its settings (lora.settings): the adapters'
# shapes and what they are trained as.
# Derived from the settings, the world and the data: named when they differ too.
DERIVED = ("world_size", "train_examples", "steps_per_epoch", "total_steps")
LABELS = {"world_size": "world size (--num-workers)", "num_slices": "slices (--num-slices, spec.tpu.slices)", "train_examples": "training examples",
          "steps_per_epoch": "steps per epoch", "total_steps": "total steps",
          "init_checkpoint": "the checkpoint the run started from (--init-checkpoint, spec.model.initFrom)",
          "lora": "LoRA settings (--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules, "
                  "--lora-train-embeddings)"}


def examples_digest(examples: Examples) -> str:
    """The tokenized training examples, as a short digest (data.examples_digest): carried
    with them from where they were prepared, so a worker's start hashes nothing."""
    return data.examples_digest(examples)


def fingerprint(cfg, world: int, examples: Examples) -> dict:
    """This run's fingerprint (JSON values): the settings, the world size, the examples and
    the step counts they give."""
    plan = cfg.batch_plan()
    epoch_steps = epoch_step_count(examples.lengths, plan)
    total = epoch_steps * cfg.num_epochs
    settings = {name: getattr(cfg, name) for name in SETTINGS}
    settings["global_batch_examples"] = plan.global_examples  # 0 means devices x batch: the resolved value
    settings.update(lora.settings(cfg))  # the method, and LoRA's shape of the trained state
    if plan.tokens_per_step:  # absent for a step of examples, so older checkpoints match
        settings["tokens_per_step"] = plan.tokens_per_step
    if cfg.freeze_embeddings:  # no optimizer state for the embedding; absent when off, so older checkpoints match
        settings["freeze_embeddings"] = True
    if getattr(cfg, "num_slices", 1) > 1:  # HSDP's mesh; absent for one slice, so older checkpoints match
        settings["num_slices"] = cfg.num_slices
    if getattr(cfg, "vision_tower", ""):  # the whole model and what of it trains; absent for a text run
        settings["vision_tower"] = cfg.vision_tower
    if getattr(cfg, "init_checkpoint", None):  # the weights the run started from; absent when none
        settings["init_checkpoint"] = cfg.init_checkpoint
    return json.loads(json.dumps({**settings, "world_size": world, "train_examples": examples_digest(examples),
                                  "steps_per_epoch": epoch_steps,
                                  "total_steps": min(total, cfg.max_steps) if cfg.max_steps else total}))


def label(field: str) -> str:
    return LABELS.get(field, "--" + field.replace("_", "-"))


def differences(saved: dict, current: dict) -> list[str]:
    """`<field> <old> -> <new>` for each field that differs, in the fingerprint's order."""
    fields = list(current) + [name for name in saved if name not in current]
    return [f"{label(name)} {json.dumps(saved.get(name))} -> {json.dumps(current.get(name))}"
            for name in fields if saved.get(name) != current.get(name)]


def check(state: dict, current: dict, location: str) -> bool:
    """Raise ResumeMismatch when the checkpoint at `location` (its trainer state `state`)
    was written by another run. False when it carries no fingerprint (an earlier trainer
    wrote it): it cannot be checked, only its step (`position`)."""
    saved = state.get("fingerprint")
    if saved is None:
        return False
    saved = {"method": "full", **saved}  # written before --method: a full fine-tune's
    differ = differences(saved, current)
    if differ:
        raise ResumeMismatch(
            f"Refusing to resume from {location}: it belongs to another run ({'; '.join(differ)}). A resume "
            "continues the same run only: resume with the checkpoint's values, or start a new run (another "
            "--run-name and no --resume-from; for a TPUFineTune, a new resource)")
    return True


def position(state: dict, epoch_steps: int, location: str) -> tuple[int, int, int]:
    """(epoch, step in it, global step) a resume continues from: the saved step, at the
    position the checkpoint saved. Raises ResumeMismatch when this plan puts that position
    at another step."""
    if state.get("step") is None or state.get("epoch") is None:
        raise ResumeMismatch(f"Refusing to resume from {location}: its trainer state holds no step")
    step, epoch = int(state["step"]), int(state["epoch"])
    done = int(state.get("epoch_step", epoch_steps))  # an epoch's checkpoint of an earlier trainer: its end
    derived = (epoch - 1) * epoch_steps + done
    if derived != step:
        raise ResumeMismatch(
            f"Refusing to resume from {location}: it saved step {step}, but its position (epoch {epoch}, "
            f"{done} steps in) is step {derived} with this run's {epoch_steps} steps per epoch")
    # A step checkpoint at an epoch's last step (a notice there) is before the epoch's end:
    # its evaluation and epoch checkpoint are still to do, so the resume stays in it.
    if done >= epoch_steps and (is_epoch_end(location) or "epoch_step" not in state):
        return epoch + 1, 0, step
    return epoch, done, step


def new_start_id() -> str:
    """One trainer start's id: its UTC start time (so ids sort by start) and a random tail
    (two starts in the same second still differ)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(2)}"


def checkpoint_name(epoch_end: bool, epoch: int, step: int, start: str) -> str:
    """`epoch_NNNN-<start>` at an epoch's end, else `step_NNNNNNN-<start>`."""
    return f"{f'epoch_{epoch:04d}' if epoch_end else f'step_{step:07d}'}-{start}"


def is_epoch_end(uri: str) -> bool:
    """Whether a checkpoint's URI (or path) names one written at an epoch's end (an older
    trainer's `epoch_NNNN` too), not a step checkpoint inside an epoch."""
    return uri.rstrip("/").rsplit("/", 1)[-1].startswith("epoch_")
