"""The TPUFineTune status: written only by the operator, declared here so nothing is pruned.

Build a patch with `status.model_dump(by_alias=True, exclude_none=True, mode="json")`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpufinetune.core.evalstatus import PROMPT_IMAGE_LIMIT, GenerationMetrics, LmEvalStatus
from tpufinetune.core.initstatus import InitFromStatus
from tpufinetune.core.planstatus import MemoryPlanStatus, ModelConfigStatus  # noqa: F401  (part of the status)
from tpufinetune.core.startupstatus import StartupTimes
from tpufinetune.core.statusbase import _Status

Phase = Literal["Pending", "Queued", "Provisioning", "Submitting", "Running", "Succeeded",
                "Failed", "Deleting"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


# Characters of status.appliedSpec at most: a spec longer than this is not recorded (a
# restart then goes by the latest generation, as before the record existed).
APPLIED_SPEC_LIMIT = 65536


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


class PreferenceMetrics(_Status):
    """Method dpo's figures of one epoch: means over its training pairs and (eval*) the held-out ones."""

    rewards_chosen: float | None = Field(None, description="beta x (policy - reference) log-probability of the chosen responses.")
    rewards_rejected: float | None = Field(None, description="The same for the rejected responses.")
    margin: float | None = Field(None, description="rewardsChosen - rewardsRejected.")
    accuracy: float | None = Field(None, ge=0, le=1, description="Share of pairs whose chosen reward is the higher.")
    eval_rewards_chosen: float | None = Field(None, description="rewardsChosen on the held-out pairs.")
    eval_rewards_rejected: float | None = Field(None, description="rewardsRejected on the held-out pairs.")
    eval_margin: float | None = Field(None, description="margin on the held-out pairs.")
    eval_accuracy: float | None = Field(None, ge=0, le=1, description="accuracy on the held-out pairs.")


