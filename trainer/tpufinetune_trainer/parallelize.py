"""FSDP2 sharding of a causal LM over a 1-D device mesh.

Order matters: every decoder block becomes its own FSDP unit first, then the root. The
root call picks up what no block claimed (embeddings, final norm, lm_head, which shares
the embedding's weight) as one unit; wrapping it last lets each block's all-gather be
prefetched while the previous block computes. The per-layer embedding table (Gemma) is
frozen and passed as `ignored_params`, so it stays a plain replicated lookup table: it is
never all-gathered, reduced or stored in the optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .model import decoder_blocks, freeze_per_layer_embeddings


def build_mesh(device_type: str, world_size: int):
    return init_device_mesh(device_type, (world_size,))


def apply_fsdp(model: torch.nn.Module, mesh, param_dtype: torch.dtype) -> torch.nn.Module:
    # Gradients are reduced in fp32 whatever the compute dtype (the tutorial's policy).
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ignored = set(freeze_per_layer_embeddings(model))
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    return model
