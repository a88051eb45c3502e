"""`collectives`: an interconnect check with Ray Core actors, one per device.

Each rank checks three things and the run fails if any rank disagrees:
1. its shard of a tensor-parallel feed-forward block equals the matching slice of a
   single-device reference built from the same seed;
2. the block's DTensor output (colwise w1, rowwise w2) equals the reference output;
3. an all_reduce of (rank + 1) sums to n(n+1)/2.

Before that, each TPU host must hold the devices Ray gave it (device files, as the TPU
runtime will need them): a host short of devices fails the check at once, named. After it,
an all_reduce of --bandwidth-mib MiB measures the bus bandwidth (as NCCL's tests define it:
bytes x 2(n-1)/n / time), checked against --min-bus-bandwidth-gbps when given. This is the
operator's preflight (spec.preflight) before a fine-tune on the same cluster.

On TPU the slice is reserved with `slice_placement_group` and ranks come from the
webhook's TPU_WORKER_ID and Ray's device id, as in the tutorial. On CPU/GPU, N bundles
in one placement group get the same arithmetic: rank = host index * devices per host +
local index.
"""

from __future__ import annotations

import os
import socket

from .backends import Backend, resolve
from .config import CollectivesConfig
from .errors import CollectivesError, ConfigError
from .events import emit

SEED = 42
RTOL, ATOL = 1e-3, 1e-2  # the tutorial's tolerances (bf16-safe)


def make_feed_forward(hidden_dim: int):
    import torch.nn as nn

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden_dim, 4 * hidden_dim, bias=False)
            self.act = nn.SiLU()
            self.w2 = nn.Linear(4 * hidden_dim, hidden_dim, bias=False)

        def forward(self, x):
            return x + self.w2(self.act(self.w1(x)))

    return FeedForward()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankWorker:
    """One process per device; decorated with ray.remote at run time."""

    def __init__(self, backend: Backend):
        import ray

        self.backend = backend
        self.node_ip = ray.util.get_node_ip_address()
        ids = ray.get_runtime_context().get_accelerator_ids()
        self.accelerator_id = int((ids.get(backend.ray_resource) or ["0"])[0]) if backend.ray_resource else 0

    def where(self) -> dict:
        from .tpu_guard import tpu_device_files

        return {"node_ip": self.node_ip, "accelerator_id": self.accelerator_id,
                "tpu_worker_id": int(os.environ.get("TPU_WORKER_ID", "0")),
                "tpu_hosts": os.environ.get("TPU_WORKER_HOSTNAMES", ""),
                "device_files": len(tpu_device_files()) if self.backend.name == "tpu" else None}

    def free_port(self) -> int:
        return _free_port()

    def setup(self, rank: int, local_rank: int, worker_id: int, world: int, local_world: int,
              master_addr: str, master_port: int) -> None:
        self.rank, self.local_rank, self.worker_id = rank, local_rank, worker_id
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world),
                           "RANK": str(rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)})

    def check(self, hidden_dim: int, batch_size: int, corrupt: bool, bandwidth_mib: float = 0.0) -> dict:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from .backends import setup_device

        # On GPU, Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 here.
        device = setup_device(self.backend, 0 if self.backend.name == "cuda" else self.local_rank)
        dist.init_process_group(backend=self.backend.dist_backend)
        try:
            world = dist.get_world_size()
            torch.manual_seed(SEED)
            reference = make_feed_forward(hidden_dim).eval()
            inputs = torch.randn(batch_size, hidden_dim)
            with torch.no_grad():
                expected = reference(inputs)
            torch.manual_seed(SEED)
            model = make_feed_forward(hidden_dim).to(device).eval()
            mesh = _mesh(self.backend.device_type, world)
            model = parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            shard = model.w1.weight.to_local()
            if corrupt:
                with torch.no_grad():
                    shard.add_(0.5)  # fault injection: this rank's slice no longer matches
            expected_shard = torch.chunk(reference.w1.weight, world, dim=0)[self.rank]  # DTensor's Shard(0) split
            shard_ok = torch.equal(shard.detach().cpu(), expected_shard)
            with torch.no_grad():
                got = model(inputs.to(device)).cpu()  # RowwiseParallel returns the replicated result
            err = float((got - expected).abs().max())
            parity_ok = bool(torch.allclose(got, expected, rtol=RTOL, atol=ATOL))
            contribution = torch.full((4,), float(self.rank + 1), dtype=torch.float32, device=device)
            dist.all_reduce(contribution, op=dist.ReduceOp.SUM)
            sums = contribution.cpu().tolist()
            seconds = _all_reduce_seconds(device, bandwidth_mib) if bandwidth_mib > 0 else None
        finally:
            dist.destroy_process_group()
        return {"rank": self.rank, "local_rank": self.local_rank, "worker_id": self.worker_id,
                "node_ip": self.node_ip, "all_reduce_sum": sums, "max_abs_diff": err,
                "shard_ok": shard_ok, "parity_ok": parity_ok, "all_reduce_s": seconds}


