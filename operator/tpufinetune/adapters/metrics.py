"""Prometheus metrics of the operator, served on `tpufinetune operator --metrics-port`.

| metric | type | labels | meaning |
|---|---|---|---|
| tpufinetune_reconciles_total | counter | phase | steps taken, by the phase the resource was in |
| tpufinetune_reconcile_errors_total | counter | phase | steps that raised (API or Ray unreachable, …); retried. A status write refused as stale (409) is not one |
| tpufinetune_resources | gauge | phase | TPUFineTunes the watch sees, by status.phase |
| tpufinetune_apply_to_raycluster_seconds | histogram | | metadata.creationTimestamp → RayCluster created |
| tpufinetune_apply_to_job_submitted_seconds | histogram | | metadata.creationTimestamp → first Ray job submitted |
| tpufinetune_time_to_first_step_seconds | histogram | attempt_kind | an attempt's start (status.attempts[].startTime) → its trainer's first optimizer step done (status.attempts[].startup.firstStepSeconds); attempt_kind first (attempt 1) or retry; one observation per attempt |
| tpufinetune_job_outcomes_total | counter | outcome, reason | runs that ended (Succeeded, Failed) or retried (Retried) |
| tpufinetune_trainer_events_dropped_total | counter | | trainer event lines the status cannot hold (a wrong type, a refused value), dropped with a Warning Event |
| tpufinetune_chip_seconds_total | counter | namespace, generation, reason | TPU chip-seconds of ended attempts (slice ready to released), by the attempt's end reason (status.attempts[].reason); counted once the attempt's slice is released |
| tpufinetune_queue_wait_seconds | histogram | | Queued → admitted by Kueue (Provisioning), from the two phaseTransitionTimes; one observation per admission |
| tpufinetune_log_bytes_total | counter | | bytes of the trainer jobs' logs read from Ray heads (streams and whole-log reads): what following the running jobs costs, e.g. after a restart |
| tpufinetune_notice_tries_total | counter | sink, outcome | tries to deliver spec.notify's notices to a configured sink: Delivered, Pending (to be tried again) or Failed (given up); sinks are the admin's, so the labels stay few |

Per run (off with TPUFT_RUN_METRICS=false), read from each TPUFineTune's status as the watch
sees it (core/runmetrics.py); a series is absent while the status has no value for it, and
all of a run's series go when the run is deleted:

| metric | type | labels | meaning |
|---|---|---|---|
| tpufinetune_run_phase | gauge | namespace, name, phase | 1 for the run's current phase (one series per run) |
| tpufinetune_run_epoch | gauge | namespace, name | last completed epoch |
| tpufinetune_run_step | gauge | namespace, name | optimizer steps done |
| tpufinetune_run_progress_ratio | gauge | namespace, name | steps done / steps planned, 0 to 1 |
| tpufinetune_run_loss | gauge | namespace, name | training loss of the last progress window (else of the last epoch) |
| tpufinetune_run_eval_loss | gauge | namespace, name | evaluation loss of the last evaluation |
| tpufinetune_run_learning_rate | gauge | namespace, name | learning rate of the last step |
| tpufinetune_run_tokens_per_second | gauge | namespace, name | throughput of the last window (else of the last epoch) |
| tpufinetune_run_step_time_seconds | gauge | namespace, name | mean seconds per optimizer step |
| tpufinetune_run_eta_seconds | gauge | namespace, name | estimated seconds of training left |
| tpufinetune_run_attempts | gauge | namespace, name | attempts so far, the current one included |
| tpufinetune_run_chip_seconds | gauge | namespace, name | TPU chip-seconds held so far (status.usage) |
| tpufinetune_run_{rewards_chosen,rewards_rejected,reward_margin,preference_accuracy} | gauge | namespace, name | method dpo: the last epoch's figures on its training pairs (status.history[].dpo) |
| tpufinetune_run_eval_{rewards_chosen,rewards_rejected,reward_margin,preference_accuracy} | gauge | namespace, name | the same on the held-out pairs |
| tpufinetune_run_eval_{exact_match,rouge_l,bleu} | gauge | namespace, name | the last generation evaluation (status.history[].eval) |

Cardinality: at most 23 series per run (runmetrics.SERIES_PER_RUN), 12 for an SFT run
without generation metrics, so 12,000 at 1,000 such runs (kept or finished, until deleted); a finished run keeps its last values (its final loss) until
it is deleted. Everything else here is bounded by phases, reasons and namespaces, not runs.

The driver (Run.step) and one kopf watch handler (handlers.resource_seen) report through the
few functions below; nothing here touches Kubernetes or Ray. Phases are the status phases; a
resource without one yet is `New`.
The timestamps Kubernetes keeps have one-second resolution, so the latency buckets start at
one second.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from tpufinetune.core import runmetrics, startup

NEW = "New"
PHASES = ("Pending", "Queued", "Provisioning", "Submitting", "Running", "Succeeded", "Failed",
          "Deleting")
RETRIED = ("Retrying", "ClusterLost")  # the Event reasons of a new attempt that counts as a retry
LATENCY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
QUEUE_BUCKETS = (*LATENCY_BUCKETS, 14400, 28800, 86400)  # a slice may be queued for hours

RECONCILES = Counter("tpufinetune_reconciles", "Reconcile steps, by the phase the resource was in.", ["phase"])
ERRORS = Counter("tpufinetune_reconcile_errors", "Reconcile steps that raised, by phase.", ["phase"])
TO_CLUSTER = Histogram(
    "tpufinetune_apply_to_raycluster_seconds",
    "Seconds from the TPUFineTune's creation to its RayCluster being created.",
    buckets=LATENCY_BUCKETS,
)
TO_SUBMITTED = Histogram(
    "tpufinetune_apply_to_job_submitted_seconds",
    "Seconds from the TPUFineTune's creation to its first Ray job being submitted.",
    buckets=LATENCY_BUCKETS,
)
TO_FIRST_STEP = Histogram(
    "tpufinetune_time_to_first_step_seconds",
    "Seconds from an attempt's start to its trainer's first optimizer step, by attempt kind (first, retry).",
    ["attempt_kind"],
    buckets=LATENCY_BUCKETS,
)
OUTCOMES = Counter(
    "tpufinetune_job_outcomes", "Runs that ended or were retried, by outcome and reason.", ["outcome", "reason"]
)
CHIP_SECONDS = Counter(
    "tpufinetune_chip_seconds", "TPU chip-seconds of ended attempts, by namespace, TPU generation and end reason.",
    ["namespace", "generation", "reason"],
)
QUEUE_WAIT = Histogram(
    "tpufinetune_queue_wait_seconds",
    "Seconds a TPUFineTune waited Queued before Kueue admitted it.",
    buckets=QUEUE_BUCKETS,
)
LOG_BYTES = Counter("tpufinetune_log_bytes", "Bytes of the trainer jobs' logs read from Ray heads.")
NOTICE_TRIES = Counter(
    "tpufinetune_notice_tries",
    "Tries to deliver notices to a configured sink, by sink and outcome (Delivered, Pending, Failed).",
    ["sink", "outcome"],
)
DROPPED_EVENTS = Counter(
    "tpufinetune_trainer_events_dropped", "Trainer event lines the status cannot hold, dropped."
)


# Every phase's series exists from the start, at 0: a rate over them is 0 until something
# happens, not an empty result (a dashboard panel shows "0 errors", not "no data").
for _phase in (NEW, *PHASES):
    RECONCILES.labels(_phase)
    ERRORS.labels(_phase)
for _kind in startup.ATTEMPT_KINDS:
    TO_FIRST_STEP.labels(_kind)


TIMED = ("cluster", "job")  # the latencies from apply, each observed once per resource


class _Phases:
    """Current phase per resource, exported as the tpufinetune_resources gauge when scraped,
    and each run's own series (tpufinetune_run_*) unless they are turned off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: dict[tuple[str, str], str] = {}
        self._values: dict[tuple[str, str], dict[str, float]] = {}
        self._timed: set[tuple[str, str]] = set()  # (uid, which): each latency once per resource
        self.per_run = True

    def set(self, key: tuple[str, str], phase: str, values: dict[str, float]) -> None:
        with self._lock:
            self._phase[key] = phase or NEW
            if self.per_run:
                self._values[key] = values

    def forget(self, key: tuple[str, str], uid: str = "") -> None:
        with self._lock:
            self._phase.pop(key, None)
            self._values.pop(key, None)
            for which in TIMED:
                self._timed.discard((uid, which))

    def names_in(self, namespace: str) -> list[str]:
        with self._lock:
            return [name for (ns, name) in self._phase if ns == namespace]

    def keep_per_run(self, enabled: bool) -> None:
        with self._lock:
            self.per_run = enabled
            if not enabled:
                self._values.clear()

    def first(self, uid: str, which: str) -> bool:
        with self._lock:
            if (uid, which) in self._timed:
                return False
            self._timed.add((uid, which))
            return True

    def collect(self):
        with self._lock:
            runs = sorted(self._phase.items())
            values = dict(self._values) if self.per_run else {}
        phases = [phase for _, phase in runs]
        family = GaugeMetricFamily("tpufinetune_resources", "TPUFineTunes by current phase.", labels=["phase"])
        for phase in (NEW, *PHASES, *sorted(set(phases) - {NEW, *PHASES})):
            family.add_metric([phase], phases.count(phase))
        yield family
        if not self.per_run:
            return
        current = GaugeMetricFamily(runmetrics.PHASE, "1 for the run's current phase.",
                                    labels=["namespace", "name", "phase"])
        for (namespace, name), phase in runs:
            current.add_metric([namespace, name, phase], 1)
        yield current
        for metric, help_text in runmetrics.GAUGES.items():
            gauge = GaugeMetricFamily(metric, help_text, labels=["namespace", "name"])
            for key, _ in runs:
                if metric in values.get(key, {}):
                    gauge.add_metric(list(key), values[key][metric])
            yield gauge


