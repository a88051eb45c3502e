"""One rank of a real gloo group that runs one training step with gradient accumulation,
plain FSDP or HSDP, counting the all-reduces across slices.

Run as a process by tests/trainer/test_trainer_accumulation.py, once per rank:
`python trainer_accum_worker.py MODEL DATA.pkl OUT PORT RANK WORLD SLICES`. Each rank is its
own slice when SLICES equals WORLD (HSDP: replicated across, nothing to shard within). The
all-reduces are counted by wrapping torch.distributed.all_reduce, which FSDP2 calls (the real
collective still runs); only those on the mesh's replicate group, the data-centre network's
between slices, are kept. Rank 0 writes the count, the FSDP units and the full gradients.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.slices import SLICE_INDEX_ENV
from tpufinetune_trainer.train import Trainer
from trainer_helpers import load_data_file

ACCUM = 4
LENGTH = 256


def main(model: str, data_file: str, out: str, port: int, rank: int, world: int, slices: int) -> None:
    if slices > 1:
        os.environ[SLICE_INDEX_ENV] = str(rank * slices // world)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = load_data_file(data_file)
    storage = str(Path(out).with_suffix(".storage"))
    cfg = FinetuneConfig(model_id=model, storage_path=storage, run_name="accum", num_workers=world, device="cpu",
                         num_slices=slices, max_seq_len=LENGTH, batch_size_per_device=1,
                         global_batch_examples=world * ACCUM, num_epochs=1, max_grad_norm=1e30).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], data, rank=rank, world=world, local_rank=0)
    assert trainer.plan.accum == ACCUM, trainer.plan
    mesh = next(iter(trainer.params)).device_mesh
    across = mesh.get_group("replicate") if slices > 1 else None
    trainer.optimizer.step = lambda *a, **k: None  # keep the gradients as the step made them
    trainer.optimizer.zero_grad = lambda *a, **k: None
    counted = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if across is not None and group is across:
            counted.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        trainer.train_step(torch.zeros(()))
    finally:
        dist.all_reduce = all_reduce
    units = sum(1 for m in trainer.model.modules()
                if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None)
    grads = [p.grad.full_tensor() for p in trainer.params]  # collective: every rank gathers
    if rank == 0:
        torch.save({"all_reduces": len(counted), "units": units, "grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, data_path, out_path, *numbers = sys.argv[1:]
    main(model_dir, data_path, out_path, *(int(n) for n in numbers))
