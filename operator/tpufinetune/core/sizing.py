"""Sizing and rendering: a validated spec -> the KubeRay RayCluster manifest (pure).

The output for v6e `4x4` and v7x `2x2x2` is the GKE Ray + TorchTPU tutorial's manifest
plus what an operator needs on top (name, namespace, labels, owner reference, rayVersion,
min/max replicas); the golden tests pin both.
"""
from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import generations as g
from .names import API_VERSION, KIND
from .specmodels import DEFAULT_TERMINATION_GRACE_SECONDS

if TYPE_CHECKING:  # sizing reads the models (the layer below), never the API above it
    from .specmodels import SpecFields as TPUFineTuneSpec

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tpufinetune"
NAME_LABEL = "tpufinetune.dev/name"
# Kueue's labels on a job it manages (its ray.io/raycluster integration).
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"

HEAD_CPU, HEAD_MEMORY = "4", "16Gi"
# The cpu stand-in's head runs Ray's head processes and the job's driver (Ray Train's
# controller with torch and transformers loaded): about 2.3 GB measured under the ground's
# enforced limits, where 2Gi was OOM-killed as soon as a job started.
CPU_HEAD_CPU, CPU_HEAD_MEMORY = "1", "4Gi"
HEAD_PORTS = ({"containerPort": 6379, "name": "gcs"},
              {"containerPort": 8265, "name": "dashboard"},
              {"containerPort": 10001, "name": "client"})
DASHBOARD_PORT = 8265
# KubeRay reads a RayCluster's Ray token from this key of the Secret that
# `spec.authOptions.secretName` names (ray-operator/controllers/ray/utils/constant.go).
AUTH_TOKEN_KEY = "auth_token"

# Multi-slice: KubeRay labels each worker pod with its replica's index in the worker group
# (feature gate RayMultiHostIndexing, on by default since v1.5;
# ray-operator/controllers/ray/utils/constant.go). A replica is a slice: the trainer reads
# its slice from this label (through the downward API), never from start order, and the
# scheduler keeps each replica on a node pool of its own by it.
REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
SLICE_INDEX_ENV = "TPUFT_SLICE_INDEX"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
RAY_CLUSTER_LABEL, RAY_GROUP_LABEL = "ray.io/cluster", "ray.io/group"

# KubeRay derives `<cluster>-headless-worker-svc` (20 more characters) and the TPU webhook
# builds `<group>-<replica>-<host>.<cluster>-headless-worker-svc` host names; a 40
# character cluster name keeps every derived DNS label within 63.
MAX_CLUSTER_NAME = 40


@dataclass(frozen=True)
class SliceShape:
    """What one slice of the spec's topology is made of."""

    generation: g.Generation
    machine: g.Machine | None  # None for the cpu stand-in
    chips: int                 # per slice; CPU workers for cpu
    hosts: int                 # pods per slice (numOfHosts)
    chips_per_host: int        # google.com/tpu per pod
    group_name: str

    @property
    def devices_per_slice(self) -> int:
        if not self.generation.is_tpu:
            return self.chips
        return self.chips * self.generation.devices_per_chip


