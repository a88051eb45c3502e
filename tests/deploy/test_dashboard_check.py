"""harness/dashboard_check.py without a server: which queries a Grafana dashboard runs, and
how its variables become PromQL (the ground test, tests/operator/test_dashboard_e2e.py, runs
them against a real Prometheus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import dashboard_check
from harness.dashboard_check import grafana_builtins, queries, substitute, variables_used

FIXTURE = Path(__file__).resolve().parent / "testdata" / "grafana" / "operator-metrics-dashboard.json"


def test_every_target_and_query_variable_is_found_nested_rows_included():
    found = queries(dashboard_check.load(FIXTURE))
    assert [(q.where, q.kind, q.instant) for q in found] == [
        ("panel 'Resources by phase' target A", "target", False),
        ("panel 'Succeeded now' target A", "target", True),
        ("panel 'Reconcile steps' target A", "target", False),  # inside the collapsed row
        ("panel 'Reconcile steps' target B", "target", True),
        ("panel 'Apply to RayCluster, p90' target A", "target", False),
        ("panel 'Runs that succeeded' target A", "target", True),
        ("variable 'phase'", "variable", False),  # the object form of newer Grafana
    ]
    assert found[-1].expr == "label_values(tpufinetune_resources, phase)"
    assert found[-1].variable == "phase"


def test_legacy_rows_wrapped_dashboards_and_string_variable_queries():
    board = {"dashboard": {
        "rows": [{"panels": [{"title": "old", "targets": [{"refId": "A", "expr": "up"}, {"refId": "B"}]}]}],
        "templating": {"list": [{"name": "name", "type": "query", "query": "label_values(x{namespace=\"$namespace\"}, name)"},
                                {"name": "ns", "type": "custom", "query": "a,b"}]},
    }}
    found = queries(board["dashboard"])
    assert [(q.where, q.expr) for q in found] == [
        ("panel 'old' target A", "up"),  # a target without an expr (another data source) is not a query
        ("variable 'name'", "label_values(x{namespace=\"$namespace\"}, name)"),
    ]


def test_a_dashboard_without_queries_or_with_an_empty_query_variable_is_refused():
    with pytest.raises(ValueError, match="variable 'name' is of type query but holds no query"):
        queries({"templating": {"list": [{"name": "name", "type": "query", "query": {"refId": "A"}}]}})
    with pytest.raises(ValueError, match="library panel"):
        queries({"panels": [{"title": "shared", "libraryPanel": {"uid": "x"}}]})


def test_every_grafana_variable_syntax_is_substituted_and_label_replace_groups_kept():
    values = {"namespace": "ml", "name": "run-1", "__rate_interval": "4s"}
    expr = ('label_replace(rate(m{namespace="$namespace", name=~"${name}", x="[[name]]", '
            'y="${name:regex}"}[$__rate_interval]), "dst", "$1", "src", "(.*)")')
    assert variables_used(expr) == {"namespace", "name", "__rate_interval"}
    assert substitute(expr, values) == ('label_replace(rate(m{namespace="ml", name=~"run-1", x="run-1", '
                                        'y="run-1"}[4s]), "dst", "$1", "src", "(.*)")')


def test_an_unknown_variable_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown variable\(s\) \$cluster in .*known: \$name"):
        substitute('m{cluster="$cluster", name="$name"}', {"name": "x"})


def test_grafana_builtins_follow_grafanas_rate_interval_rule():
    # max(interval + scrape interval, 4 x scrape interval)
    assert grafana_builtins(0, 120, step=1, scrape_interval_s=1)["__rate_interval"] == "4s"
    assert grafana_builtins(0, 3600, step=15, scrape_interval_s=1)["__rate_interval"] == "16s"
    builtins = grafana_builtins(100, 220.4, step=0.5, scrape_interval_s=1)
    assert builtins["__range"] == "120s" and builtins["__range_s"] == "120"
    assert builtins["__interval"] == "500ms" and builtins["__interval_ms"] == "500"
