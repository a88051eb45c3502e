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


class CollectivesError(TrainerError):
    """At least one rank disagreed in the collectives check."""
