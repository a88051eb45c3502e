"""The three device backends (TPU, CUDA, CPU) in one place.

Everything that differs between them lives here: the torch.distributed backend, the
Ray resources a worker asks for, the parameter dtype, the attention kernel, and how the
device is brought up. `torch_tpu` is imported only when the TPU backend is chosen: off a
TPU host, libtpu polls a cloud metadata server and stalls, so `auto` decides from what
Ray advertises (or device files on this host) and never by trying to initialise a TPU.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Mapping

from .errors import ConfigError, UsageError
from .slices import Place, layout, place

DEVICES = ("auto", "tpu", "cuda", "cpu")


@dataclass(frozen=True)
class Backend:
    name: str                 # tpu | cuda | cpu
    dist_backend: str         # torch.distributed backend
    device_type: str          # torch device type and DeviceMesh device type
    ray_resource: str | None  # what each Ray worker reserves besides a CPU
    compute_dtype: str        # torch dtype name for forward/backward (master weights are fp32)
    attn_implementation: str  # transformers attention kernel
    # AdamW keeps its step count and learning rate on the device (capturable), so an
    # optimizer step feeds the device no Python number that changes every step. CPU
    # optimizers are not capturable in torch; there the host is the device.
    capturable_optimizer: bool
    fused_optimizer: bool     # the CPU's fused AdamW kernel (one op for all parameters)
    # torch.compile each decoder block under --compile auto. Off on TPU until measured on
    # a slice (docs/trainer.md, "First hour on a real v6e-16"): Gemma 4's blocks differ in
    # shape (sliding vs global head_dim, shared-KV layers), so recompiles are likely.
    compile_by_default: bool


BACKENDS = {
    # The tutorial's TPU set-up: bf16 compute, eager attention, tpu_dist over ICI.
    "tpu": Backend("tpu", "tpu_dist", "tpu", "TPU", "bfloat16", "eager", True, False, False),
    "cuda": Backend("cuda", "nccl", "cuda", "GPU", "bfloat16", "sdpa", True, False, True),
    # CPU computes in fp32: this machine kind emulates bf16 matmuls (~20x slower), and
    # the CPU backend exists to rehearse and test. `--compute-dtype bfloat16` runs the
    # TPU's numerics on CPU.
    "cpu": Backend("cpu", "gloo", "cpu", None, "float32", "sdpa", False, True, False),
}
COMPUTE_DTYPES = ("auto", "bfloat16", "float32")
COMPILE_MODES = ("auto", "on", "off")
# The default of --compile-cache-dir: the operator names a mounted volume here.
COMPILE_CACHE_ENV = "TPUFT_COMPILE_CACHE_DIR"


def host_has_tpu() -> bool:
    """TPU device files on this host and torch_tpu installed (nothing is initialised)."""
    files = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(files) and importlib.util.find_spec("torch_tpu") is not None


def detect(cluster_resources: Mapping[str, float] | None = None) -> str:
    """`auto`: the accelerator the Ray cluster advertises; without a cluster, this host's."""
    if cluster_resources is not None:
        if cluster_resources.get("TPU", 0) > 0:
            return "tpu"
        if cluster_resources.get("GPU", 0) > 0:
            return "cuda"
        return "cpu"
    if host_has_tpu():
        return "tpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(device: str, cluster_resources: Mapping[str, float] | None = None) -> Backend:
    if device not in DEVICES:
        raise UsageError(f"unknown --device {device!r}; choose one of {', '.join(DEVICES)}")
    return BACKENDS[detect(cluster_resources) if device == "auto" else device]


def tpu_workers_per_slice(topology: str, accelerator_type: str) -> int:
    """Logical TPU devices in one slice (one worker each). Honours
    RAY_TPU_RESOURCE_PER_CHIP (2 on Ironwood, where each chip is two chiplets)."""
    from ray.util.tpu import get_tpu_worker_resources

    try:
        workers, _ = get_tpu_worker_resources(topology=topology, accelerator_type=accelerator_type,
                                              resources_per_worker={"TPU": 1}, num_slices=1)
    except Exception as exc:
        raise ConfigError(f"--topology {topology} does not fit --accelerator-type {accelerator_type}: {exc}") from exc
    return int(workers)


