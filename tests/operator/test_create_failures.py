"""Every failure to create a run's RayCluster is on the provisioning clock, against a real
kube-apiserver: not only a refusal (400, 403, 422: test_kube_faults.py) but any other
answer, such as the KubeRay CRD missing (404) or an admission webhook that fails (500,
as Kueue's RayCluster webhook would). While the run waits, its status names the API
server's answer, code and message; at the provisioning timeout it ends Failed with it.

Real parts: the kube-apiserver with the project's CRD, the operator's KubeBackend and
driver, and a real admission webhook (served here over TLS) that answers 500. The CRD
missing: the KubeRay CRD is shared by the session's other tests, so the backend asks for
a version of it that no CRD serves (ray.io/v0missing): the API server's answer is the
same 404 a missing CRD gives (no such group, version and resource).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from http.server import BaseHTTPRequestHandler

import pytest
import yaml

from harness.admission import serve_webhook
from harness.pki import write_pki
from run_helpers import RecordingBackend as Backend
from tpufinetune.adapters import kube
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.settings import Settings

pytestmark = [pytest.mark.cluster]
WEBHOOK_FAILS = "the test's RayCluster webhook is down"


def apply_run(kubectl, namespace: str) -> dict:
    manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "uncreated"},
                "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                         "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
    return json.loads(kubectl("-n", namespace, "get", "tpufinetune", "uncreated", "-o", "json").stdout)


def drive_to_the_end(k8s_api, namespace: str, body: dict) -> tuple[list[dict], Backend]:
    """Steps the run (provisioning timeout 4 s) until it ends: each step's status."""
    settings = Settings(poll_interval=1, provision_timeout=4, operator_namespace=namespace)  # the signing key
    backend = Backend(k8s_api, settings)
    run = Run(body, backend, RayJobs(), settings)

    async def drive() -> list[dict]:
        seen = []
        for _ in range(30):  # a bound, not a pace
            decision = await run.step()  # used to raise the API server's answer, for ever
            seen.append(json.loads(json.dumps(decision.status)))
            if decision.phase in phases.TERMINAL:
                break
            await asyncio.sleep(0.5)
        return seen

    return asyncio.run(drive()), backend


def assert_waited_then_failed(seen: list[dict], backend: Backend, *answer: str) -> None:
    phases_seen = [s.get("phase") for s in seen]
    assert phases.PROVISIONING in phases_seen and phases_seen[-1] == phases.FAILED, phases_seen
    waiting = [s for s in seen if s.get("phase") == phases.PROVISIONING]
    shown = (cond.find(waiting[-1], cond.CLUSTER_READY) or {}).get("message", "")
    assert all(part in shown for part in answer), shown  # while it waits, status names the answer
    failed = cond.find(seen[-1], cond.FAILED)
    assert failed["reason"] == "ProvisioningTimeout", failed
    assert all(part in failed["message"] for part in answer), failed["message"]
    events = [message for reason, message in backend.events if reason == "CreateRefused"]
    assert len(events) == 1 and all(part in events[0] for part in answer), backend.events


@pytest.mark.timeout(120)
def test_a_create_answered_404_the_raycluster_crd_missing_fails_at_the_provisioning_timeout(
        control_plane, k8s_api, namespace, monkeypatch):
    body = apply_run(control_plane.kubectl, namespace)
    monkeypatch.setattr(kube, "RAY_VERSION", "v0missing")  # no CRD serves it: see the module
    seen, backend = drive_to_the_end(k8s_api, namespace, body)
    assert_waited_then_failed(seen, backend, "404", "Not Found")


class FailingWebhook:
    """An admission webhook that answers every review 500 (a webhook that is down)."""

    def __init__(self, pki):
        self.calls = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                hook.calls += 1
                text = WEBHOOK_FAILS.encode()
                self.send_response(500)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args):
                pass

        self.server, self.url = serve_webhook(Handler, pki, "validate")

    def stop(self):
        self.server.shutdown()


