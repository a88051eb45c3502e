"""deploy/helm/tpufinetune with the real helm (built from Go modules): lint, render into a
server-side dry run on the real API server, and render exactly what deploy/ (kustomize)
installs, so the two ways to install never drift apart."""

from __future__ import annotations

import pytest
from manifests import CHART, DEPLOY, OPERATOR_NS, by_identity, documents, find, kustomize, run, template

from tpufinetune.core import notify

pytestmark = pytest.mark.cluster

EVERY_OPTION = [
    "--set", "rayToken.secretName=ray-token", "--set", "settings.namespaces={ml-team,team-b}",
    "--set", "metrics.service.enabled=true", "--set", "metrics.scrapeAnnotations=true",
    "--set", "metrics.grafanaDashboard.enabled=true", "--set", "settings.runMetrics=false",
    "--set", "image.pullPolicy=Always", "--set", "podAnnotations.team=ml",
    "--set", "nodeSelector.pool=system", "--set", "settings.pollInterval=2",
    "--set", "priorityClassName=system-cluster-critical",
    "--set", "env[0].name=EXTRA", "--set-string", "env[0].value=1",
    "--set", "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=op@p.iam.gserviceaccount.com",
]
NOTIFY_SINKS = [
    "--set", "notify.sinks[0].name=team", "--set", "notify.sinks[0].type=webhook",
    "--set", "notify.sinks[0].url=https://hooks.example.com/tpufinetune", "--set", "notify.sinks[0].namespaces={ml,ml-*}",
    "--set", "notify.sinks[0].tokenSecret.name=team-hook", "--set", "notify.sinks[0].tokenSecret.key=token",
    "--set", "notify.sinks[1].name=bus", "--set", "notify.sinks[1].type=cloudevents",
    "--set", "notify.sinks[1].url=http://broker-ingress.knative-eventing.svc/ml/default",
    "--set", "notify.sinks[1].mode=structured", "--set", "notify.sinks[1].namespaces={*}",
]
EVERY_OPTION += NOTIFY_SINKS


def test_helm_lint_is_clean(helm):
    assert "0 chart(s) failed" in run(helm, "lint", CHART, "--strict")
    assert "0 chart(s) failed" in run(helm, "lint", CHART, "--strict", *EVERY_OPTION)


@pytest.mark.parametrize("values", [[], EVERY_OPTION], ids=["defaults", "every-option"])
def test_rendered_chart_passes_a_server_side_dry_run(helm, control_plane, kuberay_crd, namespace, values):
    rendered = template(helm, namespace, *values)
    for watched in ("ml-team", "team-b"):  # the watched namespaces exist before the install
        control_plane.kubectl("create", "namespace", watched, check=False)
    applied = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered).stdout
    kinds = {line.split("/")[0].split(".")[0] for line in applied.splitlines()}
    assert {"customresourcedefinition", "serviceaccount", "clusterrole", "clusterrolebinding",
            "configmap", "deployment"} <= kinds, applied


def test_chart_defaults_render_exactly_the_kustomize_base(helm, control_plane):
    chart = by_identity(documents(template(helm, OPERATOR_NS, "--set", "createNamespace=true")))
    base = by_identity(kustomize(control_plane, DEPLOY / "base"))
    assert chart.keys() == base.keys()
    for identity in base:
        assert chart[identity] == base[identity], identity


def test_chart_metrics_values_render_exactly_the_prometheus_overlay(helm, control_plane):
    chart = by_identity(documents(template(
        helm, OPERATOR_NS, "--set", "createNamespace=true",
        "--set", "metrics.scrapeAnnotations=true", "--set", "metrics.service.enabled=true",
        "--set", "metrics.grafanaDashboard.enabled=true")))
    overlay = by_identity(kustomize(control_plane, DEPLOY / "overlays" / "prometheus"))
    assert chart.keys() == overlay.keys()
    for identity in overlay:
        assert chart[identity] == overlay[identity], identity


