"""What GKE gives: its machine shapes, node labels and TPU pod environment, written once for
the test ground.

The ground's Nodes (nodepools.py) and the environment its node agent gives TPU worker pods
(nodeagent.tpu_environment) are built from these facts, never from the product's own table
(`tpufinetune.core.generations`). So the product's sizing meets the ground as it would meet
GKE: a wrong vCPU, memory or chip figure in the product's table makes its worker pods miss
their nodes here as there, and `tests/api/test_gke_shapes.py` names the disagreement.

Sources, as published (Compute Engine "GB" in these tables are GiB):
- TPU machine types, vCPUs and memory per VM: each generation's Cloud TPU page (URLs below)
  and GKE's "Plan TPUs in GKE"
  (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus);
- node labels `cloud.google.com/gke-tpu-accelerator` and `cloud.google.com/gke-tpu-topology`:
  https://cloud.google.com/kubernetes-engine/docs/how-to/tpus;
- the environment of a TPU worker pod: the GKE Ray + TorchTPU tutorial ("Fine-tune models on
  multi-host TPUs with Ray and TorchTPU"), whose workers print TPU_WORKER_HOSTNAMES,
  TPU_WORKER_ID, TPU_NAME, TORCH_TPU_TOPOLOGY and TORCH_TPU_SLICEBUILDER_ADDRESSES as the
  KubeRay TPU webhook sets them, and the variables GKE sets on TPU nodes that Ray's TPU code
  reads (ray/_private/accelerators/tpu.py: TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY).

Pure: no Kubernetes, no Ray imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
# A Spot VM's node: https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms
SPOT_LABEL = "cloud.google.com/gke-spot"


@dataclass(frozen=True)
class Machine:
    """A Compute Engine machine type as GKE creates its node."""

    machine_type: str
    vcpus: int
    memory_gib: int
    tpu_chips: int = 0  # google.com/tpu capacity of the node; 0 for a CPU machine


@dataclass(frozen=True)
class TpuFamily:
    """One TPU generation as GKE presents it."""

    name: str  # the generation's short name in Cloud TPU's docs
    accelerator_label: str  # the value of cloud.google.com/gke-tpu-accelerator
    accelerator_type_prefix: str  # TPU_ACCELERATOR_TYPE is "<prefix>-<TensorCores in the slice>"
    tensorcores_per_chip: int
    devices_per_chip: int  # devices a framework sees per chip: Ironwood's two chiplets are two
    topology_dims: int  # 2 for a 2D torus (AxB), 3 for a 3D one (AxBxC)
    ray_accelerator_type: str  # Ray's name for it (ray.util.accelerators.GOOGLE_TPU_*)
    machines: tuple[Machine, ...]
    source: str

    def machine(self, chips_per_host: int) -> Machine:
        for machine in self.machines:
            if machine.tpu_chips == chips_per_host:
                return machine
        raise ValueError(f"GKE has no {self.name} machine with {chips_per_host} chips; it has "
                         f"{', '.join(f'{m.machine_type} ({m.tpu_chips})' for m in self.machines)}")

    def accelerator_type(self, topology: str) -> str:
        """TPU_ACCELERATOR_TYPE of a slice: v6e-16 for a v6e 4x4 (16 chips, one TensorCore
        each), tpu7x-16 for an Ironwood 2x2x2 (8 chips, two TensorCores each)."""
        return f"{self.accelerator_type_prefix}-{chips_in(topology) * self.tensorcores_per_chip}"


# n2-standard-16: https://cloud.google.com/compute/docs/general-purpose-machines#n2_machines
CPU_MACHINE = Machine("n2-standard-16", vcpus=16, memory_gib=64)

TPU_FAMILIES: tuple[TpuFamily, ...] = (
    TpuFamily("v4", "tpu-v4-podslice", "v4", tensorcores_per_chip=2, devices_per_chip=1, topology_dims=3,
              ray_accelerator_type="TPU-V4",
              machines=(Machine("ct4p-hightpu-4t", 240, 407, tpu_chips=4),),
              source="https://cloud.google.com/tpu/docs/v4"),
    TpuFamily("v5e", "tpu-v5-lite-podslice", "v5litepod", tensorcores_per_chip=1, devices_per_chip=1,
              topology_dims=2, ray_accelerator_type="TPU-V5LITEPOD",
              machines=(Machine("ct5lp-hightpu-1t", 24, 48, tpu_chips=1),
                        Machine("ct5lp-hightpu-4t", 112, 192, tpu_chips=4),
                        Machine("ct5lp-hightpu-8t", 224, 384, tpu_chips=8)),
              source="https://cloud.google.com/tpu/docs/v5e"),
    TpuFamily("v5p", "tpu-v5p-slice", "v5p", tensorcores_per_chip=2, devices_per_chip=1, topology_dims=3,
              ray_accelerator_type="TPU-V5P",
              machines=(Machine("ct5p-hightpu-4t", 208, 448, tpu_chips=4),),
              source="https://cloud.google.com/tpu/docs/v5p"),
    TpuFamily("v6e", "tpu-v6e-slice", "v6e", tensorcores_per_chip=1, devices_per_chip=1, topology_dims=2,
              ray_accelerator_type="TPU-V6E",
              machines=(Machine("ct6e-standard-1t", 44, 176, tpu_chips=1),
                        Machine("ct6e-standard-4t", 180, 720, tpu_chips=4),
                        Machine("ct6e-standard-8t", 180, 1440, tpu_chips=8)),
              source="https://cloud.google.com/tpu/docs/v6e"),
    # Ironwood: each chip holds two chiplets (two TensorCores), which frameworks see as two
    # devices; the tutorial's 2x2x2 slice is tpu7x-16 with 8 TPU devices per 4-chip host.
    TpuFamily("v7x", "tpu7x", "tpu7x", tensorcores_per_chip=2, devices_per_chip=2, topology_dims=3,
              ray_accelerator_type="TPU-V7X",
              machines=(Machine("tpu7x-standard-4t", 224, 960, tpu_chips=4),),
              source="https://cloud.google.com/tpu/docs/tpu7x"),
)

# Other spellings of a generation in GKE's and Cloud TPU's docs.
_ALIASES = {"trillium": "v6e", "v5litepod": "v5e", "tpu7x": "v7x", "ironwood": "v7x"}
_BY_NAME = {f.name: f for f in TPU_FAMILIES}
_BY_LABEL = {f.accelerator_label: f for f in TPU_FAMILIES}
_BY_RAY_TYPE = {f.ray_accelerator_type: f for f in TPU_FAMILIES}


def family(name: str) -> TpuFamily:
    """The family for a generation's name (v6e, trillium, v7x, tpu7x, ...)."""
    try:
        return _BY_NAME[_ALIASES.get(name.lower(), name.lower())]
    except KeyError:
        raise ValueError(f"GKE has no TPU generation {name!r}; known: {', '.join(_BY_NAME)}") from None


