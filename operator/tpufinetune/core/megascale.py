"""What the TPU runtime needs to join several slices over the data-centre network (pure).

libtpu finds the other slices of a multi-slice job through four variables:
MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID (this slice), MEGASCALE_COORDINATOR_ADDRESS (slice
0's first host) and MEGASCALE_PORT (where this process listens). Every worker pod of a run
with spec.tpu.slices > 1 gets them from its slice:

- MEGASCALE_NUM_SLICES: the spec's slice count.
- MEGASCALE_SLICE_ID: KubeRay's replica index label (downward API), the same source as
  TPUFT_SLICE_INDEX: one worker-group replica is one slice.
- MEGASCALE_PORT: 8081, Ray's and GKE's TPU webhook's default (Ray's metrics take 8080).
- MEGASCALE_COORDINATOR_ADDRESS, on TPU slices of several hosts: slice 0's first host by the
  DNS name GKE's TPU webhook gives it, `<group>-0-0` under KubeRay's headless worker Service
  (`<cluster>-headless`, created for multi-host groups). A replacement pod gets the same
  name. A single-host slice has no such name (KubeRay makes no headless Service and the
  webhook sets no hostname), and the cpu stand-in no webhook.

The trainer renews all four in each of its worker processes from the live Ray worker group
before the TPU runtime starts (tpufinetune_trainer/backends.py, `megascale_env`): the
coordinator as slice 0's first host's address at that moment, each process's port the base
above plus its index on its host. The pod's values are what any other process of the pod
sees.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from .sizing import REPLICA_INDEX_LABEL, raycluster_name, slice_shape

if TYPE_CHECKING:
    from .api import TPUFineTuneSpec

COORDINATOR_ENV = "MEGASCALE_COORDINATOR_ADDRESS"
NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"
SLICE_ID_ENV = "MEGASCALE_SLICE_ID"
PORT_ENV = "MEGASCALE_PORT"
DEFAULT_PORT = 8081
# KubeRay's headless worker Service: `<cluster>-headless` (HeadlessServiceSuffix, v1.6).
HEADLESS_SERVICE_SUFFIX = "-headless"


def coordinator_hostname(cluster: str, group: str) -> str:
    """Slice 0's first host, as GKE's TPU webhook names it (`hostname.subdomain`)."""
    return f"{group}-0-0.{cluster}{HEADLESS_SERVICE_SUFFIX}"


def pod_env(name: str, spec: TPUFineTuneSpec) -> list[dict]:
    """The MEGASCALE variables of every worker pod of `spec`; none for one slice."""
    if spec.tpu.slices < 2:
        return []
    shape = slice_shape(spec)
    env = [
        {"name": NUM_SLICES_ENV, "value": str(spec.tpu.slices)},
        {"name": SLICE_ID_ENV, "valueFrom": {
            "fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}},
        {"name": PORT_ENV, "value": str(DEFAULT_PORT)},
    ]
    if shape.generation.is_tpu and shape.hosts > 1:
        env.append({"name": COORDINATOR_ENV,
                    "value": coordinator_hostname(raycluster_name(name), shape.group_name)})
    return env


def with_megascale_env(raycluster: dict, name: str, spec: TPUFineTuneSpec) -> dict:
    """`raycluster` with `pod_env` appended to each worker group's Ray container (in place;
    returned for chaining)."""
    env = pod_env(name, spec)
    for group in raycluster["spec"]["workerGroupSpecs"] if env else ():
        container = group["template"]["spec"]["containers"][0]
        container["env"] = [*container.get("env", []), *copy.deepcopy(env)]
    return raycluster