def test_chart_values_reach_the_operator(helm):
    objects = documents(template(helm, "ops", *EVERY_OPTION))
    settings = find(objects, "ConfigMap", "tpufinetune-operator-settings")["data"]
    assert settings["TPUFT_NAMESPACE"] == "ml-team team-b" and settings["TPUFT_POLL_INTERVAL"] == "2"
    assert settings["TPUFT_RUN_METRICS"] == "false"
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    token_file = next(e["value"] for e in container["env"] if e["name"] == "TPUFT_RAY_TOKEN_FILE")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "ray-token")
    volume = next(v for v in pod["volumes"] if v["name"] == "ray-token")
    assert token_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert volume["secret"]["secretName"] == "ray-token"
    # Two namespaces: a RoleBinding of the runs' rules in each (on Secrets only create, each
    # run's Ray token Secret, never a read), and cluster-wide only reads.
    rules = find(objects, "ClusterRole", "tpufinetune-operator-runs")["rules"]
    assert [rule["verbs"] for rule in rules if "secrets" in rule["resources"]] == [["create"]]
    bindings = [o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == "tpufinetune-operator-runs"]
    assert sorted(o["metadata"]["namespace"] for o in bindings) == ["ml-team", "team-b"]
    cluster_rules = find(objects, "ClusterRole", "tpufinetune-operator")["rules"]
    assert {verb for rule in cluster_rules for verb in rule["verbs"]} == {"get", "list", "watch", "patch"}
    # patch only on the runs themselves: the finalizer of a run whose namespace is being deleted.
    assert {r for rule in cluster_rules if "patch" in rule["verbs"] for r in rule["resources"]} == {
        "tpufinetunes", "tpufinetunes/status"}
    # The signing key's Role lives in the release namespace, bound to the operator.
    # So do the leader election's.
    for name in ("tpufinetune-operator-ray-token-key", "tpufinetune-operator-leader-election"):
        assert find(objects, "Role", name)["metadata"]["namespace"] == "ops"
        assert find(objects, "RoleBinding", name)["subjects"][0]["namespace"] == "ops"
    assert find(objects, "Service")["spec"]["ports"][0]["port"] == 9090


