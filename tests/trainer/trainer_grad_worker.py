"""One rank of a real gloo group that runs one training step and saves its full gradients.

Run as a process by tests/trainer/test_trainer_gradients.py, once per rank:
`python trainer_grad_worker.py MODEL DATA.pkl OUT PORT RANK WORLD`. Every rank takes its
share of the same global batch (4 examples, packed the same on both); rank 0 writes the gathered (full) gradients
and the step's global gradient norm before clipping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.train import Trainer
from trainer_helpers import load_data_file

GLOBAL_EXAMPLES = 4
LENGTH = 256


def main(model: str, data_file: str, out: str, port: int, rank: int, world: int) -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = load_data_file(data_file)
    # Storage every rank shares, as a run's (the startup checkpoint probe reads back what all
    # ranks wrote), next to the output; one run name for all ranks, as the driver gives them.
    storage = str(Path(out).with_suffix(".storage"))
    # A clip threshold no norm reaches: the norm is computed and the gradients kept as
    # they are (the clip's factor is exactly 1).
    cfg = FinetuneConfig(model_id=model, storage_path=storage, run_name="grad", num_workers=world, device="cpu",
                         max_seq_len=LENGTH, batch_size_per_device=GLOBAL_EXAMPLES // world, num_epochs=1,
                         max_grad_norm=1e30).validate()
    trainer = Trainer(cfg, BACKENDS["cpu"], data, rank=rank, world=world, local_rank=0)
    trainer.optimizer.step = lambda *a, **k: None  # keep the gradients as the step made them
    trainer.optimizer.zero_grad = lambda *a, **k: None
    trainer.train_step(torch.zeros(()))  # step 0 of epoch 1: the same examples whatever the world size
    names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    grads = [p.grad.full_tensor() for p in trainer.params]  # collective: every rank gathers
    if rank == 0:
        torch.save({"names": names, "grads": grads, "grad_norm": float(trainer.grad_norm)}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, data_path, out_path, port_, rank_, world_ = sys.argv[1:]
    main(model_dir, data_path, out_path, int(port_), int(rank_), int(world_))
