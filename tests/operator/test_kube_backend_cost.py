"""What observing waiting runs costs the API server, counted by the real kube-apiserver (its
apiserver_request_total metric): with the operator's watches (adapters/informer.py) a
waiting, queued or suspended run costs no request per tick, whatever their number. The
backend and its watches run as deploy/'s ServiceAccount (a TokenRequest token, RBAC from
deploy/base), so a list or watch it makes without a rule is refused here too.
"""

from __future__ import annotations

import asyncio
import re
import threading

import yaml
from kubernetes import config

from harness.service_account import service_account_kubeconfig
from tpufinetune.adapters.informer import Store, project_raycluster
from tpufinetune.adapters.kube import NO_KUEUE, KubeBackend, Watches
from tpufinetune.core.api import parse_spec
from tpufinetune.core.phases import Identity, QueueView
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


def counts(control_plane) -> dict:
    return {(resource, verb): requests_to(control_plane, resource, verb)
            for resource in ("rayclusters", "pods", "workloads") for verb in ("GET", "LIST")}


def apply_cluster(control_plane, namespace: str, name: str, uid: str, queue: str = "") -> dict:
    spec = dict(SPEC, **({"queueName": queue} if queue else {}))
    manifest = render_raycluster(name, namespace, uid, parse_spec(spec))
    control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(manifest))
    return manifest


def pending_pod(name: str, cluster_manifest: dict) -> dict:
    """A pod as KubeRay makes it from the head template: its labels, ray.io/cluster added."""
    template = cluster_manifest["spec"]["headGroupSpec"]["template"]
    labels = {**template["metadata"]["labels"], "ray.io/cluster": cluster_manifest["metadata"]["name"],
              "ray.io/node-type": "worker"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "ray-worker", "image": "registry.example/t:1"}]}}


class Changes:
    """What the watches hand the handlers, kept for the test to wait on."""

    def __init__(self):
        self.seen: list[tuple[str, str, str]] = []
        self.lock = threading.Condition()

    def __call__(self, kind: str, type_: str, item: dict) -> None:
        with self.lock:
            self.seen.append((kind, type_, (item.get("metadata") or {}).get("name", "")))
            self.lock.notify_all()

    def wait_for(self, entry: tuple[str, str, str], timeout: float = 10.0) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: entry in self.seen, timeout), f"{entry} not seen in {self.seen}"


def test_waiting_queued_and_suspended_runs_cost_no_request_per_tick_and_changes_arrive_by_watch(
        control_plane, kuberay_crd, namespace, tmp_path):
    waiting_uid, queued_uid = "00000000-0000-0000-0000-00000000c057", "00000000-0000-0000-0000-00000000c058"
    waiting = apply_cluster(control_plane, namespace, "cost", waiting_uid)
    apply_cluster(control_plane, namespace, "queued", queued_uid, queue="team-a")
    control_plane.kubectl("-n", namespace, "apply", "-f", "-",
                          input=yaml.safe_dump(pending_pod("tft-cost-worker-0", waiting)))
    api = config.new_client_from_config(config_file=str(service_account_kubeconfig(control_plane, tmp_path / "kubeconfig", namespaces=[namespace])))
    settings = Settings()
    changes = Changes()
    watches = Watches(api, settings, changes)
    backend = KubeBackend(api, settings, watches)
    watches.start()
    try:
        for store in (watches.clusters, watches.pods, watches.workloads):
            assert store.synced.wait(30), "a watch never listed (refused by RBAC?)"
        before = counts(control_plane)

        async def ticks():
            views = []
            for _ in range(20):
                views.append((await backend.observe(Identity("cost", namespace, waiting_uid), "tft-cost"),
                              await backend.observe(Identity("queued", namespace, queued_uid), "tft-queued"),
                              # suspended: its RayCluster was deleted, its name stays in status
                              await backend.observe(Identity("gone", namespace, waiting_uid), "tft-gone")))
            return views

        views = asyncio.run(ticks())
        assert counts(control_plane) == before, "an observation read the API server"
        for cost, queued, gone in views:
            assert cost.exists and cost.owned and not cost.ready and cost.hosts_ready == 0
            # Kueue's word from the watch, or that it is not installed (the bare control plane)
            assert queued.exists and queued.suspended
            assert queued.queue == (NO_KUEUE if watches.workloads.missing else QueueView())
            assert not gone.exists

        # A change is seen without asking: the pod's, then the cluster's deletion.
        control_plane.kubectl("-n", namespace, "label", "pod", "tft-cost-worker-0", "touched=yes")
        changes.wait_for(("pods", "MODIFIED", "tft-cost-worker-0"))
        control_plane.kubectl("-n", namespace, "delete", "raycluster", "tft-cost", "--wait=false")
        changes.wait_for(("rayclusters", "DELETED", "tft-cost"))
        assert watches.owner("pods", watches.pods.get(namespace, "tft-cost-worker-0")) == "cost"
        before = counts(control_plane)
        gone = asyncio.run(backend.observe(Identity("cost", namespace, waiting_uid), "tft-cost"))
        assert not gone.exists
        assert counts(control_plane) == before
        # One list each, then the watch (Kueue's API, not served here, is looked for again later).
        assert [each.lists for each in watches.informers] == [1, 1, 0 if watches.workloads.missing else 1]
    finally:
        watches.stop()
        api.close()


