"""One rank of a real gloo group that loads the base model both ways and compares them.

Run as a process by tests/trainer/test_trainer_load.py, once per rank:
`python trainer_load_worker.py MODEL OUT_PREFIX PORT RANK WORLD COMPUTE_DTYPE`. Every rank
loads the full way (load_causal_lm, then apply_fsdp) and the sharded way (sharded_load),
gathers both models' full tensors and writes `OUT_PREFIX.<rank>.json`: the differences
(none expected), how the sharded load went, the bytes it read from the checkpoint and
whether the two forwards' logits are equal.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tpufinetune_trainer import sharded_load
from tpufinetune_trainer.model import load_causal_lm
from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
from trainer_helpers import load_differences


def main(model: str, out_prefix: str, port: int, rank: int, world: int, compute_dtype: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = getattr(torch, compute_dtype)
    read = []
    counted = sharded_load.read_rows

    def counting(stored, start, stop, out, file=None):
        read.append((stop - start) * stored.row_bytes)
        counted(stored, start, stop, out, file)

    sharded_load.read_rows = counting
    mesh = build_mesh("cpu", world)
    old = apply_fsdp(load_causal_lm(model, torch.float32, "sdpa"), mesh, dtype)
    new, how = sharded_load.load_sharded(model, "sdpa", mesh, dtype)
    differences = load_differences(old, new)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_logits = bool(torch.equal(old(input_ids=ids).logits, new(input_ids=ids).logits))
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump({"differences": differences, "how": how, "bytes_read": sum(read), "same_logits": same_logits,
                   "parameters": len(dict(new.named_parameters()))}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, prefix, port_, rank_, world_, dtype_ = sys.argv[1:]
    main(model_dir, prefix, int(port_), int(rank_), int(world_), dtype_)
