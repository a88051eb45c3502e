"""operator/tpufinetune/adapters/metrics.py: what the driver reports becomes the right samples, and
the HTTP endpoint serves them (the end-to-end suite scrapes the running operator too)."""

from __future__ import annotations

import urllib.request
from datetime import datetime, timedelta, timezone

from prometheus_client import REGISTRY

from harness.ports import free_port
from tpufinetune.adapters import metrics


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_steps_count_by_phase_and_outcomes_only_on_the_transition():
    before = {p: value("tpufinetune_reconciles_total", phase=p) for p in ("New", "Running", "Succeeded")}
    succeeded = value("tpufinetune_job_outcomes_total", outcome="Succeeded", reason="Succeeded")
    metrics.stepped("", "Pending", [("Normal", "Accepted")])
    metrics.stepped("Running", "Running", [])
    metrics.stepped("Running", "Succeeded", [("Normal", "Succeeded")])
    metrics.stepped("Succeeded", "Succeeded", [])  # e.g. after a restart: not a second outcome
    assert value("tpufinetune_reconciles_total", phase="New") == before["New"] + 1
    assert value("tpufinetune_reconciles_total", phase="Running") == before["Running"] + 2
    assert value("tpufinetune_reconciles_total", phase="Succeeded") == before["Succeeded"] + 1
    assert value("tpufinetune_job_outcomes_total", outcome="Succeeded", reason="Succeeded") == succeeded + 1


def test_failures_are_counted_by_reason_and_retries_separately():
    failed = value("tpufinetune_job_outcomes_total", outcome="Failed", reason="TrainerFailed")
    retried = value("tpufinetune_job_outcomes_total", outcome="Retried", reason="Retrying")
    errors = value("tpufinetune_reconcile_errors_total", phase="Provisioning")
    metrics.stepped("Running", "Submitting", [("Warning", "Retrying")])
    metrics.stepped("Running", "Failed", [("Warning", "TrainerFailed")])
    metrics.step_failed("Provisioning")
    assert value("tpufinetune_job_outcomes_total", outcome="Retried", reason="Retrying") == retried + 1
    assert value("tpufinetune_job_outcomes_total", outcome="Failed", reason="TrainerFailed") == failed + 1
    assert value("tpufinetune_reconcile_errors_total", phase="Provisioning") == errors + 1


def test_resources_gauge_follows_what_the_watch_reports():
    metrics.seen("gauge-ns", "a", {})
    metrics.seen("gauge-ns", "b", {"phase": "Running"})
    new, running = value("tpufinetune_resources", phase="New"), value("tpufinetune_resources", phase="Running")
    metrics.seen("gauge-ns", "a", {"phase": "Running"})
    assert value("tpufinetune_resources", phase="New") == new - 1
    assert value("tpufinetune_resources", phase="Running") == running + 1
    metrics.forget("gauge-ns", "a")
    metrics.forget("gauge-ns", "b")
    assert value("tpufinetune_resources", phase="Running") == running - 1


