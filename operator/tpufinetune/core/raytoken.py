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

The signing key is a keyring (one Secret, SIGNING_KEY_SECRET): `data.key` is the current
key, every new RayCluster gets a token from it; `data.key.<any name>` entries are older
keys, still accepted for the runs whose RayCluster was made with them. Each key has an id,
a short hash of it (never the key): the token Secret of each RayCluster carries it in its
name and in the label KEY_ID_LABEL, and so does the RayCluster, so an admin can list which
clusters still use a key before removing it (docs/gke.md, "Rotating the signing key").

The NetworkPolicy admits traffic to the cluster's pods only from the cluster's own pods
(every port: GCS, raylets, object transfer), the operator's namespace (the dashboard,
where the Job API lives) and, on the metrics port, from anywhere (Prometheus).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass

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
OLDER_KEY_PREFIX = SIGNING_KEY_FIELD + "."  # data.key.<name>: an older key, kept for its runs
SIGNING_KEY_BYTES = 32
MIN_KEY_BYTES = 16  # a shorter key is a mistake (a typed word), not a secret
KEY_ID_LABEL = "tpufinetune.dev/ray-key-id"  # on each token Secret and RayCluster
KEY_ID_CHARS = 10  # hex characters of sha256(key): 40 bits, enough to tell a keyring's keys apart
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def derive_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The Ray token of TPUFineTune namespace/name (uid): hex HMAC-SHA256. A new object
    with the same name (a new uid) gets another token."""
    if not key:
        raise ValueError("the Ray token signing key is empty")
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """The key's id: a short hash of it, safe to show (a label, a log line)."""
    return hashlib.sha256(b"tpufinetune ray key id\0" + key).hexdigest()[:KEY_ID_CHARS]


class KeyringError(ValueError):
    """The signing key Secret cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True)
class Keyring:
    """The current key and the older ones still accepted, each by its id (current first)."""

    current: str
    keys: dict  # key id -> key bytes; insertion order: current, then older by entry name

    def ids(self) -> tuple[str, ...]:
        return tuple(self.keys)

    def key(self, key_id: str) -> bytes | None:
        return self.keys.get(key_id)


def parse_keyring(data: dict | None, where: str) -> Keyring:
    """The keyring in a Secret's `data` (base64 values); `where` names the Secret in errors.
    `data.key` is required; `data.key.<name>` entries are older keys; nothing else is
    allowed (a misspelt entry would otherwise drop a key that running clusters need)."""
    data = data or {}
    if not data.get(SIGNING_KEY_FIELD):
        raise KeyringError(
            f"Secret {where} has no data.{SIGNING_KEY_FIELD}; put the current key there (32 random bytes, "
            f"base64), or delete the Secret and the operator creates a new key (the heads of running "
            f"RayClusters then refuse the operator, and each run is rebuilt once with a new token)")
    stray = sorted(k for k in data if k != SIGNING_KEY_FIELD and not k.startswith(OLDER_KEY_PREFIX))
    if stray:
        raise KeyringError(f"Secret {where}: data.{stray[0]} is not a keyring entry; name the current key "
                           f"data.{SIGNING_KEY_FIELD} and each older key data.{OLDER_KEY_PREFIX}<name>")
    keys: dict[str, bytes] = {}
    older = sorted(k for k in data if k.startswith(OLDER_KEY_PREFIX))
    for field in (SIGNING_KEY_FIELD, *older):
        key = _decoded(data[field], where, field)
        keys.setdefault(key_id(key), key)  # the same key twice is one key
    return Keyring(current=next(iter(keys)), keys=keys)


def _decoded(value: str, where: str, field: str) -> bytes:
    try:
        key = base64.b64decode(value or "", validate=True)
    except (binascii.Error, ValueError) as error:
        raise KeyringError(f"Secret {where}: data.{field} is not base64 ({error}); restore it from your copy "
                           f"or remove the entry") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyringError(f"Secret {where}: data.{field} holds {len(key)} bytes; a key needs at least "
                           f"{MIN_KEY_BYTES} random bytes (e.g. `head -c 32 /dev/urandom`)")
    return key


def keyed_secret_name(name: str, uid: str, key_id_: str) -> str:
    """The token Secret of a RayCluster made with key `key_id_`: a cluster rebuilt after a
    rotation gets a new Secret (they are create-only) with a token of the new key."""
    return f"{token_secret_name(name, uid)}-{key_id_}"


def with_key_id(raycluster: dict, name: str, uid: str, key_id_: str) -> dict:
    """The RayCluster of TPUFineTune `name` as created: its authOptions name the token
    Secret of key `key_id_`, and it carries the key's id (KEY_ID_LABEL) for the admin's
    `kubectl get -l`. A cluster without token auth is returned as it is."""
    meta, spec = raycluster["metadata"], raycluster["spec"]
    if spec.get("authOptions") is None:
        return raycluster
    return {**raycluster,
            "metadata": {**meta, "labels": {**(meta.get("labels") or {}), KEY_ID_LABEL: key_id_}},
            "spec": {**spec, "authOptions": {**spec["authOptions"],
                                             "secretName": keyed_secret_name(name, uid, key_id_)}}}


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


def token_secret(name: str, namespace: str, uid: str, token: str, key_id_: str) -> dict:
    """The token Secret of the run's RayCluster made with key `key_id_`, owned by the
    TPUFineTune (gone with it)."""
    metadata = _metadata(keyed_secret_name(name, uid, key_id_), name, namespace, uid)
    metadata["labels"][KEY_ID_LABEL] = key_id_
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
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
