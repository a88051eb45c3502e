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
    metrics.seen("gauge-ns", "a", "")
    metrics.seen("gauge-ns", "b", "Running")
    new, running = value("tpufinetune_resources", phase="New"), value("tpufinetune_resources", phase="Running")
    metrics.seen("gauge-ns", "a", "Running")
    assert value("tpufinetune_resources", phase="New") == new - 1
    assert value("tpufinetune_resources", phase="Running") == running + 1
    metrics.forget("gauge-ns", "a")
    metrics.forget("gauge-ns", "b")
    assert value("tpufinetune_resources", phase="Running") == running - 1


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