def slice_shape(spec: TPUFineTuneSpec) -> SliceShape:
    gen = g.generation(spec.tpu.generation)
    if not gen.is_tpu:
        workers = int(spec.tpu.topology)
        return SliceShape(gen, None, workers, workers, 0, f"cpu-{workers}")
    machine = g.select_machine(gen, spec.tpu.topology, spec.tpu.chips_per_host)
    chips = g.chips_in(spec.tpu.topology)
    # The KubeRay TPU webhook's rule: hosts = max(chips / TPU per pod, 1).
    hosts = max(chips // machine.chips_per_host, 1)
    per_host = min(machine.chips_per_host, chips)
    group = f"{gen.group_prefix}-{chips * gen.tensorcores_per_chip}"
    return SliceShape(gen, machine, chips, hosts, per_host, group)


def total_devices(spec: TPUFineTuneSpec) -> int:
    """Ray Train / collectives world size: every device of every slice."""
    return slice_shape(spec).devices_per_slice * spec.tpu.slices


def raycluster_name(name: str) -> str:
    """Deterministic DNS-1035 label for the RayCluster of TPUFineTune `name`.

    Names that had to be shortened or changed (dots) get a hash of the original, so two
    TPUFineTunes in one namespace never map to the same RayCluster.
    """
    safe = re.sub(r"[^a-z0-9-]", "-", name.lower())
    if safe == name and len("tft-" + name) <= MAX_CLUSTER_NAME:
        return "tft-" + name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    stem = ("tft-" + safe)[:MAX_CLUSTER_NAME - len(digest) - 1].rstrip("-")
    return f"{stem}-{digest}"


def token_secret_name(name: str, uid: str) -> str:
    """The Secret holding the Ray token of TPUFineTune `name` (core/raytoken.py): named
    after its RayCluster and the object's uid, so a new object of the same name never
    meets the Secret (and token) of the deleted one while the garbage collector is slow."""
    return f"{raycluster_name(name)}-ray-token-{uid[:8]}"


Resources = tuple[dict[str, str], dict[str, str], str | None]


def plan_resources(spec: TPUFineTuneSpec) -> dict[str, Resources]:
    """(requests, limits, /dev/shm size) for `head` and `workers`, overrides merged."""
    shape = slice_shape(spec)
    if shape.machine is None:
        head = {"cpu": CPU_HEAD_CPU, "memory": CPU_HEAD_MEMORY}
        worker = {"cpu": g.CPU_WORKER_CPU, "memory": g.CPU_WORKER_MEMORY}
        shm = None
    else:
        head = {"cpu": HEAD_CPU, "memory": HEAD_MEMORY}
        worker = {"cpu": shape.machine.worker_cpu, "memory": shape.machine.worker_memory,
                  g.TPU_RESOURCE: str(shape.chips_per_host)}
        shm = shape.machine.shm_size
    planned = {}
    for group, defaults, group_shm in (("head", head, None), ("workers", worker, shm)):
        override = getattr(spec, group).resources
        requests, limits = dict(defaults), dict(defaults)
        if override is not None:
            requests.update(override.requests or {})
            limits.update(override.limits or {})
        planned[group] = (requests, limits, group_shm)
    return planned


def pod_labels(name: str) -> dict:
    """On every pod of a run's RayCluster: the operator watches its own pods by this
    selector (POD_SELECTOR), never every pod of the cluster."""
    return {MANAGED_BY_LABEL: MANAGED_BY, NAME_LABEL: name}


POD_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"


def render_raycluster(name: str, namespace: str, uid: str, spec: TPUFineTuneSpec) -> dict:
    """The complete `ray.io/v1` RayCluster for TPUFineTune `namespace/name`."""
    shape = slice_shape(spec)
    resources = plan_resources(spec)
    env = _common_env(spec, shape)
    head_pod = _pod("ray-head", spec, env, resources["head"])
    head_pod["containers"][0]["ports"] = [dict(p) for p in HEAD_PORTS]
    worker_group: dict = {
        "groupName": shape.group_name,
        "replicas": spec.tpu.slices,
        "minReplicas": spec.tpu.slices,
        "maxReplicas": spec.tpu.slices,
        "numOfHosts": shape.hosts,
    }
    if shape.generation.devices_per_chip > 1:
        # Ray counts chiplets: advertise every logical TPU device of the host.
        worker_group["resources"] = {
            "TPU": str(shape.chips_per_host * shape.generation.devices_per_chip)}
    worker_pod = _worker_pod(spec, shape, env, resources["workers"])
    if spec.tpu.slices > 1:
        _one_pool_per_slice(worker_pod, raycluster_name(name), shape)
    worker_group["template"] = {"metadata": {"labels": pod_labels(name)}, "spec": worker_pod}
    raycluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": raycluster_name(name),
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, NAME_LABEL: name},
            "ownerReferences": [{
                "apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
                "controller": True, "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            "rayVersion": spec.ray_version,
            # Ray token authentication with the run's own token: KubeRay sets RAY_AUTH_MODE
            # and RAY_AUTH_TOKEN (from the Secret) on every Ray container.
            "authOptions": {"mode": "token", "secretName": token_secret_name(name, uid)},
            "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                              "template": {"metadata": {"labels": pod_labels(name)}, "spec": head_pod}},
            "workerGroupSpecs": [worker_group],
        },
    }
    if spec.queue_name:
        _queue_in_kueue(raycluster, spec)
    return raycluster


def _one_pool_per_slice(pod: dict, cluster: str, shape: SliceShape) -> None:
    """Several slices: each worker learns its slice (the replica index KubeRay labels it
    with), and on TPU each replica's hosts share one node pool that no other replica uses,
    as a GKE TPU node pool is one slice (its ICI domain). matchLabelKeys and
    mismatchLabelKeys (Kubernetes 1.31+) compare the pod's own replica index."""
    pod["containers"][0]["env"].append({"name": SLICE_INDEX_ENV, "valueFrom": {
        "fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}})
    if not shape.generation.is_tpu:
        return  # the cpu stand-in's workers are CPU pods, not slices of a pool
    group = {"matchLabels": {RAY_CLUSTER_LABEL: cluster, RAY_GROUP_LABEL: shape.group_name}}
    pod["affinity"] = {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": group, "matchLabelKeys": [REPLICA_INDEX_LABEL],
            "topologyKey": NODEPOOL_LABEL}]},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": copy.deepcopy(group), "mismatchLabelKeys": [REPLICA_INDEX_LABEL],
            "topologyKey": NODEPOOL_LABEL}]},
    }