def failing_webhook(name: str, namespace: str, url: str, ca: bytes) -> dict:
    """RayCluster creates in `namespace` go to the webhook at `url`; its failure fails them."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": "fail.test.tpufinetune.dev", "sideEffects": "None",
                          "admissionReviewVersions": ["v1"],
                          "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
                          "rules": [{"apiGroups": ["ray.io"], "apiVersions": ["*"], "operations": ["CREATE"],
                                     "resources": ["rayclusters"], "scope": "Namespaced"}],
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                          "timeoutSeconds": 5, "failurePolicy": "Fail"}]}


PROBE = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "probe"},
         "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
             "containers": [{"name": "ray-head", "image": "registry.example/t:1"}]}}}}}


@pytest.mark.timeout(120)
def test_a_create_answered_500_by_a_failing_webhook_fails_at_the_provisioning_timeout(
        control_plane, kuberay_crd, k8s_api, namespace, tmp_path):
    kubectl = control_plane.kubectl
    write_pki(tmp_path)
    webhook = FailingWebhook(tmp_path)
    name = f"fail-rayclusters-{namespace}"[:63]
    kubectl("apply", "-f", "-", input=yaml.safe_dump(
        failing_webhook(name, namespace, webhook.url, (tmp_path / "ca.crt").read_bytes())))
    try:
        deadline = time.monotonic() + 30  # the configuration reaches admission a moment later
        while "failed calling webhook" not in kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-",
                                                      input=yaml.safe_dump(PROBE), check=False).stderr:
            assert time.monotonic() < deadline, "the webhook never took effect"
            time.sleep(0.5)
        body = apply_run(kubectl, namespace)
        seen, backend = drive_to_the_end(k8s_api, namespace, body)
    finally:
        kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found", "--wait=false")
        webhook.stop()
    assert_waited_then_failed(seen, backend, "500", "failed calling webhook")
    assert kubectl("-n", namespace, "get", "rayclusters", "-o", "name").stdout.strip() == ""


@pytest.mark.timeout(120)
def test_a_namesakes_raycluster_without_our_label_is_not_taken_as_created_nor_created_again_and_again(
        control_plane, kuberay_crd, k8s_api, namespace, monkeypatch):
    """A RayCluster of the run's name that is not the run's (no owner of ours, no name
    label: the watch does not see it) answers the create 409: that is no cluster of ours.
    The run waits for it to go (shown, NotOwned, on the provisioning clock), asking the
    API server for it rather than creating again each time the watch misses it."""
    kubectl = control_plane.kubectl
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump({**PROBE, "metadata": {"name": "tft-uncreated"}}))
    monkeypatch.setattr(kube, "CREATED_GRACE_S", 0.5)  # the watch's grace for a new cluster, shortened
    body = apply_run(kubectl, namespace)
    settings = Settings(poll_interval=1, provision_timeout=4, operator_namespace=namespace, namespace=namespace)
    watches = kube.Watches(k8s_api, settings, lambda *change: None)
    backend = Backend(k8s_api, settings, watches)
    creates = []
    real_create = backend.objects.create_namespaced_custom_object

    def counted(*args, **kwargs):  # the real call, counted
        creates.append(args[3])
        return real_create(*args, **kwargs)

    backend.objects.create_namespaced_custom_object = counted
    run = Run(body, backend, RayJobs(), settings)
    watches.start()

    async def drive() -> list[dict]:
        seen = []
        for _ in range(30):
            decision = await run.step()
            seen.append(json.loads(json.dumps(decision.status)))
            if decision.phase in phases.TERMINAL:
                break
            await asyncio.sleep(0.5)
        return seen

    try:
        seen = asyncio.run(drive())
    finally:
        watches.stop()
    assert creates.count("rayclusters") == 1, creates
    assert seen[-1]["phase"] == phases.FAILED
    failed = cond.find(seen[-1], cond.FAILED)
    assert failed["reason"] == "ProvisioningTimeout" and "not owned by this TPUFineTune" in failed["message"], failed
