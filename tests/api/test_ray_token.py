"""Ray authentication of each run (core/raytoken.py): the RayCluster turns token auth on
with its own Secret, the token is derived from the operator's signing key and the run's
identity (so no run's token opens another run's head), and the NetworkPolicy admits only
the cluster's own pods, the operator's namespace (dashboard) and metrics scrapes."""
from __future__ import annotations

import re

import pytest
from api_spec_cases import IMAGE, spec_with

from tpufinetune.core import raytoken
from tpufinetune.core.api import parse_spec
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.settings import Settings

KEY = b"k" * 32
UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"
SPEC = parse_spec({"tpu": {"generation": "cpu", "topology": "2"}, "image": IMAGE,
                   "checkpoint": {"storagePath": "gs://b/ckpt"}})


def test_every_raycluster_turns_on_token_auth_with_its_own_secret_named_for_its_key():
    rendered = raycluster_with_pod_settings("demo", "ml", UID, SPEC)
    assert rendered["spec"]["authOptions"] == {"mode": "token", "secretName": "tft-demo-ray-token-6f1c2a7e"}
    key_id = raytoken.key_id(KEY)
    cluster = raytoken.with_key_id(rendered, "demo", UID, key_id)
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": f"tft-demo-ray-token-6f1c2a7e-{key_id}"}
    assert cluster["metadata"]["labels"][raytoken.KEY_ID_LABEL] == key_id
    assert rendered["spec"]["authOptions"]["secretName"] == "tft-demo-ray-token-6f1c2a7e"  # not changed in place
    secret = raytoken.token_secret("demo", "ml", UID, "t0k", key_id)
    assert secret["metadata"]["name"] == cluster["spec"]["authOptions"]["secretName"]
    assert secret["metadata"]["namespace"] == "ml"
    # KubeRay reads the key auth_token; the Secret goes with the TPUFineTune.
    assert secret["stringData"] == {"auth_token": "t0k"}
    assert secret["metadata"]["ownerReferences"] == cluster["metadata"]["ownerReferences"]
    assert secret["metadata"]["labels"] == cluster["metadata"]["labels"]


def test_a_cluster_rebuilt_after_a_rotation_names_another_secret():
    new_key = b"n" * 32
    names = {raytoken.with_key_id(raycluster_with_pod_settings("demo", "ml", UID, SPEC), "demo", UID,
                                  raytoken.key_id(key))["spec"]["authOptions"]["secretName"] for key in (KEY, new_key)}
    assert len(names) == 2


def test_a_new_object_of_the_same_name_gets_another_secret_and_token():
    other_uid = "0d9e8f7a-0000-4000-8000-000000000001"
    assert (raycluster_with_pod_settings("demo", "ml", other_uid, SPEC)["spec"]["authOptions"]["secretName"]
            != raycluster_with_pod_settings("demo", "ml", UID, SPEC)["spec"]["authOptions"]["secretName"])
    assert raytoken.derive_token(KEY, "ml", "demo", other_uid) != raytoken.derive_token(KEY, "ml", "demo", UID)


def test_the_token_is_derived_per_run_and_per_key():
    token = raytoken.derive_token(KEY, "ml", "demo", UID)
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert token == raytoken.derive_token(KEY, "ml", "demo", UID)  # derived again, never stored
    others = {raytoken.derive_token(KEY, "ml", "demo2", UID), raytoken.derive_token(KEY, "ml2", "demo", UID),
              raytoken.derive_token(b"x" * 32, "ml", "demo", UID)}
    assert token not in others and len(others) == 3
    # "<namespace>/<name>/<uid>": no two identities collide by moving a separator.
    assert raytoken.derive_token(KEY, "a", "b-c", UID) != raytoken.derive_token(KEY, "a-b", "c", UID)


def test_an_empty_signing_key_is_refused():
    with pytest.raises(ValueError, match="signing key is empty"):
        raytoken.derive_token(b"", "ml", "demo", UID)


