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

With several slices (--num-slices) it is also measured per link class, over the groups of
the fine-tune's own 2-D mesh (slices.py, each rank's slice from its pod): within each slice
(ICI: a mesh row, every slice at once) and across slices (DCN: a mesh column, one rank per
slice at each position), each group's bus bandwidth with its own size n; a class's figure
is its slowest group's. The floor judges ICI (with one slice ICI is the figure over all
ranks); the DCN figure is reported, not judged.

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
from .slices import slice_index

# Link class -> the mesh dimension (slices.MESH_DIMS) whose groups cross it.
LINK_DIMS = {"ici": "shard", "dcn": "replicate"}

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
                "tpu_hosts": os.environ.get("TPU_WORKER_HOSTNAMES", ""), "slice": slice_index(os.environ),
                "device_files": len(tpu_device_files()) if self.backend.name == "tpu" else None}

    def free_port(self) -> int:
        return _free_port()

    def setup(self, rank: int, local_rank: int, worker_id: int, world: int, local_world: int,
              master_addr: str, master_port: int) -> None:
        self.rank, self.local_rank, self.worker_id = rank, local_rank, worker_id
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world),
                           "RANK": str(rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)})

    def check(self, hidden_dim: int, batch_size: int, corrupt: bool, bandwidth_mib: float = 0.0,
              num_slices: int = 1) -> dict:
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
            links = (measure_links(self.backend.device_type, device, bandwidth_mib, num_slices)
                     if bandwidth_mib > 0 and num_slices > 1 else None)
        finally:
            dist.destroy_process_group()
        return {"rank": self.rank, "local_rank": self.local_rank, "worker_id": self.worker_id,
                "node_ip": self.node_ip, "all_reduce_sum": sums, "max_abs_diff": err,
                "shard_ok": shard_ok, "parity_ok": parity_ok, "all_reduce_s": seconds, "links": links}


BANDWIDTH_ITERS = 5


def _all_reduce_seconds(device, mib: float, group=None) -> float:
    """Mean seconds of one all_reduce of `mib` MiB of fp32 over `group` (None: every rank),
    after a warm-up, read on the host once (one sync for all iterations)."""
    import time

    import torch
    import torch.distributed as dist

    tensor = torch.ones(max(1, int(mib * 2**20 / 4)), dtype=torch.float32, device=device)
    dist.all_reduce(tensor, group=group)
    float(tensor[0].item())
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(BANDWIDTH_ITERS):
        dist.all_reduce(tensor, group=group)
    float(tensor[0].item())
    return (time.perf_counter() - start) / BANDWIDTH_ITERS


def bus_bandwidth_gbps(mib: float, world: int, seconds: float) -> float:
    """NCCL tests' bus bandwidth of an all_reduce: what each link carries, in GB/s."""
    return mib * 2**20 * 2 * (world - 1) / world / max(seconds, 1e-12) / 1e9


def measure_links(device_type: str, device, mib: float, num_slices: int) -> dict:
    """Collective (every rank), several slices: this rank's all_reduce seconds within its
    slice (ICI) and across slices (DCN), over the groups of the fine-tune's mesh, built as
    training builds it (slices.build_slice_mesh: each rank's slice from its pod). Every
    slice measures at once, as a step's reduce-scatters run; then every column."""
    import torch.distributed as dist

    from .slices import build_slice_mesh

    # Pickled places travel over gloo, never over the accelerator's backend (as in train.py).
    mesh = build_slice_mesh(device_type, num_slices, dist.new_group(backend="gloo"))
    measured = {}
    for link, dim in LINK_DIMS.items():
        group = mesh.get_group(dim)
        measured[link] = {"ranks": sorted(dist.get_process_group_ranks(group)),
                          "seconds": _all_reduce_seconds(device, mib, group)}
    return measured