def _queue_in_kueue(raycluster: dict, spec: TPUFineTuneSpec) -> None:
    """Created suspended with Kueue's queue label: Kueue admits it (unsuspends it) when the
    quota allows. Suspended by us, not by Kueue's webhook, so nothing depends on it."""
    labels = raycluster["metadata"]["labels"]
    labels[QUEUE_NAME_LABEL] = spec.queue_name
    if spec.workload_priority_class_name:
        labels[PRIORITY_CLASS_LABEL] = spec.workload_priority_class_name
    raycluster["spec"]["suspend"] = True


def _common_env(spec: TPUFineTuneSpec, shape: SliceShape) -> list[dict]:
    env = []
    secret = spec.model.token_secret
    if secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": secret.name, "key": secret.key}}})
    if shape.generation.devices_per_chip > 1:
        env.append({"name": "RAY_TPU_RESOURCE_PER_CHIP",
                    "value": str(shape.generation.devices_per_chip)})
    return env


# Checkpoint on notice (the trainer's notice.py): each Ray worker process of the pod leaves
# an empty file named by its pid in the pod's notice directory, and removes it once it has
# saved on notice. The kubelet runs this before it sends SIGTERM to the container's first
# process (`ray start`, which would take every Ray process with it): it signals those
# workers and waits, inside the grace period, until each has saved.
NOTICE_DIR = "/tmp/tpufinetune-notice/$(TPUFT_POD_UID)"
# A worker's file holds its start time (field 22 of /proc/<pid>/stat, as the trainer's
# notice.py writes it): a pid whose process has since ended may name another process, and
# the hook leaves that one alone. An empty file (a trainer before this) is taken at its pid.
PRE_STOP_SCRIPT = (
    'd="$TPUFT_NOTICE_DIR"; [ -d "$d" ] || exit 0; '
    'ours() { p=${1##*/}; [ -r "/proc/$p/stat" ] || return 1; s=$(cat "$1" 2>/dev/null); '
    '[ -z "$s" ] || [ "$(sed "s/^.*) //" "/proc/$p/stat" | cut -d" " -f20)" = "$s" ]; }; '
    'for f in "$d"/*; do [ -e "$f" ] && ours "$f" && kill -TERM "${f##*/}" 2>/dev/null; done; '
    'while :; do left=0; for f in "$d"/*; do [ -e "$f" ] && ours "$f" && left=1; done; '
    '[ "$left" = 0 ] && exit 0; sleep 0.5; done')
NOTICE_ENV = [
    {"name": "TPUFT_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    {"name": "TPUFT_NOTICE_DIR", "value": NOTICE_DIR},
]

# Ray's own answer to SIGTERM first marks the node draining and waits, up to 30 s, for it to
# go idle: that is for Ray Serve, whose proxies stop taking traffic meanwhile. A training
# pod has nothing to hand over (the preStop hook above has saved the step), and when a run
# is released its head goes with its workers, so the workers' wait runs out: every host of
# the slice was held 30 s longer (measured on the test ground). With 0, `ray start` stops
# its processes at once. A run's own env (spec.head.env, spec.workers.env) comes later and wins.
SHUTDOWN_ENV = [{"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "0"}]


def _pod(container_name: str, spec: TPUFineTuneSpec, env: list[dict],
         resources: Resources) -> dict:
    requests, limits, _ = resources
    container: dict = {"name": container_name, "image": spec.image}
    container["env"] = copy.deepcopy(env) + copy.deepcopy(NOTICE_ENV) + copy.deepcopy(SHUTDOWN_ENV)
    container["resources"] = {"limits": dict(limits), "requests": dict(requests)}
    container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", PRE_STOP_SCRIPT]}}}
    grace = spec.termination_grace_period_seconds or DEFAULT_TERMINATION_GRACE_SECONDS
    pod: dict = {"containers": [container], "terminationGracePeriodSeconds": grace}
    if spec.service_account_name:
        pod["serviceAccountName"] = spec.service_account_name
    return pod


def _worker_pod(spec: TPUFineTuneSpec, shape: SliceShape, env: list[dict],
                resources: Resources) -> dict:
    pod = _pod("ray-worker", spec, env, resources)
    shm = resources[2]
    if shm:
        # Ray's object store lives in /dev/shm; the container default (64Mi) is too small.
        pod["containers"][0]["volumeMounts"] = [{"mountPath": "/dev/shm", "name": "dshm"}]
        pod["volumes"] = [{"name": "dshm",
                           "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    selector = {}
    if shape.generation.is_tpu:
        selector[g.ACCELERATOR_LABEL] = shape.generation.accelerator_label
        selector[g.TOPOLOGY_LABEL] = spec.tpu.topology
    if spec.tpu.spot:
        selector[g.SPOT_LABEL] = "true"
    if spec.tpu.reservation:
        selector[g.RESERVATION_NAME_LABEL] = spec.tpu.reservation
        selector[g.RESERVATION_AFFINITY_LABEL] = "specific"
    if selector:
        pod["nodeSelector"] = selector
    return pod
