"""TPU generation facts: the one table that sizing, validation and the CRD's CEL rules read.

Every rule about which topology a generation accepts, which machine serves it and how big
the worker pods are lives here, so the admission-time CEL rules (crdgen), the operator's
pydantic checks (api) and the RayCluster sizing (sizing) can never disagree.

Facts follow the GKE TPU documentation: node label `cloud.google.com/gke-tpu-accelerator`,
machine types, chips per host, supported slice shapes. Worker CPU/memory/`/dev/shm`
defaults leave headroom below each machine's allocatable capacity; the v6e `4x4` and v7x
`2x2x2` values are the GKE Ray + TorchTPU tutorial's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
TPU_RESOURCE = "google.com/tpu"

# The CPU stand-in accepts topology "N" = N CPU workers, 1 <= N <= this.
MAX_CPU_WORKERS = 64
# The largest TPU machine (ct5lp-hightpu-8t, ct6e-standard-8t); bounds spec.tpu.chipsPerHost.
MAX_CHIPS_PER_HOST = 8
# spec.tpu.slices' own bound: the replicas of one RayCluster worker group.
MAX_SLICES = 64


@dataclass(frozen=True)
class Machine:
    """One GKE TPU machine type and the slice shapes it can form."""

    machine_type: str
    chips_per_host: int
    topologies: tuple[str, ...]
    worker_cpu: str
    worker_memory: str
    shm_size: str
    vcpus: int
    """The whole VM's vCPUs, as Compute Engine lists the machine type."""
    memory_gib: int
    """The whole VM's memory (Compute Engine's "GB" here are GiB)."""
    source: str
    """Where the vCPU and memory figures come from."""


@dataclass(frozen=True)
class Generation:
    name: str
    """Canonical name (the one the docs, group names and messages use)."""
    aliases: tuple[str, ...]
    """Every spelling `spec.tpu.generation` accepts for this generation, canonical first."""
    accelerator_label: str | None
    ray_accelerator_type: str | None
    """Ray's accelerator type (ScalingConfig / slice_placement_group)."""
    group_prefix: str
    tensorcores_per_chip: int
    """Used only for the worker group name, which follows Cloud TPU's accelerator-type
    naming (v4-16 and tpu7x-16 are 8 chips; v6e-16 is 16)."""
    devices_per_chip: int
    """What Ray and torch see as devices: 2 on v7x (two chiplets), else 1 (v4/v5p
    megacore presents its two TensorCores as one device)."""
    dimensions: int
    machines: tuple[Machine, ...]
    """Ordered by preference: the first machine that serves a topology is its default."""
    hbm_gib_per_chip: float = 0.0
    """High-bandwidth memory of one chip, GiB (0: no HBM, the cpu stand-in). On v7x the two
    devices of a chip share it: each holds half. The memory planner (memplan.py) reads it."""
    hbm_source: str = ""
    """Where the HBM figure comes from."""
    multislice_max_chips: int | None = None
    """Chips one Multislice job may span over every slice, where Cloud TPU publishes a
    ceiling (None: none published; MAX_SLICES bounds it)."""

    @property
    def is_tpu(self) -> bool:
        return self.accelerator_label is not None

    def valid_topologies(self) -> list[str]:
        seen: list[str] = []
        for machine in self.machines:
            seen.extend(t for t in machine.topologies if t not in seen)
        return sorted(seen, key=topology_sort_key)

    def machines_for(self, topology: str) -> list[Machine]:
        return [m for m in self.machines if topology in m.topologies]


_2D_SHAPES = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_3D_SHAPES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
              "8x8x16", "8x16x16")

