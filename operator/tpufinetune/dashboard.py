"""Generate the Grafana dashboard from the metrics the operator exports (`make dashboards`).

Usage: `python -m tpufinetune.dashboard --out deploy/`. It writes the same JSON twice,
because kustomize and Helm each read files only below their own root:
grafana/tpufinetune-dashboard.json (deploy/grafana, which the Prometheus overlay installs as
a ConfigMap) and helm/tpufinetune/dashboards/tpufinetune-dashboard.json (the chart's
metrics.grafanaDashboard). tests/deploy/test_dashboard.py checks both against this module.

The queries use only the template variables $namespace and $name (picked from
tpufinetune_run_phase) and Grafana's $__rate_interval; the Prometheus data source is the
dashboard's `datasource` variable, so it imports into any Grafana.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tpufinetune.core import runmetrics

UID = "tpufinetune"
FILENAME = "tpufinetune-dashboard.json"
PATHS = (Path("grafana") / FILENAME, Path("helm") / "tpufinetune" / "dashboards" / FILENAME)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'namespace="$namespace", name=~"$name"'
WIDTH = 24


def run_metric(short: str) -> str:
    """A per-run series of the selected runs; the name must be one runmetrics exports."""
    metric = runmetrics.PREFIX + short
    if metric != runmetrics.PHASE and metric not in runmetrics.GAUGES:
        raise KeyError(f"{metric} is not a per-run metric (core/runmetrics.py)")
    return f"{metric}{{{RUN}}}"


def quantiles(histogram: str, legend: str, by: str = "") -> list[tuple[str, str]]:
    """The median and p95 of `histogram`, one series per value of the label `by` (if any)."""
    rate = f"sum by ({', '.join(filter(None, ('le', by)))}) (rate({histogram}_bucket[$__rate_interval]))"
    return [(f"histogram_quantile({q}, {rate})", f"{legend} p{int(q * 100)}") for q in (0.5, 0.95)]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          width: int = 12, height: int = 8, description: str = "", **options) -> dict:
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options,
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend, **({"instant": True, "format": "table"} if kind == "table" else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": WIDTH, "h": 1}}


def sections() -> list[dict]:
    runs = "{{namespace}}/{{name}}"
    return [
        row("Runs"),
        panel("Runs by phase", [("sum by (phase) (tpufinetune_resources)", "{{phase}}")], kind="bargauge",
              description="TPUFineTunes the operator watches, by status.phase (every namespace).",
              orientation="horizontal", displayMode="basic"),
        panel("Phase of the selected runs", [(f"{run_metric('phase')} == 1", "")], kind="table",
              description="status.phase of each run picked above."),
        row("Training"),
        panel("Loss", [(run_metric("loss"), f"{runs} loss"), (run_metric("eval_loss"), f"{runs} eval loss")],
              description="Training loss of the last progress window, and the last evaluation's loss."),
        panel("Learning rate", [(run_metric("learning_rate"), runs)], unit="none"),
        panel("Throughput", [(run_metric("tokens_per_second"), runs)], unit="none",
              description="Training tokens per second."),
        panel("Step time", [(run_metric("step_time_seconds"), runs)], unit="s",
              description="Mean seconds per optimizer step."),
        row("Quality"),
        panel("Preference accuracy (dpo)", [(run_metric("preference_accuracy"), f"{runs} training pairs"),
                                            (run_metric("eval_preference_accuracy"), f"{runs} held-out pairs")],
              unit="percentunit", width=8,
              description="Method dpo: share of pairs whose chosen response has the higher reward, last epoch."),
        panel("Reward margin (dpo)", [(run_metric("reward_margin"), f"{runs} training pairs"),
                                      (run_metric("eval_reward_margin"), f"{runs} held-out pairs")],
              unit="none", width=8, description="Method dpo: mean chosen minus rejected reward, last epoch."),
        panel("Rewards (dpo)", [(run_metric(f"{pairs}rewards_{side}"), f"{runs} {side}, {label}")
                                for pairs, label in (("", "training"), ("eval_", "held-out"))
                                for side in ("chosen", "rejected")],
              unit="none", width=8,
              description="Method dpo: mean beta x (policy - reference) log-probability per response, last epoch."),
        panel("Generation", [(run_metric("eval_exact_match"), f"{runs} exact match"),
                             (run_metric("eval_rouge_l"), f"{runs} ROUGE-L")],
              unit="percentunit", width=12,
              description="training.evaluation.generate: held-out answers scored against their responses."),
        panel("BLEU", [(run_metric("eval_bleu"), runs)], unit="none", width=12,
              description="training.evaluation.generate: corpus BLEU (0 to 100) of the held-out answers."),
        row("Progress and cost"),
        panel("Progress", [(run_metric("progress_ratio"), runs)], unit="percentunit", width=8,
              description="Optimizer steps done of those planned."),
        panel("ETA", [(run_metric("eta_seconds"), runs)], unit="s", kind="stat", width=8,
              description="Estimated training time left."),
        panel("Epoch and step", [(run_metric("epoch"), f"{runs} epoch"), (run_metric("step"), f"{runs} step")],
              kind="stat", width=8),
        panel("Attempts", [(run_metric("attempts"), runs)], kind="stat",
              description="Attempts so far (retries, evictions and cluster losses each start one)."),
        panel("Chip-hours", [(f"{run_metric('chip_seconds')} / 3600", runs)], unit="none",
              description="TPU chips x hours the run's slices were held so far (status.usage)."),
        row("Operator"),
        panel("Reconcile errors", [
            ("sum by (phase) (rate(tpufinetune_reconcile_errors_total[$__rate_interval]))", "{{phase}}")],
              unit="ops", width=8, description="Reconcile steps that raised (retried), per second."),
        panel("Apply to RayCluster", quantiles("tpufinetune_apply_to_raycluster_seconds", "apply to RayCluster"),
              unit="s", width=8, description="Seconds from a TPUFineTune's creation to its RayCluster."),
        panel("Queue wait (Kueue)", quantiles("tpufinetune_queue_wait_seconds", "queued"), unit="s", width=8,
              description="Seconds runs with spec.queueName waited before Kueue admitted them."),
        panel("Time to first step", quantiles("tpufinetune_time_to_first_step_seconds", "{{attempt_kind}}",
                                              by="attempt_kind"), unit="s", width=8,
              description="Seconds from an attempt's start to its trainer's first optimizer step, first "
                          "attempts and retries apart (status.attempts[].startup says where the time went)."),
    ]


def layout(items: list[dict]) -> list[dict]:
    """Place panels left to right, wrapping at the grid's width; ids in order."""
    x = y = height = 0
    for number, item in enumerate(items, start=1):
        grid = item["gridPos"]
        if x + grid["w"] > WIDTH or item["type"] == "row":
            x, y, height = 0, y + height, 0
        grid.update(x=x, y=y)
        item["id"] = number
        x, height = x + grid["w"], max(height, grid["h"])
        if item["type"] == "row":
            x, y, height = 0, y + grid["h"], 0
    return items


def variable(name: str, label: str, query: str, multi: bool) -> dict:
    return {
        "type": "query", "name": name, "label": label, "datasource": DATASOURCE,
        "query": query, "definition": query, "refresh": 2, "sort": 1,
        "multi": multi, "includeAll": multi, **({"allValue": ".+"} if multi else {}),
        "current": {}, "options": [], "hide": 0,
    }


def dashboard() -> dict:
    phase = runmetrics.PHASE
    return {
        "uid": UID, "title": "TPUFineTune", "tags": ["tpufinetune", "tpu", "ray"],
        "description": "Fine-tuning runs (loss, throughput, progress, cost) and the TPUFineTune operator.",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "timezone": "browser",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "options": [], "refresh": 1},
            variable("namespace", "Namespace", f"label_values({phase}, namespace)", multi=False),
            variable("name", "Run", f'label_values({phase}{{namespace="$namespace"}}, name)', multi=True),
        ]},
        "panels": layout(sections()),
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpufinetune.dashboard",
                                     description="Write the Grafana dashboard under deploy/.")
    parser.add_argument("--out", type=Path, required=True, help="the deploy/ directory")
    args = parser.parse_args(argv)
    text = dashboard_json()
    for relative in PATHS:
        path = args.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