BANDWIDTH_ITERS = 5


def _all_reduce_seconds(device, mib: float) -> float:
    """Mean seconds of one all_reduce of `mib` MiB of fp32, after a warm-up, read on the
    host once (one sync for all iterations)."""
    import time

    import torch
    import torch.distributed as dist

    tensor = torch.ones(max(1, int(mib * 2**20 / 4)), dtype=torch.float32, device=device)
    dist.all_reduce(tensor)
    float(tensor[0].item())
    dist.barrier()
    start = time.perf_counter()
    for _ in range(BANDWIDTH_ITERS):
        dist.all_reduce(tensor)
    float(tensor[0].item())
    return (time.perf_counter() - start) / BANDWIDTH_ITERS


def bus_bandwidth_gbps(mib: float, world: int, seconds: float) -> float:
    """NCCL tests' bus bandwidth of an all_reduce: what each link carries, in GB/s."""
    return mib * 2**20 * 2 * (world - 1) / world / max(seconds, 1e-12) / 1e9


def short_hosts(places: list[dict], per_host: int | None) -> dict[str, int]:
    """TPU hosts whose device files are fewer than the devices Ray placed there: node ip ->
    files found (empty off TPU)."""
    found: dict[str, int] = {}
    for p in places:
        if p.get("device_files") is not None:
            found[p["node_ip"]] = p["device_files"]
    return {ip: n for ip, n in found.items() if per_host and n < per_host}


def devices_per_host(places: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in places:
        counts[p["node_ip"]] = counts.get(p["node_ip"], 0) + 1
    return dict(sorted(counts.items()))


def _mesh(device_type: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world,))


def assign_ranks(places: list[dict], devices_per_host: int | None = None) -> list[dict]:
    """Rank arithmetic for every actor (in bundle order): TPU uses the webhook's worker
    id and Ray's device id; elsewhere hosts are numbered in order of first appearance."""
    hosts: list[str] = []
    local_counts: dict[str, int] = {}
    out = []
    for p in places:
        if devices_per_host is not None:  # TPU
            worker_id, local = p["tpu_worker_id"], p["accelerator_id"]
        else:
            if p["node_ip"] not in hosts:
                hosts.append(p["node_ip"])
            worker_id, local = hosts.index(p["node_ip"]), local_counts.get(p["node_ip"], 0)
            local_counts[p["node_ip"]] = local + 1
        out.append({"worker_id": worker_id, "local_rank": local})
    per_host = devices_per_host or max(local_counts.values())
    for o in out:
        o["rank"] = o["worker_id"] * per_host + o["local_rank"]
    ranks = sorted(o["rank"] for o in out)
    if ranks != list(range(len(places))):
        raise ConfigError(f"placement gave uneven hosts; ranks {ranks} are not 0..{len(places) - 1}")
    return out


