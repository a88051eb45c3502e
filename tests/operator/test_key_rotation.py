"""Rotating the Ray token signing key (docs/gke.md, "Rotating the signing key").

- Against a real kube-apiserver, the operator's KubeBackend and driver: each RayCluster is
  made with the keyring's current key, its token Secret named and labelled with the key's
  id, and so is the RayCluster; after a rotation (new key in data.key, the old one kept
  in data.key.<name>) a new run gets the new key while the first run's token stays the
  old key's, for this process and for a restarted one; the admin lists who uses a key.
- Against a real Ray head with token auth (its token is a run's, derived from the old key):
  a restarted operator finds the old key after the head refuses the current one, and the
  run goes on; once the old key is removed the head takes no key, and the attempt ends at
  once (not after TPUFT_RAY_UNREACHABLE_TIMEOUT) with a rebuild on a cluster of the current
  key, using no retry; refused again under the same key, it uses one (none left: Failed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets

import pytest
import yaml
from kubernetes import client

from harness import rayhead
from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.adapters.raytokens import RayTokens
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases, raytoken
from tpufinetune.core.phases import Identity
from tpufinetune.driver import Run
from tpufinetune.settings import Settings

from run_helpers import MemoryCluster, body, running, settings

OLD, NEW = secrets.token_bytes(32), secrets.token_bytes(32)
OLD_ID, NEW_ID = raytoken.key_id(OLD), raytoken.key_id(NEW)


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def spoken_with(tokens: RayTokens) -> str:
    """The id of the key whose token the run's head is given now."""
    token = tokens.token(IDENT)
    return next(k for k, key in ((OLD_ID, OLD), (NEW_ID, NEW))
                if raytoken.derive_token(key, IDENT.namespace, IDENT.name, IDENT.uid) == token)


# ---- the real kube-apiserver: Secrets, labels, names ------------------------------------


class Backend(KubeBackend):
    def record(self, ident, type_, reason, message):
        pass  # kopf posts Events only from inside a running operator


def keyring_secret(namespace: str, data: dict) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                           "metadata": {"name": raytoken.SIGNING_KEY_SECRET, "namespace": namespace},
                           "data": data})


def new_run(kubectl, namespace: str, name: str) -> dict:
    manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
                "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                         "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
    return json.loads(kubectl("-n", namespace, "get", "tpufinetune", name, "-o", "json").stdout)


async def until_created(run: Run) -> None:
    for _ in range(10):  # a bound, not a pace: New -> Pending -> Provisioning creates it
        decision = await run.step()
        if decision.phase == phases.PROVISIONING:
            return
    raise AssertionError(f"no RayCluster created; phase {decision.phase}")


@pytest.mark.timeout(120)
def test_each_raycluster_is_made_with_the_current_key_and_a_rotation_keeps_the_old_runs_key(
        control_plane, kuberay_crd, k8s_api, namespace):
    kubectl = control_plane.kubectl
    kubectl("apply", "-f", "-", input=keyring_secret(namespace, {"key": b64(OLD)}))
    settings_ = Settings(poll_interval=1, operator_namespace=namespace)  # the keyring lives here
    backend = Backend(k8s_api, settings_)
    first = Run(new_run(kubectl, namespace, "first"), backend, RayJobs(), settings_)
    asyncio.run(until_created(first))

    cluster = json.loads(kubectl("-n", namespace, "get", "raycluster", "tft-first", "-o", "json").stdout)
    assert cluster["metadata"]["labels"][raytoken.KEY_ID_LABEL] == OLD_ID
    secret_name = cluster["spec"]["authOptions"]["secretName"]
    assert secret_name.endswith(f"-{OLD_ID}")
    secret = json.loads(kubectl("-n", namespace, "get", "secret", secret_name, "-o", "json").stdout)
    assert secret["metadata"]["labels"][raytoken.KEY_ID_LABEL] == OLD_ID
    ident = first.ident
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == raytoken.derive_token(
        OLD, namespace, "first", ident.uid)

    # The rotation: the new key becomes data.key, the old one stays as data.key.<name>.
    kubectl("apply", "-f", "-", input=keyring_secret(namespace, {"key": b64(NEW), "key.2026-12": b64(OLD)}))
    second = Run(new_run(kubectl, namespace, "second"), backend, RayJobs(), settings_)
    asyncio.run(until_created(second))
    assert json.loads(kubectl("-n", namespace, "get", "raycluster", "tft-second", "-o", "json").stdout)[
        "metadata"]["labels"][raytoken.KEY_ID_LABEL] == NEW_ID
    # This process speaks to the first run's head with the old key's token still ...
    assert backend.tokens.token(ident) == raytoken.derive_token(OLD, namespace, "first", ident.uid)
    # ... and a restarted one finds it after the head refuses the current key's.
    restarted = RayTokens(k8s_api, namespace)
    assert restarted.token(ident) == raytoken.derive_token(NEW, namespace, "first", ident.uid)
    assert restarted.refused(ident) == OLD_ID
    assert restarted.token(ident) == raytoken.derive_token(OLD, namespace, "first", ident.uid)
    assert restarted.refused(ident) == ""  # no key left to try: the cluster is rebuilt

    # What the admin looks at before removing the old key: who still uses it.
    users = kubectl("get", "rayclusters", "-A", "-l", f"{raytoken.KEY_ID_LABEL}={OLD_ID}", "-o",
                    "jsonpath={.items[*].metadata.name}").stdout.split()
    assert users == ["tft-first"]
    secrets_ = kubectl("-n", namespace, "get", "secrets", "-l", f"{raytoken.KEY_ID_LABEL}={NEW_ID}", "-o",
                       "jsonpath={.items[*].metadata.name}").stdout.split()
    assert secrets_ == [f"tft-second-ray-token-{second.ident.uid[:8]}-{NEW_ID}"]


