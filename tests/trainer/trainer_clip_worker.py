"""One rank of a real gloo group of four that clips FSDP2 gradients two ways and saves both.

Run as a process by tests/trainer/test_trainer_clip.py, once per rank:
`python trainer_clip_worker.py OUT PORT RANK WORLD`. For a 1-D mesh (FSDP over 4) and a 2-D
one (HSDP: 2 replicas of 2 shards), and a threshold the norm passes and one it does not,
two copies of the same model take the same backward; one is clipped by the trainer's
`clip_grad_norm`, the other by torch's `clip_grad_norm_` over the DTensors. Rank 0 saves the
norms and the full clipped gradients of both.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tpufinetune_trainer.parallelize import clip_grad_norm


def sharded(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(out: str, port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for shape in ((world,), (2, world // 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for max_norm in (0.05, 1e30):
            torch.manual_seed(0)
            # 3 output rows over 2 or 4 shards: some ranks hold an empty shard of the last layer.
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            twin = copy.deepcopy(model)
            ours, theirs = sharded(model, mesh), sharded(twin, mesh)
            torch.manual_seed(1 + rank)  # each rank its own batch
            batch = torch.randn(5, 8)
            for net in (ours, theirs):
                net(batch).square().sum().backward()
            norm_ours = clip_grad_norm(list(ours.parameters()), max_norm)
            norm_theirs = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_norm, foreach=True)
            if hasattr(norm_theirs, "full_tensor"):
                norm_theirs = norm_theirs.full_tensor()
            grads = [[p.grad.full_tensor() for p in net.parameters()] for net in (ours, theirs)]
            results[(shape, max_norm)] = {"norms": (float(norm_ours), float(norm_theirs)), "grads": grads}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
