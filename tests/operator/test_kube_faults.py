"""The Kubernetes side of a run under faults, against a real kube-apiserver: a
RayCluster, or the run's NetworkPolicy before it, that admission refuses (a
ValidatingAdmissionPolicy, as a webhook, a quota or a policy would) is shown with the API server's words and fails the run once the
provisioning timeout has passed; a deletion the watch never delivered (the watch expired,
410 Gone) is found by the informer's next list; a RayCluster already being deleted is not
deleted again.

Real parts: the kube-apiserver with the KubeRay CRD and the project's CRD, the operator's
KubeBackend and driver. No KubeRay and no Ray.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import yaml

from run_helpers import RecordingBackend as Backend
from tpufinetune.adapters.informer import Gone
from tpufinetune.adapters.kube import KubeBackend, Watches
from tpufinetune.core.api import parse_spec
from tpufinetune.core.phases import Identity
from tpufinetune.core.sizing import render_raycluster
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.settings import Settings
from harness.admission import refusing_policy

pytestmark = [pytest.mark.cluster]
REFUSAL = "RayClusters are refused by the test's admission policy"


# What admission may refuse of a run's creates, each with a probe of that kind.
REFUSED_KINDS = {
    "rayclusters": ("ray.io", {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "probe"},
                               "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
                                   "containers": [{"name": "ray-head", "image": "registry.example/t:1"}]}}}}}),
    # The run's NetworkPolicy, created with its token Secret before the RayCluster.
    "networkpolicies": ("networking.k8s.io", {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                              "metadata": {"name": "probe"}, "spec": {"podSelector": {}}}),
}


def refuse(namespace: str, resource: str = "rayclusters") -> list[dict]:
    return refusing_policy(f"refuse-{resource}-{namespace}", namespace, REFUSED_KINDS[resource][0], resource,
                           ["CREATE"], REFUSAL)


def wait_until_refused(kubectl, namespace: str, resource: str = "rayclusters", timeout: float = 30) -> None:
    """A policy reaches the admission plugin a moment after it is applied: probe with a
    server-side dry run (admission runs, nothing is stored) until it refuses."""
    probe = yaml.safe_dump(REFUSED_KINDS[resource][1])
    deadline = time.monotonic() + timeout
    while REFUSAL not in kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-", input=probe,
                                 check=False).stderr:
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.5)


@pytest.mark.parametrize("resource", sorted(REFUSED_KINDS))
def test_a_refused_create_says_why_and_fails_after_the_provisioning_timeout(
        control_plane, kuberay_crd, k8s_api, namespace, resource):
    kubectl = control_plane.kubectl
    policy = yaml.safe_dump_all(refuse(namespace, resource))
    kubectl("apply", "-f", "-", input=policy)
    try:
        wait_until_refused(kubectl, namespace, resource)
        manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "refused"},
                    "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                             "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}
        kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
        body = json.loads(kubectl("-n", namespace, "get", "tpufinetune", "refused", "-o", "json").stdout)
        settings = Settings(poll_interval=1, provision_timeout=4, operator_namespace=namespace)  # the signing key
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


UID = "00000000-0000-0000-0000-0000000000c1"


def ready_raycluster(control_plane, namespace: str, **meta) -> dict:
    """A RayCluster as KubeRay would report it ready (no KubeRay runs here)."""
    spec = parse_spec({"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                       "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}})
    manifest = render_raycluster("cache", namespace, UID, spec)
    manifest["metadata"].update(meta)
    kubectl = control_plane.kubectl
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
    kubectl("-n", namespace, "patch", "raycluster", "tft-cache", "--subresource=status", "--type=merge",
            "-p", '{"status": {"state": "ready"}}')
    return json.loads(kubectl("-n", namespace, "get", "raycluster", "tft-cache", "-o", "json").stdout)


def test_a_deletion_no_watch_saw_is_dropped_by_the_list_a_410_leads_to(
        control_plane, kuberay_crd, k8s_api, namespace):
    """A RayCluster deleted while no watch was open (the watch expired: 410 Gone) gets no
    DELETED event; the informer's next list replaces its store, reports the deletion, and
    the run sees the cluster gone: never a submit to a head that went with it."""
    ident = Identity("cache", namespace, UID)
    changes = []
    watches = Watches(k8s_api, Settings(namespace=namespace), lambda *change: changes.append(change))
    informer = watches.informers[0]
    ready_raycluster(control_plane, namespace)
    version = informer._list()
    backend = KubeBackend(k8s_api, Settings(), watches)
    assert asyncio.run(backend.observe(ident, "tft-cache")).ready
    control_plane.kubectl("-n", namespace, "delete", "raycluster", "tft-cache", "--wait=true")
    assert asyncio.run(backend.observe(ident, "tft-cache")).ready  # nothing told the store yet
    # The API server answers a watch from a resourceVersion it no longer holds with 410 Gone.
    with pytest.raises(Gone):
        informer._watch("1")
    assert version  # the list's own version, where a watch would have resumed
    informer._list()
    assert ("rayclusters", "DELETED") in [(kind, type_) for kind, type_, _ in changes]
    assert not asyncio.run(backend.observe(ident, "tft-cache")).exists


def test_a_raycluster_already_being_deleted_is_not_deleted_again(control_plane, kuberay_crd, k8s_api, namespace):
    kubectl = control_plane.kubectl
    ready_raycluster(control_plane, namespace, finalizers=["tpufinetune.dev/test-hold"])  # it lingers
    backend = KubeBackend(k8s_api, Settings())
    deletes = []
    real_delete = backend.objects.delete_namespaced_custom_object

    def counted(*args, **kwargs):  # the real call, counted
        deletes.append(args)
        return real_delete(*args, **kwargs)

    backend.objects.delete_namespaced_custom_object = counted
    ident = Identity("cache", namespace, UID)
    try:
        for _ in range(3):  # on.delete's loop while the RayCluster goes
            asyncio.run(backend.delete(ident, "tft-cache"))
        body = json.loads(kubectl("-n", namespace, "get", "raycluster", "tft-cache", "-o", "json").stdout)
        assert body["metadata"].get("deletionTimestamp")
        assert len(deletes) == 1
    finally:
        kubectl("-n", namespace, "patch", "raycluster", "tft-cache", "--type=merge",
                "-p", '{"metadata": {"finalizers": null}}', check=False)
