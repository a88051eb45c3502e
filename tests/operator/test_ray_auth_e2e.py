"""Collectives checks on the test ground, as production gets them: two runs in two
namespaces, one test for what needs only a short run that ends.

- Ray authentication: each RayCluster turns token auth on itself (authOptions, its own
  Secret), so KubeRay gives its pods their own token; each head refuses a request without
  a token and one with the other run's token, and takes its own; the operator, which
  derives each run's token and never reads it back, drives both to Succeeded. The
  NetworkPolicy the operator creates passes the API server and selects the cluster's pods
  (the ground does not enforce NetworkPolicy; GKE Dataplane V2 does).
- The user's pod settings (annotations, labels, env) reach the pods KubeRay makes, and the
  check passes on two ranks there.
- A key rotation mid-run (docs/gke.md, "Rotating the signing key"): once run a's RayCluster
  is made, the keyring gets a new current key and keeps the old one; run b, started then,
  is made with the new key, run a keeps the old one, both end Succeeded, each cluster and
  token Secret names its key id, and once a's cluster is gone no cluster uses the old key
  and it is removed.
- ttlSecondsAfterFinished keeps each RayCluster (every change to it seen by a watch) and
  the operator wakes itself to release it at completion + TTL, with nothing else
  happening.

On the code before per-run tokens this fails at the first assertion of the token part (no
authOptions), and without it the other run's token would be accepted: the ground gave every
pod one token.
"""

from __future__ import annotations

import base64
import json
import secrets
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pytest

from harness.ground_fixtures import Kube, delete_namespace
from harness.service_account import bind_namespace
from harness.kubewatch import KubeWatch
from tpufinetune.core import raytoken
from tpufinetune.core.conditions import parse_time
from ground_runs import released, resource, start_run

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]

# Long enough that both heads still answer when the second run has ended, and the checks
# on them are done: the two runs share two cores and end some seconds apart.
TTL = 60
USER_POD_SETTINGS = {"annotations": {"example.com/team": "ml"}, "labels": {"team": "ml"},
                     "env": [{"name": "TEAM_NAME", "value": "ml"}]}


