"""The run's vocabulary, shared by the state machine's modules (phases.py and its parts):
phases, what the driver observes, the actions it performs, the Decision, and the small
helpers every phase uses to set conditions and enter a phase. Pure: no I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tpufinetune.core import conditions as cond
from tpufinetune.core.initsource import InitRequest, SourceView
from tpufinetune.core.podstatus import PodProblem, SliceHealth

PENDING = "Pending"
PROVISIONING = "Provisioning"
QUEUED = "Queued"
SUBMITTING = "Submitting"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
DELETING = "Deleting"
TERMINAL = frozenset({SUCCEEDED, FAILED})

JOB_ACTIVE = frozenset({"PENDING", "RUNNING"})

# Phases in which a run only waits for something the operator watches (its RayCluster, the
# cluster's pods, its Kueue Workload, a spec edit) or for one of its own timers.
WAITING = frozenset({PENDING, QUEUED, PROVISIONING})


# ---- observations (gathered by the driver) -------------------------------------------


@dataclass(frozen=True)
class Identity:
    name: str
    namespace: str
    uid: str
    generation: int = 1


@dataclass(frozen=True)
class Plan:
    """What the spec asks for, as the transition needs it (plan_for derives it)."""

    cluster_name: str
    epochs: int
    max_retries: int = 0
    provision_timeout: timedelta = timedelta(minutes=30)
    # Submitting's bound (TPUFT_SUBMIT_TIMEOUT: the preflight, the submit), counted from
    # entering it; None: no bound.
    submit_timeout: timedelta | None = None
    suspended: bool = False
    cluster_hash: str = ""  # cluster_fingerprint() of the RayCluster the spec renders
    hosts: int = 0  # worker pods of the slice(s), for "hosts ready 3/4"
    chips: int = 0  # TPU chips of the slice(s), for usage.chipHours (0: cpu)
    active_deadline: timedelta | None = None  # spec.activeDeadlineSeconds
    ttl_after_finished: timedelta = timedelta(0)  # spec.ttlSecondsAfterFinished
    no_progress_timeout: timedelta | None = None  # spec.noProgressTimeoutSeconds (None: off)
    queue: str = ""  # spec.queueName: Kueue admits the RayCluster
    preflight: bool = False  # spec.preflight.enabled (mode finetune): collectives first
    # status.plan (core/memplan.py's estimate; None: not planned, mode collectives), and
    # why the run cannot fit its slice ('' when it can, or when the model is unknown).
    memory: dict | None = field(default=None, hash=False)
    does_not_fit: str = ""
    # The planner's request (memplan.Request), planned again when the trainer reports the
    # model's own config.json (its `model` event); None: not planned.
    memory_request: object | None = field(default=None, hash=False, compare=False)
    logs_root: str = ""  # jobspec.run_logs_root: status.attempts[].logsURI ('': none kept)
    init_from: InitRequest | None = None  # spec.model.initFrom: wait for that run, then train from its result
    lm_eval_tasks: tuple[str, ...] = ()  # spec.evaluation.lmEval.tasks: run on the export before the release


@dataclass(frozen=True)
class QueueView:
    """Kueue's Workload for a suspended RayCluster: why it waits, or why it was evicted."""

    reason: str = ""  # e.g. Pending, Inadmissible
    message: str = ""  # Kueue's own words, e.g. "couldn't assign flavors to pod set ..."
    evicted: str = ""  # the eviction's reason and message while it is evicted


@dataclass(frozen=True)
class ClusterView:
    exists: bool
    owned: bool = True
    ready: bool = False
    problem: str = ""  # e.g. KubeRay's ReplicaFailure message: shown, not fatal
    dashboard_url: str = ""
    pod_problem: PodProblem | None = None  # the worst pod state while not ready
    hosts_ready: int | None = None  # worker pods Ready; None: pods not looked at
    suspended: bool = False  # spec.suspend: Kueue has not admitted it (or evicted it)
    deleting: bool = False  # metadata.deletionTimestamp is set: it is going away
    queue: QueueView | None = None  # read only for a suspended cluster with a queue
    uid: str = ""  # metadata.uid: which RayCluster an attempt ran on
    hosts_ready_since: str = ""  # when its last worker pod became Ready (read once it is ready)
    routine_wait: str = ""  # a pod's routine wait with the kubelet's words for it (podstatus.routine_wait)


@dataclass(frozen=True)
class JobView:
    status: str  # Ray's JobStatus: PENDING RUNNING STOPPED SUCCEEDED FAILED
    message: str = ""


