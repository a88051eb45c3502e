"""The Grafana dashboard (operator/tpufinetune/dashboard.py, `make dashboards`): both shipped
copies are the generator's output, every query names a metric the operator exports and only
the variables the dashboard defines, and the run picker reads the per-run phase series."""

from __future__ import annotations

import json
import re

import pytest
from manifests import DEPLOY
from prometheus_client import REGISTRY

from tpufinetune import dashboard
from tpufinetune.adapters import metrics  # noqa: F401  (registers what /metrics exports)
from tpufinetune.core import runmetrics

VARIABLES = {"namespace", "name", "__rate_interval"}


def exprs(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_metrics() -> set[str]:
    """The series names /metrics can hold, whether or not a label set was used yet."""
    return {family.name + suffix for family in REGISTRY.collect() for suffix in SUFFIXES.get(family.type, ())}


@pytest.mark.parametrize("relative", dashboard.PATHS, ids=str)
def test_the_shipped_dashboard_is_the_generators_output(relative):
    path = DEPLOY / relative
    assert path.exists(), "run `make dashboards`"
    assert path.read_text() == dashboard.dashboard_json(), (
        f"{path} is stale: run `make dashboards` (python -m tpufinetune.dashboard --out deploy/)")


def test_the_generator_writes_every_copy(tmp_path):
    assert dashboard.main(["--out", str(tmp_path)]) == 0
    for relative in dashboard.PATHS:
        assert json.loads((tmp_path / relative).read_text())["uid"] == "tpufinetune"


def test_every_query_names_an_exported_metric_and_only_defined_variables():
    board = dashboard.dashboard()
    exported = exported_metrics()
    queries = exprs(board) + [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    for expr in queries:
        for metric in re.findall(r"\btpufinetune_\w+", expr):
            assert metric in exported, f"{metric} in {expr!r} is not on /metrics"
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= VARIABLES, expr
    shown = {m for e in exprs(board) for m in re.findall(r"\btpufinetune_run_\w+", e)}
    assert shown == set(runmetrics.GAUGES) | {runmetrics.PHASE}  # every per-run metric has a panel


def test_the_run_picker_lists_runs_from_the_phase_series():
    variables = {v["name"]: v for v in dashboard.dashboard()["templating"]["list"]}
    assert variables["namespace"]["query"] == "label_values(tpufinetune_run_phase, namespace)"
    assert variables["name"]["query"] == 'label_values(tpufinetune_run_phase{namespace="$namespace"}, name)'
    assert variables["datasource"]["query"] == "prometheus"


def test_panels_cover_runs_training_cost_and_operator_health_without_overlapping():
    board = dashboard.dashboard()
    titles = {p["title"] for p in board["panels"]}
    assert {"Runs by phase", "Loss", "Throughput", "Step time", "Progress", "ETA", "Attempts", "Chip-hours",
            "Reconcile errors", "Apply to RayCluster", "Queue wait (Kueue)", "Time to first step"} <= titles
    (first_step,) = [p for p in board["panels"] if p["title"] == "Time to first step"]
    assert [t["legendFormat"] for t in first_step["targets"]] == ["{{attempt_kind}} p50", "{{attempt_kind}} p95"]
    assert all("sum by (le, attempt_kind) (rate(tpufinetune_time_to_first_step_seconds_bucket" in t["expr"]
               for t in first_step["targets"])
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
    assert [p["id"] for p in board["panels"]] == list(range(1, len(board["panels"]) + 1))


def test_a_metric_that_is_not_per_run_is_refused():
    with pytest.raises(KeyError, match="tpufinetune_run_los is not a per-run metric"):
        dashboard.run_metric("los")
