"""The Kubernetes side of a run under refusals, against a real kube-apiserver: a
RayCluster that admission refuses (a ValidatingAdmissionPolicy, as a webhook, a quota or
a policy would) is shown with the API server's words and fails the run once the
provisioning timeout has passed.

Real parts: the kube-apiserver with the KubeRay CRD and the project's CRD, the operator's
KubeBackend and driver. No KubeRay and no Ray: the cluster is never created.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import yaml

from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.settings import Settings

pytestmark = [pytest.mark.cluster]
REFUSAL = "RayClusters are refused by the test's admission policy"


def refuse_rayclusters(namespace: str) -> list[dict]:
    name = f"refuse-rayclusters-{namespace}"
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{
                      "apiGroups": ["ray.io"], "apiVersions": ["*"], "operations": ["CREATE"],
                      "resources": ["rayclusters"]}]},
                  "validations": [{"expression": "false", "message": REFUSAL}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ]


def wait_until_refused(kubectl, namespace: str, timeout: float = 30) -> None:
    """A policy reaches the admission plugin a moment after it is applied: probe with a
    server-side dry run (admission runs, nothing is stored) until it refuses."""
    probe = yaml.safe_dump({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "probe"},
                            "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
                                "containers": [{"name": "ray-head", "image": "registry.example/t:1"}]}}}}})
    deadline = time.monotonic() + timeout
    while REFUSAL not in kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-", input=probe,
                                 check=False).stderr:
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.5)


class Backend(KubeBackend):
    """The operator's KubeBackend; its Events go to a list (kopf posts them only from
    inside a running operator)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, str]] = []

    def record(self, ident, type_, reason, message):
        self.events.append((reason, message))


def test_a_refused_raycluster_says_why_and_fails_after_the_provisioning_timeout(
        control_plane, kuberay_crd, k8s_api, namespace):
    kubectl = control_plane.kubectl
    policy = yaml.safe_dump_all(refuse_rayclusters(namespace))
    kubectl("apply", "-f", "-", input=policy)
    try:
        wait_until_refused(kubectl, namespace)
        manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "refused"},
                    "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                             "checkpoint": {"storagePath": "/tmp/unused"}}}
        kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
        body = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "refused", "-o", "json").stdout)
        settings = Settings(poll_interval=1, provision_timeout=4)
        backend = Backend(k8s_api, settings)
        run = Run(body, backend, RayJobs(), settings)

        async def drive() -> list[str]:
            seen = []
            for _ in range(30):  # a bound, not a pace: each step is one create the server refuses
                decision = await run.step()  # used to raise the refusal on every step, for ever
                seen.append(decision.phase)
                if decision.phase in phases.TERMINAL:
                    break
                await asyncio.sleep(0.5)
            return seen

        seen = asyncio.run(drive())
    finally:
        kubectl("delete", "-f", "-", input=policy, check=False)
    assert phases.PROVISIONING in seen and seen[-1] == phases.FAILED, seen
    status = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "refused", "-o", "json").stdout)["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ProvisioningTimeout" and REFUSAL in failed["message"]
    refused = [message for reason, message in backend.events if reason == "CreateRefused"]
    assert len(refused) == 1 and REFUSAL in refused[0]
    assert kubectl("-n", namespace, "get", "rayclusters", "-o", "name").stdout.strip() == ""
