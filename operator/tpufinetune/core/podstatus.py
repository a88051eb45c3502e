"""Why a RayCluster is not ready yet, from its pods (pure): the worst pod state in the
words of whoever knows it (the scheduler, the kubelet), and how many hosts are ready.

"Stuck, no reason" is the top complaint about KubeRay; these are the reasons it hides.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def hosts_ready(pods: list[dict]) -> int:
    """Worker pods (one per TPU host) whose Ready condition is True."""
    return sum(1 for pod in pods if _is_worker(pod) and _ready(pod))


def _problems(pod: dict) -> list[PodProblem]:
    name = _name(pod)
    status = pod.get("status") or {}
    problems = []
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "Unschedulable"
            problems.append(PodProblem(reason, f"pod {name} is {reason}: {condition.get('message') or 'not scheduled'}"))
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in ROUTINE_WAITING:
            detail = waiting.get("message") or _last_exit(container)
            problems.append(PodProblem(reason, f"pod {name} is {reason}" + (f": {detail}" if detail else "")))
    return problems


def _last_exit(container: dict) -> str:
    # CrashLoopBackOff's own message names only the back-off; the last exit says why.
    terminated = (container.get("lastState") or {}).get("terminated") or {}
    if "exitCode" not in terminated:
        return ""
    return f"container {container.get('name', '')} exited {terminated['exitCode']} ({terminated.get('reason') or 'Error'}), restarted {container.get('restartCount', 0)} times"


def _rank(problem: PodProblem) -> int:
    if problem.reason in _SEVERITY:
        return _SEVERITY.index(problem.reason)
    return _UNSCHEDULABLE_RANK if problem.reason == "Unschedulable" else len(_SEVERITY)


def _name(pod: dict) -> str:
    return (pod.get("metadata") or {}).get("name", "")


def _is_worker(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get("ray.io/node-type") == "worker"


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])
