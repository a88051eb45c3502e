"""The chart, by default, watches named namespaces: the operator's rules on the runs' objects
are bound by a RoleBinding in each, and the ClusterRole only reads cluster-scoped things
(nodes, CRDs, namespaces). Asked of the real kube-apiserver as the chart's ServiceAccount
(impersonated; `kubectl auth can-i` is a SubjectAccessReview): it creates RayClusters,
Secrets and NetworkPolicies in the watched namespace and in no other. Every namespace, with
the runs' rules bound cluster-wide, only when settings.namespaces is emptied."""

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
                          "--set", f"settings.namespaces={{{namespace}}}",
                          "--set", f"serviceAccount.name={account}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = [o for o in documents(out.stdout) if o["kind"] in RBAC_KINDS
               and o["metadata"]["name"] not in ("tpufinetune-edit", "tpufinetune-view")]
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            obj["metadata"]["name"] = obj["metadata"]["name"].replace("tpufinetune-operator", unique)
        if obj["kind"] in ("ClusterRoleBinding", "RoleBinding") and obj["roleRef"]["kind"] == "ClusterRole":
            obj["roleRef"]["name"] = obj["roleRef"]["name"].replace("tpufinetune-operator", unique)
    return objects


def test_watching_one_namespace_the_operator_creates_only_there(helm, control_plane, kuberay_crd, namespace):
    account, unique = "tft-operator", f"tft-namespaced-{secrets.token_hex(3)}"
    objects = chart_rbac(helm, namespace, account, unique)
    cluster_roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    cluster_role = cluster_roles[unique]  # the one the ClusterRoleBinding grants
    assert {verb for rule in cluster_role["rules"] for verb in rule["verbs"]} <= {"get", "list", "watch", "patch"}
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces", "tpufinetunes", "tpufinetunes/status"}
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "tpufinetune-operator"]
    assert binding["metadata"]["namespace"] == namespace
    assert not [o for o in objects if o["kind"] == "ClusterRoleBinding" and o["roleRef"]["name"] != unique]

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
        # Elsewhere only a run's own object: its finalizer, once its namespace is being deleted.
        assert can_i("patch", "tpufinetunes.tpufinetune.dev", ["-n", "elsewhere"])
        assert not can_i("delete", "tpufinetunes.tpufinetune.dev", ["-n", "elsewhere"])
        assert can_i("watch", "nodes", []) and not can_i("get", "secrets", ["-n", namespace])
    finally:
        kubectl("delete", "-f", "-", input=text, check=False, timeout=120)


def test_the_several_namespaces_overlay_is_the_chart_watching_several(helm, control_plane):
    from manifests import DEPLOY, OPERATOR_NS, by_identity, kustomize, template

    chart = by_identity(documents(template(helm, OPERATOR_NS, "--set", "createNamespace=true",
                                           "--set", "settings.namespaces={ml-team,team-*}")))
    overlay = by_identity(kustomize(control_plane, DEPLOY / "overlays" / "several-namespaces"))
    assert chart.keys() == overlay.keys()
    for identity in overlay:
        assert chart[identity] == overlay[identity], identity
    # The caches' reads across namespaces, and the runs' finalizer, cluster-wide.
    rules = overlay[("ClusterRole", "tpufinetune-operator")]["rules"]
    assert {verb for rule in rules for verb in rule["verbs"]} == {"get", "list", "watch", "patch"}
    assert {r for rule in rules if "patch" in rule["verbs"] for r in rule["resources"]} == {
        "tpufinetunes", "tpufinetunes/status"}
    assert {r for rule in rules for r in rule["resources"]} >= {"rayclusters", "pods", "workloads"}


def test_every_namespace_is_an_explicit_choice_that_binds_the_runs_rules_cluster_wide(helm):
    from manifests import OPERATOR_NS, template

    objects = documents(template(helm, OPERATOR_NS, "--set", "settings.namespaces=null"))
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding" and o["roleRef"]["name"] == "tpufinetune-operator-runs"]
    assert not [o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == "tpufinetune-operator-runs"]
    settings = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "tpufinetune-operator-settings")
    assert settings["data"]["TPUFT_NAMESPACE"] == ""
