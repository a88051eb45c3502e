"""Why a RayCluster is not ready yet, from its pods (pure): the worst pod state in the
words of whoever knows it (the scheduler, the kubelet), and how many hosts are ready.

"Stuck, no reason" is the top complaint about KubeRay; these are the reasons it hides.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tpufinetune.core.sizing import REPLICA_INDEX_LABEL

# Waiting reasons a kubelet reports while a container is being set up as usual.
ROUTINE_WAITING = frozenset({"ContainerCreating", "PodInitializing"})

# Worst first: what waiting will never fix comes before what capacity or a restart might.
# A reason not listed ranks after these and before Unschedulable.
_SEVERITY = (
    "CreateContainerConfigError",  # a missing Secret or ConfigMap key
    "InvalidImageName",
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "OOMKilled",  # over its memory limit: a restart runs into the same limit
    "CrashLoopBackOff",
    "CreateContainerError",
    "RunContainerError",
)
_UNSCHEDULABLE_RANK = len(_SEVERITY) + 1


@dataclass(frozen=True)
class PodProblem:
    reason: str  # the scheduler's or kubelet's own: Unschedulable, ErrImagePull, ...
    message: str  # "pod <name> is <reason>: <their text>"


def worst_problem(pods: list[dict]) -> PodProblem | None:
    """The worst state among the pods (ties: the first pod by name); None if every pod is
    scheduled and starting as usual."""
    found = [problem for pod in sorted(pods, key=_name) for problem in _problems(pod)]
    return min(found, key=_rank, default=None)


def routine_wait(pods: list[dict]) -> str:
    """What the first pod (by name) in a routine wait says it waits for: "pod X is
    ContainerCreating: <message>", only where the kubelet gave a message ("" otherwise): a
    waiting run says what for, not only how many hosts are ready."""
    for pod in sorted(pods, key=_name):
        status = pod.get("status") or {}
        for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in ROUTINE_WAITING and waiting.get("message"):
                return f"pod {_name(pod)} is {waiting['reason']}: {waiting['message']}"
    return ""


def hosts_ready(pods: list[dict]) -> int:
    """Worker pods (one per TPU host) whose Ready condition is True."""
    return sum(1 for pod in pods if _is_worker(pod) and _ready(pod))


def hosts_ready_since(pods: list[dict]) -> str:
    """When the last worker pod became Ready (its Ready condition's transition time), if
    every worker is Ready: the slice is usable from then, whatever the head still does."""
    workers = [p for p in pods if _is_worker(p)]
    times = [c.get("lastTransitionTime") or "" for p in workers for c in (p.get("status") or {}).get("conditions") or []
             if c.get("type") == "Ready" and c.get("status") == "True"]
    return max(times) if workers and len(times) == len(workers) and all(times) else ""


def _problems(pod: dict) -> list[PodProblem]:
    name = _name(pod)
    status = pod.get("status") or {}
    problems = []
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "Unschedulable"
            problems.append(PodProblem(reason, f"pod {name} is {reason}: {condition.get('message') or 'not scheduled'}"))
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason")
        # The kubelet's OOMKilled outranks the crash loop it causes, and shows while the
        # restarted container runs again (lastState) or after its last exit (state).
        if _exit(container).get("reason") == "OOMKilled" or (state.get("terminated") or {}).get("reason") == "OOMKilled":
            problems.append(PodProblem("OOMKilled", f"pod {name} is OOMKilled: container {container.get('name', '')} "
                                       f"exceeded its memory limit (limits.memory), restarted {container.get('restartCount', 0)} times"))
        elif reason and reason not in ROUTINE_WAITING:
            detail = "; ".join(filter(None, [_last_exit(container), waiting.get("message")]))
            problems.append(PodProblem(reason, f"pod {name} is {reason}" + (f": {detail}" if detail else "")))
    return problems


def _exit(container: dict) -> dict:
    return (container.get("lastState") or {}).get("terminated") or {}


def _last_exit(container: dict) -> str:
    # CrashLoopBackOff's own message names only the back-off; the last exit says why.
    terminated = _exit(container)
    if "exitCode" not in terminated:
        return ""
    return f"container {container.get('name', '')} exited {terminated['exitCode']} ({terminated.get('reason') or 'Error'}), restarted {container.get('restartCount', 0)} times"


def _rank(problem: PodProblem) -> int:
    if problem.reason in _SEVERITY:
        return _SEVERITY.index(problem.reason)
    return _UNSCHEDULABLE_RANK if problem.reason == "Unschedulable" else len(_SEVERITY)


def _name(pod: dict) -> str:
    return (pod.get("metadata") or {}).get("name", "")


def _replica_index(pod: dict) -> str:
    """KubeRay's replica index of a worker pod: its slice ("" for a head, or a KubeRay
    without multi-host indexing)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(REPLICA_INDEX_LABEL, "")


