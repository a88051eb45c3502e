"""harness/prometheus.py and harness/dashboard_check.py against the real Prometheus (`make
prometheus`), scraping a prometheus_client registry served here: each kind of broken
dashboard query (a renamed metric, run labels aggregated away, another run's series, a
variable that lists nothing, a query that does not parse) fails, a sound one passes. The
ground test (tests/operator/test_dashboard_e2e.py) runs the project's dashboard the same way
against the operator."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from harness import dashboard_check
from harness.ports import free_port
from harness.prometheus import Prometheus, PrometheusError

pytestmark = pytest.mark.cluster  # a built binary of its own (like the GCS emulator's tests), no control plane

RUN = {"namespace": "ml", "name": "run-a"}


@pytest.fixture(scope="module")
def served():
    """A registry on a free loopback port: two runs in `ml`, one of the same name in `other`."""
    registry = CollectorRegistry()
    loss = Gauge("tpufinetune_run_loss", "Loss.", ["namespace", "name"], registry=registry)
    for namespace, name, value in (("ml", "run-a", 1.25), ("ml", "run-b", 2.5), ("other", "run-a", 3.0)):
        loss.labels(namespace, name).set(value)
    steps = Counter("tpufinetune_steps", "Steps.", ["namespace", "name"], registry=registry)
    steps.labels("ml", "run-a").inc(7)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(5)


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    with Prometheus({"app": [served]}, tmp_path_factory.mktemp("prometheus"),
                    labels={"namespace": "tpufinetune-system", "pod": "app-0"}, honor_labels=True) as server:
        server.wait_up("app")
        server.wait_scraped()
        yield server


def target(title: str, expr: str, **extra) -> dict:
    return {"title": title, "targets": [{"refId": "A", "expr": expr, **extra}]}


def test_queries_return_what_was_scraped_with_the_target_labels(prometheus):
    [series] = prometheus.query('tpufinetune_run_loss{namespace="ml", name="run-a"}')
    assert series["metric"]["job"] == "app" and series["metric"]["pod"] == "app-0"
    assert float(series["value"][1]) == 1.25
    now = time.time()
    [ranged] = prometheus.query_range('tpufinetune_steps_total{name="run-a"}', now - 5, now, 1)
    assert {float(v) for _, v in ranged["values"]} == {7.0}
    assert prometheus.label_values("namespace", match="tpufinetune_run_loss") == ["ml", "other"]
    assert len(prometheus.series('{__name__=~"tpufinetune_run_.*"}', now - 5, now)) == 3
    with pytest.raises(PrometheusError, match="bad_data"):
        prometheus.query("sum(")


def test_without_honor_labels_the_target_namespace_wins(served, tmp_path):
    """What a ServiceMonitor without honorLabels does to a metric's own `namespace`."""
    with Prometheus({"app": [served]}, tmp_path, labels={"namespace": "tpufinetune-system"}) as server:
        server.wait_up("app")
        [series] = server.query('tpufinetune_run_loss{exported_namespace="ml", name="run-a"}')
        assert series["metric"]["namespace"] == "tpufinetune-system"


def test_sound_queries_pass_and_every_broken_one_fails_naming_why(prometheus):
    board = {
        "panels": [
            target("loss", 'tpufinetune_run_loss{namespace="$namespace", name="$name"}'),
            target("steps", 'sum by (namespace, name) (rate(tpufinetune_steps_total{namespace="$namespace", '
                            'name="$name"}[$__rate_interval]))'),
            target("namespace loss", 'max by (name) (tpufinetune_run_loss{namespace="$namespace"})', instant=True),
            target("renamed", 'tpufinetune_run_losses{namespace="$namespace", name="$name"}'),
            target("aggregated", 'max(tpufinetune_run_loss{namespace="$namespace", name="$name"})'),
            target("any namespace", 'tpufinetune_run_loss{name="$name"}'),
            target("other namespace", 'tpufinetune_run_loss{namespace!="$namespace"}'),
            target("broken", 'sum(tpufinetune_run_loss{name="$name"}'),
            target("unknown variable", 'tpufinetune_run_loss{cluster="$cluster"}'),
            target("allowed empty", 'sum(rate(tpufinetune_chips_total{namespace="$namespace"}[$__rate_interval]))'),
            target("not all allowed", 'tpufinetune_chips_total or tpufinetune_run_losses{name="$name"}'),
            target("allowed broken", 'sum(tpufinetune_chips_total'),
        ],
        "templating": {"list": [
            {"name": "namespace", "type": "query", "query": "label_values(tpufinetune_run_loss, namespace)"},
            {"name": "name", "type": "query",
             "query": {"query": 'label_values(tpufinetune_run_loss{namespace="$namespace"}, name)'}},
            {"name": "metric", "type": "query", "query": "metrics(tpufinetune_run_.*)"},
            {"name": "nothing", "type": "query", "query": 'label_values(tpufinetune_run_loss{namespace="none"}, name)'},
        ]},
    }
    end = time.time()
    outcomes = {o.query.where: o for o in dashboard_check.check(
        board, prometheus, **RUN, start=end - 10, end=end, may_be_empty={"tpufinetune_chips": "no chips here"})}
    assert {w for w, o in outcomes.items() if o.ok} == {
        "panel 'loss' target A", "panel 'steps' target A", "panel 'namespace loss' target A",
        "panel 'allowed empty' target A", "variable 'namespace'", "variable 'name'", "variable 'metric'"}
    assert outcomes["panel 'allowed empty' target A"].note == "empty, allowed: no chips here"
    problems = {w: " ".join(o.problems) for w, o in outcomes.items() if not o.ok}
    assert "no series" in problems["panel 'renamed' target A"]
    assert "keep the labels" in problems["panel 'aggregated' target A"]
    assert "not the run's" in problems["panel 'any namespace' target A"]
    assert "returns namespace 'other'" in problems["panel 'other namespace' target A"]
    assert "PrometheusError" in problems["panel 'broken' target A"]
    assert "unknown variable(s) $cluster" in problems["panel 'unknown variable' target A"]
    assert "lists no value" in problems["variable 'nothing'"]
    assert "no series" in problems["panel 'not all allowed' target A"]
    assert "PrometheusError" in problems["panel 'allowed broken' target A"]
    with pytest.raises(AssertionError, match="9 of 16 dashboard queries failed"):
        dashboard_check.assert_ok(list(outcomes.values()))
    # The substituted text is what ran.
    assert outcomes["panel 'steps' target A"].substituted.endswith('name="run-a"}[4s]))')
    assert not math.isnan(float(prometheus.query('tpufinetune_run_loss{name="run-b"}')[0]["value"][1]))
