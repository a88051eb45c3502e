"""One rank of a real gloo group that trains a few steps, plain FSDP or HSDP, and saves a
sharded checkpoint.

Run as a process by tests/trainer/test_trainer_hsdp.py, once per rank:
`python trainer_hsdp_worker.py MODEL DATA.pkl OUT PORT RANK WORLD SLICES SLICE`. SLICE is
this rank's slice, given to it as the operator gives it to a pod (TPUFT_SLICE_INDEX), so the
mesh comes from it and never from the rank order. Rank 0 writes the global loss of each
step, the mesh's rows and the checkpoint's location.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.slices import SLICE_INDEX_ENV
from tpufinetune_trainer.train import Trainer
from trainer_helpers import load_data_file

STEPS = 5
PER_DEVICE = 2
LENGTH = 256


def main(model: str, data_file: str, out: str, port: int, rank: int, world: int, slices: int, slice_: int) -> None:
    if slices > 1:
        os.environ[SLICE_INDEX_ENV] = str(slice_)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = load_data_file(data_file)
    storage = str(Path(out).with_suffix(".storage"))
    cfg = FinetuneConfig(model_id=model, storage_path=storage, run_name="hsdp", num_workers=world, device="cpu",
                         num_slices=slices, max_seq_len=LENGTH, batch_size_per_device=PER_DEVICE, num_epochs=1,
                         learning_rate=1e-3, seed=42).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], data, rank=rank, world=world, local_rank=0)
    mesh = next(p for p in trainer.params).device_mesh
    losses = []
    for step in range(STEPS):
        loss_sum = torch.zeros((), dtype=torch.float32)
        trainer.train_step(loss_sum)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        losses.append(float(loss_sum) / float(trainer.epoch_inputs[step, -1]))
    location = ckpt.join_uri(storage, "hsdp", "step")
    ckpt.save_sharded(trainer.model, trainer.optimizer, location, {"step": STEPS}, group=trainer.cpu_group)
    if rank == 0:
        torch.save({"losses": losses, "mesh": mesh.mesh.tolist(), "dims": mesh.mesh_dim_names,
                    "checkpoint": location}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, data_path, out_path, *numbers = sys.argv[1:]
    main(model_dir, data_path, out_path, *(int(n) for n in numbers))
