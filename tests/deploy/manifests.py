"""Helpers of the deployment tests: paths, and the manifests under deploy/ as the real
tools render them (kubectl's built-in kustomize, helm built from Go modules)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from harness.controlplane import module_pin

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
HELM_GO_MODULE = ROOT / "tests" / "helmbuild"
CHART = DEPLOY / "helm" / "tpufinetune"
OPERATOR_NS = "tpufinetune-system"
OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NS}:tpufinetune-operator"


def helm_version() -> str:
    return module_pin(HELM_GO_MODULE, "helm.sh/helm/v3")


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML resolves YAML 1.1, where `2e-05` is a string; Go's YAML (kubectl, kustomize,
    helm, the API server) reads it as the number it is. kustomize writes floats that way."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)


def load(text: str) -> dict:
    return yaml.load(text, Loader=Yaml12Loader)


def documents(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=Yaml12Loader) if d]


def kustomize(control_plane, path: Path) -> list[dict]:
    return documents(control_plane.kubectl("kustomize", path).stdout)


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"{len(matches)} {kind} {name or ''}"
    return matches[0]


# Labels helm adds to what it installs, which kustomize's copy has not.
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")


def run(*argv, input: str | None = None, check: bool = True) -> str:
    result = subprocess.run([str(a) for a in argv], input=input, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
        return result.stdout
    assert result.returncode != 0, f"{argv} succeeded"
    return result.stderr


def template(helm, namespace: str, *values: str) -> str:
    return run(helm, "template", "tpufinetune", CHART, "--namespace", namespace, "--include-crds", *values)


def without_helm_labels(obj: dict) -> dict:
    for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
        for label in HELM_ONLY_LABELS:
            (meta.get("labels") or {}).pop(label, None)
    return obj


def by_identity(objects: list[dict]) -> dict:
    return {(o["kind"], o["metadata"]["name"]): without_helm_labels(o) for o in objects}


POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
SETTINGS_CONFIGMAP = "tpufinetune-operator-settings"


def policy_of_its_own(objects: list[dict], watched: str, suffix: str) -> tuple[list[dict], dict]:
    """deploy/base's admission policy and binding, and the settings ConfigMap that is the
    binding's parameter, each renamed with `suffix`, the ConfigMap watching `watched`.
    Each test applies its own: the API server's admission plugin follows a parameter
    ConfigMap per binding, and a binding deleted and made again under its old name can keep
    the parameter's earlier value for minutes (seen on this pin), so a test that re-used the
    names would judge the policy by the previous test's setting."""
    import copy

    policy = [copy.deepcopy(o) for o in objects if o["kind"] in POLICY_KINDS]
    settings = copy.deepcopy(next(o for o in objects
                                  if o["kind"] == "ConfigMap" and o["metadata"]["name"] == SETTINGS_CONFIGMAP))
    assert len(policy) == 2, [o["kind"] for o in policy]
    settings["metadata"]["name"] = f"{SETTINGS_CONFIGMAP}-{suffix}"
    settings["data"]["TPUFT_NAMESPACE"] = watched
    for o in policy:
        o["metadata"]["name"] = f"{o['metadata']['name']}-{suffix}"
        if o["kind"] == "ValidatingAdmissionPolicyBinding":
            o["spec"]["policyName"] = f"{o['spec']['policyName']}-{suffix}"
            assert o["spec"]["paramRef"]["name"] == SETTINGS_CONFIGMAP
            o["spec"]["paramRef"]["name"] = settings["metadata"]["name"]
    return policy, settings