def link_figures(results: list[dict], mib: float, bandwidth: float | None) -> dict:
    """Bus bandwidth per link class from every rank's `measure_links`: per class, its groups
    (each timed by its slowest rank, its bandwidth with the group's own size) and the
    slowest group's figure. Without per-link measurements (one slice), ICI is `bandwidth`,
    the figure over all ranks."""
    if not any(r.get("links") for r in results):
        return {} if bandwidth is None else {
            "ici": {"bus_bandwidth_gbps": bandwidth, "groups": 1, "ranks_per_group": len(results)}}
    figures = {}
    for link in LINK_DIMS:
        slowest: dict[tuple[int, ...], float] = {}
        for r in results:
            measured = r["links"][link]
            ranks = tuple(measured["ranks"])
            slowest[ranks] = max(slowest.get(ranks, 0.0), measured["seconds"])
        worst = min(bus_bandwidth_gbps(mib, len(ranks), s) for ranks, s in slowest.items())
        figures[link] = {"bus_bandwidth_gbps": round(worst, 3), "groups": len(slowest),
                         "ranks_per_group": len(next(iter(slowest))), "group_ranks": sorted(map(list, slowest))}
    return figures


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
    id and Ray's device id, after the ranks of the slices before its own (the webhook
    numbers hosts within a slice); elsewhere hosts are numbered in order of first appearance."""
    slices = sorted({p.get("slice") or 0 for p in places})
    per_slice = len(places) // len(slices)
    hosts: list[str] = []
    local_counts: dict[str, int] = {}
    out, offsets = [], []
    for p in places:
        if devices_per_host is not None:  # TPU
            worker_id, local = p["tpu_worker_id"], p["accelerator_id"]
            offsets.append(slices.index(p.get("slice") or 0) * per_slice)  # 0 with one slice
        else:
            if p["node_ip"] not in hosts:
                hosts.append(p["node_ip"])
            worker_id, local = hosts.index(p["node_ip"]), local_counts.get(p["node_ip"], 0)
            local_counts[p["node_ip"]] = local + 1
            offsets.append(0)
        out.append({"worker_id": worker_id, "local_rank": local})
    per_host = devices_per_host or max(local_counts.values())
    for o, offset in zip(out, offsets):
        o["rank"] = offset + o["worker_id"] * per_host + o["local_rank"]
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
                                       num_slices=_num_slices(cfg), resources_per_bundle={"TPU": 1})
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


def _num_slices(cfg) -> int:
    """--num-slices (a trainer whose collectives parser knows it); 1 otherwise."""
    return max(1, int(getattr(cfg, "num_slices", 1) or 1))


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
            master, port = places[[r["rank"] for r in ranks].index(0)]["tpu_hosts"].split(",")[0], 29500
        else:
            master, port = places[[r["rank"] for r in ranks].index(0)]["node_ip"], ray.get(rank0.free_port.remote())
        emit("start", mode="collectives", world_size=world, backend=backend.dist_backend, device=backend.device_type,
             devices=[f"host{r['worker_id']}/{backend.device_type}:{r['local_rank']}" for r in ranks])
        ray.get([w.setup.remote(r["rank"], r["local_rank"], r["worker_id"], world, local_world, master, port)
                 for w, r in zip(workers, ranks)])
        results = ray.get([w.check.remote(cfg.hidden_dim, cfg.batch_size, r["rank"] == cfg.corrupt_rank,
                                          cfg.bandwidth_mib, _num_slices(cfg))
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
    links = link_figures(results, cfg.bandwidth_mib, bandwidth) if cfg else {}
    judged = links["ici"]["bus_bandwidth_gbps"] if "ici" in links else bandwidth
    floor = cfg.min_bus_bandwidth_gbps if cfg else 0.0
    slow = bool(floor) and (judged is None or judged < floor)
    emit("collectives", world_size=world, passed=not failed and not slow,
         all_reduce_sum=results[0]["all_reduce_sum"][0], expected_sum=expected, tp_max_abs_err=err,
         failed_ranks=failed, bad_shards=[r["rank"] for r in results if not r["shard_ok"]],
         bus_bandwidth_gbps=bandwidth, min_bus_bandwidth_gbps=floor or None,
         hosts=len(per_host or {}) or None, devices_per_host=per_host, links=links or None)
    if bandwidth is not None:
        print(f"all_reduce of {cfg.bandwidth_mib:g} MiB over {world} ranks: bus bandwidth {bandwidth:.3f} GB/s",
              flush=True)
    for link, figure in links.items() if "dcn" in links else ():
        print(f"{link.upper()}: {figure['groups']} groups of {figure['ranks_per_group']} ranks, slowest bus "
              f"bandwidth {figure['bus_bandwidth_gbps']:.3f} GB/s", flush=True)
    if slow and not failed:
        within = " within a slice (ICI)" if "dcn" in links else ""
        raise CollectivesError(f"all_reduce bus bandwidth{within} {judged} GB/s is under the floor of {floor:g} "
                               "GB/s (--min-bus-bandwidth-gbps): a slow or degraded interconnect")
    if failed:
        bad = [r["rank"] for r in results if not r["shard_ok"]]
        raise CollectivesError(f"{len(failed)} of {world} ranks disagree: ranks {failed} "
                               f"(max TP error {err:.6f}, tolerance rtol={RTOL} atol={ATOL}; expected all_reduce "
                               f"sum {expected:.1f}; shards differing from the reference: {bad or 'none'})")
    print(f"All {world} {label} ranks verified DTensor TP parity (max_abs_diff={err:.6f}) and "
          f"all_reduce sum = {expected:.1f}", flush=True)
    return 0