class EpochRecord(_Status):
    """Metrics of one finished epoch."""

    epoch: int = Field(ge=0, description="Epoch number, from 1.")
    step: int | None = Field(None, ge=0, description="Optimizer steps done at its end (whole "
                                                     "run): where its evalLoss sits on "
                                                     "status.curve.")
    loss: float | None = Field(None, description="Mean training loss of the epoch.")
    eval_loss: float | None = Field(None, description="Mean evaluation loss, if evaluated.")
    tokens_per_second: float | None = Field(None, description="Training throughput.")
    epoch_time_seconds: float | None = Field(None, description="Wall time of the epoch.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="Checkpoint written after the epoch.")
    dpo: PreferenceMetrics | None = Field(None, description="Method dpo's rewards, margin and accuracy.")
    eval: GenerationMetrics | None = Field(None, description="Generation metrics of the epoch "
                                                            "(training.evaluation.generate).")


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
    grad_norm: float | None = Field(None, ge=0, description="Global gradient norm of the last "
                                                         "step, before clipping.")
    eta_seconds: int | None = Field(None, ge=0, description="Estimated seconds of training left "
                                                          "(steps left x step time; checkpoints "
                                                          "and evaluation not included).")
    summary: str | None = Field(None, max_length=128,
                                description="e.g. '37% 120/320 ETA 12m', for kubectl get.")


# Points status.curve keeps at most; when full, every other point is dropped (the first and
# the newest kept), so a long run keeps its shape in a bounded status.
CURVE_LIMIT = 200


class CurvePoint(_Status):
    """One progress sample of the training loss curve."""

    step: int = Field(ge=0, description="Optimizer steps done (whole run).")
    loss: float | None = Field(None, description="Training loss over the progress window.")
    learning_rate: float | None = Field(None, description="Learning rate of the last step.")
    tokens_per_second: float | None = Field(None, description="Throughput over the window.")
    training_seconds: float | None = Field(None, ge=0, description="Seconds of training when it "
                                                                  "was taken (every attempt's).")


class LinkBandwidth(_Status):
    """all_reduce bus bandwidth over one link class: its slowest group's."""

    bus_bandwidth_gbps: float | None = Field(None, alias="busBandwidthGBps",
                                             description="The slowest group's bus bandwidth, GB/s.")
    groups: int | None = Field(None, ge=0, description="Groups measured (at once).")
    ranks_per_group: int | None = Field(None, ge=0, description="Ranks in each group.")


class LinkBandwidths(_Status):
    """Bus bandwidth per link class: within a slice (ICI; with one slice, over every rank)
    and, with several slices, across them (DCN: one rank per slice)."""

    ici: LinkBandwidth | None = Field(None, description="Within each slice.")
    dcn: LinkBandwidth | None = Field(None, description="Across slices (reported, not judged).")


class CollectivesResult(_Status):
    """Outcome of the interconnect check (mode collectives)."""

    passed: bool | None = Field(None, description="Every rank verified the all_reduce sum "
                                                  "and tensor-parallel parity.")
    ranks: int | None = Field(None, ge=0, description="Number of ranks that took part.")
    links: LinkBandwidths | None = Field(None, description="Bus bandwidth per link class.")
    message: str | None = Field(None, description="Summary line from the check.")


class NoticeCheckpoint(_Status):
    """The last checkpoint the trainer wrote on notice."""

    reason: str | None = Field(None, max_length=64,
                               description="SIGTERM (the pod was going away) or Requested "
                                           "(asked for, e.g. before node maintenance).")
    requested_by: str | None = Field(None, max_length=64,
                                     description="Who asked, for Requested (e.g. Maintenance).")
    detail: str | None = Field(None, max_length=1024, description="e.g. the node and its "
                                                                  "maintenance time.")
    step: int | None = Field(None, ge=0, description="Optimizer steps the checkpoint holds.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="The checkpoint written.")
    save_seconds: float | None = Field(None, ge=0, description="Seconds from the agreed notice "
                                                               "to the checkpoint saved.")
    time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                             description="When the operator read the notice.")


class PreflightResult(_Status):
    """The collectives check run on the slice before the fine-tune (spec.preflight)."""

    phase: Literal["Running", "Passed", "Failed"] | None = Field(None, description="Running, Passed or Failed.")
    attempt: int | None = Field(None, ge=0, description="The attempt it checked the slice for.")
    job_id: str | None = Field(None, description="Its Ray submission id.")
    bus_bandwidth_gbps: float | None = Field(None, alias="busBandwidthGBps",
                                             description="all_reduce bus bandwidth, GB/s.")
    min_bus_bandwidth_gbps: float | None = Field(None, alias="minBusBandwidthGBps",
                                                 description="The floor it was checked against.")
    hosts: int | None = Field(None, ge=0, description="Hosts that took part.")
    devices_per_host: dict[str, int] | None = Field(None, description="Devices placed per host (by IP).")
    short_hosts: dict[str, int] | None = Field(None, description="TPU hosts with fewer device files "
                                                                "than devices placed there: IP -> found.")
    ranks: int | None = Field(None, ge=0, description="Ranks (devices) that took part.")
    links: LinkBandwidths | None = Field(None, description="Bus bandwidth per link class; "
                                                           "minBusBandwidthGBps judges ici.")
    message: str | None = Field(None, max_length=1024, description="What it found.")


class EarlyStop(_Status):
    """Why the trainer stopped before its planned steps (training.targetEvalLoss or
    training.earlyStoppingPatience)."""

    reason: str | None = Field(None, max_length=64, description="TargetEvalLoss or Patience.")
    step: int | None = Field(None, ge=0, description="Optimizer step of the deciding evaluation.")
    eval_loss: float | None = Field(None, description="Its eval loss.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="The checkpoint of that evaluation.")


class Maintenance(_Status):
    """Nodes of the run's pods with maintenance scheduled (GKE's
    cloud.google.com/scheduled-maintenance-time label), and the checkpoint asked for."""

    nodes: list[str] | None = Field(None, max_length=256, description="The nodes, in this attempt.")
    attempt: int | None = Field(None, ge=0, description="The attempt they were seen in.")
    requests: int | None = Field(None, ge=0, description="Checkpoints asked for in that attempt.")
    request_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                     description="When the last checkpoint was asked for.")
    message: str | None = Field(None, max_length=1024, description="Which node, and when.")


# Bounds of status.export: a few prompts, each text cut, a prompt's first images (the full proof is in the job log).
EXPORT_SAMPLE_LIMIT = 8
EXPORT_TEXT_LIMIT = 256


class ExportSample(_Status):
    """One held-out prompt and what the exported model generated for it."""

    prompt: str = Field(max_length=EXPORT_TEXT_LIMIT, description="The prompt's end.")
    completion: str | None = Field(None, max_length=EXPORT_TEXT_LIMIT,
                                   description="The exported model's greedy completion.")
    adapter_completion: str | None = Field(None, max_length=EXPORT_TEXT_LIMIT,
                                           description="The base with the exported LoRA adapter's.")
    images: list[str] | None = Field(None, max_length=PROMPT_IMAGE_LIMIT, description="A multimodal run's: the "
                                     "images the prompt was asked with, where they were read (each its end).")


class ExportProof(_Status):
    """The export loaded back from where it was written (transformers; the adapter with peft
    onto the base) and generated for a few held-out prompts, before the run succeeded."""

    sample: list[ExportSample] | None = Field(None, max_length=EXPORT_SAMPLE_LIMIT, description="The prompts and "
                                                                             "their completions.")
    tokens: int | None = Field(None, ge=0, description="Tokens generated for each prompt (greedy).")
    load_seconds: float | None = Field(None, ge=0, description="Seconds to load the export (and "
                                                               "the adapter).")
    dtype: str | None = Field(None, max_length=32, description="The dtype it was loaded in.")


class TrainerFailure(_Status):
    """What the trainer reported before it failed."""

    type: str | None = Field(None, max_length=128, description="Exception type.")
    message: str | None = Field(None, max_length=1024, description="What went wrong.")


# Why an attempt ended: a closed set, decided by the pure core (core/attempts.py) from what
# the operator observed (docs/api.md, "Attempts").
AttemptReason = Literal["Succeeded", "AppFailed", "NoProgress", "Preempted", "NodeLost", "Maintenance",
                        "Evicted", "ClusterLost", "DeadlineExceeded", "Stopped", "NotStarted",
                        "PreflightFailed"]
ATTEMPT_REASONS: tuple[str, ...] = AttemptReason.__args__  # type: ignore[attr-defined]


class Usage(_Status):
    """What the slice cost: chip-hours and host-hours from the slice being ready to its
    release, and the time spent waiting for it."""

    chip_hours: float = Field(0.0, ge=0, description="TPU chips x hours the slice was held "
                                                     "(ready to released); 0 for cpu runs.")
    host_hours: float = Field(0.0, ge=0, description="TPU hosts (worker pods) x hours the "
                                                     "slice was held.")
    provisioning_seconds: float = Field(0.0, ge=0, description="Seconds spent waiting for "
                                                               "the slice (queued, scheduled, "
                                                               "starting).")


class Attempt(_Status):
    """One attempt: from asking for its slice (or taking over the previous attempt's) to
    its end."""

    attempt: int = Field(ge=1, description="Attempt number, from 1 (status.attempt).")
    start_time: str = Field(json_schema_extra={"format": "date-time"},
                            description="When the attempt began (waiting for its slice).")
    end_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                 description="When it ended; absent while it runs.")
    reason: AttemptReason | None = Field(None, description="Why it ended: Succeeded, "
                                         "AppFailed, NoProgress, Preempted, NodeLost, "
                                         "Maintenance, Evicted, ClusterLost, "
                                         "DeadlineExceeded, Stopped or NotStarted.")
    message: str | None = Field(None, max_length=2048,
                                description="Why it ended; for a failed job, the last lines "
                                            "of its driver log (bounded).")
    resumed_from: str | None = Field(None, max_length=2048,
                                     description="Checkpoint URI it resumed from; empty: "
                                                 "from the start.")
    resumed_step: int | None = Field(None, ge=0, description="Optimizer steps the checkpoint "
                                                             "it restored holds (its trainer's "
                                                             "first plan; 0: from the start); "
                                                             "absent: not reported yet.")
    last_step: int | None = Field(None, ge=0, description="Highest optimizer step the "
                                                          "trainer reported in it.")
    lost_steps: int | None = Field(None, ge=0, description="Steps done in it after the "
                                                           "checkpoint the next attempt "
                                                           "resumes from: lastStep less the "
                                                           "next attempt's resumedStep (until "
                                                           "that is known, the last checkpoint "
                                                           "reported).")
    ray_cluster_uid: str | None = Field(None, alias="rayClusterUID", max_length=64,
                                        description="uid of the RayCluster it ran on.")
    slice_ready_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                         description="When its slice was ready: its last "
                                                     "worker pod Ready (usage counts from "
                                                     "here).")
    slice_release_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                           description="When its slice was released or "
                                                       "handed to the next attempt.")
    usage: Usage | None = Field(None, description="What this attempt cost.")
    logs_uri: str | None = Field(None, alias="logsURI", max_length=2048,
                                 description="Where its logs are kept (the driver's and "
                                             "each worker's output, written while it runs "
                                             "and kept after the RayCluster is gone): "
                                             "`tpufinetune logs NAME --attempt N`.")
    startup: StartupTimes | None = Field(None, description="Where its time before its first "
                                                           "optimizer step went; absent until the "
                                                           "trainer reports that step.")


