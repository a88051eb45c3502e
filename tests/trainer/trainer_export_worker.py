"""One rank of a real gloo group that writes the export's weights (export.write_weights) of
the sharded tiny model and counts, per rank, the bytes it copied to its host and the bytes
its all-gathers landed.

Run as a process by tests/trainer/test_trainer_export_bytes.py, once per rank:
`python trainer_export_worker.py MODEL OUT DESTINATION PORT RANK WORLD`. On a CPU worker the
device is the host, so a copy to the host is counted where the export asks for one
(Tensor.to/cpu with a CPU target: on a TPU, what lands in the worker's host memory) and a
gather where DTensor.full_tensor returns; both wrap the real calls. Each rank writes its
counts to OUT.<rank>.pt; rank 0 also the fp32 full tensors, to compare with the files.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpufinetune_trainer import export
from tpufinetune_trainer.parallelize import build_mesh
from tpufinetune_trainer.sharded_load import load_sharded


def is_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def main(model_dir: str, out: str, destination: str, port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, _ = load_sharded(model_dir, "sdpa", build_mesh("cpu", world), torch.float32)
    reference = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    counts = {"host": 0, "gathered": 0}
    to, cpu, full_tensor = torch.Tensor.to, torch.Tensor.cpu, DTensor.full_tensor

    def counted_to(self, *args, **kwargs):
        result = to(self, *args, **kwargs)
        if is_host(args, kwargs):
            counts["host"] += result.numel() * result.element_size()
        return result

    def counted_cpu(self, *args, **kwargs):
        result = cpu(self, *args, **kwargs)
        counts["host"] += result.numel() * result.element_size()
        return result

    def counted_full(self, *args, **kwargs):
        result = full_tensor(self, *args, **kwargs)
        counts["gathered"] += result.numel() * result.element_size()
        return result

    torch.Tensor.to, torch.Tensor.cpu, DTensor.full_tensor = counted_to, counted_cpu, counted_full
    try:
        written = export.write_weights(model, destination, torch.bfloat16, rank)
    finally:
        torch.Tensor.to, torch.Tensor.cpu, DTensor.full_tensor = to, cpu, full_tensor
    torch.save({"counts": counts, "written": written, "reference": reference if rank == 0 else None},
               f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_path, out_path, destination_path, *numbers = sys.argv[1:]
    main(model_path, out_path, destination_path, *(int(n) for n in numbers))
