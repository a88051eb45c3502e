"""Every query of a Grafana dashboard, run against a real Prometheus for one TPUFineTune run:
each must return series, and the run's own queries series of that run.

What a dashboard holds (reading only what Grafana itself would run):
- panels' targets, each with a PromQL `expr` (rows' nested `panels` and the older `rows`
  layout included); a target with `"instant": true` is an instant query at the window's
  end, any other a range query over the window, as Grafana runs them;
- template variables of type `query`: `label_values(label)`, `label_values(selector, label)`,
  `label_names()`, `metrics(regex)`, `query_result(expr)`, the query a string or an object
  with a `query` key (newer Grafana).

Variables are substituted as Grafana does for one selected value: `$var`, `${var}`,
`${var:format}`, `[[var]]`. The dashboard's own variables (`namespace`, `name`: the run's)
and Grafana's built-ins `$__rate_interval` (max(interval + scrape interval, 4 x scrape
interval), Grafana's rule), `$__interval`, `$__interval_ms`, `$__range`, `$__range_s`; any
other name is an error naming it (a `$1` of label_replace is left alone, as Grafana does).

A query that uses `$name` is run-scoped: every series it returns must carry the labels
`namespace` and `name` with the run's values (an aggregation that drops them fails: keep
`by (namespace, name)`). One that uses `$namespace` but not `$name` must not return
another namespace's series. A `namespace` variable must list the run's namespace, a `name`
variable the run's name.

`may_be_empty` names metrics the run cannot produce (with the reason, e.g. chip-seconds of a
run without chips): a target whose every tpufinetune_* metric is one of them (or its
_bucket/_sum/_count/_total) passes empty; it must still be accepted by Prometheus.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# Grafana's variable syntaxes: $var, [[var]] / [[var:format]], ${var} / ${var.field} / ${var:format}.
_VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")
RUN_LABELS = ("namespace", "name")


@dataclass(frozen=True)
class Query:
    """One query of the dashboard: where it is (`where`: the panel's title and the target's
    refId, or the variable), its kind ('target' or 'variable') and its text as written."""

    where: str
    kind: str
    expr: str
    instant: bool = False
    variable: str = ""  # a variable query's variable name


@dataclass
class Outcome:
    query: Query
    substituted: str
    series: list[dict] = field(default_factory=list)  # label sets (targets), or [{"value": v}] (variables)
    problems: list[str] = field(default_factory=list)
    note: str = ""  # why an empty answer passed

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        return (f"{self.query.where}: {self.query.expr!r} -> {self.substituted!r}: "
                f"{len(self.series)} series{'; ' + '; '.join(self.problems) if self.problems else ''}"
                f"{' (' + self.note + ')' if self.note else ''}")


def load(path: Path) -> dict:
    """The dashboard JSON at `path` (the file Grafana imports: the dashboard object itself, or
    one wrapped in {"dashboard": ...} as the HTTP API and some exports hold it)."""
    board = json.loads(Path(path).read_text())
    return board["dashboard"] if isinstance(board.get("dashboard"), dict) else board


def _panels(container: dict):
    """Every panel, depth first: `panels` (rows' nested panels included) and legacy `rows`."""
    for panel in container.get("panels") or []:
        yield panel
        yield from _panels(panel)
    for row in container.get("rows") or []:
        yield from _panels(row)


def queries(dashboard: dict) -> list[Query]:
    """Every query the dashboard runs: panel targets with an `expr`, then `query` variables."""
    found = []
    for panel in _panels(dashboard):
        title = panel.get("title") or f"panel {panel.get('id', '?')}"
        if panel.get("libraryPanel") and not panel.get("targets"):
            raise ValueError(f"panel {title!r} is a library panel; inline it so its queries can be checked")
        for target in panel.get("targets") or []:
            expr = target.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                continue
            instant = bool(target.get("instant")) and not target.get("range")
            found.append(Query(f"panel {title!r} target {target.get('refId', '?')}", "target", expr, instant))
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        query = query or variable.get("definition")
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"variable {variable.get('name')!r} is of type query but holds no query")
        found.append(Query(f"variable {variable.get('name')!r}", "variable", query, variable=variable.get("name", "")))
    return found


def grafana_builtins(start: float, end: float, step: float, scrape_interval_s: float) -> dict[str, str]:
    """Grafana's built-in variables for a range [start, end] queried at `step` seconds, with
    the data source's scrape interval."""
    def duration(seconds: float) -> str:
        return f"{int(round(seconds * 1000))}ms" if seconds < 1 or seconds != int(seconds) else f"{int(seconds)}s"

    rate_interval = max(step + scrape_interval_s, 4 * scrape_interval_s)
    return {"__rate_interval": duration(rate_interval), "__interval": duration(step),
            "__interval_ms": str(int(step * 1000)), "__range": duration(round(end - start)),
            "__range_s": str(int(round(end - start))), "__range_ms": str(int(round((end - start) * 1000)))}


