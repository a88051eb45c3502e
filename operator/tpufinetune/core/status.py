"""The TPUFineTune status: written only by the operator, declared here so nothing is pruned.

Build a patch with `status.model_dump(by_alias=True, exclude_none=True, mode="json")`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Queued", "Provisioning", "Submitting", "Running", "Succeeded",
                "Failed", "Deleting"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


class _Status(BaseModel):
    # Unknown keys are ignored, not refused: status is read back from the apiserver.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              extra="ignore")


class Condition(_Status):
    """A standard metav1.Condition, so `kubectl wait --for=condition=<type>` works."""

    type: str = Field(max_length=316, description="Condition type, e.g. Ready, Succeeded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=1024, description="CamelCase reason for the last change.")
    message: str = Field("", max_length=32768, description="Human-readable detail.")
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"},
                                      description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0,
                                            description="metadata.generation it reflects.")


class EpochRecord(_Status):
    """Metrics of one finished epoch."""

    epoch: int = Field(ge=0, description="Epoch number, from 1.")
    loss: float | None = Field(None, description="Mean training loss of the epoch.")
    eval_loss: float | None = Field(None, description="Mean evaluation loss, if evaluated.")
    tokens_per_second: float | None = Field(None, description="Training throughput.")
    epoch_time_seconds: float | None = Field(None, description="Wall time of the epoch.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="Checkpoint written after the epoch.")


class Progress(_Status):
    """Where the run is inside an epoch, from the trainer's throttled progress events."""

    step: int | None = Field(None, ge=0, description="Optimizer steps done (whole run).")
    total_steps: int | None = Field(None, ge=0, description="Optimizer steps planned.")
    epoch_step: int | None = Field(None, ge=0, description="Steps done in the current epoch.")
    epoch_steps: int | None = Field(None, ge=0, description="Steps in one epoch.")
    percent: float | None = Field(None, ge=0, le=100, description="step / totalSteps x 100.")
    loss: float | None = Field(None, description="Training loss over the last progress window.")
    learning_rate: float | None = Field(None, description="Learning rate of the last step.")
    tokens_per_second: float | None = Field(None, description="Throughput over the last window.")
    step_time_seconds: float | None = Field(None, ge=0, description="Mean seconds per step.")
    eta_seconds: int | None = Field(None, ge=0, description="Estimated seconds of training left "
                                                          "(steps left x step time; checkpoints "
                                                          "and evaluation not included).")
    summary: str | None = Field(None, max_length=128,
                                description="e.g. '37% 120/320 ETA 12m', for kubectl get.")


class CollectivesResult(_Status):
    """Outcome of the interconnect check (mode collectives)."""

    passed: bool | None = Field(None, description="Every rank verified the all_reduce sum "
                                                  "and tensor-parallel parity.")
    ranks: int | None = Field(None, ge=0, description="Number of ranks that took part.")
    message: str | None = Field(None, description="Summary line from the check.")


class TrainerFailure(_Status):
    """What the trainer reported before it failed."""

    type: str | None = Field(None, max_length=128, description="Exception type.")
    message: str | None = Field(None, max_length=1024, description="What went wrong.")


