"""One rank of a real gloo group that answers its share of prompts on the FSDP2-sharded model.

Run as a process by tests/trainer/test_trainer_generation_sharded.py, once per rank:
`python trainer_generation_worker.py MODEL PROMPTS OUT_PREFIX PORT RANK WORLD`. Every rank loads
its own slices of the model (sharded_load), counts the parameter bytes it holds materialised
around every module's forward (a DTensor counts its local shard, a gathered parameter its
full size), answers its share of the prompts (generation.generate_share) and writes
`OUT_PREFIX.<rank>.json`: its answers, the most bytes it held, the model's full bytes and
whether every decoder block's parameters are shards again afterwards, and how many forwards it ran.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpufinetune_trainer import generation, sharded_load
from tpufinetune_trainer.parallelize import build_mesh


def held_bytes(params) -> int:
    total = 0
    for param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


def main(model_dir: str, prompts_path: str, out_prefix: str, port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = json.loads(open(prompts_path).read())
    model, _ = sharded_load.load_sharded(model_dir, "sdpa", build_mesh("cpu", world), torch.float32)
    # The decoder blocks (each its own FSDP2 group) and the rest (the root's group: embeddings,
    # norms, the towers), which FSDP2 keeps gathered after the root's forward.
    def blocks():  # looked up each time: FSDP2 swaps a gathered parameter in for its shard
        return [p for name, p in model.named_parameters() if ".layers." in name]

    full = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel is the global one
    blocks_full = sum(p.numel() * p.element_size() for p in blocks())
    peak, peak_blocks = [0], [0]

    def count(*_):
        peak[0] = max(peak[0], held_bytes(model.parameters()))
        peak_blocks[0] = max(peak_blocks[0], held_bytes(blocks()))

    for module in model.modules():
        module.register_forward_pre_hook(count)
        module.register_forward_hook(count)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    answers = generation.generate_share(model, spec["prompts"], rank, world, spec["max_new_tokens"], spec["pad_id"],
                                        spec["eos_ids"], torch.device("cpu"), batch_size=spec["batch_size"])
    sharded = all(isinstance(p, DTensor) for p in blocks())
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump({"answers": {str(k): v for k, v in answers.items()}, "peak_bytes": peak[0], "full_bytes": full,
                   "peak_block_bytes": peak_blocks[0], "blocks_full_bytes": blocks_full,
                   "block_bytes": blocks_full // len(model.model.language_model.layers),
                   "sharded_after": sharded, "forwards": forwards[0]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    model_, prompts_, prefix_, port_, rank_, world_ = sys.argv[1:]
    main(model_, prompts_, prefix_, int(port_), int(rank_), int(world_))
