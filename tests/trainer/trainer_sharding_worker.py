"""One rank of a real gloo group that trains a few steps with a shard group (--shard-group)
and saves a sharded checkpoint, or restores one first.

Run as a process by tests/trainer/test_trainer_sharding.py, once per rank:
`python trainer_sharding_worker.py MODEL DATA.pkl OUT PORT RANK WORLD SHARD_GROUP STEPS [RESTORE]`.
SHARD_GROUP 0 is the whole slice (plain FSDP), 1 every rank holding the whole state (every
block kept gathered, as the operator's plan runs it). With
RESTORE (a checkpoint's location) the model and optimizer are loaded from it before the
steps; without it the trained model is also exported (checkpoint.export_hf, as a run's end
does). Rank 0 writes each step's global loss, the mesh's rows and where it saved and exported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.train import Trainer
from trainer_helpers import load_data_file

PER_DEVICE = 2
LENGTH = 256


def main(model: str, data_file: str, out: str, port: int, rank: int, world: int, shard_group: int, steps: int,
         restore: str = "") -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = load_data_file(data_file)
    storage = str(Path(out).with_suffix(".storage"))
    cfg = FinetuneConfig(model_id=model, storage_path=storage, run_name="sharding", num_workers=world, device="cpu",
                         shard_group=shard_group, max_seq_len=LENGTH, batch_size_per_device=PER_DEVICE, num_epochs=1,
                         learning_rate=1e-3, seed=42,
                         # As the plan runs a replicated state: every block kept gathered (its
                         # blocks then share FSDP units: parallelize.block_units).
                         reshard_after_forward=shard_group != 1).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], data, rank=rank, world=world, local_rank=0)
    mesh = next(p for p in trainer.params).device_mesh
    if restore:
        ckpt.load_sharded(trainer.model, trainer.optimizer, restore, group=trainer.cpu_group)
    losses = []
    for step in range(steps):
        loss_sum = torch.zeros((), dtype=torch.float32)
        trainer.train_step(loss_sum)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        losses.append(float(loss_sum) / float(trainer.epoch_inputs[step, -1]))
    location = ckpt.join_uri(storage, "sharding", "step")
    ckpt.save_sharded(trainer.model, trainer.optimizer, location, {"step": steps}, group=trainer.cpu_group)
    export = "" if restore else str(Path(out).with_suffix(".export"))
    if export:
        ckpt.export_hf(trainer.model, None, export, group=trainer.cpu_group)
    if rank == 0:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # FSDP units: a list given to fully_shard makes each module an FSDPModule sharing one state.
        units = len({id(fully_shard.state(m)) for m in trainer.model.modules() if isinstance(m, FSDPModule)})
        torch.save({"losses": losses, "mesh": mesh.mesh.tolist(), "dims": mesh.mesh_dim_names, "units": units,
                    "checkpoint": location, "export": export}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, data_path, out_path, port, rank, world, group, steps, *restore = sys.argv[1:]
    main(model_dir, data_path, out_path, int(port), int(rank), int(world), int(group), int(steps), *restore)