def check_workers(backend: Backend, num_workers: int, topology: str, accelerator_type: str,
                  num_slices: int = 1) -> None:
    if num_workers < 1:
        raise ConfigError(f"--num-workers must be at least 1, got {num_workers}")
    if backend.name != "tpu":
        return
    per_slice = tpu_workers_per_slice(topology, accelerator_type)
    if num_workers != per_slice * num_slices:
        hint = ""
        if "V7" in accelerator_type.upper() and os.environ.get("RAY_TPU_RESOURCE_PER_CHIP", "1") == "1":
            hint = " (Ironwood schedules per chiplet: the cluster and this job need RAY_TPU_RESOURCE_PER_CHIP=2)"
        raise ConfigError(
            f"--num-workers {num_workers} does not match the {per_slice} TPU devices of each of "
            f"{num_slices} {accelerator_type} {topology} slice(s) (one worker per device, "
            f"--num-slices {num_slices}). Set --num-workers {per_slice * num_slices}{hint}.")


def scaling_config(backend: Backend, num_workers: int, topology: str, accelerator_type: str,
                   num_slices: int = 1):
    """Ray Train's ScalingConfig: the tutorial's TPU slice reservation, or N GPU/CPU workers.
    With several slices, num_workers is every slice's devices: Ray reserves one slice per
    multiple of a slice's workers (its TPU slice placement groups)."""
    from ray.train import ScalingConfig

    check_workers(backend, num_workers, topology, accelerator_type, num_slices)
    if backend.name == "tpu":
        return ScalingConfig(use_tpu=True, num_workers=num_workers, topology=topology,
                             accelerator_type=accelerator_type, resources_per_worker={"TPU": 1})
    if backend.name == "cuda":
        return ScalingConfig(num_workers=num_workers, use_gpu=True)
    return ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1})


# What libtpu reads to join several slices over the data-centre network (the operator's
# core/megascale.py sets them on the worker pods; tests/api/test_megascale.py holds the two
# to the same names and port).
MEGASCALE_COORDINATOR_ENV = "MEGASCALE_COORDINATOR_ADDRESS"
MEGASCALE_NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"
MEGASCALE_SLICE_ID_ENV = "MEGASCALE_SLICE_ID"
MEGASCALE_PORT_ENV = "MEGASCALE_PORT"
MEGASCALE_ENV = (MEGASCALE_COORDINATOR_ENV, MEGASCALE_NUM_SLICES_ENV, MEGASCALE_SLICE_ID_ENV, MEGASCALE_PORT_ENV)
DEFAULT_MEGASCALE_PORT = 8081  # Ray's and GKE's TPU webhook's (Ray's metrics take 8080)
# The line each worker-group start prints with every rank's values, as its process holds them.
MEGASCALE_LOG_PREFIX = "MEGASCALE by rank "


@dataclass(frozen=True)
class WorkerHost:
    """What a worker reports for the MEGASCALE variables: its place (slice, host in the
    slice, Ray Train rank), its node's address and its pod's base MEGASCALE_PORT."""

    place: Place
    address: str
    base_port: int


def megascale_env(workers: list[WorkerHost], num_slices: int) -> list[dict[str, str]]:
    """Each rank's MEGASCALE variables (pure), from the live worker group: its own slice;
    the coordinator at slice 0's first host (the first rank of the mesh's slice-0 row,
    slices.layout: lowest TPU_WORKER_ID, then rank); each process's port the base plus its
    index among the ranks on its node, as several processes of one host each listen. Raises
    ConfigError (slices.layout's) when the ranks do not form `num_slices` slices."""
    rows = layout([w.place for w in workers], num_slices)
    by_rank = {w.place.rank: w for w in workers}
    port = {}
    for address in {w.address for w in workers}:
        on_node = sorted(w.place.rank for w in workers if w.address == address)
        port |= {rank: by_rank[rank].base_port + index for index, rank in enumerate(on_node)}
    first = rows[0][0]
    host = by_rank[first].address
    coordinator = f"[{host}]:{port[first]}" if ":" in host else f"{host}:{port[first]}"
    return [{MEGASCALE_COORDINATOR_ENV: coordinator, MEGASCALE_NUM_SLICES_ENV: str(num_slices),
             MEGASCALE_SLICE_ID_ENV: str(w.place.slice), MEGASCALE_PORT_ENV: str(port[w.place.rank])}
            for w in sorted(workers, key=lambda w: w.place.rank)]