def variables_used(expr: str) -> set[str]:
    names = set()
    for match in _VARIABLE.finditer(expr):
        name = match.group(1) or match.group(2) or match.group(4)
        if not name.isdigit():
            names.add(name)
    return names


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with every variable replaced by its value; ValueError naming an unknown one."""
    unknown = sorted(variables_used(expr) - set(values))
    if unknown:
        raise ValueError(f"unknown variable(s) {', '.join('$' + u for u in unknown)} in {expr!r}; "
                         f"known: {', '.join('$' + k for k in sorted(values))}")

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        return match.group(0) if name.isdigit() else values[name]

    return _VARIABLE.sub(replace, expr)


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<match>.*)\s*,\s*)?(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.S)
_LABEL_NAMES = re.compile(r"^\s*label_names\(\s*(?P<match>.*?)\s*\)\s*$", re.S)
_METRICS = re.compile(r"^\s*metrics\(\s*(?P<regex>.*?)\s*\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\(\s*(?P<expr>.*)\s*\)\s*$", re.S)


def variable_values(prometheus, query: str, start: float, end: float) -> list[str]:
    """What Grafana lists for a Prometheus `query` variable over [start, end]."""
    if m := _LABEL_VALUES.match(query):
        return sorted(prometheus.label_values(m["label"], match=m["match"] or None, start=start, end=end))
    if m := _LABEL_NAMES.match(query):
        return sorted(prometheus.api("labels", **{"match[]": [m["match"]] if m["match"] else None,
                                                  "start": start, "end": end}))
    if m := _METRICS.match(query):
        names = prometheus.label_values("__name__", start=start, end=end)
        return sorted(n for n in names if re.search(m["regex"], n))
    if m := _QUERY_RESULT.match(query):
        return [json.dumps(s) for s in prometheus.query(m["expr"], at=end)]
    raise ValueError(f"variable query {query!r} is none of label_values(), label_names(), metrics(), query_result()")


def project_metrics(expr: str) -> set[str]:
    """The project's metric names an expression reads."""
    return set(re.findall(r"\btpufinetune_\w+", expr))


def _allowed_empty(expr: str, may_be_empty: dict[str, str]) -> str:
    """The reason `expr` may return nothing ("" when it must return series)."""
    names = project_metrics(expr)
    reasons = []
    for metric in names:
        base = next((b for b in may_be_empty if metric == b or (metric.startswith(b + "_") and metric[len(b) + 1:]
                                                                 in ("bucket", "sum", "count", "total"))), None)
        if base is None:
            return ""
        reasons.append(may_be_empty[base])
    return "; ".join(sorted(set(reasons)))


def check(dashboard: dict, prometheus, namespace: str, name: str, start: float, end: float,
          step: float = 1.0, may_be_empty: dict[str, str] | None = None) -> list[Outcome]:
    """Every query of `dashboard` for the run `namespace`/`name`, over [start, end] (Unix
    seconds) on `prometheus` (harness.prometheus.Prometheus)."""
    found = queries(dashboard)
    if not found:
        raise ValueError("the dashboard holds no Prometheus query (no panel target with an expr, no query variable)")
    values = {"namespace": namespace, "name": name,
              **grafana_builtins(start, end, step, prometheus.interval_s)}
    outcomes = []
    for query in found:
        try:
            text = substitute(query.expr, values)
        except ValueError as error:
            outcomes.append(Outcome(query, query.expr, problems=[str(error)]))
            continue
        outcome = Outcome(query, text)
        outcomes.append(outcome)
        try:
            if query.kind == "variable":
                listed = variable_values(prometheus, text, start, end)
                outcome.series = [{"value": v} for v in listed]
                _check_variable(outcome, listed, values)
            else:
                result = (prometheus.query(text, at=end) if query.instant
                          else prometheus.query_range(text, start, end, step))
                outcome.series = [s["metric"] for s in result]
                allowed = _allowed_empty(query.expr, may_be_empty or {})
                if allowed and not outcome.series:
                    outcome.note = f"empty, allowed: {allowed}"
                else:
                    _check_target(outcome, query, namespace, name)
        except Exception as error:  # noqa: BLE001 - a refused query is an outcome to report
            outcome.problems.append(f"{type(error).__name__}: {error}")
    return outcomes


def _check_variable(outcome: Outcome, listed: list[str], values: dict[str, str]) -> None:
    if not listed:
        outcome.problems.append("lists no value")
    elif outcome.query.variable in RUN_LABELS and values[outcome.query.variable] not in listed:
        outcome.problems.append(f"does not list the run's {outcome.query.variable} "
                                f"{values[outcome.query.variable]!r} (lists {listed[:10]})")


def _check_target(outcome: Outcome, query: Query, namespace: str, name: str) -> None:
    if not outcome.series:
        outcome.problems.append("no series" + (" at the window's end (an instant query)" if query.instant else ""))
        return
    used = variables_used(query.expr)
    run = {"namespace": namespace, "name": name}
    for labels in outcome.series:
        if "name" in used:
            wrong = {k: labels.get(k) for k in RUN_LABELS if labels.get(k) != run[k]}
            if wrong:
                outcome.problems.append(f"run-scoped ($name) but a series is not the run's {run}: {labels} "
                                        "(keep the labels: `by (namespace, name)`)")
                return
        elif "namespace" in used and "namespace" in labels and labels["namespace"] != namespace:
            outcome.problems.append(f"uses $namespace but returns namespace {labels['namespace']!r}: {labels}")
            return


def assert_ok(outcomes: list[Outcome]) -> None:
    """AssertionError listing every query that failed (and how many passed)."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(outcomes)} dashboard queries failed:\n"
                             + "\n".join(f"- {o}" for o in failed))
