"""What a deployment depends on, for resources that never train, on the test ground with the
operator running as deploy/'s ServiceAccount (the `operator` fixture): the Argo CD health check
(deploy/argocd/health.lua, in a real Lua interpreter) reads the suspended, deleting and refused
objects watched live, and /metrics counts the refusal. The same checks of a run that trains
(no drift, every phase's health, /metrics moving with the run) ride on the finetune run of
test_operator_e2e.py.

TPUFT_CAPTURE_ARGOCD=1 also writes the watched objects to tests/deploy/testdata/argocd/.
"""

from __future__ import annotations

import urllib.request

import pytest

from harness import operator_deployment as deployment
from harness.nodeagent import pod_log_path
from harness.timing import within
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


def metrics_answer(pod: dict) -> bool:
    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9090/metrics", timeout=5) as response:
            return response.status == 200 and b"tpufinetune_" in response.read()
    except OSError:
        return False


def test_deploys_deployment_runs_two_replicas_that_lead_in_turn_from_their_own_token(operator, kube, ground):
    """deploy/base applied (harness/operator_deployment.py): the Deployment's two pods run the
    image Dockerfile.operator builds, from its entrypoint, with the ConfigMap's settings, the
    ServiceAccount's bound token (in-cluster config), the pod name from the downward API, and
    both listen on the same ports, each on its own address. Both become Ready by their
    readinessProbe and stand by while the session's operator holds the Lease; when it stops,
    a pod leads and drives runs; when that pod is deleted, another takes over at once (the
    Lease released on SIGTERM)."""
    cp = ground.cp
    objects = deployment.apply(cp)
    try:
        pods = deployment.wait_ready(cp, timeout=within(120))
        container = pods[0]["spec"]["containers"][0]
        assert not container.get("command"), "the image's own entrypoint runs"
        assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in container["volumeMounts"])
        assert all(metrics_answer(pod) for pod in pods), "each replica's /metrics on its own address, port 9090"
        assert deployment.lease_holder(cp) == "tpufinetune-operator-0"  # the session's operator still leads

        operator.stop()  # SIGTERM: it releases the Lease
        first = kube.wait_for(lambda: deployment.leading_pod(cp), "a pod holds the Lease", timeout=within(30))
        kube.apply(manifest("deployed-held", {"tpu": {"generation": "cpu", "topology": "1"}, "mode": "collectives",
                                              "image": "registry.example/t:1", "suspend": True}))
        kube.wait_for(lambda: kube.status("deployed-held").get("message", "").startswith("suspended"),
                      "the leading pod wrote the suspended run's status", timeout=within(60))

        cp.kubectl("-n", deployment.NAMESPACE, "delete", "pod", first, "--wait=false")
        def another_leader() -> str:  # the standby or the ReplicaSet's replacement: whichever asks first
            holder = deployment.leading_pod(cp)
            return holder if holder != first else ""
        second = kube.wait_for(another_leader, "another pod holds the Lease", timeout=within(30))
        kube.apply(manifest("deployed-refused", {"tpu": {"generation": "cpu", "topology": "1"}, "mode": "collectives",
                                                 "image": "registry.example/t:1", "workers": {"resources": {
                                                     "requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}}}))
        kube.kubectl("wait", "tpufinetune/deployed-refused", "--for=condition=Failed", "--timeout=60s", timeout=70)
        assert "exceeds the limit" in kube.status("deployed-refused")["message"]
        logs = pod_log_path(ground.workdir, deployment.NAMESPACE, second).read_text(errors="replace")
        assert "Forbidden" not in logs and "forbidden" not in logs, logs[-3000:]
    finally:
        deployment.remove(cp, objects)
        operator.start()
    kube.wait_for(lambda: deployment.lease_holder(cp) == "tpufinetune-operator-0",
                  "the session's operator leads again", timeout=within(30))