def test_a_cluster_created_moments_ago_is_read_once_when_the_watch_has_not_delivered_it(
        control_plane, kuberay_crd, namespace, tmp_path):
    """The watch lags our own create by milliseconds: a miss right after a create is a GET,
    never taken for a deleted cluster."""
    uid = "00000000-0000-0000-0000-00000000c059"
    api = config.new_client_from_config(config_file=str(service_account_kubeconfig(control_plane, tmp_path / "kubeconfig", namespaces=[namespace])))
    settings = Settings()
    watches = Watches(api, settings, lambda *_: None)
    backend = KubeBackend(api, settings, watches)
    watches.clusters.synced.set()  # a store that is "synced" but never hears of the create
    try:
        manifest = render_raycluster("fresh", namespace, uid, parse_spec(SPEC))
        asyncio.run(backend.create(Identity("fresh", namespace, uid), manifest))
        gets = requests_to(control_plane, "rayclusters", "GET")
        view = asyncio.run(backend.observe(Identity("fresh", namespace, uid), "tft-fresh"))
        assert view.exists and view.owned
        assert requests_to(control_plane, "rayclusters", "GET") == gets + 1
    finally:
        api.close()


def test_a_new_list_drops_what_was_deleted_while_no_watch_was_open():
    """After a 410 the informer lists again; an object deleted in the gap got no DELETED
    event, and the new list's difference reports it."""
    store = Store(project_raycluster)
    first = {"metadata": {"name": "a", "namespace": "n", "uid": "1"}, "status": {"state": "ready"}}
    second = {"metadata": {"name": "b", "namespace": "n", "uid": "2"}}
    assert [t for t, _ in store.replace([first, second])] == ["ADDED", "ADDED"]
    changed = store.replace([{**second, "status": {"state": "ready"}}])
    assert sorted((t, item["metadata"]["name"]) for t, item in changed) == [("DELETED", "a"), ("MODIFIED", "b")]
    assert store.get("n", "a") is None and store.get("n", "b")["status"] == {"state": "ready"}
    assert store.replace([{**second, "status": {"state": "ready"}}]) == []  # nothing new: nothing to wake


def test_projections_keep_what_the_views_read_and_drop_the_rest():
    manifest = render_raycluster("p", "ns", "u", parse_spec(SPEC))
    manifest["status"] = {"state": "ready", "head": {"serviceName": "svc"}}
    kept = project_raycluster(manifest)
    assert kept["podsLabelled"] is True
    assert "headGroupSpec" not in kept["spec"] and kept["status"] == manifest["status"]
    assert kept["metadata"]["ownerReferences"][0]["uid"] == "u"
    old = {**manifest, "spec": {**manifest["spec"], "headGroupSpec": {"template": {"spec": {}}}}}
    assert project_raycluster(old)["podsLabelled"] is False  # an older version's cluster: its pods are listed