RESOURCES = _Phases()
REGISTRY.register(RESOURCES)


class _StatusWrites:
    """tpufinetune_status_write_failing_seconds: how long each run's status writes have
    failed (core/progress.py), read from the operator's tracker when scraped; a run whose
    writes land has no series."""

    def __init__(self) -> None:
        self.tracker = None

    def collect(self):
        gauge = GaugeMetricFamily("tpufinetune_status_write_failing_seconds",
                                  "Seconds a run's status writes have failed, since the first failure.",
                                  labels=["namespace", "name", "cause"])
        tracker = self.tracker
        if tracker is not None:
            now = time.monotonic()
            for run, failing in sorted(dict(tracker.failing).items()):
                gauge.add_metric([run[0], run[1], "run" if failing.own else "operator"], now - failing.since)
        yield gauge


STATUS_WRITES = _StatusWrites()
REGISTRY.register(STATUS_WRITES)


# ---- what the driver calls ---------------------------------------------------------------


def stepped(before: str, after: str, recorded: list[tuple[str, str]]) -> None:
    """One step done: `before`/`after` are the phases around it, `recorded` the (type,
    reason) of the Events it posted (the transition's reasons name outcomes and retries)."""
    RECONCILES.labels(before or NEW).inc()
    if after != before and after in ("Succeeded", "Failed"):
        reason = next((r for _, r in reversed(recorded)), after)
        OUTCOMES.labels(after, reason).inc()
    else:
        for reason in (r for _, r in recorded if r in RETRIED):
            OUTCOMES.labels("Retried", reason).inc()


