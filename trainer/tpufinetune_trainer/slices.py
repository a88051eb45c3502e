"""Several TPU slices, or shard groups within one: which slice each rank is in, and the 2-D
device mesh over them (HSDP).

With --num-slices N the model is sharded inside each slice (over ICI) and replicated
across slices (over the data-centre network): FSDP2's `fully_shard` over a 2-D mesh whose
dims are (MESH_DIMS) `replicate` (one row per slice) and `shard` (the slice's ranks). A
step's gradients are reduce-scattered inside the slice and all-reduced across slices once.

With --shard-group G (the operator's memory plan chose it: spec.training.sharding) each
slice's row is cut into groups of G consecutive ranks (by host, then rank: a group stays on
as few hosts as it can): the model is sharded within a group and replicated across the
groups of every slice, one row per group. G = 1 replicates it on every device (the shard
dim is 1: no all-gather or reduce-scatter moves a byte, one all-reduce a step does). The
parameters' names and shapes do not change, so a checkpoint written on one mesh loads on
another (DCP reshards) and the export is the same.

A rank's slice is read from what its pod is given, never from the order ranks start in
(Ray Train orders ranks by node, not by slice):

1. TPUFT_SLICE_INDEX: the operator sets it on every worker pod from KubeRay's label
   `ray.io/worker-group-replica-index` (downward API); one worker-group replica is one slice.
2. Else TPU_NAME's last `-<n>`: GKE's TPU webhook names a slice `<group>-<replica>`.

Inside a slice, ranks are ordered by TPU_WORKER_ID (the host in the slice; 0 off TPU),
then by Ray Train's rank. docs/trainer.md ("Several slices") says what is an assumption
until a multi-slice TPU run checks it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ConfigError

SLICE_INDEX_ENV = "TPUFT_SLICE_INDEX"
MESH_DIMS = ("replicate", "shard")
_TRAILING_INDEX = re.compile(r"-(\d+)$")


@dataclass(frozen=True, order=True)
class Place:
    """Where a rank runs: its slice, its host in the slice, its Ray Train rank."""

    slice: int | None
    host: int
    rank: int


def slice_index(env: dict) -> int | None:
    """This process's slice, from its pod's environment (None when nothing says)."""
    value = env.get(SLICE_INDEX_ENV, "")
    if value.strip():
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{SLICE_INDEX_ENV}={value!r} is not a slice index (KubeRay's "
                              "ray.io/worker-group-replica-index label, an integer)") from None
    match = _TRAILING_INDEX.search(env.get("TPU_NAME", ""))
    return int(match.group(1)) if match else None


def place(rank: int, env: dict | None = None) -> Place:
    env = os.environ if env is None else env
    host = env.get("TPU_WORKER_ID", "")
    return Place(slice_index(env), int(host) if host.isdigit() else 0, rank)


def layout(places: list[Place], num_slices: int, shard_group: int = 0) -> list[list[int]]:
    """The mesh's ranks, one row per slice (slice 0 first), each row by host then rank; with
    `shard_group` G (0: the slice), each slice's row cut into rows of G. Raises ConfigError
    when the ranks do not form `num_slices` slices of equal size, or G does not divide them."""
    world = len(places)
    if num_slices == 1:  # one slice: whatever a pod says, every rank is in it
        places = [Place(0, p.host, p.rank) for p in places]
    unknown = [p.rank for p in places if p.slice is None]
    if unknown:
        raise ConfigError(f"--num-slices {num_slices}: ranks {unknown[:8]} cannot tell which slice they are in: "
                          f"their pods have neither {SLICE_INDEX_ENV} (the operator sets it from KubeRay's "
                          "ray.io/worker-group-replica-index label) nor a TPU_NAME ending in -<replica>")
    rows: dict[int, list[Place]] = {}
    for p in places:
        rows.setdefault(p.slice, []).append(p)
    if sorted(rows) != list(range(num_slices)) or any(len(r) != world // num_slices for r in rows.values()):
        counts = ", ".join(f"slice {s}: {len(r)}" for s, r in sorted(rows.items()))
        raise ConfigError(f"--num-slices {num_slices}: the {world} ranks are not {num_slices} slices of "
                          f"{world // num_slices} ({counts}); each worker-group replica must be one whole slice")
    per_slice = world // num_slices
    group = shard_group or per_slice
    if per_slice % group:
        raise ConfigError(f"--shard-group {shard_group} does not divide the {per_slice} devices of a slice")
    ordered = [[p.rank for p in sorted(rows[s])] for s in range(num_slices)]
    return [row[i:i + group] for row in ordered for i in range(0, per_slice, group)]


def build_slice_mesh(device_type: str, num_slices: int, group=None, shard_group: int = 0):
    """Collective (every rank): the 2-D (replicate, shard) mesh of `num_slices` slices (each
    cut into groups of `shard_group` ranks when given), each rank placed by its pod's slice
    and host (`place`), gathered over `group` (gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, place(dist.get_rank()), group=group)
    mesh = torch.tensor(layout(places, num_slices, shard_group), dtype=torch.int)
    return DeviceMesh(device_type, mesh, mesh_dim_names=MESH_DIMS)
