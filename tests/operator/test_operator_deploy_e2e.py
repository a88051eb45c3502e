"""What a deployment depends on, for resources that never train, on the test ground with the
operator running as deploy/'s ServiceAccount (the `operator` fixture): the Argo CD health check
(deploy/argocd/health.lua, in a real Lua interpreter) reads the suspended, deleting and refused
objects watched live, and /metrics counts the refusal. The same checks of a run that trains
(no drift, every phase's health, /metrics moving with the run) ride on the finetune run of
test_operator_e2e.py.

TPUFT_CAPTURE_ARGOCD=1 also writes the watched objects to tests/deploy/testdata/argocd/.
"""

from __future__ import annotations

import pytest

from ground_runs import Watch, by_phase, capture, check_health, delta, scrape

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


def test_suspended_deleted_and_invalid_resources_report_their_health(operator, kube, ground):
    metrics_before = scrape(operator)
    watch = Watch(ground.cp, kube.ns)
    base = {"tpu": {"generation": "cpu", "topology": "1"}, "mode": "collectives", "image": "registry.example/t:1"}
    kube.apply(manifest("held", {**base, "suspend": True}))
    kube.wait_for(lambda: kube.status("held").get("message", "").startswith("suspended"), "suspended message")
    kube.kubectl("delete", "tpufinetune", "held", "--wait=true", "--timeout=60s", timeout=70)
    # Valid for the schema, refused by the operator: a request above its limit.
    kube.apply(manifest("refused", {**base, "workers": {"resources": {
        "requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}}}))
    kube.kubectl("wait", "tpufinetune/refused", "--for=condition=Failed", "--timeout=60s", timeout=70)
    objects = watch.stop()
    held, refused = by_phase(objects, "held"), by_phase(objects, "refused")

    assert {"Suspended", "Deleting"} <= set(held), sorted(held)
    assert "Failed" in refused, sorted(refused)
    assert "exceeds the limit" in refused["Failed"]["status"]["message"]
    check_health(held)
    check_health(refused)
    capture({"Suspended": held["Suspended"], "Deleting": held["Deleting"], "Failed": refused["Failed"]},
            {kube.ns: "ml-team"})

    after = scrape(operator)
    assert delta(metrics_before, after, "tpufinetune_job_outcomes_total", outcome="Failed", reason="InvalidSpec") == 1
    # A deleted run's series are gone; a failed one keeps its phase.
    assert not [key for key in after if key[0].startswith("tpufinetune_run_") and ("name", "held") in key[1]]
    assert after[("tpufinetune_run_phase", (("name", "refused"), ("namespace", kube.ns), ("phase", "Failed")))] == 1
    assert delta(metrics_before, after, "tpufinetune_apply_to_raycluster_seconds_count") == 0
