"""GKE-shaped Node objects for the test ground: one node pool per TPU slice, plus CPU nodes.

Each TPU node carries the labels and the taint GKE puts on a TPU slice node, and the
capacity of its machine type as GKE publishes it (`gke_shapes.py`, written once in the
harness, never read from the product's own table, so a wrong product figure meets these
nodes as it would meet GKE's). What a pod may use is the allocatable GKE leaves after its
system reservations, computed with GKE's published formula, so a worker pod that fits here
fits the real machine.

Pure: this module builds manifests; `Ground` creates them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gke_shapes import (  # noqa: E402
    ACCELERATOR_LABEL,
    CPU_MACHINE,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    check_topology,
    chips_in,
    default_chips_per_host,
    family,
)

NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
MACHINE_FAMILY_LABEL = "cloud.google.com/machine-family"
# Marks the nodes whose pods the ground's node agent runs.
SIMULATED_LABEL = "tpufinetune.dev/simulated-node"
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
# A Spot pool: GKE labels its nodes cloud.google.com/gke-spot=true, and the taint below is
# the one node auto-provisioning puts on Spot pools (and GKE's docs advise for Standard pools),
# so only pods that tolerate preemption land there.
SPOT_TAINT = {"key": SPOT_LABEL, "value": "true", "effect": "NoSchedule"}
# GKE announces a host maintenance event on the node: the label's value is its start time,
# in seconds since the epoch.
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
MAX_PODS = 110  # GKE's default maximum pods per node (Standard clusters)
EPHEMERAL_STORAGE_GIB = 100  # the boot disk of a default GKE node pool


@dataclass(frozen=True)
class NodePool:
    name: str
    machine_type: str
    nodes: int
    vcpus: int
    memory_gib: int
    tpu_chips: int = 0  # google.com/tpu per node; 0 for CPU nodes
    accelerator: str | None = None  # cloud.google.com/gke-tpu-accelerator
    topology: str | None = None  # cloud.google.com/gke-tpu-topology
    spot: bool = False  # Spot VMs: GKE's spot label and taint; preempt_node() ends them

    def node_names(self) -> list[str]:
        return [f"gke-ground-{self.name}-{i}" for i in range(self.nodes)]


def tpu_pool(name: str, generation_name: str, topology: str, nodes: int | None = None,
             chips_per_host: int | None = None) -> NodePool:
    """The node pool GKE creates for one slice (`gcloud container node-pools create
    --machine-type=... --tpu-topology=...`): hosts = chips / chips per VM, unless `nodes`
    asks for another count (a pool short of capacity, for tests)."""
    tpu = family(generation_name)
    check_topology(tpu, topology)
    machine = tpu.machine(chips_per_host or default_chips_per_host(topology))
    if chips_in(topology) % machine.tpu_chips:
        raise ValueError(f"{machine.machine_type} ({machine.tpu_chips} chips) cannot form a {topology} slice")
    hosts = chips_in(topology) // machine.tpu_chips
    return NodePool(
        name=name, machine_type=machine.machine_type, nodes=hosts if nodes is None else nodes,
        vcpus=machine.vcpus, memory_gib=machine.memory_gib, tpu_chips=machine.tpu_chips,
        accelerator=tpu.accelerator_label, topology=topology,
    )


def cpu_pool(name: str = "cpu-pool", nodes: int = 3, spot: bool = False) -> NodePool:
    """CPU nodes: they hold the Ray heads and the `cpu` stand-in's workers."""
    return NodePool(name=name, machine_type=CPU_MACHINE.machine_type, nodes=nodes,
                    vcpus=CPU_MACHINE.vcpus, memory_gib=CPU_MACHINE.memory_gib, spot=spot)


def default_pools() -> list[NodePool]:
    """The default ground: a v6e 4x4 slice, a v7x 2x2x2 slice and CPU nodes."""
    return [
        tpu_pool("v6e-4x4", "v6e", "4x4"),
        tpu_pool("v7x-2x2x2", "v7x", "2x2x2"),
        cpu_pool(),
    ]


# ---- GKE's node allocatable --------------------------------------------------------------
# https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes#memory_and_cpu_reservations


def reserved_millicores(vcpus: int) -> int:
    """CPU GKE reserves for the system: 6% of the first core, 1% of the next, 0.5% of the
    next 2, 0.25% of every core above 4."""
    tiers = ((1, 60), (1, 10), (2, 5), (float("inf"), 2.5))
    return round(_tiered(vcpus, tiers))


def reserved_memory_mib(memory_gib: int) -> int:
    """Memory GKE reserves: 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8,
    6% of the next 112, 2% above 128 GiB; plus the 100 MiB eviction threshold."""
    tiers = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02))
    return round(_tiered(memory_gib, tiers) * 1024) + 100