@dataclass(frozen=True)
class Observations:
    now: datetime
    spec_error: str = ""  # non-empty when the spec failed validation
    cluster: ClusterView | None = None  # None: not looked at this tick
    job: JobView | None = None  # None: Ray has no job with status.jobId
    events: tuple[dict, ...] = ()  # new trainer events, in order
    log_tail: str = ""  # last lines of the job log, read only once a job failed
    deleting: bool = False
    ray_unreachable: str = ""  # why, once the job's head has not answered for too long
    ray_down: str = ""  # why the head does not answer (or its token cannot be derived), within that bound
    ray_answered: bool = False  # the head answered a call of this step (its unreachable clock stops)
    create_refused: str = ""  # the API server's words when it refused to create the RayCluster
    slice_health: SliceHealth | None = None  # read only once a job ended without success
    # (node, GKE's cloud.google.com/scheduled-maintenance-time value) for the nodes of the
    # run's pods that carry it; read only while Running.
    maintenance: tuple[tuple[str, str], ...] = ()
    # The attempt's preflight job (None: Ray has none) and, once it ended, its events.
    preflight_job: JobView | None = None
    preflight_events: tuple[dict, ...] = ()
    # spec.model.initFrom's source, read while the run waits for it (None: not read).
    init_source: SourceView | None = None


# ---- actions (performed by the driver) -------------------------------------------------


@dataclass(frozen=True)
class CreateCluster:
    name: str


@dataclass(frozen=True)
class SubmitJob:
    submission_id: str
    attempt: int


@dataclass(frozen=True)
class SubmitPreflight:
    submission_id: str
    attempt: int


@dataclass(frozen=True)
class SubmitEvaluation:
    """Submit the attempt's lm-eval job on its export (spec.evaluation.lmEval)."""

    submission_id: str
    attempt: int
    model_uri: str


@dataclass(frozen=True)
class StopJob:
    submission_id: str


@dataclass(frozen=True)
class RequestCheckpoint:
    """Ask the running trainer for a step checkpoint now (a short Ray job on the head)."""

    submission_id: str
    attempt: int
    request: int
    reason: str
    detail: str


@dataclass(frozen=True)
class DeleteCluster:
    name: str


@dataclass(frozen=True)
class ReadLogTail:
    """Ask the driver for the log tail (only when a job failed without a failure event)."""

    submission_id: str


@dataclass(frozen=True)
class ReadSliceHealth:
    """Ask the driver for the slice's pods and nodes (once a job ended without success):
    they decide the attempt's reason and whether the retry may keep the RayCluster."""

    since: str  # when the slice was ready for the attempt: a pod newer than this replaced one


@dataclass(frozen=True)
class RecordEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: dict
    actions: list = field(default_factory=list)
    # Step again by then at the latest, even with nothing to do now (a RayCluster kept by
    # spec.ttlSecondsAfterFinished is released then).
    wake_at: datetime | None = None

    @property
    def phase(self) -> str:
        return self.status.get("phase", "")


# ---- helpers ---------------------------------------------------------------------------


def cluster_lost(cluster: ClusterView | None) -> bool:
    """The job's RayCluster is gone or going (None: not looked at). In Submitting and
    Running that is never the operator's doing: it deletes one only in other phases."""
    return cluster is not None and (not cluster.exists or not cluster.owned or cluster.deleting)


def _expired(deadline: datetime | None, obs: Observations) -> bool:
    return deadline is not None and obs.now > deadline


def _first_and_last_line(text: str) -> str:
    """Ray's message of a failed job can hold a whole traceback (a runtime_env that could
    not be set up): its first line says what failed, its last one why."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[1:][-1:])


def _applied(s: dict, ident: Identity) -> None:
    """status.observedGeneration names only a generation acted on: the one a RayCluster
    was created from, a job submitted with, or a suspend applied for. An edit to a running
    job applies to the next attempt, and the status says so by not claiming it yet."""
    s["observedGeneration"] = ident.generation


def _set(s: dict, obs: Observations, type_: str, value: bool, reason: str, message: str) -> None:
    cond.set_condition(s, type_, value, reason, message, obs.now, s.get("observedGeneration"))


def _enter(s: dict, d: Decision, phase: str, reason: str, message: str, warn: bool = False) -> None:
    s["phase"] = phase
    s["message"] = message[: cond.MESSAGE_LIMIT]
    d.actions.append(RecordEvent("Warning" if warn else "Normal", reason, message[: cond.MESSAGE_LIMIT]))


def _note(s, d, obs, type_, reason, message, warn=False) -> None:
    """Update a condition; emit an Event only when the message changes (no event storms)."""
    previous = cond.find(s, type_) or {}
    _set(s, obs, type_, False, reason, message)
    s["message"] = message[: cond.MESSAGE_LIMIT]
    if previous.get("message") != message[: cond.MESSAGE_LIMIT]:
        d.actions.append(RecordEvent("Warning" if warn else "Normal", reason, message[: cond.MESSAGE_LIMIT]))


def _copy(status: dict) -> dict:
    # kopf keeps its own bookkeeping under status.kopf; it is not ours to rewrite.
    return copy.deepcopy({k: v for k, v in (status or {}).items() if k != "kopf"})


def recorded_cluster_uid(status: dict, cluster: ClusterView | None) -> str:
    """The RayCluster a delete may remove (its uid precondition): the owned one the step's
    decision was made on, else the one the run's status records for its latest attempt; ''
    when neither is known. Never one a fresh read finds: after a hand-over that could be a
    newer leader's cluster of the same name."""
    if cluster is not None and cluster.exists and cluster.owned and cluster.uid:
        return cluster.uid
    entries = status.get("attempts") or []
    return str(entries[-1].get("rayClusterUID") or "") if entries else ""
