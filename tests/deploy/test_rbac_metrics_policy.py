"""The operator's own pods take connections only on the metrics port, and only from the
scraper's namespace (deploy/base/networkpolicy-metrics.yaml; the chart's
metrics.networkPolicy). The operator serves nothing else: it calls out."""

from __future__ import annotations

import subprocess

import pytest
from manifests import CHART, DEPLOY, documents, load

VALUES = load((CHART / "values.yaml").read_text())


def base(name: str) -> dict:
    return load((DEPLOY / "base" / name).read_text())


def test_the_base_admits_only_the_metrics_port_from_the_scrapers_namespace():
    policy, deployment = base("networkpolicy-metrics.yaml"), base("deployment.yaml")
    assert "networkpolicy-metrics.yaml" in base("kustomization.yaml")["resources"]
    pod = deployment["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert rule["ports"] == [{"protocol": "TCP", "port": ports["metrics"]}]
    assert ports["metrics"] == VALUES["metrics"]["port"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": VALUES["metrics"]["networkPolicy"]["namespace"]}}}]


def policies(helm, *values: str) -> list[dict]:
    out = subprocess.run([str(helm), "template", "tpufinetune", str(CHART), "--namespace", "ops", *values],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [o for o in documents(out.stdout) if o["kind"] == "NetworkPolicy"]


@pytest.mark.cluster
def test_the_chart_admits_the_configured_namespace_and_nothing_without_metrics(helm):
    (policy,) = policies(helm, "--set", "metrics.networkPolicy.namespace=monitoring", "--set", "metrics.port=9100")
    assert policy["metadata"]["namespace"] == "ops"
    assert policy["spec"]["ingress"] == [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": 9100}]}]
    (closed,) = policies(helm, "--set", "metrics.port=0")
    assert closed["spec"]["ingress"] == [] and closed["spec"]["policyTypes"] == ["Ingress"]
    assert policies(helm, "--set", "metrics.networkPolicy.enabled=false") == []
