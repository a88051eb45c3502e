"""What deploy/base's ValidatingAdmissionPolicy refuses the operator beyond labels and owners,
asked of the real kube-apiserver with the operator's own credentials (a TokenRequest token of
its ServiceAccount, as the Deployment's pods and the ground's operator have): a RayCluster in
a namespace it does not watch (though RBAC lets it there), whose pods ask for a
ServiceAccount the admin has not allowed in that namespace, a hostPath volume, a privileged
container or the host's network, PID or IPC namespace; and a Secret that is not Opaque. Each
create is a server-side dry run: admission runs, nothing is stored."""

from __future__ import annotations

import copy
import secrets
import time

import pytest
import yaml
from manifests import DEPLOY, kustomize, policy_of_its_own
from operator_objects import rendered

from harness.service_account import service_account_kubeconfig

pytestmark = pytest.mark.cluster

ALLOWED = "tpufinetune.dev/ray-service-accounts"  # the Namespace's annotation


@pytest.fixture
def watched(control_plane, kuberay_crd, namespace, tmp_path):
    """(kubectl as the operator, the watched namespace, a bound but unwatched one, set(patterns)):
    deploy/base's RBAC with both namespaces bound, its settings ConfigMap watching `namespace`
    only, and its admission policy (removed after)."""
    kubectl = control_plane.kubectl
    unwatched = f"u-{secrets.token_hex(4)}"
    kubectl("create", "namespace", unwatched)
    policy, settings = policy_of_its_own(kustomize(control_plane, DEPLOY / "base"), namespace, namespace)
    kubeconfig = service_account_kubeconfig(control_plane, tmp_path / "kubeconfig", namespaces=[namespace, unwatched])

    def watch(patterns: str) -> None:
        settings["data"]["TPUFT_NAMESPACE"] = patterns
        kubectl("apply", "-f", "-", input=yaml.safe_dump(settings))

    watch(namespace)
    text = yaml.safe_dump_all(policy)
    kubectl("apply", "-f", "-", input=text)

    def as_operator(where: str, obj: dict):
        return kubectl("-n", where, "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj),
                       kubeconfig=kubeconfig, check=False)

    # In force (a stranger's Secret refused), with this parameter (its own Secret passes).
    own = rendered(namespace)["secret"]
    stranger = changed(own, lambda s: s["metadata"].pop("ownerReferences"))
    until_in_force(as_operator, namespace, stranger)
    until_passes(as_operator, namespace, own)
    try:
        yield as_operator, unwatched, watch
    finally:
        kubectl("delete", "-f", "-", input=text + "---\n" + yaml.safe_dump(settings), check=False)
        kubectl("delete", "namespace", unwatched, "--wait=false", check=False)


def refused(result, words: str) -> None:
    assert result.returncode != 0 and words in result.stderr, result.stderr


def passes(result) -> None:
    assert result.returncode == 0, result.stderr


def until_in_force(as_operator, namespace: str, probe: dict, timeout: float = 30) -> None:
    """A policy reaches the admission plugin a moment after it is applied."""
    deadline = time.monotonic() + timeout
    while as_operator(namespace, probe).returncode == 0:
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.5)


def until_passes(as_operator, namespace: str, obj: dict, timeout: float = 120) -> None:
    """A changed parameter (the settings ConfigMap, a Namespace's annotation) reaches the
    admission plugin a moment after it is stored."""
    deadline = time.monotonic() + timeout
    while (result := as_operator(namespace, obj)).returncode != 0:
        assert time.monotonic() < deadline, result.stderr
        time.sleep(0.5)


def pods(cluster: dict) -> list[dict]:
    """The RayCluster's pod specs: the head's, then each worker group's."""
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec.get("workerGroupSpecs", [])]


def changed(obj: dict, change) -> dict:
    obj = copy.deepcopy(obj)
    change(obj)
    return obj