def family_by_label(accelerator_label: str) -> TpuFamily:
    try:
        return _BY_LABEL[accelerator_label]
    except KeyError:
        raise ValueError(f"no GKE TPU node carries {ACCELERATOR_LABEL}={accelerator_label}") from None


def family_by_ray_type(ray_accelerator_type: str) -> TpuFamily:
    try:
        return _BY_RAY_TYPE[ray_accelerator_type]
    except KeyError:
        raise ValueError(f"Ray has no TPU accelerator type {ray_accelerator_type!r}; known: "
                         f"{', '.join(_BY_RAY_TYPE)}") from None


def chips_in(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def check_topology(tpu: TpuFamily, topology: str) -> None:
    """A value GKE could put on the topology label: AxB for a 2D torus, AxBxC for a 3D one."""
    dims = topology.split("x")
    if len(dims) != tpu.topology_dims or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"{topology!r} is not a {tpu.name} topology: {tpu.topology_dims} dimensions "
                         f"joined by 'x' ({'2x2' if tpu.topology_dims == 2 else '2x2x2'})")


def default_chips_per_host(topology: str) -> int:
    """The VM GKE uses for a slice when no machine type is asked for: the 4-chip machine
    (multi-host slices always use it), the 1-chip one for a 1x1 slice."""
    return min(4, chips_in(topology))


# ---- the TPU worker pod's environment ----------------------------------------------------
# The slice builder's first port on each host (the tutorial's workers list 8471 upwards,
# one port per TPU device of the host).
SLICE_BUILDER_PORT = 8471


def tpu_pod_environment(tpu: TpuFamily, topology: str, worker_id: int, slice_name: str,
                        hostnames: list[str]) -> dict[str, str]:
    """What a TPU worker pod finds in its environment on GKE: the node's TPU variables and the
    KubeRay TPU webhook's (TPU_WORKER_ID, TPU_NAME, TPU_WORKER_HOSTNAMES and TorchTPU's)."""
    check_topology(tpu, topology)
    hosts = max(1, len(hostnames))
    devices_per_host = chips_in(topology) // hosts * tpu.devices_per_chip
    dims = topology.split("x") + ["1"] * (3 - tpu.topology_dims)
    # The tutorial's workers: v6e 4x4 -> "4,4,1"; Ironwood 2x2x2 -> "2,2,2,2" (its chiplets last).
    torch_topology = dims + ([str(tpu.devices_per_chip)] if tpu.devices_per_chip > 1 else [])
    addresses = [f"{host}:{SLICE_BUILDER_PORT + i}" for host in hostnames for i in range(devices_per_host)]
    return {
        "TPU_WORKER_ID": str(worker_id),
        "TPU_WORKER_HOSTNAMES": ",".join(hostnames),
        "TPU_NAME": slice_name,
        "TPU_ACCELERATOR_TYPE": tpu.accelerator_type(topology),
        "TPU_TOPOLOGY": topology,
        # No TPU metadata server answers inside a pod: GKE's variables replace it.
        "TPU_SKIP_MDS_QUERY": "true",
        "TORCH_TPU_TOPOLOGY": ",".join(torch_topology),
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(addresses),
    }