def test_the_network_policy_selects_the_clusters_pods_and_admits_only_its_own_and_the_operator():
    cluster = raycluster_with_pod_settings("demo", "ml", UID, SPEC)
    policy = raytoken.network_policy("demo", "ml", UID, "tpufinetune-system")
    # KubeRay labels every pod of the cluster ray.io/cluster=<RayCluster name>.
    own_pods = {"ray.io/cluster": cluster["metadata"]["name"]}
    assert policy["spec"]["podSelector"] == {"matchLabels": own_pods}
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"] == cluster["metadata"]["ownerReferences"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, operator, metrics = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": own_pods}}]}
    assert operator["from"] == [{"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "tpufinetune-system"}}}]
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert metrics == {"ports": [{"protocol": "TCP", "port": 8080}]}
    # GCS (6379) and the Ray client (10001) are reachable only from the cluster's own pods.
    assert all(p["port"] not in (6379, 10001) for rule in (operator, metrics) for p in rule["ports"])


@pytest.mark.parametrize("url,fixed", [
    ("http://{service}.{namespace}.svc:8265", False),
    ("https://{cluster}.{namespace}.ray.example", False),
    ("http://127.0.0.1:8265", True),
])
def test_only_a_fixed_dashboard_uses_the_configured_token(url, fixed):
    assert Settings(dashboard_url=url).fixed_dashboard is fixed


def test_the_operator_namespace_defaults_to_deploys_and_is_read_from_its_variable():
    assert Settings().operator_namespace == "tpufinetune-system"
    assert Settings.from_env({"TPUFT_OPERATOR_NAMESPACE": "ops"}).operator_namespace == "ops"


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "2.100.1", "3.0.0", "10.1.2"])
def test_every_ray_version_with_token_auth_is_accepted_by_python_and_the_cel_pattern(version):
    from tpufinetune.core.validation import RAY_VERSION_AT_LEAST

    assert parse_spec(spec_with(rayVersion=version)).ray_version == version
    assert re.match(RAY_VERSION_AT_LEAST, version)


@pytest.mark.parametrize("version", ["2.51.9", "2.5.0", "1.99.0", "0.52.0"])
def test_a_ray_version_without_token_auth_is_refused_naming_the_field(version):
    from tpufinetune.core.errors import SpecError
    from tpufinetune.core.validation import RAY_VERSION_AT_LEAST, RAY_VERSION_MESSAGE

    with pytest.raises(SpecError, match=r"spec\.rayVersion: must be 2\.52\.0 or newer"):
        parse_spec(spec_with(rayVersion=version))
    assert not re.match(RAY_VERSION_AT_LEAST, version)
    assert "2.52.0" in RAY_VERSION_MESSAGE


# ---- the signing keyring and key ids (rotation: docs/gke.md) --------------------------

def b64(key: bytes) -> str:
    import base64
    return base64.b64encode(key).decode()


WHERE = "tpufinetune-system/tpufinetune-ray-token-key"
OLD, NEW = b"o" * 32, b"n" * 32


def test_a_key_id_is_short_stable_and_tells_keys_apart_without_showing_them():
    assert raytoken.key_id(KEY) == raytoken.key_id(bytes(KEY))
    assert len(raytoken.key_id(KEY)) == raytoken.KEY_ID_CHARS
    assert raytoken.key_id(OLD) != raytoken.key_id(NEW)
    assert re.fullmatch(r"[0-9a-f]+", raytoken.key_id(KEY))  # a label value
    assert raytoken.key_id(KEY) not in (KEY.hex(), b64(KEY))


def test_the_keyring_is_the_current_key_then_the_older_ones_by_entry_name():
    keyring = raytoken.parse_keyring({"key": b64(NEW), "key.2026-11": b64(OLD), "key.2026-10": b64(KEY),
                                      "key.same-as-current": b64(NEW)}, WHERE)
    assert keyring.current == raytoken.key_id(NEW)
    assert keyring.ids() == (raytoken.key_id(NEW), raytoken.key_id(KEY), raytoken.key_id(OLD))
    assert keyring.key(raytoken.key_id(OLD)) == OLD
    assert keyring.key("0000000000") is None
    assert raytoken.parse_keyring({"key": b64(NEW)}, WHERE).ids() == (raytoken.key_id(NEW),)


@pytest.mark.parametrize("data,words", [
    (None, f"Secret {WHERE} has no data.key; put the current key there"),
    ({"key.old": b64(OLD)}, "has no data.key; put the current key there"),
    ({"key": "%%% not base64"}, r"data.key is not base64 .*restore it from your copy or remove the entry"),
    ({"key": b64(NEW), "key.old": "nope!"}, r"data.key.old is not base64"),
    ({"key": b64(b"secret")}, r"data.key holds 6 bytes; a key needs at least 16"),
    ({"key": b64(NEW), "previous": b64(OLD)}, r"data.previous is not a keyring entry; .*data.key.<name>"),
])
def test_a_keyring_that_cannot_be_used_is_named_with_the_entry_and_the_fix(data, words):
    with pytest.raises(raytoken.KeyringError, match=words):
        raytoken.parse_keyring(data, WHERE)


def test_a_run_refused_again_under_the_same_key_uses_a_retry_and_under_a_new_key_does_not():
    from tpufinetune.core.phaseattempts import _free_rebuild, token_refused

    why = token_refused("aaaa", "the head took no key")
    assert _free_rebuild({}, why)
    ended = {"attempts": [{"attempt": 1, "endTime": "t", "message": why}]}
    assert not _free_rebuild(ended, token_refused("aaaa", "again"))
    assert _free_rebuild(ended, token_refused("bbbb", "a second rotation"))
    assert not _free_rebuild({}, "the Ray head at x does not answer")
