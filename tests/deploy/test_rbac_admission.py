"""What deploy/ lets the operator's ServiceAccount do, asked of the real kube-apiserver as
that ServiceAccount (impersonated): RBAC's answers (`kubectl auth can-i`, a
SubjectAccessReview) for what it must not do, and the ValidatingAdmissionPolicy
(deploy/base/admissionpolicy.yaml) for what RBAC cannot say: it creates only the
RayClusters, NetworkPolicies and Secrets it renders itself. Each create is a server-side
dry run: admission runs, nothing is stored."""

from __future__ import annotations

import copy
import time

import pytest
import yaml
from manifests import DEPLOY, OPERATOR_SA, kustomize, policy_of_its_own
from operator_objects import rendered

from harness.service_account import rbac_objects, watch_binding
from tpufinetune.core import raytoken

pytestmark = pytest.mark.cluster

@pytest.fixture
def admission(control_plane, kuberay_crd, namespace):
    """deploy/base's RBAC and admission policy on the API server (the policy removed after),
    watching `namespace`: its RoleBinding, and the settings ConfigMap (the policy's
    parameter) naming it."""
    policy, settings = policy_of_its_own(kustomize(control_plane, DEPLOY / "base"), namespace, namespace)
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
        rbac_objects(control_plane) + [watch_binding(control_plane, namespace), settings]))
    text = yaml.safe_dump_all(policy)
    control_plane.kubectl("apply", "-f", "-", input=text)
    try:
        yield control_plane.kubectl
    finally:
        control_plane.kubectl("delete", "-f", "-", input=text + "---\n" + yaml.safe_dump(settings), check=False)


def create_as_operator(kubectl, namespace: str, obj: dict, check: bool = False):
    return kubectl("--as", OPERATOR_SA, "-n", namespace, "create", "--dry-run=server", "-f", "-",
                   input=yaml.safe_dump(obj), check=check)


def refused_with(kubectl, namespace: str, obj: dict, words: str) -> None:
    result = create_as_operator(kubectl, namespace, obj)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def until_in_force(kubectl, namespace: str, probe: dict, timeout: float = 30) -> None:
    """A policy reaches the admission plugin a moment after it is applied."""
    deadline = time.monotonic() + timeout
    while create_as_operator(kubectl, namespace, probe).returncode == 0:
        assert time.monotonic() < deadline, "the admission policy never took effect"
        time.sleep(0.5)


def test_the_operator_creates_only_what_it_renders(admission, namespace):
    kubectl = admission
    own = rendered(namespace)
    stranger = copy.deepcopy(own["raycluster"])
    del stranger["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    until_in_force(kubectl, namespace, stranger)

    for kind, obj in own.items():  # what it renders passes
        result = create_as_operator(kubectl, namespace, obj)
        assert result.returncode == 0, f"{kind}: {result.stderr}"

    refused_with(kubectl, namespace, stranger, "creates only what it renders")
    unowned = copy.deepcopy(own["secret"])
    del unowned["metadata"]["ownerReferences"]
    refused_with(kubectl, namespace, unowned, "controller ownerReference to that TPUFineTune")
    other_owner = copy.deepcopy(own["networkpolicy"])
    other_owner["metadata"]["ownerReferences"][0]["name"] = "someone-else"
    refused_with(kubectl, namespace, other_owner, "creates only what it renders")
    open_head = copy.deepcopy(own["raycluster"])
    del open_head["spec"]["authOptions"]
    refused_with(kubectl, namespace, open_head, "only RayClusters with token authentication")
    for selector in ({}, {"matchLabels": {"app": "web"}},
                     {"matchLabels": {"ray.io/cluster": "tft-demo", "team": "ml"}},
                     {"matchLabels": {"ray.io/cluster": "tft-other"}}):
        wide = copy.deepcopy(own["networkpolicy"])
        wide["spec"]["podSelector"] = selector
        refused_with(kubectl, namespace, wide, "only NetworkPolicies that select one of its")

    # Only the operator is held to it: the admin creates what it likes.
    assert kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-",
                   input=yaml.safe_dump(stranger), check=False).returncode == 0


def can_i(kubectl, verb: str, resource: str, namespace: str, name: str = "") -> bool:
    args = ["auth", "can-i", verb, f"{resource}/{name}" if name else resource, "-n", namespace, "--as", OPERATOR_SA]
    answer = kubectl(*args, check=False).stdout.strip()
    assert answer in ("yes", "no"), answer
    return answer == "yes"


@pytest.mark.parametrize("verb,resource", [
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("update", "secrets"), ("delete", "secrets"),
    ("get", "networkpolicies"), ("update", "networkpolicies"), ("delete", "networkpolicies"),
    ("update", "rayclusters.ray.io"), ("patch", "rayclusters.ray.io"),
    ("create", "pods"), ("delete", "pods"), ("create", "pods/exec"), ("get", "configmaps"),
    ("create", "serviceaccounts/token"), ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("update", "tpufinetunes.tpufinetune.dev"), ("delete", "tpufinetunes.tpufinetune.dev"),
])
def test_the_operator_cannot(admission, namespace, verb, resource):
    assert not can_i(admission, verb, resource, namespace)


def test_the_operator_reads_one_secret_of_its_namespace_by_name_and_creates_the_rest(admission, namespace):
    kubectl = admission
    assert can_i(kubectl, "get", "secrets", "tpufinetune-system", raytoken.SIGNING_KEY_SECRET)
    assert not can_i(kubectl, "get", "secrets", "tpufinetune-system", "another-secret")
    assert not can_i(kubectl, "update", "secrets", "tpufinetune-system", raytoken.SIGNING_KEY_SECRET)
    for resource in ("secrets", "networkpolicies.networking.k8s.io", "rayclusters.ray.io"):
        assert can_i(kubectl, "create", resource, namespace)
