"""deploy/ (kustomize) installed into the real API server: everything applies, the pod
meets the restricted Pod Security Standard, and the ServiceAccount can do what the operator
calls: on Secrets only create, and get on its one signing key."""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import pytest
from manifests import DEPLOY, OPERATOR_NS, OPERATOR_SA, ROOT, find, kustomize, load

from tpufinetune.cli import build_parser
from tpufinetune.core import raytoken
from tpufinetune.settings import Settings

pytestmark = pytest.mark.cluster

# Each rule has one caller (deploy/base/clusterrole.yaml and clusterrole-runs.yaml say
# which). Widening this is a decision: the end-to-end suite shows these are enough (zero
# Forbidden responses). Cluster-wide, reads of cluster-scoped things only:
EXPECTED_CLUSTER_RULES = [
    # get: KubeBackend.slice_health; list, watch: handlers.node_maintenance.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    # kopf resolves TPUFT_NAMESPACE against the namespaces there are; handlers.namespace_deleted
    # sees one being deleted.
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # The finalizer of a run whose namespace is being deleted (its RoleBinding already gone).
    {"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes"], "verbs": ["patch"]},
    {"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes/status"], "verbs": ["patch"]},
]
# In each watched namespace (a RoleBinding to tpufinetune-operator-runs):
EXPECTED_RUN_RULES = [
    # get: driver.Run._reread_status (KubeBackend.read_status), after a refused status write.
    {"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["tpufinetune.dev"], "resources": ["tpufinetunes/status"], "verbs": ["patch"]},
    {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
WATCHED = "ml-team"  # deploy/base's TPUFT_NAMESPACE


@pytest.fixture(autouse=True)
def without_the_base_policy_after(control_plane):
    """The tests here apply deploy/base itself, admission policy included, on the session's
    API server; that policy (TPUFT_NAMESPACE: ml-team) would then judge every later test's
    creates as the operator. Each admission test applies a policy of its own
    (manifests.policy_of_its_own), so the base's goes after each test here."""
    yield
    control_plane.kubectl("delete", "--ignore-not-found", "--wait=false",
                          "validatingadmissionpolicybinding/tpufinetune-operator-creates",
                          "validatingadmissionpolicy/tpufinetune-operator-creates", check=False)


def apply_base(control_plane):
    """`kubectl apply -k deploy/base` after creating the namespace it watches (docs/gke.md
    creates it first: the base never creates, so never deletes, a tenant's namespace)."""
    control_plane.kubectl("create", "namespace", WATCHED, check=False)
    return control_plane.kubectl("apply", "-k", DEPLOY / "base")


def test_base_applies_to_the_real_api_server_and_meets_the_restricted_pod_standard(control_plane):
    result = apply_base(control_plane)
    for ref in ("namespace/tpufinetune-system",
                "customresourcedefinition.apiextensions.k8s.io/tpufinetunes.tpufinetune.dev",
                "serviceaccount/tpufinetune-operator",
                "clusterrole.rbac.authorization.k8s.io/tpufinetune-operator",
                "clusterrolebinding.rbac.authorization.k8s.io/tpufinetune-operator",
                "configmap/tpufinetune-operator-settings",
                "deployment.apps/tpufinetune-operator"):
        assert ref in result.stdout, result.stdout
    # The namespace says `restricted` (enforce and warn): the API server's PodSecurity
    # admission warns about a Deployment whose pods it would refuse.
    assert "PodSecurity" not in result.stderr, result.stderr
    deployment = find(kustomize(control_plane, DEPLOY / "base"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(deployment))
    assert 'would violate PodSecurity "restricted' in refused.stderr, refused.stderr
    live = json.loads(control_plane.kubectl("-n", OPERATOR_NS, "get", "deployment", "tpufinetune-operator",
                                            "-o", "json").stdout)
    (container,) = live["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "us-docker.pkg.dev/PROJECT/tpufinetune/operator:0.1.0"


def test_the_crd_is_the_generated_one_not_a_copy(control_plane):
    rendered = find(kustomize(control_plane, DEPLOY / "base"), "CustomResourceDefinition")
    assert rendered == load((ROOT / "crds" / "tpufinetunes.tpufinetune.dev.yaml").read_text())
    listed = load((ROOT / "crds" / "kustomization.yml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))


def test_prometheus_overlay_adds_scraping_of_the_metrics_port(control_plane):
    result = control_plane.kubectl("apply", "-k", DEPLOY / "overlays" / "prometheus")
    assert "service/tpufinetune-operator-metrics" in result.stdout
    objects = kustomize(control_plane, DEPLOY / "overlays" / "prometheus")
    deployment = find(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert f"--metrics-port={port}" in container["args"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}
    service = json.loads(control_plane.kubectl("-n", OPERATOR_NS, "get", "service",
                                               "tpufinetune-operator-metrics", "-o", "json").stdout)
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_prometheus_overlay_ships_the_grafana_dashboard_for_grafanas_sidecar(control_plane):
    objects = kustomize(control_plane, DEPLOY / "overlays" / "prometheus")
    board = find(objects, "ConfigMap", "tpufinetune-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["namespace"] == OPERATOR_NS
    assert board["data"] == {"tpufinetune-dashboard.json": (DEPLOY / "grafana" / "tpufinetune-dashboard.json").read_text()}
    assert json.loads(board["data"]["tpufinetune-dashboard.json"])["uid"] == "tpufinetune"
    assert "tpufinetune-dashboard" not in {o["metadata"]["name"] for o in kustomize(control_plane, DEPLOY / "base")}


def test_cluster_role_is_exactly_what_the_operator_calls(control_plane):
    objects = kustomize(control_plane, DEPLOY / "base")
    assert find(objects, "ClusterRole", "tpufinetune-operator")["rules"] == EXPECTED_CLUSTER_RULES
    assert find(objects, "ClusterRole", "tpufinetune-operator-runs")["rules"] == EXPECTED_RUN_RULES
    # The runs' rules are bound in the watched namespace only, never cluster-wide.
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
                and o["roleRef"]["name"] == "tpufinetune-operator-runs"]
    assert [(o["kind"], o["metadata"]["namespace"]) for o in bindings] == [("RoleBinding", WATCHED)]
    data = find(objects, "ConfigMap", "tpufinetune-operator-settings")["data"]
    assert data["TPUFT_NAMESPACE"] == WATCHED


def test_the_service_account_creates_secrets_but_reads_only_its_signing_key(control_plane, kuberay_crd):
    apply_base(control_plane)

    def can(*args) -> bool:
        result = control_plane.kubectl("auth", "can-i", *args, f"--as={OPERATOR_SA}", check=False)
        assert result.stdout.strip() in ("yes", "no"), result
        return result.stdout.strip() == "yes"

    # The binding is live (so the refusals below are RBAC's answer, not a missing subject).
    assert can("create", "rayclusters.ray.io", "-n", WATCHED)
    assert can("patch", "tpufinetunes.tpufinetune.dev", "--subresource=status", "-n", WATCHED)
    # Each run's Ray token Secret is created, never read back: no tenant's Secret is readable.
    assert can("create", "secrets", "-n", WATCHED)
    for verb in ("get", "list", "watch", "update", "patch", "delete"):
        assert not can(verb, "secrets", "--all-namespaces"), verb
        assert not can(verb, "secrets", "-n", WATCHED), verb
    # Nothing is created, nor a run's object read, in a namespace it does not watch.
    for resource in ("rayclusters.ray.io", "secrets", "networkpolicies.networking.k8s.io", "events"):
        assert not can("create", resource, "-n", "default"), resource
        assert not can("create", resource, "--all-namespaces"), resource
    for resource in ("tpufinetunes.tpufinetune.dev", "rayclusters.ray.io", "pods"):
        assert not can("list", resource, "--all-namespaces"), resource
    # In its own namespace: get on the signing key only, by name (core/raytoken.py names it).
    assert can("get", f"secrets/{raytoken.SIGNING_KEY_SECRET}", "-n", OPERATOR_NS)
    assert not can("get", "secrets/another", "-n", OPERATOR_NS)
    assert not can("list", "secrets", "-n", OPERATOR_NS)
    assert not can("update", f"secrets/{raytoken.SIGNING_KEY_SECRET}", "-n", OPERATOR_NS)
    # Nothing wider either: no wildcard anywhere in the rules.
    objects = kustomize(control_plane, DEPLOY / "base")
    for role in (find(objects, "ClusterRole", "tpufinetune-operator"),
                 find(objects, "ClusterRole", "tpufinetune-operator-runs"),
                 find(objects, "Role", "tpufinetune-operator-ray-token-key"),
                 find(objects, "Role", "tpufinetune-operator-leader-election")):
        for rule in role["rules"]:
            assert "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"]


def test_the_pod_is_hardened_and_its_probes_hit_the_liveness_endpoint(control_plane):
    objects = kustomize(control_plane, DEPLOY / "base")
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == find(objects, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}

    args = build_parser().parse_args(container["args"])  # the CLI accepts exactly these
    liveness = urlparse(args.liveness)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == liveness.path and ports[get["port"]] == liveness.port
    assert ports["metrics"] == args.metrics_port

    # Dockerfile.operator's user is the one the pod runs as.
    user = re.search(r"^USER (\d+)", (ROOT / "Dockerfile.operator").read_text(), re.MULTILINE)
    assert int(user.group(1)) == pod["securityContext"]["runAsUser"]


def test_the_settings_config_map_holds_only_settings_the_operator_reads(control_plane):
    objects = kustomize(control_plane, DEPLOY / "base")
    deployment = find(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (source,) = container["envFrom"]
    data = find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    settings_doc = (ROOT / "operator" / "tpufinetune" / "settings.py").read_text()
    documented = set(re.findall(r"^\| (TPUFT_\w+) \|", settings_doc, re.MULTILINE))
    assert set(data) <= documented
    settings = Settings.from_env(data)
    # The shipped values are the documented defaults, but for the namespace watched: the
    # operator's default is every namespace, the install's one namespace.
    assert settings == Settings(namespace=WATCHED)


def test_kubectl_apply_k_deploy_installs_the_base(control_plane):
    assert kustomize(control_plane, DEPLOY) == kustomize(control_plane, DEPLOY / "base")
    control_plane.kubectl("create", "namespace", WATCHED, check=False)
    result = control_plane.kubectl("apply", "--dry-run=server", "-k", DEPLOY)
    assert "deployment.apps/tpufinetune-operator" in result.stdout, result.stdout
    assert "clusterrole.rbac.authorization.k8s.io/tpufinetune-edit" in result.stdout


def test_leader_election_is_granted_on_leases_in_the_operators_namespace_only(control_plane):
    objects = kustomize(control_plane, DEPLOY / "base")
    role = find(objects, "Role", "tpufinetune-operator-leader-election")
    assert role["metadata"]["namespace"] == OPERATOR_NS
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    binding = find(objects, "RoleBinding", "tpufinetune-operator-leader-election")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tpufinetune-operator",
                                    "namespace": OPERATOR_NS}]
    # The ClusterRole grants nothing on Leases: no replica can touch another namespace's.
    cluster_role = find(objects, "ClusterRole", "tpufinetune-operator")
    assert not any("leases" in rule["resources"] for rule in cluster_role["rules"])
    apply_base(control_plane)

    def can(*args) -> bool:
        return control_plane.kubectl("auth", "can-i", *args, f"--as={OPERATOR_SA}",
                                     check=False).stdout.strip() == "yes"

    assert can("update", "leases.coordination.k8s.io", "-n", OPERATOR_NS)
    assert not can("update", "leases.coordination.k8s.io", "-n", "default")
    assert not can("delete", "leases.coordination.k8s.io", "-n", OPERATOR_NS)


def test_two_replicas_roll_one_at_a_time_and_know_their_pod_for_the_lease(control_plane):
    objects = kustomize(control_plane, DEPLOY / "base")
    deployment = find(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert downward == {"POD_NAME": "metadata.name", "TPUFT_OPERATOR_NAMESPACE": "metadata.namespace"}
    budget = find(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    data = find(objects, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"]
    assert Settings.from_env(data).leader_election is True