def attempt_ended(namespace: str, generation: str, reason: str, chip_seconds: float) -> None:
    """An attempt's usage is final (it ended and its slice is released or handed over)."""
    if chip_seconds > 0:
        CHIP_SECONDS.labels(namespace, generation, reason).inc(chip_seconds)


def events_dropped(count: int) -> None:
    DROPPED_EVENTS.inc(count)


def log_read(size: int) -> None:
    LOG_BYTES.inc(size)


def notice_tried(sink: str, outcome: str) -> None:
    """One try of a notice to a sink the admin configured (never a name from a spec)."""
    NOTICE_TRIES.labels(sink, outcome).inc()


def step_failed(phase: str) -> None:
    ERRORS.labels(phase or NEW).inc()


def seen(namespace: str, name: str, status: dict | None) -> None:
    """The resources gauge and the per-run series follow the watch: what the API server
    holds, not what this process last wrote."""
    status = status or {}
    RESOURCES.set((namespace or "", name or ""), status.get("phase") or "", runmetrics.values(status))


def names_in(namespace: str) -> list[str]:
    """The TPUFineTunes the watch holds in `namespace` (every one it delivered and has not
    seen deleted)."""
    return RESOURCES.names_in(namespace)


def per_run(enabled: bool) -> None:
    """TPUFT_RUN_METRICS: export each run's own series, or none of them."""
    RESOURCES.keep_per_run(enabled)


def left_queue(before: dict, after: dict) -> None:
    """A step from `before` to `after` (statuses): a Kueue admission observes the queue wait."""
    waited = runmetrics.queue_wait(before, after)
    if waited is not None:
        QUEUE_WAIT.observe(waited)


def first_steps(before: dict, after: dict) -> None:
    """A step from status `before` to `after`: each attempt whose first step it folded
    observes its time to first step (once: the next step's `before` holds it)."""
    for kind, seconds in startup.first_steps(before, after):
        TO_FIRST_STEP.labels(kind).observe(seconds)


def forget(namespace: str, name: str, uid: str = "") -> None:
    """The resource is gone from the API server: its series, and the note that its
    latencies were observed (a set that would otherwise grow with every run ever seen)."""
    RESOURCES.forget((namespace or "", name or ""), uid)


def cluster_created(uid: str, created: str | None) -> None:
    _since_apply(TO_CLUSTER, uid, "cluster", created)


def job_submitted(uid: str, created: str | None) -> None:
    _since_apply(TO_SUBMITTED, uid, "job", created)


def _since_apply(histogram: Histogram, uid: str, which: str, created: str | None) -> None:
    """Observed once per resource and operator process: a RayCluster created again after a
    suspension, or a retry, measures something else."""
    if not created or not RESOURCES.first(uid, which):
        return
    start = datetime.fromisoformat(created.replace("Z", "+00:00"))
    histogram.observe(max(0.0, (datetime.now(timezone.utc) - start).total_seconds()))


def serve(port: int, address: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> None:
    """Serve /metrics on a daemon thread (prometheus_client's own HTTP server)."""
    start_http_server(port, addr=address, registry=registry)