def answer(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


KEYRING = ["-n", "tpufinetune-system", "secret", raytoken.SIGNING_KEY_SECRET]
ROTATED = "key.rotated-" + secrets.token_hex(3)


def rotate(ground) -> tuple[str, str]:
    """The first step of the procedure: a new current key, the old one kept; (old, new) ids."""
    data = json.loads(ground.kubectl("get", *KEYRING, "-o", "json").stdout)["data"]
    new = secrets.token_bytes(32)
    ground.kubectl("patch", *KEYRING, "--type=merge", "-p", json.dumps(
        {"data": {"key": base64.b64encode(new).decode(), ROTATED: data["key"]}}))
    return raytoken.key_id(base64.b64decode(data["key"])), raytoken.key_id(new)


def key_users(kubes, key_id: str) -> list[str]:
    """The RayClusters still made with key `key_id` (the admin asks with -A; here only this
    test's namespaces, as other tests' may still be going away)."""
    return [name for k in kubes.values() for name in k.kubectl(
        "get", "rayclusters", "-l", f"{raytoken.KEY_ID_LABEL}={key_id}", "-o",
        "jsonpath={.items[*].metadata.name}").stdout.split()]


def released_early(cluster: str, release: datetime):
    def measure(clusters: list[dict]) -> int:
        """1 if, at this event, the RayCluster is gone or being deleted before the TTL (a
        second of slack for the clock's resolution)."""
        ours = [c for c in clusters if c["metadata"]["name"] == cluster]
        gone = not ours or any(c["metadata"].get("deletionTimestamp") for c in ours)
        return int(gone and (release - datetime.now(timezone.utc)).total_seconds() > 1)
    return measure


def test_collectives_runs_take_only_their_own_token_carry_the_pod_settings_and_keep_the_slice_for_the_ttl(
        operator, ground, kube, ground_assets, storage):
    other_ns = kube.ns + "-b"
    ground.kubectl("create", "namespace", other_ns)
    bind_namespace(ground.cp, other_ns)  # watched (t-*), and bound as the operator's namespaces are
    try:
        kubes = {"a": kube, "b": Kube(ground, other_ns)}
        runs, key_ids = {}, {}
        for key, k in kubes.items():
            manifest = resource(f"auth-{key}", ground_assets, f"{storage}/{key}", mode="collectives",
                                ttlSecondsAfterFinished=TTL, **({"workers": USER_POD_SETTINGS} if key == "a" else {}))
            runs[key] = start_run(k, manifest)
            if key == "a":  # the rotation, mid-run: a's RayCluster is made with the old key
                kube.wait_for(lambda: kube.get("raycluster", runs["a"][1]), "run a's RayCluster")
                key_ids["a"], key_ids["b"] = rotate(ground)
                assert key_users(kubes, key_ids["a"]) == [runs["a"][1]]
        uid_a, cluster_a = runs["a"]

        workers = kube.wait_for(lambda: [p for p in kube.pods_of(cluster_a)
                                         if p["metadata"]["labels"].get("ray.io/node-type") == "worker"],
                                "worker pods", timeout=120)
        # KubeRay carried the settings from the RayCluster into the pods it made.
        for pod in workers:
            assert pod["metadata"]["annotations"]["example.com/team"] == "ml"
            assert pod["metadata"]["labels"]["team"] == "ml"
            assert {"name": "TEAM_NAME", "value": "ml"} in pod["spec"]["containers"][0]["env"]

        kube.kubectl("wait", "tpufinetune/auth-a", "--for=condition=Succeeded", "--timeout=400s", timeout=420)
        status = kube.status("auth-a")
        completed, release = parse_time(status["completionTime"]), parse_time(status["rayClusterReleaseTime"])
        assert (release - completed).total_seconds() == TTL
        pods_a = kube.pods_of(cluster_a)
        # Kept until then (every change to it is seen by the watch) ...
        with KubeWatch(kube.cp.kubeconfig, kube.ns, resource=("ray.io", "v1", "rayclusters"),
                       early=released_early(cluster_a, release)) as seen:
            kubes["b"].kubectl("wait", "tpufinetune/auth-b", "--for=condition=Succeeded", "--timeout=400s",
                               timeout=420)
            tokens, heads = {}, {}
            for key, k in kubes.items():
                uid, cluster = runs[key]
                status = k.status(f"auth-{key}")
                assert status["collectives"]["passed"] is True and status["collectives"]["ranks"] == 2, status
                body = k.get("raycluster", cluster)
                auth = body["spec"].get("authOptions")
                # Each cluster's token Secret is of the key it was made with: a keeps the old one.
                assert body["metadata"]["labels"][raytoken.KEY_ID_LABEL] == key_ids[key]
                assert auth == {"mode": "token", "secretName": f"{cluster}-ray-token-{uid[:8]}-{key_ids[key]}"}
                assert k.get("secret", auth["secretName"])["metadata"]["labels"][raytoken.KEY_ID_LABEL] == key_ids[key]
                head = next(p for p in k.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "head")
                env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
                assert env["RAY_AUTH_MODE"]["value"] == "token"  # KubeRay put it there, from authOptions
                assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": auth["secretName"],
                                                                              "key": "auth_token"}
                tokens[key], heads[key] = k.ray_token(cluster), k.head_dashboard(cluster) + "/api/jobs/"

                policy = k.get("networkpolicy", f"{cluster}-ray")
                assert policy is not None  # the operator's create passed the API server's validation
                selector = policy["spec"]["podSelector"]["matchLabels"]
                for pod in k.pods_of(cluster):
                    assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["name"]
                admitted = policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]
                assert admitted == {"kubernetes.io/metadata.name": "tpufinetune-system"}

            assert tokens["a"] != tokens["b"]
            for key, other in (("a", "b"), ("b", "a")):
                assert answer(heads[key], None) in (401, 403)
                assert answer(heads[key], tokens[other]) in (401, 403)
                assert answer(heads[key], tokens[key]) == 200
                assert kubes[key].status(f"auth-{key}")["phase"] == "Succeeded"
            assert datetime.now(timezone.utc) < release, "the checks outlasted the TTL: raise TTL"

            # ... then released with nothing else happening to wake the operator: it woke itself.
            left = (release - datetime.now(timezone.utc)).total_seconds()
            kube.wait_for(lambda: kube.get("raycluster", cluster_a) is None, "RayCluster released after the TTL",
                          timeout=max(left, 0) + 30)
        assert seen.error is None, seen.error
        # The last steps of the procedure: no cluster uses the old key any more; it goes.
        assert key_users(kubes, key_ids["a"]) == []
        ground.kubectl("patch", *KEYRING, "--type=json", "-p", json.dumps([{"op": "remove", "path": f"/data/{ROTATED}"}]))
        assert seen.most["early"] == 0, "released before the TTL"
        assert datetime.now(timezone.utc) >= release
        released(kube, ground, cluster_a, [p["metadata"]["uid"] for p in pods_a])
    finally:
        delete_namespace(ground, other_ns)
