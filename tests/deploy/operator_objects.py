"""The objects the operator creates for a run, rendered by its own code: what the admission
tests ask the API server to admit from the operator's account."""

from __future__ import annotations

from tpufinetune.core import raytoken
from tpufinetune.core.api import parse_spec
from tpufinetune.core.podtemplate import raycluster_with_pod_settings

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"
SPEC = parse_spec({"tpu": {"generation": "cpu", "topology": "2"}, "image": "registry.example/t:1",
                   "checkpoint": {"storagePath": "gs://b/ckpt"}})


def rendered(namespace: str) -> dict[str, dict]:
    """The operator's own objects for run `demo`, as it creates them."""
    cluster = raycluster_with_pod_settings("demo", namespace, UID, SPEC)
    return {"raycluster": raytoken.with_key_id(cluster, "demo", UID, "abcdef0123"),
            "secret": raytoken.token_secret("demo", namespace, UID, "t0k", "abcdef0123"),
            "networkpolicy": raytoken.network_policy("demo", namespace, UID, "tpufinetune-system")}