def test_the_operator_creates_only_in_the_namespaces_it_watches(watched, namespace):
    as_operator, unwatched, watch = watched
    own, theirs = rendered(namespace), rendered(unwatched)
    until_in_force(as_operator, unwatched, theirs["secret"])
    for kind, obj in own.items():  # what it renders passes where it watches
        passes(as_operator(namespace, obj))
    for kind, obj in theirs.items():  # RBAC lets it there (bound), the policy does not
        refused(as_operator(unwatched, obj), f"creates only in the namespaces it watches (TPUFT_NAMESPACE: {namespace}), not in {unwatched}")
    # A glob, as kopf reads it: t-* is every harness namespace, and not u-….
    assert namespace.startswith("t-") and unwatched.startswith("u-")
    watch("elsewhere")
    until_in_force(as_operator, namespace, own["secret"])
    watch("elsewhere t-*")
    until_passes(as_operator, namespace, own["secret"])
    passes(as_operator(namespace, own["raycluster"]))
    refused(as_operator(unwatched, theirs["raycluster"]), "creates only in the namespaces it watches")


def test_ray_pods_run_only_as_the_service_accounts_the_admin_allows(watched, control_plane, namespace):
    as_operator, unwatched, _ = watched
    cluster = rendered(namespace)["raycluster"]
    as_builder = changed(cluster, lambda c: pods(c)[-1].update(serviceAccountName="builder"))
    until_in_force(as_operator, namespace, as_builder)
    refused(as_operator(namespace, as_builder),
            f"only as the ServiceAccounts the admin allows there (default): list others in the Namespace annotation {ALLOWED}")
    refused(as_operator(namespace, changed(cluster, lambda c: pods(c)[0].update(serviceAccount="builder"))),
            "only as the ServiceAccounts the admin allows")
    passes(as_operator(namespace, changed(cluster, lambda c: [p.update(serviceAccountName="default") for p in pods(c)])))
    # The admin allows the Workload Identity account (a tenant cannot annotate a Namespace).
    control_plane.kubectl("annotate", "namespace", namespace, f"{ALLOWED}=trainer-wi, eval-wi")
    until_passes(as_operator, namespace, changed(cluster, lambda c: [p.update(serviceAccountName="trainer-wi") for p in pods(c)]))
    refused(as_operator(namespace, as_builder), "(default, trainer-wi, eval-wi)")


@pytest.mark.parametrize("what,change,words", [
    ("hostPath", lambda c: pods(c)[-1].setdefault("volumes", []).append({"name": "host", "hostPath": {"path": "/"}}),
     "no RayCluster with a hostPath volume"),
    ("privileged", lambda c: pods(c)[-1]["containers"][0].setdefault("securityContext", {}).update(privileged=True),
     "no RayCluster with a privileged container"),
    ("privileged init", lambda c: pods(c)[0].update(initContainers=[
        {"name": "init", "image": "busybox", "securityContext": {"privileged": True}}]),
     "no RayCluster with a privileged container"),
    ("hostNetwork", lambda c: pods(c)[0].update(hostNetwork=True), "on the host's network, PID or IPC namespace"),
    ("hostPID", lambda c: pods(c)[-1].update(hostPID=True), "on the host's network, PID or IPC namespace"),
    ("hostIPC", lambda c: pods(c)[-1].update(hostIPC=True), "on the host's network, PID or IPC namespace"),
])
def test_ray_pods_never_reach_into_the_host(watched, namespace, what, change, words):
    as_operator, _, _ = watched
    cluster = rendered(namespace)["raycluster"]
    bad = changed(cluster, change)
    until_in_force(as_operator, namespace, bad)
    refused(as_operator(namespace, bad), words)
    passes(as_operator(namespace, cluster))


@pytest.mark.parametrize("kind", ["kubernetes.io/service-account-token", "kubernetes.io/dockerconfigjson"])
def test_the_operator_creates_only_opaque_secrets(watched, namespace, kind):
    as_operator, _, _ = watched
    secret = rendered(namespace)["secret"]
    bad = changed(secret, lambda s: s.update(type=kind))
    if kind == "kubernetes.io/service-account-token":
        bad["metadata"].setdefault("annotations", {})["kubernetes.io/service-account.name"] = "default"
    if kind == "kubernetes.io/dockerconfigjson":
        bad["data"] = {".dockerconfigjson": "e30="}
    until_in_force(as_operator, namespace, bad)
    refused(as_operator(namespace, bad), "creates only Secrets of type Opaque")
    passes(as_operator(namespace, secret))