def sample(metric: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(metric, labels)


def run_series(namespace: str) -> set[tuple[str, tuple]]:
    return {(s.name, tuple(sorted(s.labels.items()))) for family in REGISTRY.collect()
            for s in family.samples if s.name.startswith("tpufinetune_run_") and s.labels.get("namespace") == namespace}


def test_each_run_has_its_series_from_the_status_the_watch_saw_until_it_is_deleted():
    run = {"namespace": "runs-ns", "name": "ft"}
    metrics.seen("runs-ns", "ft", {"phase": "Provisioning", "attempt": 1})
    assert sample("tpufinetune_run_phase", **run, phase="Provisioning") == 1
    assert sample("tpufinetune_run_attempts", **run) == 1
    assert sample("tpufinetune_run_loss", **run) is None  # no value yet: no series, not a 0
    metrics.seen("runs-ns", "ft", {"phase": "Running", "attempt": 1, "progress": {
        "step": 10, "totalSteps": 40, "loss": 1.25, "tokensPerSecond": 512.0}, "usage": {"chipHours": 0.25}})
    assert sample("tpufinetune_run_phase", **run, phase="Provisioning") is None  # one phase series per run
    assert sample("tpufinetune_run_phase", **run, phase="Running") == 1
    assert sample("tpufinetune_run_loss", **run) == 1.25
    assert sample("tpufinetune_run_progress_ratio", **run) == 0.25
    assert sample("tpufinetune_run_tokens_per_second", **run) == 512.0
    assert sample("tpufinetune_run_chip_seconds", **run) == 900.0
    assert len(run_series("runs-ns")) == 7  # phase, attempts, step, ratio, loss, tokens/s, chip-seconds
    metrics.seen("runs-ns", "other", {"phase": "Pending"})
    metrics.forget("runs-ns", "ft")
    assert run_series("runs-ns") == {("tpufinetune_run_phase", (("name", "other"), ("namespace", "runs-ns"),
                                                                ("phase", "Pending")))}
    metrics.forget("runs-ns", "other")
    assert run_series("runs-ns") == set()


def test_per_run_series_can_be_turned_off_and_the_resources_gauge_stays():
    pending = value("tpufinetune_resources", phase="Pending")
    metrics.seen("off-ns", "ft", {"phase": "Pending", "attempt": 1})
    try:
        metrics.per_run(False)
        assert run_series("off-ns") == set()
        metrics.seen("off-ns", "ft", {"phase": "Pending", "attempt": 2})
        assert run_series("off-ns") == set()
        assert value("tpufinetune_resources", phase="Pending") == pending + 1
    finally:
        metrics.per_run(True)
    metrics.seen("off-ns", "ft", {"phase": "Pending", "attempt": 2})
    assert sample("tpufinetune_run_attempts", namespace="off-ns", name="ft") == 2
    metrics.forget("off-ns", "ft")


def test_queue_wait_is_observed_when_kueue_admits_a_run():
    count, total = value("tpufinetune_queue_wait_seconds_count"), value("tpufinetune_queue_wait_seconds_sum")
    queued = {"phase": "Queued", "phaseTransitionTime": "2026-01-01T10:00:00Z"}
    metrics.left_queue(queued, {"phase": "Queued", "phaseTransitionTime": "2026-01-01T10:00:00Z"})
    metrics.left_queue(queued, {"phase": "Provisioning", "phaseTransitionTime": "2026-01-01T11:30:00Z"})
    assert value("tpufinetune_queue_wait_seconds_count") == count + 1
    assert value("tpufinetune_queue_wait_seconds_sum") == total + 5400
    assert value("tpufinetune_queue_wait_seconds_bucket", le="7200.0") >= 1


def test_latency_from_apply_is_observed_once_per_resource():
    created = (datetime.now(timezone.utc) - timedelta(seconds=42)).strftime("%Y-%m-%dT%H:%M:%SZ")
    count = value("tpufinetune_apply_to_raycluster_seconds_count")
    total = value("tpufinetune_apply_to_raycluster_seconds_sum")
    metrics.cluster_created("uid-latency", created)
    metrics.cluster_created("uid-latency", created)  # created again after a suspension
    metrics.cluster_created("uid-other", None)  # no timestamp (the local runner)
    assert value("tpufinetune_apply_to_raycluster_seconds_count") == count + 1
    assert 41 <= value("tpufinetune_apply_to_raycluster_seconds_sum") - total < 60
    assert value("tpufinetune_apply_to_raycluster_seconds_bucket", le="60.0") >= 1


def test_the_endpoint_serves_prometheus_text():
    port = free_port()
    metrics.serve(port, address="127.0.0.1")
    metrics.stepped("Pending", "Provisioning", [("Normal", "CreatingCluster")])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'tpufinetune_reconciles_total{phase="Pending"}' in text
    assert "# TYPE tpufinetune_apply_to_job_submitted_seconds histogram" in text
    assert 'tpufinetune_resources{phase="Succeeded"}' in text
    assert "# TYPE tpufinetune_queue_wait_seconds histogram" in text
    assert "# TYPE tpufinetune_run_loss gauge" in text
