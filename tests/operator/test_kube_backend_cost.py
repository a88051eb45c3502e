"""What observing a waiting run costs the API server, counted by the real kube-apiserver
(its apiserver_request_total metric): a RayCluster the watch already delivered is not
fetched again, and the pods of a cluster that waits for capacity are listed once, not
every tick. The backend runs as deploy/'s ServiceAccount (a TokenRequest token, RBAC from
deploy/base), so a read it makes without a rule is refused here too. The watch's
delivery is handed to the backend directly (what kopf's RayCluster event handler does).
"""

from __future__ import annotations

import asyncio
import re

import yaml
from kubernetes import config

from harness.service_account import service_account_kubeconfig
from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.core.api import parse_spec
from tpufinetune.core.phases import Identity
from tpufinetune.core.sizing import render_raycluster
from tpufinetune.settings import Settings

SPEC = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "registry.example/t:1",
        "checkpoint": {"storagePath": "gs://bench/ckpt"}}
REQUEST = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<count>[0-9.e+]+)$')


def requests_to(control_plane, resource: str, verb: str) -> int:
    total = 0
    for line in control_plane.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        match = REQUEST.match(line)
        if match and f'resource="{resource}"' in match["labels"] and f'verb="{verb}"' in match["labels"]:
            total += int(float(match["count"]))
    return total


def test_a_watched_waiting_raycluster_costs_no_get_per_tick_and_one_pod_list(control_plane, kuberay_crd, namespace,
                                                                              tmp_path):
    uid = "00000000-0000-0000-0000-00000000c057"
    control_plane.kubectl("-n", namespace, "apply", "-f", "-",
                          input=yaml.safe_dump(render_raycluster("cost", namespace, uid, parse_spec(SPEC))))
    cluster = yaml.safe_load(control_plane.kubectl("-n", namespace, "get", "raycluster", "tft-cost", "-o", "yaml").stdout)
    api = config.new_client_from_config(config_file=str(service_account_kubeconfig(control_plane, tmp_path / "kubeconfig")))
    backend = KubeBackend(api, Settings())
    backend.watched.seen(cluster)  # what kopf's RayCluster watch hands the operator
    ident = Identity("cost", namespace, uid)

    gets, lists = requests_to(control_plane, "rayclusters", "GET"), requests_to(control_plane, "pods", "LIST")

    async def ticks():
        return [await backend.observe(ident, "tft-cost") for _ in range(20)]

    try:
        views = asyncio.run(ticks())
    finally:
        api.close()
    assert all(v.exists and v.owned and not v.ready for v in views)
    assert requests_to(control_plane, "rayclusters", "GET") == gets
    assert requests_to(control_plane, "pods", "LIST") == lists + 1
