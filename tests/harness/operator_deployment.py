"""The operator as deploy/'s Deployment on the ground: deploy/overlays/several-namespaces (deploy/base
watching the ground's namespaces, service_account.WATCHED, each bound when it is made) less the
CRD (the ground installs the same file), so its two pods run the image Dockerfile.operator
builds (images.ensure_operator), from its entrypoint, with the ConfigMap's settings, the
ServiceAccount's bound token (in-cluster config, the ServiceAccount admission plugin and the
node agent's projection) and the downward API's pod name; the node agent runs their probes.
`make cluster` runs the operator this way; tests/operator/test_operator_deploy_e2e.py checks it.
"""
from __future__ import annotations

import json

import yaml

from service_account import SEVERAL_NAMESPACES, WATCHED, is_watch_binding, watch_binding
from waiting import wait_for

NAMESPACE = "tpufinetune-system"
SELECTOR = "app.kubernetes.io/name=tpufinetune-operator"
LEASE = "tpufinetune-operator"
# What applying deploy/base adds to a ground whose operator runs as a process (the ground
# already has the RBAC objects, the namespace, and the settings are harmless): removed again.
ADDED_KINDS = ("Deployment", "PodDisruptionBudget", "NetworkPolicy", "ValidatingAdmissionPolicy",
               "ValidatingAdmissionPolicyBinding")


def rendered(cp) -> list[dict]:
    """The overlay with TPUFT_NAMESPACE set to the ground's namespaces, as its user would set
    it: its example namespace's RoleBinding replaced by one in each namespace WATCHED names
    (`default`; a glob's are bound as they are made)."""
    objects = [obj for obj in yaml.safe_load_all(cp.kubectl("kustomize", str(SEVERAL_NAMESPACES)).stdout)
               if obj and obj["kind"] != "CustomResourceDefinition" and not is_watch_binding(obj)]
    objects += [watch_binding(cp, name) for name in WATCHED.split() if "*" not in name]
    for obj in objects:
        if obj["kind"] == "ConfigMap" and "TPUFT_NAMESPACE" in obj.get("data", {}):
            obj["data"]["TPUFT_NAMESPACE"] = WATCHED
    return objects


def apply(cp) -> list[dict]:
    """Applied server-side (the objects the ground applied before are taken over)."""
    objects = rendered(cp)
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(objects))
    return objects


def pods(cp) -> list[dict]:
    listed = cp.kubectl("-n", NAMESPACE, "get", "pods", "-l", SELECTOR, "-o", "json").stdout
    return [pod for pod in json.loads(listed)["items"] if not pod["metadata"].get("deletionTimestamp")]


def ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def wait_ready(cp, replicas: int = 2, timeout: float = 180) -> list[dict]:
    def all_ready():
        found = pods(cp)
        return found if len(found) == replicas and all(map(ready, found)) else None
    return wait_for(all_ready, timeout, f"{replicas} operator pods Running and Ready",
                    details=lambda: json.dumps([{"name": p["metadata"]["name"], "phase": p["status"].get("phase"),
                                                 "containers": p["status"].get("containerStatuses")} for p in pods(cp)])[-3000:])


def lease_holder(cp) -> str:
    answer = cp.kubectl("-n", NAMESPACE, "get", "lease", LEASE, "-o", "json", check=False)
    return (json.loads(answer.stdout)["spec"].get("holderIdentity") or "") if answer.returncode == 0 else ""


def leading_pod(cp) -> str:
    """The Lease's holder when it is one of the Deployment's pods, else ""."""
    holder = lease_holder(cp)
    return holder if holder and holder in {pod["metadata"]["name"] for pod in pods(cp)} else ""


def remove(cp, objects: list[dict], timeout: float = 60) -> None:
    """The kinds a process-run ground did not have, deleted; their pods gone."""
    added = [obj for obj in objects if obj["kind"] in ADDED_KINDS]
    cp.kubectl("delete", "--wait=true", f"--timeout={int(timeout)}s", "--ignore-not-found", "-f", "-",
               input=yaml.safe_dump_all(added), check=False, timeout=timeout + 10)
    wait_for(lambda: not pods(cp), timeout, "the operator Deployment's pods gone")
