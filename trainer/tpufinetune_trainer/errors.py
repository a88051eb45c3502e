"""Errors the trainer reports as a `failure` event. The event's `type` is the class name."""


class TrainerError(Exception):
    """A problem with the run's input or environment, explained in the message."""


class UsageError(TrainerError):
    """Bad command line (unknown flag, unknown device, …)."""


class ConfigError(TrainerError):
    """Flags that parse but do not fit together (worker count vs topology, …)."""


class DataError(TrainerError):
    """The dataset cannot be loaded or is not in the dolly format."""


class ModelError(TrainerError):
    """The model or tokenizer cannot be loaded."""


class StorageError(TrainerError):
    """The checkpoint storage path cannot be written."""


class ResumeMismatch(TrainerError):
    """The checkpoint a resume would continue from belongs to another run: its fingerprint
    (model, data, world size, batch, block length, schedule) differs from this run's, or its
    step is not where its position puts it in this run's plan. The message names each field
    that differs, old -> new."""


class CollectivesError(TrainerError):
    """At least one rank disagreed in the collectives check."""


class Preempted(TrainerError):
    """SIGTERM (the pod is going away): a step checkpoint was written and the workers
    stopped; the next attempt (or Ray Train's in-job recovery) resumes from it. Carries the
    `notice` event's fields, which the driver emits again: rank 0's own line may be lost
    with its pod (its node's log monitor goes with it)."""

    def __init__(self, message: str, notice: dict | None = None):
        super().__init__(message)
        self.notice = notice or {}


class ExportUnloadable(TrainerError):
    """The export was written but does not load back (with transformers, or the adapter with
    peft) or does not generate: the run fails with this; its checkpoints are kept."""


class EvaluationFailed(TrainerError):
    """`lmeval`: lm-eval could not evaluate the export (a task it does not know, an include
    folder it cannot read, an export that does not load, a task that fails); the message
    names which and the fix. The fine-tune's own result stands."""