# Machine-type tables (vCPUs and memory per VM) of each generation's Cloud TPU page.
_V4 = "https://cloud.google.com/tpu/docs/v4"
_V5E = "https://cloud.google.com/tpu/docs/v5e"
_V5P = "https://cloud.google.com/tpu/docs/v5p"
_V6E = "https://cloud.google.com/tpu/docs/v6e"
_V7X = "https://cloud.google.com/tpu/docs/tpu7x"
# HBM per chip: each generation's "System architecture" table on the same pages (v4 32 GiB,
# v5e 16 GiB, v5p 95 GiB, v6e 32 GiB, Ironwood 192 GiB per chip).
# Multislice (https://cloud.google.com/tpu/docs/multislice-introduction): v4 and later, every
# slice of one accelerator type and topology, in one zone. The only per-generation ceiling
# Cloud TPU publishes is v5p's: single-slice training up to 6,144 chips, "Multislice ... up to
# 18,432 chips" (the v5p page). The cpu stand-in's ceiling is its worker count, all slices
# together (MAX_CPU_WORKERS).
V5P_MULTISLICE_MAX_CHIPS = 18432

GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="v4", aliases=("v4",), accelerator_label="tpu-v4-podslice",
        ray_accelerator_type="TPU-V4", group_prefix="v4", tensorcores_per_chip=2,
        devices_per_chip=1, dimensions=3,
        hbm_gib_per_chip=32, hbm_source=_V4,
        machines=(Machine("ct4p-hightpu-4t", 4, _3D_SHAPES + ("8x8x12",), "64", "200Gi",
                          "100Gi", vcpus=240, memory_gib=407, source=_V4),),
    ),
    Generation(
        name="v5e", aliases=("v5e", "v5litepod"), accelerator_label="tpu-v5-lite-podslice",
        ray_accelerator_type="TPU-V5LITEPOD", group_prefix="v5litepod",
        tensorcores_per_chip=1, devices_per_chip=1, dimensions=2,
        hbm_gib_per_chip=16, hbm_source=_V5E,
        machines=(
            Machine("ct5lp-hightpu-4t", 4, _2D_SHAPES, "64", "128Gi", "64Gi",
                    vcpus=112, memory_gib=192, source=_V5E),
            Machine("ct5lp-hightpu-1t", 1, ("1x1",), "16", "32Gi", "16Gi",
                    vcpus=24, memory_gib=48, source=_V5E),
            Machine("ct5lp-hightpu-8t", 8, ("2x4",), "128", "256Gi", "128Gi",
                    vcpus=224, memory_gib=384, source=_V5E),
        ),
    ),
    Generation(
        name="v5p", aliases=("v5p",), accelerator_label="tpu-v5p-slice",
        ray_accelerator_type="TPU-V5P", group_prefix="v5p", tensorcores_per_chip=2,
        devices_per_chip=1, dimensions=3,
        hbm_gib_per_chip=95, hbm_source=_V5P, multislice_max_chips=V5P_MULTISLICE_MAX_CHIPS,
        machines=(Machine("ct5p-hightpu-4t", 4, _3D_SHAPES + ("16x16x16", "16x16x24"),
                          "64", "200Gi", "100Gi", vcpus=208, memory_gib=448, source=_V5P),),
    ),
    Generation(
        name="v6e", aliases=("v6e", "trillium"), accelerator_label="tpu-v6e-slice",
        ray_accelerator_type="TPU-V6E", group_prefix="v6e", tensorcores_per_chip=1,
        devices_per_chip=1, dimensions=2,
        hbm_gib_per_chip=32, hbm_source=_V6E,
        machines=(
            Machine("ct6e-standard-4t", 4, _2D_SHAPES, "64", "200Gi", "100Gi",
                    vcpus=180, memory_gib=720, source=_V6E),
            Machine("ct6e-standard-1t", 1, ("1x1",), "32", "96Gi", "48Gi",
                    vcpus=44, memory_gib=176, source=_V6E),
            Machine("ct6e-standard-8t", 8, ("2x4",), "128", "400Gi", "200Gi",
                    vcpus=180, memory_gib=1440, source=_V6E),
        ),
    ),
    Generation(
        name="v7x", aliases=("v7x", "tpu7x", "ironwood"), accelerator_label="tpu7x",
        ray_accelerator_type="TPU-V7X", group_prefix="tpu7x", tensorcores_per_chip=2,
        devices_per_chip=2, dimensions=3,
        hbm_gib_per_chip=192, hbm_source=_V7X,
        machines=(Machine("tpu7x-standard-4t", 4, _3D_SHAPES + ("16x16x16", "16x16x24"),
                          "64", "250Gi", "128Gi", vcpus=224, memory_gib=960, source=_V7X),),
    ),
    Generation(
        name="cpu", aliases=("cpu",), accelerator_label=None, ray_accelerator_type=None,
        group_prefix="cpu", tensorcores_per_chip=0, devices_per_chip=0, dimensions=1,
        machines=(),
    ),
)

