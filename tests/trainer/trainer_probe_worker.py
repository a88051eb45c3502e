"""One rank of a real gloo group that runs the startup checkpoint probe.

Run as a process by tests/trainer/test_trainer_checkpoint.py, once per rank:
`python trainer_probe_worker.py LOCATION OUT_PREFIX PORT RANK WORLD`; `{rank}` in LOCATION
is replaced by the rank (a storage the ranks do not share). Writes `OUT_PREFIX.<rank>.json`:
the probe's result, or the StorageError's message.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer.errors import StorageError
from tpufinetune_trainer.parallelize import build_mesh


def main(location: str, out_prefix: str, port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = ckpt.cpu_group()
    try:
        result = ckpt.startup_probe(location.replace("{rank}", str(rank)), build_mesh("cpu", world),
                                    torch.device("cpu"), group)
    except StorageError as exc:
        result = {"error": str(exc)}
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    location_, prefix_, port_, rank_, world_ = sys.argv[1:]
    main(location_, prefix_, int(port_), int(rank_), int(world_))
