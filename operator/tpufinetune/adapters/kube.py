"""Thin Kubernetes adapter: the RayCluster a run owns, and the run's status writes.

Blocking client calls run in threads so one slow API call never stalls other runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from tpufinetune.core.api import GROUP, PLURAL, VERSION
from tpufinetune.core.phases import ClusterView, Identity, QueueView
from tpufinetune.core.sizing import QUEUE_NAME_LABEL
from tpufinetune.settings import Settings

log = logging.getLogger(__name__)

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
KUEUE_GROUP, KUEUE_VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"
# Kueue labels each Workload with the uid of the job (here the RayCluster) it stands for.
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def cluster_view(body: dict | None, owner_uid: str, settings: Settings) -> ClusterView:
    """What a RayCluster object says about readiness, as KubeRay reports it. Pure."""
    if not body:
        return ClusterView(exists=False)
    meta = body.get("metadata") or {}
    owned = any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or [])
    status = body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}

    def true(kind: str) -> bool:
        return (conditions.get(kind) or {}).get("status") == "True"

    ready = status.get("state") == "ready" or (true("HeadPodReady") and true("RayClusterProvisioned"))
    problem = ""
    if true("RayClusterReplicaFailure"):
        failure = conditions["RayClusterReplicaFailure"]
        problem = failure.get("message") or failure.get("reason") or "a replica failed"
    elif status.get("reason"):
        problem = status["reason"]
    name = meta.get("name", "")
    service = (status.get("head") or {}).get("serviceName") or f"{name}-head-svc"
    url = settings.dashboard_for(cluster=name, namespace=meta.get("namespace", ""), service=service)
    suspended = (body.get("spec") or {}).get("suspend") is True
    return ClusterView(exists=True, owned=owned, ready=ready, problem=problem, dashboard_url=url,
                       suspended=suspended)


NO_KUEUE = QueueView(reason="KueueNotInstalled",
                     message="Kueue is not installed (no workloads.kueue.x-k8s.io API): "
                             "nothing will admit the RayCluster")


def queue_view(workloads: list[dict], cluster_uid: str) -> QueueView:
    """What Kueue says about the RayCluster `cluster_uid` in its Workload's conditions. Pure.

    Waiting: QuotaReserved False (reason Pending, or Inadmissible: no such LocalQueue, ...)
    with Kueue's message. Evicted True: the reason (Preempted, ...) and message."""
    owned = [w for w in workloads
             if any(ref.get("uid") == cluster_uid for ref in (w.get("metadata") or {}).get("ownerReferences") or [])]
    if not owned:
        return QueueView()
    conditions = {c.get("type"): c for c in (owned[0].get("status") or {}).get("conditions") or []}
    evicted = ""
    eviction = conditions.get("Evicted") or {}
    if eviction.get("status") == "True":
        evicted = f"{eviction.get('reason') or 'Evicted'}: {eviction.get('message') or ''}".rstrip(": ")
    waiting = conditions.get("QuotaReserved") or {}
    if waiting.get("status") == "False" and waiting.get("message"):
        return QueueView(reason=waiting.get("reason") or "Pending", message=waiting["message"], evicted=evicted)
    return QueueView(reason="Evicted" if evicted else "", message=evicted, evicted=evicted)


# Waiting reasons a kubelet reports while a container is being set up as usual.
_ROUTINE_WAITING = frozenset({"ContainerCreating", "PodInitializing"})


def pod_problem(pods: list[dict]) -> str:
    """Why a cluster's pods are not running yet, in the words of whoever knows: the
    scheduler (Unschedulable: "0/12 nodes are available: 3 Insufficient google.com/tpu …")
    or the kubelet (a missing Secret, an image that cannot be pulled). Pure; '' if none."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        name = (pod.get("metadata") or {}).get("name", "")
        status = pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                reason = condition.get("reason") or "Unschedulable"
                return f"pod {name} is {reason}: {condition.get('message') or 'not scheduled'}"
        for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") and waiting["reason"] not in _ROUTINE_WAITING:
                return f"pod {name}: {waiting['reason']}: {waiting.get('message') or ''}".rstrip(": ")
    return ""


class KubeBackend:
    def __init__(self, api: client.ApiClient, settings: Settings):
        self.objects = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.settings = settings

    async def observe(self, ident: Identity, name: str) -> ClusterView:
        body = await asyncio.to_thread(self._get_cluster, ident.namespace, name)
        view = cluster_view(body, ident.uid, self.settings)
        if view.exists and view.owned and view.suspended and QUEUE_NAME_LABEL in body["metadata"].get("labels", {}):
            workloads = await asyncio.to_thread(self._workloads, ident.namespace, body["metadata"]["uid"])
            queue = NO_KUEUE if workloads is None else queue_view(workloads, body["metadata"]["uid"])
            return dataclasses.replace(view, queue=queue)
        if view.exists and view.owned and not view.ready and not view.problem:
            pods = await asyncio.to_thread(self._cluster_pods, ident.namespace, name)
            problem = pod_problem(pods)
            if problem:
                view = dataclasses.replace(view, problem=problem)
        return view

    def _cluster_pods(self, namespace: str, name: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"ray.io/cluster={name}")
        return [self.core.api_client.sanitize_for_serialization(p) for p in pods.items]

    def _workloads(self, namespace: str, cluster_uid: str) -> list[dict] | None:
        """Kueue's Workloads of one RayCluster (RBAC: list workloads, nothing more); None
        when the API has no Workloads (Kueue is not installed)."""
        try:
            found = self.objects.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, label_selector=f"{JOB_UID_LABEL}={cluster_uid}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return found.get("items") or []

    def _get_cluster(self, namespace: str, name: str) -> dict | None:
        try:
            return self.objects.get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def create(self, ident: Identity, manifest: dict) -> None:
        await asyncio.to_thread(self._create_cluster, ident.namespace, manifest)

    def _create_cluster(self, namespace: str, manifest: dict) -> None:
        try:
            self.objects.create_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, manifest)
        except ApiException as error:
            if error.status != 409:  # exists: ownership is checked on the next observation
                raise

    async def delete(self, ident: Identity, name: str) -> None:
        await asyncio.to_thread(self._delete_cluster, ident, name)

    def _delete_cluster(self, ident: Identity, name: str) -> None:
        # Preconditions: only delete the object we own (uid checked on observe), and
        # only if it is still the same object.
        body = self._get_cluster(ident.namespace, name)
        if body is None or not cluster_view(body, ident.uid, self.settings).owned:
            return
        options = client.V1DeleteOptions(
            propagation_policy="Background",
            preconditions=client.V1Preconditions(uid=body["metadata"]["uid"]),
        )
        try:
            self.objects.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, ident.namespace, RAY_PLURAL, name, body=options
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    async def write_status(self, ident: Identity, patch: dict, new: dict) -> None:
        await asyncio.to_thread(
            self.objects.patch_namespaced_custom_object_status,
            GROUP, VERSION, ident.namespace, PLURAL, ident.name, {"status": patch},
        )

    def record(self, ident: Identity, type_: str, reason: str, message: str) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TPUFineTune",
            "metadata": {"name": ident.name, "namespace": ident.namespace, "uid": ident.uid},
        }
        kopf.event(body, type=type_, reason=reason, message=message)