def test_a_keyring_secret_with_a_stray_entry_refuses_the_create_naming_the_entry(
        control_plane, kuberay_crd, k8s_api, namespace):
    kubectl = control_plane.kubectl
    kubectl("apply", "-f", "-", input=keyring_secret(namespace, {"key": b64(NEW), "previous": b64(OLD)}))
    settings_ = Settings(poll_interval=1, operator_namespace=namespace)
    run = Run(new_run(kubectl, namespace, "stray"), Backend(k8s_api, settings_), RayJobs(), settings_)

    async def three_steps():
        for _ in range(3):
            await run.step()
    asyncio.run(three_steps())
    assert "data.previous is not a keyring entry" in run.create_refused
    assert kubectl("-n", namespace, "get", "rayclusters", "-o", "name").stdout.strip() == ""


# ---- a real Ray head with token auth ----------------------------------------------------


class KeyringCluster(MemoryCluster):
    """One run's Kubernetes in memory, with the operator's RayTokens over a keyring the test
    edits (the Secret's `data`); the RayClusters it is asked to create are kept."""

    def __init__(self, address: str, keyring: dict):
        super().__init__(address)
        self.exists = True
        self.tokens = RayTokens(client.ApiClient(), "tpufinetune-system")
        self.tokens._read_or_create = lambda: dict(keyring)
        self.manifests: list[dict] = []

    async def create(self, ident, manifest):
        self.manifests.append(manifest)
        await super().create(ident, manifest)

    async def ray_token(self, ident):
        return await asyncio.to_thread(self.tokens.token, ident)


IDENT = Identity("demo", "ns", "uid-1")  # run_helpers.body's