def _is_worker(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get("ray.io/node-type") == "worker"


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


# ---- a slice's health after a job ended (pure) ----------------------------------------------

# GKE labels a node this way when its maintenance is scheduled; kept on the node until then.
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
# The pod condition Kubernetes sets (reason = who) on a pod it is about to take away.
DISRUPTION_TARGET = "DisruptionTarget"
_DISRUPTIONS = {
    "TerminationByKubelet": "Preempted",  # graceful node shutdown: a spot VM's notice
    "PreemptionByScheduler": "Preempted",  # a pod of a higher priority needed the room
    "EvictionByEvictionAPI": "Maintenance",  # a drain: a node upgrade, a repair
    "DeletionByTaintManager": "NodeLost",  # the node went NotReady or unreachable
    "DeletionByPodGC": "NodeLost",  # the node is gone
}
# The kubelet's Ready condition message during its graceful node shutdown (nodeshutdown).
NODE_SHUTTING_DOWN = "node is shutting down"
# When several pods say different things, the most specific wins.
_REASON_RANK = ("Maintenance", "NodeLost", "Preempted")


@dataclass(frozen=True)
class SliceHealth:
    """Whether the slice can take another attempt as it is: every pod Ready, none lost,
    replaced or restarted since `since`, every node there and Ready. `reason` names a
    disruption (Preempted, NodeLost, Maintenance); "" for a slice that is merely not well
    (a container restarted, a pod not Ready), or healthy."""

    healthy: bool
    reason: str = ""
    detail: str = ""


HEALTHY = SliceHealth(True)


def slice_health(pods: list[dict], nodes: dict, since, hosts: int) -> SliceHealth:
    """`nodes`: node name -> the Node (None: it is gone) for the pods' nodes; `since`: when
    the slice was ready for the attempt (a datetime, or None: not known); `hosts`: the
    worker pods the slice has. On a run of several slices each problem names the slice
    (KubeRay's replica index) of the pod it is about."""
    found: list[tuple[str, str]] = []  # (reason, detail)
    live = [p for p in sorted(pods, key=_name) if not (p.get("metadata") or {}).get("deletionTimestamp")]
    several = any(_replica_index(p) not in ("", "0") for p in pods)
    for pod in sorted(pods, key=_name):
        found += _pod_health(pod, nodes, since, several_slices=several)
    workers = sum(1 for p in live if _is_worker(p))
    if hosts and workers < hosts:
        found.append(("Preempted", f"{hosts - workers} of {hosts} worker pods are gone"))
    if not any(not _is_worker(p) for p in live):
        found.append(("", "the head pod is gone"))
    if not found:
        return HEALTHY
    ranked = sorted(found, key=lambda f: _REASON_RANK.index(f[0]) if f[0] in _REASON_RANK else len(_REASON_RANK))
    return SliceHealth(False, ranked[0][0], ranked[0][1])


def _pod_health(pod: dict, nodes: dict, since, several_slices: bool = False) -> list[tuple[str, str]]:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = _name(pod) + (f" of slice {_replica_index(pod)}" if several_slices and _is_worker(pod) else "")
    node_name = (pod.get("spec") or {}).get("nodeName") or ""
    node = nodes.get(node_name) if node_name else {}
    problems = []
    disruption = next((c for c in status.get("conditions") or []
                       if c.get("type") == DISRUPTION_TARGET and c.get("status") == "True"), None)
    if node_name and node is None:
        # A pod the kubelet shut down with its node (a Spot VM's notice) says why the node
        # went: its disruption below is the reason, the node's absence only the sequel.
        if disruption is None or disruption.get("reason") != "TerminationByKubelet":
            problems.append(("NodeLost", f"node {node_name} of pod {name} is gone"))
    elif node:
        if MAINTENANCE_LABEL in ((node.get("metadata") or {}).get("labels") or {}):
            problems.append(("Maintenance", f"node {node_name} of pod {name} has maintenance scheduled"))
        ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
        if ready and ready[0].get("status") != "True" and NODE_SHUTTING_DOWN in (ready[0].get("message") or ""):
            # The kubelet's graceful node shutdown (a Spot VM's notice, before it marks the
            # pods): the node is being taken away, not lost.
            problems.append(("Preempted", f"node {node_name} of pod {name} is shutting down"))
        elif ready and ready[0].get("status") != "True":
            problems.append(("NodeLost", f"node {node_name} of pod {name} is not Ready ({ready[0].get('reason') or ready[0].get('status')})"))
    if disruption is not None:
        why = disruption.get("reason") or ""
        reason = _DISRUPTIONS.get(why, "Preempted")
        if why == "TerminationByKubelet" and any(p[0] == "Maintenance" for p in problems):
            reason = "Maintenance"
        problems.append((reason, f"pod {name}: {why}: {disruption.get('message') or 'disrupted'}"))
    elif meta.get("deletionTimestamp"):
        problems.append(("Preempted", f"pod {name} was deleted"))
    created = _time(meta.get("creationTimestamp"))
    if since is not None and created is not None and created > since:
        problems.append(("Preempted", f"pod {name} was replaced during the attempt (created {meta['creationTimestamp']})"))
    for container in status.get("containerStatuses") or []:
        finished = _time(((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        if since is not None and finished is not None and finished > since:
            problems.append(("", f"pod {name}: {_last_exit(container)}"))
    if not _ready(pod) and not meta.get("deletionTimestamp"):
        problems.append(("", f"pod {name} is not Ready"))
    return problems


def _time(text):
    if not text:
        return None
    return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