class TPUFineTuneStatus(_Status):
    """Observed state of a TPUFineTune."""

    phase: Phase | None = Field(None, description="Pending, Queued (waiting for Kueue to "
                                                  "admit the RayCluster), Provisioning, "
                                                  "Submitting, Running, Succeeded, Failed or "
                                                  "Deleting.")
    conditions: list[Condition] | None = Field(
        None, max_length=16, description="Standard conditions.",
        json_schema_extra={"x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["type"]})
    observed_generation: int | None = Field(
        None, description="The spec generation applied: the one the RayCluster was created "
                          "from, the current attempt submitted with, or a suspend applied "
                          "for. An edit to a running job applies to the next attempt, and "
                          "shows here only then.")
    ray_cluster_name: str | None = Field(None, description="The owned RayCluster.")
    job_id: str | None = Field(None, description="Ray job submission id of this attempt.")
    dashboard_url: str | None = Field(None, alias="dashboardURL",
                                      description="Ray dashboard address.")
    attempt: int | None = Field(None, ge=0, description="Submission attempt, from 1.")
    evictions: int | None = Field(None, ge=0,
                                  description="Attempts that ended because Kueue evicted the "
                                              "RayCluster (preemption); they do not count "
                                              "against maxRetries.")
    epoch: int | None = Field(None, ge=0, description="Last completed epoch.")
    epochs: int | None = Field(None, ge=0, description="Epochs planned.")
    epoch_progress: str | None = Field(None, description="epoch/epochs, e.g. 2/3.")
    loss: float | None = Field(None, description="Training loss of the last epoch.")
    eval_loss: float | None = Field(None, description="Evaluation loss of the last epoch.")
    tokens_per_second: float | None = Field(None, description="Throughput of the last epoch.")
    epoch_time_seconds: float | None = Field(None, description="Duration of the last epoch.")
    history: list[EpochRecord] | None = Field(None, max_length=1000,
                                              description="Per-epoch metrics.")
    progress: Progress | None = Field(None, description="Progress within the run, updated "
                                                        "during an epoch.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="Latest (best-kept) checkpoint.")
    exported_model_uri: str | None = Field(None, alias="exportedModelURI",
                                           description="Exported model weights, if any.")
    start_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                   description="When the run started (reset on resume after "
                                               "a suspend; spec.activeDeadlineSeconds counts "
                                               "from it).")
    completion_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                        description="When the run finished.")
    message: str | None = Field(None, description="What is happening, or why it failed.")
    phase_transition_time: str | None = Field(
        None, json_schema_extra={"format": "date-time"},
        description="When the current phase was entered (the provisioning timeout counts "
                    "from it).")
    last_event_time: str | None = Field(
        None, json_schema_extra={"format": "date-time"},
        description="When the trainer last reported an event (the no-progress watchdog "
                    "counts from it, or from entering Running).")
    ray_cluster_release_time: str | None = Field(
        None, json_schema_extra={"format": "date-time"},
        description="When the finished run's RayCluster is (or was) released: "
                    "completionTime + spec.ttlSecondsAfterFinished.")
    retries: int | None = Field(None, ge=0, description="Failed attempts resubmitted so far "
                                                        "(spec.maxRetries caps it; a suspend "
                                                        "is not one).")
    cluster_hash: str | None = Field(None, description="Fingerprint of the spec's RayCluster "
                                                       "when it was created; a new attempt "
                                                       "rebuilds the cluster when the spec's "
                                                       "differs.")
    log_cursor: int | None = Field(None, ge=0,
                                   description="Bytes of the job log already parsed.")
    collectives: CollectivesResult | None = Field(None, description="Result of mode "
                                                                    "collectives.")
    log_job_id: str | None = Field(None, description="The job whose log logCursor counts.")
    trainer_failure: TrainerFailure | None = Field(
        None, description="The trainer's failure event of the current attempt, if any.")


class UndeclaredStatusKey(ValueError):
    """A status key the CRD does not declare: the API server would prune it in silence."""


# The top-level status keys this version declares (and so owns): the only ones it may
# remove. A key a newer version wrote is kept as it is (docs/architecture.md, "Upgrades").
STATUS_KEYS = frozenset(field.alias or name for name, field in TPUFineTuneStatus.model_fields.items())
_ABSENT = object()


def checked_status(status: dict, previous: dict | None = None) -> dict:
    """`status` as the operator is about to write it, validated by the model; refused with
    the key's path when a key (at any depth) is not declared.

    Only what this version writes is checked: a key whose value is the one in `previous`
    (the status read back from the API server) is carried, not written. So a key a newer
    operator wrote (its CRD declares it; after a rollback this version does not) passes,
    while a misspelt key this version adds or changes is still refused."""
    previous = previous or {}
    written = {key: value for key, value in status.items()
               if key != "kopf" and previous.get(key, _ABSENT) != value}  # kopf's own bookkeeping
    declared = TPUFineTuneStatus.model_validate(written).model_dump(by_alias=True, exclude_unset=True)
    unknown = _undeclared(written, declared, previous, "status")
    if unknown:
        raise UndeclaredStatusKey(f"undeclared status keys (the API server would drop them): "
                                  f"{', '.join(unknown)}")
    return status


def _undeclared(given, declared, previous, path: str) -> list[str]:
    if isinstance(given, dict):
        declared = declared if isinstance(declared, dict) else {}
        previous = previous if isinstance(previous, dict) else {}
        found = [f"{path}.{key}" for key in given
                 if key not in declared and previous.get(key, _ABSENT) != given[key]]
        for key in given.keys() & declared.keys():
            found += _undeclared(given[key], declared[key], previous.get(key), f"{path}.{key}")
        return found
    if isinstance(given, list) and isinstance(declared, list):
        previous = previous if isinstance(previous, list) else []
        return [k for i, (g, d) in enumerate(zip(given, declared))
                for k in _undeclared(g, d, _same_item(g, previous, i), f"{path}[{i}]")]
    return []


def _same_item(item, previous: list, index: int):
    """The item of the previous list that `item` carries: itself when unchanged (a list
    may be reordered around it), else the one at the same index."""
    at_index = previous[index] if index < len(previous) else None
    if at_index != item and item in previous:  # the index first: a long history is appended to
        return item
    return at_index
