"""The chart watching one namespace with rbac.namespaced: the operator's rules on the runs'
objects are a Role of that namespace, and the ClusterRole only reads cluster-scoped things
(nodes, CRDs, namespaces). Asked of the real kube-apiserver as the chart's ServiceAccount
(impersonated; `kubectl auth can-i` is a SubjectAccessReview): it creates RayClusters,
Secrets and NetworkPolicies in the watched namespace and in no other."""

from __future__ import annotations

import secrets
import subprocess
import time

import pytest
import yaml
from manifests import CHART, documents

pytestmark = pytest.mark.cluster

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def chart_rbac(helm, namespace: str, account: str, unique: str) -> list[dict]:
    """The chart's own RBAC objects (not the aggregated user roles), the cluster-scoped ones
    renamed `unique` so that they never replace those other tests bind."""
    out = subprocess.run([str(helm), "template", "t", str(CHART), "--namespace", namespace,
                          "--set", f"settings.namespace={namespace}", "--set", "rbac.namespaced=true",
                          "--set", f"serviceAccount.name={account}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = [o for o in documents(out.stdout) if o["kind"] in RBAC_KINDS
               and o["metadata"]["name"] not in ("tpufinetune-edit", "tpufinetune-view")]
    for obj in objects:
        if obj["kind"] == "ClusterRole":
            obj["metadata"]["name"] = unique
        if obj["kind"] == "ClusterRoleBinding":
            obj["metadata"]["name"] = unique
            obj["roleRef"]["name"] = unique
    return objects


def test_watching_one_namespace_the_operator_creates_only_there(helm, control_plane, kuberay_crd, namespace):
    account, unique = "tft-operator", f"tft-namespaced-{secrets.token_hex(3)}"
    objects = chart_rbac(helm, namespace, account, unique)
    (cluster_role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    assert {verb for rule in cluster_role["rules"] for verb in rule["verbs"]} <= {"get", "list", "watch"}
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces"}
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "tpufinetune-operator")
    assert role["metadata"]["namespace"] == namespace

    kubectl = control_plane.kubectl
    text = yaml.safe_dump_all(objects)
    kubectl("apply", "-f", "-", input=text)
    try:
        user = f"system:serviceaccount:{namespace}:{account}"

        def can_i(verb: str, resource: str, where: list[str]) -> bool:
            answer = kubectl("auth", "can-i", verb, resource, *where, "--as", user, check=False).stdout.strip()
            assert answer in ("yes", "no"), answer
            return answer == "yes"

        # The authorizer learns of new bindings a moment after they are stored.
        deadline = time.monotonic() + 30
        while not can_i("create", "rayclusters.ray.io", ["-n", namespace]):
            assert time.monotonic() < deadline, "the chart's RoleBinding never took effect"
            time.sleep(0.5)
        for resource in ("rayclusters.ray.io", "secrets", "networkpolicies.networking.k8s.io"):
            assert can_i("create", resource, ["-n", namespace]), resource
            assert not can_i("create", resource, ["-n", "elsewhere"]), resource
        assert can_i("list", "pods", ["-n", namespace]) and not can_i("list", "pods", ["-A"])
        assert not can_i("watch", "tpufinetunes.tpufinetune.dev", ["-n", "elsewhere"])
        assert can_i("watch", "nodes", []) and not can_i("get", "secrets", ["-n", namespace])
    finally:
        kubectl("delete", "-f", "-", input=text, check=False, timeout=120)


def test_the_single_namespace_overlay_is_the_chart_watching_one_namespace(helm, control_plane):
    from manifests import DEPLOY, OPERATOR_NS, kustomize
    from test_helm_chart import by_identity, template

    chart = by_identity(documents(template(helm, OPERATOR_NS, "--set", "createNamespace=true",
                                           "--set", "settings.namespace=ml-team", "--set", "rbac.namespaced=true")))
    overlay = by_identity(kustomize(control_plane, DEPLOY / "overlays" / "single-namespace"))
    assert chart.keys() == overlay.keys()
    for identity in overlay:
        assert chart[identity] == overlay[identity], identity
    assert ("Role", "tpufinetune-operator") in overlay