_BY_ALIAS = {alias: g for g in GENERATIONS for alias in g.aliases}
ALL_GENERATION_NAMES: tuple[str, ...] = tuple(a for g in GENERATIONS for a in g.aliases)

# Pods of the CPU stand-in: small enough for a laptop-sized test cluster.
CPU_WORKER_CPU = "1"
CPU_WORKER_MEMORY = "2Gi"


def generation(name: str) -> Generation:
    """The generation for any accepted spelling (KeyError for an unknown one)."""
    return _BY_ALIAS[name]


def topology_sort_key(topology: str) -> tuple[int, ...]:
    dims = [int(d) for d in topology.split("x")]
    return (math.prod(dims), *dims)


def chips_in(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def topology_error(gen: Generation, topology: str) -> str | None:
    """Why `topology` is invalid for `gen` (None when valid). Mirrors the CEL rules."""
    if not gen.is_tpu:
        if topology.isdigit() and 1 <= int(topology) <= MAX_CPU_WORKERS:
            return None
        return (f'"{topology}" is not a valid cpu topology; use a worker count from 1 to '
                f"{MAX_CPU_WORKERS}")
    if topology in gen.valid_topologies():
        return None
    return (f'"{topology}" is not a valid {gen.name} topology; valid: '
            f"{', '.join(gen.valid_topologies())}")


def select_machine(gen: Generation, topology: str, chips_per_host: int | None) -> Machine:
    """The machine that hosts `topology`: the first in table order, or the one with the
    requested chips per host. Callers validate first (`chips_per_host_error`)."""
    candidates = gen.machines_for(topology)
    if chips_per_host is not None:
        candidates = [m for m in candidates if m.chips_per_host == chips_per_host]
    if not candidates:
        raise ValueError(f"no {gen.name} machine serves {topology} "
                         f"with chipsPerHost={chips_per_host}")
    return candidates[0]


def chips_per_host_options(gen: Generation, topology: str) -> list[int]:
    return sorted({m.chips_per_host for m in gen.machines_for(topology)})


def chips_per_host_error(gen: Generation, topology: str, chips_per_host: int) -> str | None:
    """Why `chips_per_host` cannot host `topology` (None when it can). Mirrors CEL."""
    if not gen.is_tpu:
        return "applies to TPU generations only; remove it for cpu"
    options = chips_per_host_options(gen, topology)
    if chips_per_host in options:
        return None
    return (f"{chips_per_host} does not fit a {gen.name} {topology} slice; valid: "
            f"{', '.join(str(o) for o in options)}")


def machines_summary(gen: Generation) -> str:
    """`4 (ct6e-standard-4t: 2x2, 2x4, …); 1 (ct6e-standard-1t: 1x1)`, for messages."""
    return "; ".join(
        f"{m.chips_per_host} ({m.machine_type}: "
        f"{', '.join(sorted(m.topologies, key=topology_sort_key))})" for m in gen.machines)


def max_slices(gen: Generation, topology: str) -> int:
    """How many slices of `topology` one run may span (callers validate the topology first)."""
    if not gen.is_tpu:
        return max(MAX_CPU_WORKERS // int(topology), 1)
    if gen.multislice_max_chips is None:
        return MAX_SLICES
    return max(min(MAX_SLICES, gen.multislice_max_chips // chips_in(topology)), 1)


def multislice_ceilings() -> str:
    """Every ceiling `max_slices` applies, for the one message the CEL rule and Python share."""
    ceilings = [f"{gen.name} Multislice spans at most {gen.multislice_max_chips} chips"
                for gen in GENERATIONS if gen.multislice_max_chips]
    ceilings.append(f"the cpu stand-in at most {MAX_CPU_WORKERS} workers over all slices")
    return "; ".join(ceilings)