def worker_host(rank: int) -> WorkerHost:
    """This worker's WorkerHost (in the worker, before megascale_env's values are set)."""
    import ray

    base = os.environ.get(MEGASCALE_PORT_ENV, "")
    return WorkerHost(place(rank), ray.util.get_node_ip_address(),
                      int(base) if base.isdigit() else DEFAULT_MEGASCALE_PORT)


def use_megascale_env(env: dict[str, str]) -> dict[str, str]:
    """Set this worker's MEGASCALE variables; returns them as this process now holds them."""
    os.environ.update(env)
    return {name: os.environ[name] for name in MEGASCALE_ENV}


def renew_megascale_env(worker_group, num_slices: int) -> list[dict[str, str]]:
    """Every worker's MEGASCALE variables from the group as it is now (each start of the
    worker group: a rebuilt slice's new hosts, a new coordinator), before torch_tpu is
    imported and tpu_dist starts; prints them, one line, as each process holds them."""
    import ray

    size = len(worker_group)
    hosts = ray.get([worker_group.execute_single_async(i, worker_host, i) for i in range(size)])
    env = megascale_env(hosts, num_slices)
    held = ray.get([worker_group.execute_single_async(i, use_megascale_env, env[i]) for i in range(size)])
    report = [{"rank": i, "address": hosts[i].address, **held[i]} for i in range(size)]
    print(MEGASCALE_LOG_PREFIX + json.dumps(report, separators=(",", ":")), flush=True)
    return held


def torch_config(backend: Backend, compile_cache_dir: str = "", num_slices: int = 1, run_cache: str = ""):
    """Ray Train's TorchConfig, whose backend first runs on every worker (an actor call, so
    on the worker's main thread): with several slices the MEGASCALE variables, renewed from
    the live group (renew_megascale_env); the SIGTERM handler of checkpoint on notice
    (notice.py); and on TPU the device check (tpu_guard.py) and torch_tpu's import
    (load_tpu_runtime) before tpu_dist starts. `run_cache`: the run's compile cache in its
    storage (compile_cache.run_cache_uri), seeded into each host's directory there."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    from .notice import install_sigterm_handler
    from .tpu_guard import require_tpu_device

    is_tpu = backend.name == "tpu"

    class _WorkerSetupBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            import ray

            size = len(worker_group)
            if num_slices > 1:
                renew_megascale_env(worker_group, num_slices)
            if is_tpu:
                ray.get([worker_group.execute_single_async(i, require_tpu_device, worker_rank=i, world_size=size)
                         for i in range(size)])
                # tpu_dist, which super().on_start starts, exists once torch_tpu is imported.
                ray.get([worker_group.execute_single_async(i, load_tpu_runtime, compile_cache_dir, run_cache)
                         for i in range(size)])
            ray.get([worker_group.execute_single_async(i, install_sigterm_handler) for i in range(size)])
            super().on_start(worker_group, backend_config)

        def _setup_tpu_multislice(self, worker_group, master_addr, num_slices):
            """Ray's own (super().on_start, tpu_dist) would set the MEGASCALE variables again
            with each rank's slice from its rank and rank 0 as the coordinator; the ones set
            above, from each pod's slice, stand."""

    class WorkerSetupTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return _WorkerSetupBackend

    return WorkerSetupTorchConfig(backend=backend.dist_backend)


