"""The Grafana dashboard (deploy/grafana/tpufinetune-dashboard.json) against a real
Prometheus (`make prometheus`) that scrapes the operator on the test ground every second
while one short cpu run goes to Succeeded: every query of every panel, and every query
variable, returns the series it should (harness/dashboard_check.py), and the run's series
hold what its status says. A metric or label renamed in the operator or the dashboard fails
here. (lm-eval on the ground: the Spot preemption run of test_node_failures_e2e.py.)

Prometheus scrapes the operator as the chart's ServiceMonitor does (tests/README.md: where
the ground differs from GKE): the target labels a Kubernetes scrape attaches (`namespace`
the operator's, `pod`, `service`, `container`, `endpoint`), with the metrics' own labels
honoured. It runs for this module only.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ground_runs import resource
from harness import dashboard_check
from harness.ground_fixtures import Kube, delete_namespace
from harness.service_account import bind_namespace
from harness.k8s_fixtures import namespace_name
from harness.prometheus import Prometheus

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tpufinetune-dashboard.json"
# Queries on the metrics every operator version serves: proves the check itself on the ground.
OPERATOR_FIXTURE = ROOT / "tests" / "deploy" / "testdata" / "grafana" / "operator-metrics-dashboard.json"
RUN = "dashboard-run"
# What the chart's ServiceMonitor scrape attaches (deploy/helm/tpufinetune/templates/
# servicemonitor.yaml, honorLabels: true; tests/deploy/test_helm_chart.py checks it).
# Metrics a cpu run cannot produce: a query on them alone may return nothing (it must still
# parse). Each with the reason; nothing else is excused.
MAY_BE_EMPTY = {
    "tpufinetune_chip_seconds": "TPU chip-seconds of ended attempts: a cpu run has no chips, so the counter "
                                "is never incremented and has no series",
    **{f"tpufinetune_run_{pairs}{figure}": "method dpo's figures: this run is SFT (the DPO run of "
                                           "test_node_failures_e2e.py reads them off /metrics)"
       for pairs in ("", "eval_")
       for figure in ("rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")},
}
# The run also answers its held-out prompts (training.evaluation.generate, a few short
# answers): the generation panels have the run's series.
GENERATE = {"examples": 4, "maxNewTokens": 8}
TARGET_LABELS = {"namespace": "tpufinetune-system", "pod": "tpufinetune-operator-0",
                 "service": "tpufinetune-operator-metrics", "container": "operator", "endpoint": "metrics"}


@dataclass(frozen=True)
class FinishedRun:
    prometheus: Prometheus
    namespace: str
    name: str
    start: float  # Unix seconds: just before it was applied, after a scrape
    end: float  # Prometheus has scraped the operator after Succeeded
    status: dict


@pytest.fixture(scope="module")
def prometheus(operator, tmp_path_factory):
    with Prometheus({"tpufinetune-operator": [operator.metrics_url]}, tmp_path_factory.mktemp("prometheus"),
                    labels=TARGET_LABELS, honor_labels=True) as server:
        server.wait_up("tpufinetune-operator")
        yield server


@pytest.fixture(scope="module")
def finished_run(request, ground, operator, prometheus, ground_assets) -> FinishedRun:
    """One short cpu run (the smallest the e2e tests run: 64 rows, one epoch) to Succeeded,
    in a namespace of its own, scraped all along."""
    namespace = namespace_name(request)
    bind_namespace(ground.cp, namespace, create=True)  # watched (t-*), and bound as the operator's namespaces are
    kube = Kube(ground, namespace)
    try:
        prometheus.wait_scraped()  # what the operator served before the run is in the TSDB at `start`
        start = time.time()
        kube.apply(resource(RUN, ground_assets, ground.gcs.unique_uri("runs", "dashboard"), epochs=1,
                            dataset={"split": "train[:64]"},
                            training={"maxSeqLen": 64, "evaluation": {"generate": GENERATE}}))
        kube.kubectl("wait", f"tpufinetune/{RUN}", "--for=condition=Succeeded", "--timeout=600s", timeout=620)
        prometheus.wait_scraped()
        yield FinishedRun(prometheus, namespace, RUN, start, time.time(), kube.status(RUN))
    finally:
        delete_namespace(ground, namespace)


def check(path: Path, run: FinishedRun) -> list[dashboard_check.Outcome]:
    outcomes = dashboard_check.check(dashboard_check.load(path), run.prometheus, run.namespace, run.name,
                                     run.start, run.end, may_be_empty=MAY_BE_EMPTY)
    print("\n".join(str(o) for o in outcomes))
    dashboard_check.assert_ok(outcomes)
    return outcomes


def values(series: list[dict]) -> list[float]:
    return [float(v) for s in series for _, v in s.get("values", [s.get("value")] if s.get("value") else [])]


def test_the_check_passes_on_the_metrics_every_operator_serves(finished_run):
    check(OPERATOR_FIXTURE, finished_run)
    prometheus, run = finished_run.prometheus, finished_run
    # The operator's own view of the run, as Prometheus kept it: a resource Running during
    # the run, one Succeeded at the end, the outcome counted.
    running = prometheus.query_range('tpufinetune_resources{phase="Running"}', run.start, run.end)
    assert max(values(running)) >= 1
    [succeeded] = prometheus.query('tpufinetune_resources{phase="Succeeded"}', at=run.end)
    assert float(succeeded["value"][1]) >= 1
    assert succeeded["metric"]["namespace"] == TARGET_LABELS["namespace"]  # the target's: the gauge has none
    outcome = 'sum(tpufinetune_job_outcomes_total{outcome="Succeeded"})'
    before = prometheus.query(outcome, at=run.start)
    after = prometheus.query(outcome, at=run.end)
    assert values(after)[0] - (values(before)[0] if before else 0) == 1


def test_every_query_of_the_dashboard_returns_the_runs_series(finished_run):
    if not DASHBOARD.is_file():
        pytest.fail(f"the dashboard {DASHBOARD.relative_to(ROOT)} is missing: this test checks every query in it "
                    "against the operator's metrics", pytrace=False)
    outcomes = check(DASHBOARD, finished_run)
    run_scoped = [o for o in outcomes if "name" in dashboard_check.variables_used(o.query.expr)]
    assert run_scoped, "no query of the dashboard selects the run ($name)"


def test_the_runs_series_hold_its_final_status(finished_run):
    prometheus, run = finished_run.prometheus, finished_run
    selector = f'namespace="{run.namespace}", name="{run.name}"'
    progress, history = run.status.get("progress") or {}, run.status.get("history") or []
    print(json.dumps({"progress": progress, "history": history}))
    # The trainer reports the loss every 30 s within an epoch (status.progress) and at each
    # epoch's end (status.history): a run this short may have only the latter.
    final_loss = progress.get("loss", history[-1].get("loss") if history else None)
    assert final_loss is not None and progress.get("step"), run.status

    def series(metric: str, **labels) -> list[dict]:
        matchers = "".join(f', {k}="{v}"' for k, v in labels.items())
        found = prometheus.query_range(f"{metric}{{{selector}{matchers}}}", run.start, run.end)
        assert found, f"no {metric} series for the run {run.namespace}/{run.name} over the run"
        return found

    loss = values(series("tpufinetune_run_loss"))
    assert any(math.isclose(v, final_loss, rel_tol=1e-9) for v in loss), (final_loss, sorted(set(loss)))
    assert max(values(series("tpufinetune_run_step"))) == progress["step"], progress
    succeeded = series("tpufinetune_run_phase", phase="Succeeded")
    assert values(succeeded)[-1] == 1, succeeded
    # The epoch's generation metrics, in status (the trainer's eval event, folded) and as series.
    generation = history[-1].get("eval") or {}
    assert 1 <= generation.get("examples", 0) <= GENERATE["examples"], history[-1]
    assert generation.get("samplesURI", "").endswith("/eval-samples/epoch-1.jsonl"), generation
    for metric, key in (("eval_exact_match", "exactMatch"), ("eval_rouge_l", "rougeL"), ("eval_bleu", "bleu")):
        assert values(series(f"tpufinetune_run_{metric}"))[-1] == pytest.approx(generation[key]), (metric, generation)
