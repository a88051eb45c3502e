"""Ray authentication of each run's RayCluster, and the network policy around it (pure).

Every RayCluster runs Ray with token authentication, its own token: KubeRay's
`spec.authOptions` (mode token, secretName) puts RAY_AUTH_MODE and RAY_AUTH_TOKEN (a
secretKeyRef on the key `auth_token`) into every Ray container, head and workers, and
creates no Secret of its own when secretName is set.

The token is derived, never stored where the operator must read it back:
HMAC-SHA256(the operator's signing key, "<namespace>/<name>/<uid>") of the TPUFineTune.
The operator writes it once into the run's Secret (owned by the TPUFineTune, so the
garbage collector removes it) and derives it again whenever it talks to that head; it
never reads tenants' Secrets. One run's token opens no other run's head.

The NetworkPolicy admits traffic to the cluster's pods only from the cluster's own pods
(every port: GCS, raylets, object transfer), the operator's namespace (the dashboard,
where the Job API lives) and, on the metrics port, from anywhere (Prometheus).
"""
from __future__ import annotations

import hashlib
import hmac

from .names import API_VERSION, KIND
from .sizing import (
    AUTH_TOKEN_KEY,
    DASHBOARD_PORT,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    raycluster_name,
    token_secret_name,
)

CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's label on every pod of a RayCluster
METRICS_PORT = 8080  # KubeRay's default metrics port on every Ray container

# The operator's signing key: one Secret in the operator's own namespace, the only Secret
# the operator reads (its Role names it; deploy/base/role-ray-token-key.yaml).
SIGNING_KEY_SECRET = "tpufinetune-ray-token-key"
SIGNING_KEY_FIELD = "key"
SIGNING_KEY_BYTES = 32
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def derive_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The Ray token of TPUFineTune namespace/name (uid): hex HMAC-SHA256. A new object
    with the same name (a new uid) gets another token."""
    if not key:
        raise ValueError("the Ray token signing key is empty")
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


def network_policy_name(name: str) -> str:
    return f"{raycluster_name(name)}-ray"


def _metadata(object_name: str, name: str, namespace: str, uid: str) -> dict:
    return {
        "name": object_name,
        "namespace": namespace,
        "labels": {MANAGED_BY_LABEL: MANAGED_BY, NAME_LABEL: name},
        "ownerReferences": [{
            "apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True,
        }],
    }


def token_secret(name: str, namespace: str, uid: str, token: str) -> dict:
    """The run's token Secret, owned by the TPUFineTune (gone with it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(token_secret_name(name, uid), name, namespace, uid),
        "type": "Opaque",
        "stringData": {AUTH_TOKEN_KEY: token},
    }


def network_policy(name: str, namespace: str, uid: str, operator_namespace: str) -> dict:
    """Ingress to the RayCluster's pods: from its own pods (any port), from the operator's
    namespace (the dashboard only) and to the metrics port from anywhere. Everything else
    is refused where the network enforces NetworkPolicy (GKE Dataplane V2)."""
    cluster = {CLUSTER_LABEL: raycluster_name(name)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(network_policy_name(name), name, namespace, uid),
        "spec": {
            "podSelector": {"matchLabels": dict(cluster)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(cluster)}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}}],
                 "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]},
                {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
            ],
        },
    }