def test_values_in_kuberays_shape_reach_the_deployment(helm):
    objects = documents(template(helm, "ops", *EVERY_OPTION))
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert {"name": "EXTRA", "value": "1"} in pod["containers"][0]["env"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    account = find(objects, "ServiceAccount")
    assert account["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}


def test_an_existing_service_account_is_bound_and_not_created(helm):
    objects = documents(template(helm, "ops", "--set", "serviceAccount.create=false",
                                 "--set", "serviceAccount.name=platform-operator"))
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    assert find(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"
    (subject,) = find(objects, "ClusterRoleBinding")["subjects"]
    assert subject["name"] == "platform-operator"


def test_service_monitor_is_off_by_default_and_selects_the_metrics_service(helm):
    assert "ServiceMonitor" not in {o["kind"] for o in documents(template(helm, "ops"))}
    objects = documents(template(helm, "ops", "--set", "metrics.serviceMonitor.enabled=true",
                                 "--set", "metrics.serviceMonitor.labels.release=prom"))
    monitor, service = find(objects, "ServiceMonitor"), find(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The run's `namespace` label is kept, not moved to exported_namespace (the dashboard's
    # queries select by it: tests/operator/test_dashboard_e2e.py scrapes the same way).
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_the_grafana_dashboard_is_off_by_default_and_is_the_shipped_json(helm):
    assert "tpufinetune-dashboard" not in {o["metadata"]["name"] for o in documents(template(helm, "ops"))}
    objects = documents(template(helm, "ops", "--set", "metrics.grafanaDashboard.enabled=true",
                                 "--set", "metrics.grafanaDashboard.namespace=monitoring",
                                 "--set", "metrics.grafanaDashboard.annotations.grafana_folder=TPUFineTune"))
    board = find(objects, "ConfigMap", "tpufinetune-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["namespace"] == "monitoring"
    assert board["metadata"]["annotations"] == {"grafana_folder": "TPUFineTune"}
    shipped = (DEPLOY / "grafana" / "tpufinetune-dashboard.json").read_text()
    assert board["data"] == {"tpufinetune-dashboard.json": shipped}


def test_aggregated_roles_can_be_left_out(helm):
    names = {o["metadata"]["name"] for o in documents(template(helm, "ops")) if o["kind"] == "ClusterRole"}
    assert names == {"tpufinetune-operator", "tpufinetune-operator-runs", "tpufinetune-edit", "tpufinetune-view"}
    objects = documents(template(helm, "ops", "--set", "rbac.aggregateToDefaultRoles=false"))
    assert sorted(o["metadata"]["name"] for o in objects if o["kind"] == "ClusterRole") == [
        "tpufinetune-operator", "tpufinetune-operator-runs"]


def test_values_schema_refuses_a_misspelt_key(helm):
    error = run(helm, "template", "tpufinetune", CHART, "--set", "serviceAcount.create=false", check=False)
    assert "serviceAcount" in error


def test_values_schema_refuses_an_env_value_that_is_not_a_string(helm):
    error = run(helm, "template", "tpufinetune", CHART, "--set", "env[0].name=A", "--set", "env[0].value=1",
                check=False)
    assert "env" in error and "string" in error


def test_several_replicas_without_leader_election_are_refused(helm):
    refused = run(helm, "template", "tpufinetune", CHART, "--set", "settings.leaderElection=false", check=False)
    assert "replicas > 1 needs settings.leaderElection" in refused
    objects = documents(template(helm, "ops", "--set", "settings.leaderElection=false", "--set", "replicas=1"))
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding", "PodDisruptionBudget")
                and o["metadata"]["name"] != "tpufinetune-operator-ray-token-key"
                and not (o["kind"] == "RoleBinding" and o["roleRef"]["name"] == "tpufinetune-operator-runs")]
    assert find(objects, "ConfigMap", "tpufinetune-operator-settings")["data"]["TPUFT_LEADER_ELECTION"] == "false"


def test_notify_sinks_reach_the_operator_as_its_sinks_file_with_their_tokens_mounted(helm):
    objects = documents(template(helm, "ops", *NOTIFY_SINKS))
    settings = find(objects, "ConfigMap", "tpufinetune-operator-settings")["data"]
    sinks_file = settings["TPUFT_NOTIFY_SINKS_FILE"]
    text = find(objects, "ConfigMap", "tpufinetune-operator-notify-sinks")["data"]["sinks.yaml"]
    sinks = notify.parse_sinks(text)  # what the operator reads at its start
    assert {n: (s.type, s.url, s.mode) for n, s in sinks.items()} == {
        "team": ("webhook", "https://hooks.example.com/tpufinetune", "binary"),
        "bus": ("cloudevents", "http://broker-ingress.knative-eventing.svc/ml/default", "structured")}
    assert sinks["bus"].token_file == ""
    assert (sinks["team"].namespaces, sinks["bus"].namespaces) == (("ml", "ml-*"), ("*",))
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[sinks_file.rsplit("/", 1)[0]]]["configMap"]["name"] == "tpufinetune-operator-notify-sinks"
    token_dir, token_name = sinks["team"].token_file.rsplit("/", 1)
    secret = volumes[mounts[token_dir]]["secret"]
    assert secret == {"secretName": "team-hook", "items": [{"key": "token", "path": token_name}]}
    refused = run(helm, "template", "tpufinetune", CHART, "--set", "notify.sinks[0].name=x",
                  "--set", "notify.sinks[0].type=webhook", "--set", "notify.sinks[0].url=file:///etc/passwd",
                  check=False)
    assert "/notify/sinks/0/url" in refused, refused
    unsaid = run(helm, "template", "tpufinetune", CHART, "--set", "notify.sinks[0].name=x",
                 "--set", "notify.sinks[0].type=webhook", "--set", "notify.sinks[0].url=https://h.example/x",
                 check=False)
    assert "/notify/sinks/0': missing property 'namespaces'" in unsaid, unsaid  # each sink says who may use it