def _tiered(amount: float, tiers) -> float:
    total, left = 0.0, amount
    for size, rate in tiers:
        take = min(left, size)
        total += take * rate
        left -= take
        if left <= 0:
            break
    return total


def node_manifest(pool: NodePool, name: str) -> dict:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        NODEPOOL_LABEL: pool.name,
        INSTANCE_TYPE_LABEL: pool.machine_type,
        MACHINE_FAMILY_LABEL: pool.machine_type.split("-", 1)[0],
        SIMULATED_LABEL: "true",
    }
    taints = []
    if pool.tpu_chips:
        labels[ACCELERATOR_LABEL] = pool.accelerator
        labels[TOPOLOGY_LABEL] = pool.topology
        taints.append(dict(TPU_TAINT))
    if pool.spot:
        labels[SPOT_LABEL] = "true"
        taints.append(dict(SPOT_TAINT))
    spec = {"taints": taints} if taints else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec}


def node_status(pool: NodePool, now: str) -> dict:
    capacity = {
        "cpu": str(pool.vcpus),
        "memory": f"{pool.memory_gib}Gi",
        "pods": str(MAX_PODS),
        "ephemeral-storage": f"{EPHEMERAL_STORAGE_GIB}Gi",
    }
    allocatable = {
        "cpu": f"{pool.vcpus * 1000 - reserved_millicores(pool.vcpus)}m",
        "memory": f"{pool.memory_gib * 1024 - reserved_memory_mib(pool.memory_gib)}Mi",
        "pods": str(MAX_PODS),
        "ephemeral-storage": f"{EPHEMERAL_STORAGE_GIB - 10}Gi",
    }
    if pool.tpu_chips:
        capacity[TPU_RESOURCE] = allocatable[TPU_RESOURCE] = str(pool.tpu_chips)
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "node agent of the test ground", "lastHeartbeatTime": now,
             "lastTransitionTime": now}
    return {
        "capacity": capacity,
        "allocatable": allocatable,
        "conditions": [ready],
        "addresses": [{"type": "Hostname", "address": "localhost"},
                      {"type": "InternalIP", "address": "127.0.0.1"}],
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                     "kubeletVersion": "ground-node-agent", "containerRuntimeVersion": "ray-process://",
                     "kernelVersion": "", "osImage": "", "kubeProxyVersion": "", "machineID": "",
                     "systemUUID": "", "bootID": ""},
    }


# ---- what GKE's TPU webhook gives a TPU worker pod ----------------------------------------
# KubeRay labels every worker pod with its replica's index in the group and, in a multi-host
# group, its host index within the replica (feature gate RayMultiHostIndexing, on by default
# since KubeRay v1.5; ray-operator/controllers/ray/common/pod.go). GKE's TPU webhook derives a
# worker's identity from the same place: TPU_WORKER_ID is the host index, TPU_NAME is
# "<group>-<replica>", and TPU_WORKER_HOSTNAMES (multi-host only) lists the replica's hosts by
# the names the webhook gives them under the cluster's headless worker Service.
REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
HOST_INDEX_LABEL = "ray.io/replica-host-index"


@dataclass(frozen=True)
class TpuHost:
    replica: int
    worker_id: int
    slice_name: str
    hostnames: tuple[str, ...]  # empty for a single-host slice


def tpu_host(pod_labels: dict, hosts: int) -> TpuHost:
    """A TPU worker's place in its slice, from the labels KubeRay put on its pod. Pure: a
    replacement pod gets the index of the one it replaces, so ids never grow."""
    def index(label: str) -> int:
        try:
            return int(pod_labels[label])
        except (KeyError, ValueError):
            raise ValueError(
                f"TPU worker pod has no integer {label} label (labels: {sorted(pod_labels)}); KubeRay sets it "
                "with its RayMultiHostIndexing feature gate (on by default since v1.5)") from None

    replica = index(REPLICA_INDEX_LABEL)
    worker_id = index(HOST_INDEX_LABEL) if hosts > 1 else 0
    if not 0 <= worker_id < hosts:
        raise ValueError(f"{HOST_INDEX_LABEL}={worker_id} is outside a slice of {hosts} hosts")
    group, cluster = pod_labels.get("ray.io/group", ""), pod_labels.get("ray.io/cluster", "")
    slice_name = f"{group}-{replica}"
    hostnames = tuple(f"{slice_name}-{i}.{cluster}-headless-worker-svc" for i in range(hosts)) if hosts > 1 else ()
    return TpuHost(replica, worker_id, slice_name, hostnames)
