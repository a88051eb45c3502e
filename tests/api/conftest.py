"""Fixtures for the pure-core API tests: KubeRay's real RayCluster schema and the KubeRay
TPU webhook's admission rule, both applied to every RayCluster the sizing renders."""
from __future__ import annotations

import math
from pathlib import Path

import jsonschema  # a dev dependency (pyproject.toml): missing, the schema checks fail, never skip
import pytest
import yaml

from harness import controlplane

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERAY_CRD = controlplane.KUBERAY_CRD  # extracted from the pinned ray-operator module

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _unknown_fields(value: object, schema: dict, path: str) -> list[str]:
    """Fields the apiserver would prune (or refuse under strict field validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    problems: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                problems += _unknown_fields(item, properties[key], f"{path}.{key}")
            elif isinstance(additional, dict):
                problems += _unknown_fields(item, additional, f"{path}.{key}")
            elif properties is not None:
                problems.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problems += _unknown_fields(item, schema["items"], f"{path}[{index}]")
    return problems


class KubeRaySchema:
    """Checks a manifest against the published `ray.io/v1` RayCluster openAPIV3Schema."""

    def __init__(self, schema: dict):
        self.schema = schema
        self._validator = jsonschema.Draft4Validator(schema)

    def problems(self, manifest: dict) -> list[str]:
        problems = _unknown_fields(manifest, self.schema, "")
        problems += [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
                     for e in self._validator.iter_errors(manifest)]
        return problems


@pytest.fixture(scope="session")
def kuberay_schema() -> KubeRaySchema:
    if not KUBERAY_CRD.exists():
        pytest.fail(f"KubeRay CRD not found at {controlplane.KUBERAY_CRD_DISPLAY}; the schema "
                    "checks need it", pytrace=False)
    return KubeRaySchema(_v1_schema(KUBERAY_CRD.read_text()))


def _v1_schema(text: str) -> dict:
    # The file holds two ~9k-line versions (v1 first); parsing only the first halves the
    # session's set-up time. Falls back to the whole file if the layout ever changes.
    first = text.find("\n  - ", text.find("\n  versions:"))
    second = text.find("\n  - ", first + 1)
    for candidate in ((text[:second],) if second > 0 else ()) + (text,):
        try:
            crd = yaml.load(candidate, Loader=_Loader)
            version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        except (yaml.YAMLError, StopIteration, KeyError, TypeError):
            continue
        return version["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no ray.io/v1 schema in {KUBERAY_CRD}")


def tpu_webhook_refusal(raycluster: dict) -> str | None:
    """The KubeRay TPU webhook's RayCluster admission rule, as its Go source states it:
    a worker group whose containers request google.com/tpu needs the
    cloud.google.com/gke-tpu-topology node selector, and numOfHosts must equal
    max(chips in the topology / min(TPU limit, TPU request), 1)."""
    for group in raycluster["spec"].get("workerGroupSpecs", []):
        pod = group["template"]["spec"]
        per_pod = 0
        for container in pod["containers"]:
            resources = container.get("resources", {})
            limit = int(resources.get("limits", {}).get("google.com/tpu", 0))
            request = int(resources.get("requests", {}).get("google.com/tpu", limit))
            per_pod = max(per_pod, min(limit, request))
        if per_pod == 0:
            continue
        topology = pod.get("nodeSelector", {}).get("cloud.google.com/gke-tpu-topology", "")
        if not topology:
            return f"{group['groupName']}: TPU topology not specified"
        chips = math.prod(int(d) for d in topology.split("x"))
        if group.get("numOfHosts", 0) != max(chips // per_pod, 1):
            return f"{group['groupName']}: number of workers not equal to the topology"
    return None


@pytest.fixture
def webhook_refusal():
    return tpu_webhook_refusal