class Notification(_Status):
    """One notice of spec.notify and its delivery (core/notify.py)."""

    sink: str = Field(max_length=63, description="The sink it was sent to.")
    event: Literal["Succeeded", "Failed", "AttemptEnded"] = Field(description="What it tells.")
    attempt: int = Field(ge=0, description="The attempt it is about.")
    id: str = Field(max_length=128, description="Its CloudEvent id (the same at every try and "
                                                "sink; a receiver may dedupe on it).")
    state: Literal["Pending", "Delivered", "Failed"] = Field(
        description="Pending (being retried), Delivered, or Failed (refused, out of tries, or "
                    "a sink not configured): a Delivered or Failed notice is not sent again.")
    tries: int = Field(0, ge=0, description="HTTP tries made.")
    last_error: str | None = Field(None, max_length=512, description="Why the last try failed.")
    time: str = Field(json_schema_extra={"format": "date-time"}, description="When it was last tried.")


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
    applied_spec: str | None = Field(
        None, max_length=APPLIED_SPEC_LIMIT,
        description="The spec of observedGeneration, as JSON: after a restart, the plan an "
                    "attempt keeps (watchdog, deadline, TTL, slice size) while a later edit "
                    "waits for the next attempt or is refused.")
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
    curve: list[CurvePoint] | None = Field(
        None, max_length=CURVE_LIMIT,
        description=f"The training loss curve: progress samples by step, at most "
                    f"{CURVE_LIMIT} (when full, every other point is dropped, the first and "
                    f"the newest kept); a resumed attempt's repeated steps replace the "
                    f"earlier attempt's from there on.")
    checkpoint_uri: str | None = Field(None, alias="checkpointURI",
                                       description="Latest (best-kept) checkpoint.")
    exported_model_uri: str | None = Field(None, alias="exportedModelURI",
                                           description="Exported model weights, if any.")
    exported_adapter_uri: str | None = Field(None, alias="exportedAdapterURI",
                                             description="Exported LoRA adapter (PEFT's format), "
                                                         "for training.method lora (or dpo with lora).")
    tensorboard_uri: str | None = Field(None, alias="tensorboardURI", max_length=2048, description=(
        "The run's TensorBoard event files (tensorboard --logdir): one folder per attempt, attempt-N."))
    export: ExportProof | None = Field(None, description="The proof that the export loads and "
                                                         "generates (written before Succeeded).")
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
    log_anchor: str | None = Field(None, max_length=64,
                                   description="Digests of the log lines just before "
                                               "logCursor: a restart finds them in the "
                                               "log's last lines and reads only what "
                                               "follows.")
    attempts: list[Attempt] | None = Field(
        None, max_length=20, description="The last 20 attempts, oldest first, each with "
                                         "why it ended and what it cost; older ones are "
                                         "counted in usage only.")
    usage: Usage | None = Field(None, description="What every attempt cost, summed.")
    checkpoint_step: int | None = Field(None, ge=0, description="Optimizer step of "
                                                                "checkpointURI.")
    notice: NoticeCheckpoint | None = Field(
        None, description="The last checkpoint written on notice (SIGTERM, or asked for before "
                          "node maintenance).")
    maintenance: Maintenance | None = Field(
        None, description="Set when a node of the run's pods has maintenance scheduled: the "
                          "trainer was asked for a checkpoint now (status.notice says when it "
                          "was written).")
    early_stop: EarlyStop | None = Field(None, description="Set when the trainer stopped early.")
    preflight: PreflightResult | None = Field(None, description="The slice's check before the "
                                                                "fine-tune (spec.preflight).")
    time_to_target: float | None = Field(
        None, ge=0, description="Seconds of training (every attempt's, loading and export left "
                                "out) until the evaluation that reached "
                                "training.targetEvalLoss.")
    trainer_failure: TrainerFailure | None = Field(
        None, description="The trainer's failure event of the current attempt, if any.")
    notifications: list[Notification] | None = Field(
        None, max_length=50, description="Delivery of spec.notify's notices, newest last (at "
                                         "most 50).")
    evaluation: LmEvalStatus | None = Field(None, description="lm-eval on the export (spec.evaluation.lmEval).")
    init_from: InitFromStatus | None = Field(None, description="spec.model.initFrom resolved: the source's result every attempt trains from.")
    plan: MemoryPlanStatus | None = Field(
        None, description="The memory planner's estimate (HBM per chip, memory per host) and "
                          "whether it fits; a run that does not fit fails with reason DoesNotFit "
                          "before any RayCluster exists.")


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
