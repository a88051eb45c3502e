"""What the Kubernetes adapter reads out of the API server's objects and answers: a
RayCluster's readiness (cluster_view), Kueue's word on its Workload (queue_view), and the
API server's own words in an error. Pure: no client calls.
"""

from __future__ import annotations

import json

from tpufinetune.core.phases import ClusterView, QueueView
from tpufinetune.settings import Settings

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
KUEUE_GROUP, KUEUE_VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"
# Kueue labels each Workload with the uid of the job (here the RayCluster) it stands for.
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# KubeRay labels each pod with its RayCluster's name.
CLUSTER_LABEL = "ray.io/cluster"
# GKE puts it on a node with maintenance scheduled (seconds since the epoch).
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"


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
    if meta.get("deletionTimestamp"):
        # Going away (a suspend, someone's delete): its head is no place for a job.
        ready, problem = False, f"RayCluster {meta.get('name', '')} is being deleted"
    elif true("RayClusterReplicaFailure"):
        failure = conditions["RayClusterReplicaFailure"]
        problem = failure.get("message") or failure.get("reason") or "a replica failed"
    elif status.get("reason"):
        problem = status["reason"]
    name = meta.get("name", "")
    service = (status.get("head") or {}).get("serviceName") or f"{name}-head-svc"
    url = settings.dashboard_for(cluster=name, namespace=meta.get("namespace", ""), service=service)
    suspended = (body.get("spec") or {}).get("suspend") is True
    return ClusterView(exists=True, owned=owned, ready=ready, problem=problem, dashboard_url=url,
                       suspended=suspended, deleting=bool(meta.get("deletionTimestamp")),
                       uid=meta.get("uid", ""))


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


def server_message(error: Exception) -> str | None:
    """The API server's own words in an error (the message of the Status object an
    ApiException carries as its body); None when it has none."""
    body = getattr(error, "body", None)
    if not isinstance(body, (str, bytes)):
        return None
    try:
        return json.loads(body).get("message") or None
    except (ValueError, AttributeError):
        return None


def api_answer(error) -> str:
    """The API server's answer in one line, code and message: `404 Not Found: the server
    could not find the requested resource` (an error with no status: its first line)."""
    code = getattr(error, "status", None)
    if not isinstance(code, int):
        text = str(error).strip()
        return text.splitlines()[0][:1000] if text else type(error).__name__
    reason = str(getattr(error, "reason", "") or "").strip()
    message = server_message(error) or ""
    head = f"{code} {reason}".strip()
    return f"{head}: {message}"[:1000] if message else head