@pytest.fixture(scope="module")
def old_key_head():
    """A head whose token is run demo's of the OLD key, as KubeRay would give it."""
    token = raytoken.derive_token(OLD, IDENT.namespace, IDENT.name, IDENT.uid)
    original = rayhead.secrets.token_hex
    rayhead.secrets.token_hex = lambda _n: token  # RayHead.start draws its token so
    try:
        head = rayhead.RayHead.start(num_cpus=1)
    finally:
        rayhead.secrets.token_hex = original
    assert head.token == token
    job = head.job_client().submit_job(entrypoint="sleep 600", submission_id="tft-uid-1-1")
    yield head, job
    head.stop()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_restarted_operator_keeps_the_old_key_for_its_head_and_a_removed_key_rebuilds_once_for_free(
        old_key_head):
    head, _ = old_key_head
    keyring = {"key": b64(NEW), "key.2026-12": b64(OLD)}  # rotated: the old key kept
    cluster = KeyringCluster(head.dashboard_url, keyring)
    run = Run(body(running(head.dashboard_url)), cluster, RayJobs(timeout=5), settings(ray_unreachable_timeout=600))

    async def steps():
        first = await run.step()  # the current key's token is refused, the old key's taken
        first_key, first_events = spoken_with(cluster.tokens), list(cluster.events)
        await run.close()  # its log stream
        keyring.pop("key.2026-12")  # removed too early: the head takes no key now
        restarted = Run(body(first.status), cluster, RayJobs(timeout=5), settings(ray_unreachable_timeout=600))
        cluster.tokens = RayTokens(client.ApiClient(), "tpufinetune-system")
        cluster.tokens._read_or_create = lambda: dict(keyring)
        refused = await restarted.step()
        for _ in range(3):  # Pending -> the new RayCluster
            if cluster.manifests:
                break
            await restarted.step()
        return first, first_key, first_events, refused
    first, first_key, first_events, refused = asyncio.run(steps())

    assert first.phase == phases.RUNNING and first_events == [], first_events
    assert first_key == OLD_ID

    # At once, not after 600 s: a rebuild, attempt 2, no retry used (spec.maxRetries 0).
    assert refused.phase == phases.PENDING, refused.status.get("message")
    assert refused.status["attempt"] == 2 and int(refused.status.get("retries") or 0) == 0
    assert phases.DeleteCluster("tft-demo") in refused.actions
    ended = refused.status["attempts"][0]
    assert ended["reason"] == "ClusterLost" and ended["message"].startswith(
        f"the Ray head refused the run's token (current key {NEW_ID})")
    assert f"Secret tpufinetune-system/{raytoken.SIGNING_KEY_SECRET}" in ended["message"]
    # The new RayCluster is made with the current key: a new token Secret, a new label.
    (manifest,) = cluster.manifests
    assert manifest["spec"]["authOptions"]["secretName"].endswith(f"-{NEW_ID}")
    assert manifest["metadata"]["labels"][raytoken.KEY_ID_LABEL] == NEW_ID

    # The same head refusing again under the same current key costs a retry: none left.
    again = Run(body({**running(head.dashboard_url), "attempt": 2, "jobId": "tft-uid-1-1",
                      "attempts": refused.status["attempts"]}), cluster, RayJobs(timeout=5),
                settings(ray_unreachable_timeout=600))
    failed = asyncio.run(again.step())
    assert failed.phase == phases.FAILED
    condition = cond.find(failed.status, cond.FAILED)
    assert condition["reason"] == "RayUnreachable" and "no retries left" in condition["message"]


def test_many_refused_tokens_read_the_keyring_once_not_once_each():
    """A hundred heads refusing at once (a key removed too early) cost one read of the
    signing key Secret within REFUSED_REREAD_S, not a hundred under the keyring's lock. The
    Secret read is replaced by a count: the fault is in how often it is asked."""
    reads = []
    tokens = RayTokens(client.ApiClient(), "tpufinetune-system")
    tokens._read_or_create = lambda: reads.append(1) or {"key": b64(NEW), "key.2026-12": b64(OLD)}
    tokens.keyring()
    for i in range(100):
        assert tokens.refused(Identity(f"run-{i}", "ns", f"uid-{i}")) == OLD_ID  # the other key, to try
    assert len(reads) == 1


@pytest.mark.timeout(120)
def test_a_burst_of_new_clusters_shares_fresh_reads_of_the_keyring_and_a_rotation_is_seen_at_once(
        control_plane, k8s_api, namespace):
    """Each new RayCluster takes the key current when its create began (a GET sent after
    that), but a burst of them waiting on one read at a time shares each read: far fewer
    GETs than clusters. A spy on the real client counts them; the apiserver answers."""
    import threading

    kubectl = control_plane.kubectl
    kubectl("apply", "-f", "-", input=keyring_secret(namespace, {"key": b64(OLD)}))
    tokens = RayTokens(k8s_api, namespace)
    real_read, reads = tokens.core.read_namespaced_secret, []

    def counted(*args, **kwargs):
        reads.append(args[0])
        return real_read(*args, **kwargs)

    tokens.core.read_namespaced_secret = counted
    runs = 24
    start, keys = threading.Barrier(runs), {}

    def new_cluster(n: int) -> None:
        start.wait()
        keys[n] = tokens.key_for_new_cluster(Identity(name=f"r{n}", namespace=namespace, uid=f"uid-{n}"))

    threads = [threading.Thread(target=new_cluster, args=(n,)) for n in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(keys.values()) == {OLD_ID} and len(keys) == runs
    assert 1 <= len(reads) <= runs // 2, len(reads)
    # A rotation: the next create (begun after it) reads again and takes the new key.
    kubectl("apply", "-f", "-", input=keyring_secret(namespace, {"key": b64(NEW), "key.2026-12": b64(OLD)}))
    before = len(reads)
    assert tokens.key_for_new_cluster(Identity(name="after", namespace=namespace, uid="uid-after")) == NEW_ID
    assert len(reads) == before + 1
