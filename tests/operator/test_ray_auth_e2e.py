"""Ray authentication as production gets it, on the test ground: two runs in two
namespaces. Each RayCluster turns token auth on itself (authOptions, its own Secret), so
KubeRay gives its pods their own token; each head refuses a request without a token and
one with the other run's token, and takes its own; the operator, which derives each
run's token and never reads it back, drives both to Succeeded. The NetworkPolicy the
operator creates passes the API server and selects the cluster's pods (the ground does
not enforce NetworkPolicy; GKE Dataplane V2 does).

On the code before per-run tokens this fails at the first assertion (no authOptions), and
without it the other run's token would be accepted: the ground gave every pod one token.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from harness.ground_fixtures import Kube
from ground_runs import resource, start_run

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def answer(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_each_head_takes_only_its_own_runs_token(operator, ground, kube, ground_assets, storage):
    other_ns = kube.ns + "-b"
    ground.kubectl("create", "namespace", other_ns)
    try:
        kubes = {"a": kube, "b": Kube(ground, other_ns)}
        runs = {}
        for key, k in kubes.items():
            # Kept after the end (ttlSecondsAfterFinished), so the heads can be asked.
            manifest = resource(f"auth-{key}", ground_assets, f"{storage}/{key}", mode="collectives",
                                ttlSecondsAfterFinished=300)
            runs[key] = start_run(k, manifest)
        for key, k in kubes.items():
            k.kubectl("wait", f"tpufinetune/auth-{key}", "--for=condition=Succeeded", "--timeout=400s", timeout=420)

        tokens, heads = {}, {}
        for key, k in kubes.items():
            uid, cluster = runs[key]
            auth = k.get("raycluster", cluster)["spec"].get("authOptions")
            assert auth == {"mode": "token", "secretName": f"{cluster}-ray-token-{uid[:8]}"}
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
    finally:
        ground.kubectl("delete", "namespace", other_ns, "--wait=false", check=False)
