"""Refuse, with one clear message, to bring up `tpu_dist` on a host that has no TPU chip.

Ray places the workers by the `TPU` resources its nodes advertise, so a node that
advertises TPUs without having them (a mislabelled pool, a device plugin that did not
run, a test ground) gets its workers placed and the slice reserved. Bringing up the TPU
runtime there does not fail cleanly: libtpu polls a cloud metadata server and stalls.
So before Ray Train opens the `tpu_dist` process group, every worker checks for the
device files first and fails at once, saying where it was placed (backends.torch_config).
"""

from __future__ import annotations

import glob
import os

from .errors import ConfigError


class NoTPUDevice(ConfigError):
    pass


def tpu_device_files() -> list[str]:
    """The chips a TPU VM exposes: /dev/accel* (or VFIO groups on newer machines)."""
    files = [p for p in glob.glob("/dev/accel*") if not os.path.isdir(p)]
    try:
        files += [f"/dev/vfio/{e}" for e in os.listdir("/dev/vfio") if e.isdigit()]
    except OSError:
        pass
    return files


def require_tpu_device(worker_rank: int, world_size: int) -> None:
    """Run in each worker before the TPU runtime starts."""
    if tpu_device_files():
        return
    import ray

    slice_name = os.environ.get("TPU_NAME") or "?"
    host = os.environ.get("TPU_WORKER_ID") or "?"
    raise NoTPUDevice(
        f"no TPU device: Ray placed worker rank {worker_rank} of {world_size} on TPU slice {slice_name} "
        f"(host {host}, {ray.util.get_node_ip_address()}), but that host has no /dev/accel* "
        "or /dev/vfio TPU device. The node advertises TPU resources without chips: check that "
        "the pod runs on a TPU node pool and that GKE's TPU device plugin gave it the chips.")