def _reserve(cfg: CollectivesConfig, backend: Backend):
    """A placement group with one bundle per device; returns (pg, devices_per_host, release)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if backend.name == "tpu":
        from ray.util.tpu import get_tpu_version_from_type, slice_placement_group

        handle = slice_placement_group(topology=cfg.topology,
                                       accelerator_version=get_tpu_version_from_type(cfg.accelerator_type),
                                       num_slices=1, resources_per_bundle={"TPU": 1})
        pg, per_host, release = handle.placement_group, handle.num_bundles // handle.num_hosts, handle.shutdown
        bundles = handle.num_bundles
    else:
        bundle = {"CPU": 1} if backend.ray_resource is None else {"CPU": 1, backend.ray_resource: 1}
        pg = placement_group([dict(bundle) for _ in range(cfg.num_workers)], strategy="PACK")
        per_host, bundles = None, cfg.num_workers
        release = lambda: remove_placement_group(pg)  # noqa: E731
    ready, _ = ray.wait([pg.ready()], timeout=cfg.placement_timeout_s)
    if not ready:
        release()
        raise ConfigError(f"could not reserve {bundles} devices within {cfg.placement_timeout_s:g}s "
                          f"(cluster resources: {ray.cluster_resources()})")
    return pg, per_host, bundles, release


def run(cfg: CollectivesConfig) -> int:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg.validate()
    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    backend = resolve(cfg.device, ray.cluster_resources())
    pg, per_host, bundles, release = _reserve(cfg, backend)
    remote = ray.remote(RankWorker)
    if backend.name == "tpu":
        per_actor = {"num_cpus": 0, "resources": {"TPU": 1}}  # the tutorial's one actor per TPU device
    else:
        per_actor = {"num_cpus": 1, "num_gpus": 1 if backend.name == "cuda" else 0}
    workers = [remote.options(**per_actor, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote(backend) for i in range(bundles)]
    try:
        places = ray.get([w.where.remote() for w in workers])
        short = short_hosts(places, per_host)
        if short:
            emit("collectives", world_size=len(workers), passed=False, hosts=len(devices_per_host(places)),
                 devices_per_host=devices_per_host(places), short_hosts=short, failed_ranks=[], bad_shards=[])
            detail = ", ".join(f"{ip} has {n} of {per_host}" for ip, n in short.items())
            raise CollectivesError(f"{len(short)} host(s) short of TPU devices: {detail} (device files "
                                   f"/dev/accel* or /dev/vfio; Ray placed {per_host} devices on each)")
        ranks = assign_ranks(places, per_host)
        world, local_world = len(workers), per_host or bundles
        rank0 = workers[[r["rank"] for r in ranks].index(0)]
        if backend.name == "tpu":
            master, port = places[0]["tpu_hosts"].split(",")[0], 29500
        else:
            master, port = places[[r["rank"] for r in ranks].index(0)]["node_ip"], ray.get(rank0.free_port.remote())
        emit("start", mode="collectives", world_size=world, backend=backend.dist_backend, device=backend.device_type,
             devices=[f"host{r['worker_id']}/{backend.device_type}:{r['local_rank']}" for r in ranks])
        ray.get([w.setup.remote(r["rank"], r["local_rank"], r["worker_id"], world, local_world, master, port)
                 for w, r in zip(workers, ranks)])
        results = ray.get([w.check.remote(cfg.hidden_dim, cfg.batch_size, r["rank"] == cfg.corrupt_rank,
                                          cfg.bandwidth_mib)
                           for w, r in zip(workers, ranks)])
    finally:
        for w in workers:
            ray.kill(w)
        release()
    return report(sorted(results, key=lambda r: r["rank"]), "TorchTPU" if backend.name == "tpu" else backend.dist_backend,
                  cfg, devices_per_host(places))


def report(results: list[dict], label: str, cfg: CollectivesConfig | None = None,
           per_host: dict[str, int] | None = None) -> int:
    world = len(results)
    expected = world * (world + 1) / 2
    failed = []
    for r in results:
        print(f"Rank {r['rank']:2d} (worker_id={r['worker_id']}, local_rank={r['local_rank']}, ip={r['node_ip']}): "
              f"all_reduce_sum={r['all_reduce_sum']}", flush=True)
        sum_ok = r["all_reduce_sum"] == [float(expected)] * len(r["all_reduce_sum"])
        if not (sum_ok and r["shard_ok"] and r["parity_ok"]):
            failed.append(r["rank"])
    err = max(r["max_abs_diff"] for r in results)
    timed = [r["all_reduce_s"] for r in results if r.get("all_reduce_s")]
    bandwidth = round(bus_bandwidth_gbps(cfg.bandwidth_mib, world, max(timed)), 3) if timed and cfg else None
    floor = cfg.min_bus_bandwidth_gbps if cfg else 0.0
    slow = bool(floor) and (bandwidth is None or bandwidth < floor)
    emit("collectives", world_size=world, passed=not failed and not slow,
         all_reduce_sum=results[0]["all_reduce_sum"][0], expected_sum=expected, tp_max_abs_err=err,
         failed_ranks=failed, bad_shards=[r["rank"] for r in results if not r["shard_ok"]],
         bus_bandwidth_gbps=bandwidth, min_bus_bandwidth_gbps=floor or None,
         hosts=len(per_host or {}) or None, devices_per_host=per_host)
    if bandwidth is not None:
        print(f"all_reduce of {cfg.bandwidth_mib:g} MiB over {world} ranks: bus bandwidth {bandwidth:.3f} GB/s",
              flush=True)
    if slow and not failed:
        raise CollectivesError(f"all_reduce bus bandwidth {bandwidth} GB/s is under the floor of {floor:g} GB/s "
                               "(--min-bus-bandwidth-gbps): a slow or degraded interconnect")
    if failed:
        bad = [r["rank"] for r in results if not r["shard_ok"]]
        raise CollectivesError(f"{len(failed)} of {world} ranks disagree: ranks {failed} "
                               f"(max TP error {err:.6f}, tolerance rtol={RTOL} atol={ATOL}; expected all_reduce "
                               f"sum {expected:.1f}; shards differing from the reference: {bad or 'none'})")
    print(f"All {world} {label} ranks verified DTensor TP parity (max_abs_diff={err:.6f}) and "
          f"all_reduce sum = {expected:.1f}", flush=True)
    return 0
