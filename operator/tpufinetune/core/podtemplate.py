"""The users' pod settings (`spec.head`, `spec.workers`) merged into a rendered RayCluster
(pure), after the TPU runtime's multi-slice variables (core/megascale.py).

Only additions and the fields the slice does not decide: service account, priority class,
pod metadata, tolerations, volumes, mounts and env. Resources, node selectors, the
/dev/shm volume and the operator's env stay as sized; validation has already refused any
setting that would collide with them, and the merge never replaces one either.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from .megascale import with_megascale_env
from .sizing import render_raycluster

if TYPE_CHECKING:
    from .api import PodGroup, TPUFineTuneSpec


def raycluster_with_pod_settings(name: str, namespace: str, uid: str,
                                 spec: TPUFineTuneSpec) -> dict:
    """The RayCluster the operator creates: the sized one, its workers' MEGASCALE variables
    (several slices), then the pod settings."""
    sized = render_raycluster(name, namespace, uid, spec)
    return apply_pod_settings(with_megascale_env(sized, name, spec), spec)


def apply_pod_settings(raycluster: dict, spec: TPUFineTuneSpec) -> dict:
    """A copy of `raycluster` with `spec.head` and `spec.workers` merged into the head's
    and every worker group's pod template."""
    merged = copy.deepcopy(raycluster)
    _merge(merged["spec"]["headGroupSpec"]["template"], spec.head)
    for group in merged["spec"]["workerGroupSpecs"]:
        _merge(group["template"], spec.workers)
    return merged


def _dump(items: list | None) -> list[dict]:
    return [item.model_dump(by_alias=True, exclude_none=True, mode="json")
            for item in items or ()]


def _merge(template: dict, settings: PodGroup) -> None:
    metadata = template.setdefault("metadata", {})
    for key, values in (("annotations", settings.annotations), ("labels", settings.labels)):
        if values:
            metadata[key] = {**values, **metadata.get(key, {})}
    if not metadata:
        del template["metadata"]
    pod = template["spec"]
    if settings.service_account_name:
        pod["serviceAccountName"] = settings.service_account_name
    if settings.priority_class_name:
        pod["priorityClassName"] = settings.priority_class_name
    for key, items in (("tolerations", settings.tolerations), ("volumes", settings.volumes)):
        if items:
            pod[key] = [*pod.get(key, []), *_dump(items)]
    container = pod["containers"][0]
    for key, items in (("volumeMounts", settings.volume_mounts), ("env", settings.env)):
        if items:
            container[key] = [*container.get(key, []), *_dump(items)]