def compute_dtype(backend: Backend, requested: str = "auto"):
    """The dtype of forward and backward; parameters and optimizer state stay fp32."""
    import torch

    if requested not in COMPUTE_DTYPES:
        raise UsageError(f"unknown --compute-dtype {requested!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return getattr(torch, backend.compute_dtype if requested == "auto" else requested)


def compile_enabled(backend: Backend, requested: str = "auto") -> bool:
    """Whether decoder blocks are compiled: `on`, `off`, or `auto` (the backend's default)."""
    if requested not in COMPILE_MODES:
        raise UsageError(f"unknown --compile {requested!r}; choose one of {', '.join(COMPILE_MODES)}")
    return requested == "on" or (requested == "auto" and backend.compile_by_default)


def compile_cache_env(cache_dir: str, backend: Backend) -> dict[str, str]:
    """The variables that keep compiled programs under `cache_dir` (--compile-cache-dir, a
    volume that outlives the pod), so a restarted worker loads them instead of compiling
    again. Inductor's FX-graph and AOTAutograd caches (torch.compile on CUDA and CPU) default
    to /tmp, which dies with the pod; on TPU, TorchTPU's persistent (tier-3) cache of
    compiled PJRT executables is off unless its root is set. Empty without a directory."""
    if not cache_dir:
        return {}
    env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache_dir.rstrip('/')}/inductor"}
    if backend.name == "tpu":
        env["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] = f"{cache_dir.rstrip('/')}/torch_tpu"
    return env


def use_compile_cache(cache_dir: str, backend: Backend) -> dict[str, str]:
    """Set compile_cache_env in this process, before torch_tpu is imported and before the
    first compile (both read them then); returns what was set. The flag wins over a value
    already there: inductor writes its /tmp default into the environment on first use."""
    env = compile_cache_env(cache_dir, backend)
    for name, directory in env.items():
        os.makedirs(directory, exist_ok=True)
        os.environ[name] = directory
    return env


def load_tpu_runtime(compile_cache_dir: str = "", run_cache: str = "") -> None:
    """Import torch_tpu: it registers the `tpu` device and the `tpu_dist` process group
    backend. Jobs run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (the operator's JOB_ENV), so
    `import torch` no longer does it in every process; a worker on a TPU host does it here,
    before Ray Train starts `tpu_dist` and before the first use of the device. The compile
    cache's place is set first (`compile_cache_dir`, else the host's copy of the run's cache
    `run_cache`, compile_cache.seed): torch_tpu reads it at import."""
    if run_cache and not compile_cache_dir:
        from .compile_cache import seed

        compile_cache_dir = str(seed(run_cache)[0])
    use_compile_cache(compile_cache_dir, BACKENDS["tpu"])
    importlib.import_module("torch_tpu")


def setup_device(backend: Backend, local_rank: int = 0):
    """Bring up this process's device. Call inside a worker, never in the driver.
    `local_rank` is the CUDA device index as this process sees it; on TPU, the worker's
    rank on its host (tpu_device_index)."""
    import torch

    if backend.name == "tpu":
        load_tpu_runtime()  # only on TPU hosts
        return select_tpu_device(local_rank)
    if backend.name == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def tpu_device_index(local_rank: int, visible: int) -> int:
    """This worker's TPU as its process numbers it: 0 where the process sees one chip (Ray
    gives each worker its own, TPU_VISIBLE_CHIPS), else its rank on the host; never one the
    process cannot see (ConfigError, naming both)."""
    index = 0 if visible == 1 else local_rank
    if not 0 <= index < visible:
        raise ConfigError(f"worker with local rank {local_rank} sees {visible} TPU device(s) on its host: no device "
                          "of its own (check TPU_VISIBLE_CHIPS and the workers per host, one per chip)")
    return index


def select_tpu_device(local_rank: int):
    """Make this worker's TPU the process's current device before anything picks one (the
    device mesh otherwise sets one itself: LOCAL_RANK's, else `global rank % devices`),
    through torch's accelerator API, which torch_tpu backs (it refuses an index other than
    the one its process is bound to)."""
    import torch

    index = tpu_device_index(local_rank, torch.accelerator.device_count())
    torch.accelerator.set_device_index(index)
    return torch.device("tpu", index)
