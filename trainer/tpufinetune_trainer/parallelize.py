"""FSDP2 sharding (and optional torch.compile) of a causal LM over a 1-D device mesh (one
slice), or HSDP over a 2-D one (several slices, or shard groups within a slice: slices.py).

Mixed precision: the model arrives in fp32 and its parameters stay fp32 (the master
weights, and so AdamW's state); FSDP casts the all-gathered copy to the compute dtype
(bf16 on TPU/GPU) for forward and backward and reduces gradients in fp32. With LoRA
(lora.py) the frozen base arrives in bf16 and only the adapters are fp32; FSDP2 requires one
original dtype across a unit's trainable parameters only, and casts the frozen ones to the
compute dtype for the all-gather like the rest.

Order matters: every decoder block becomes its own FSDP unit first, then the root. The
root call picks up what no block claimed (embeddings, final norm, lm_head, which shares
the embedding's weight) as one unit; wrapping it last lets each block's all-gather be
prefetched while the previous block computes. The per-layer embedding table (Gemma) is
frozen, stored in the compute dtype and passed as `ignored_params`, so it stays a plain
replicated lookup table: never all-gathered, reduced or stored in the optimizer.

Under replication with every block kept gathered (--shard-group 1, --reshard-after-forward
false: the plan's choice for a model one device holds) consecutive blocks share a unit up
to 25 MB of gradients, as DDP buckets them: each unit's gradients are all-reduced in one
call, and a small model's per-call cost is paid once a step, not once per block.

Resharding: by default every block frees its all-gathered parameters after its forward
and gathers them again for its backward (`reshard_after_forward=True`,
RESHARD_AFTER_FORWARD): the memory-safe choice, at the cost of one more all-gather per
block per micro-batch. Keeping them (--reshard-after-forward false) needs every block's
compute-dtype copy beside the activations; the operator asks for it only where its memory
plan holds that within a margin (core/memplan.py, `keeps_gathered`; docs/trainer.md,
"Resharding after forward"). The root never reshards after forward (FSDP2 keeps the
embedding and the tied head gathered until its backward).

Compile: each block's forward is compiled on its own (torch.compile), before sharding,
so FSDP's all-gather and reduce-scatter hooks stay outside the compiled graph; every
block of a kind shares one graph.

Activation checkpointing (--activation-checkpointing) replaces a module's `forward` with
torch.utils.checkpoint (non-reentrant) of it, inside the module's call: FSDP2's hooks stay
around it as around torchtitan's checkpoint_wrapper applied before fully_shard (the block's
pre-backward all-gather runs before the recompute needs the weights), and, unlike a
wrapper module, no parameter is renamed, so checkpoints, the sharded load and the export
see the same names. It can therefore come after sharding. `block` recomputes each whole
decoder block in the backward (one more forward of the body per step; only each block's
input is kept); `selective` recomputes each block's self-attention only (its queries,
keys, values and, with eager attention, the heads x length^2 scores and their softmax),
keeping the MLP's activations: the part that grows with the square of the length, at the
cost of one more attention forward. A compiled block is compiled again around the
checkpoint (torchtitan's order: checkpoint inside the compiled graph).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .errors import ModelError
from .model import decoder_blocks, freeze_per_layer_embeddings

# The default (--reshard-after-forward true): the memory-safe choice.
RESHARD_AFTER_FORWARD = True


def build_mesh(device_type: str, world_size: int, num_slices: int = 1, group=None, shard_group: int = 0):
    """The 1-D mesh of one slice; with several slices, or a `shard_group` smaller than the
    slice (--shard-group: 1 replicates the state on every device), the 2-D (replicate,
    shard) mesh of slices.py, on which fully_shard is HSDP: sharded within a slice (or
    group), replicated across, each step's gradients reduce-scattered within and all-reduced
    across once. Collective on a 2-D mesh (every rank tells its slice and host over the gloo
    `group`)."""
    per_slice = world_size // max(num_slices, 1)
    if num_slices <= 1 and shard_group in (0, per_slice):
        return init_device_mesh(device_type, (world_size,))
    from .slices import build_slice_mesh

    return build_slice_mesh(device_type, num_slices, group, 0 if shard_group == per_slice else shard_group)


# Graphs dynamo may keep for the decoder blocks' forward. They all share one code object
# (one class), whose cache holds a graph per block kind (six on Gemma 4 E2B) and per mode:
# training, evaluation (grad mode off is one of dynamo's guards) and --loss-head full (the
# root's forward calls the blocks with other arguments): 18 on E2B, where dynamo's default of
# 8 ran every kind past the eighth eager (docs/trainer.md, "On a GPU").
BLOCK_RECOMPILE_LIMIT = 64


def compile_blocks(model: torch.nn.Module) -> None:
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, BLOCK_RECOMPILE_LIMIT)
    for block in decoder_blocks(model):
        block.forward = torch.compile(block.forward)


def apply_fsdp(model: torch.nn.Module, mesh, compute_dtype: torch.dtype, compile: bool = False,
               device: torch.device | None = None,
               reshard_after_forward: bool = RESHARD_AFTER_FORWARD) -> torch.nn.Module:
    """Shard `model` (fp32, on the CPU or already on the device) in place; the frozen
    table, which FSDP does not manage, is moved to `device` afterwards. A model on the
    meta device is sharded without storage (sharded_load.py then materialises it: no `device`)."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    ignored = set(freeze_per_layer_embeddings(model))
    for param in ignored:
        param.data = param.data.to(compute_dtype)
    if compile:
        compile_blocks(model)
    for unit in block_units(decoder_blocks(model), replicated(mesh) and not reshard_after_forward):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    # fully_shard moves what it manages to the mesh's device, one block at a time (so
    # the whole fp32 model never sits on one device); the frozen table follows by hand.
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    if device is not None:
        for param in ignored:
            param.data = param.data.to(device)
    return model


# A replicated state's unit reduces its gradients in one all-reduce a step. As DDP's
# buckets (bucket_cap_mb=25), consecutive blocks share a unit up to this many bytes of
# parameters: a small model pays one all-reduce a step instead of one per block, a large
# one's blocks (each past it) stay units of their own, each reduced as its backward ends.
REPLICATED_UNIT_BYTES = 25 * 2**20


def replicated(mesh) -> bool:
    """Every rank holds the whole state: the 2-D (replicate, shard) mesh with shards of one."""
    return mesh.ndim == 2 and mesh.size(1) == 1


def block_units(blocks, merge: bool) -> list[list[torch.nn.Module]]:
    """The decoder blocks grouped into FSDP units: one block a unit, or, with `merge`
    (replicated, every block kept gathered: merging then holds no more parameters at once),
    consecutive blocks up to REPLICATED_UNIT_BYTES a unit. Only a unit's unreduced
    gradients are held together, at most those bytes in fp32."""
    units: list[list[torch.nn.Module]] = []
    size = 0
    for block in blocks:
        block_bytes = sum(p.numel() * 4 for p in block.parameters())  # its gradients, reduced in fp32
        if not units or not merge or size + block_bytes > REPLICATED_UNIT_BYTES:
            units.append([])
            size = 0
        units[-1].append(block)
        size += block_bytes
    return units


def checkpointed(forward):
    """`forward` recomputed in the backward instead of keeping its activations."""
    original = getattr(forward, "_torchdynamo_orig_callable", None)  # a compiled forward (compile_blocks)
    wrapped = functools.partial(torch.utils.checkpoint.checkpoint, original or forward, use_reentrant=False)
    return torch.compile(wrapped) if original is not None else wrapped


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> list[torch.nn.Module]:
    """Checkpoint every decoder block (`block`) or every block's self-attention
    (`selective`); `none` leaves the model as it is. Returns the modules checkpointed."""
    if mode == "none":
        return []
    modules = []
    for block in decoder_blocks(model):
        target = block if mode == "block" else getattr(block, "self_attn", None)
        if target is None:
            raise ModelError(f"--activation-checkpointing selective: {type(block).__name__} has no self_attn "
                             "module to checkpoint; use block (spec.training.activationCheckpointing: block)")
        target.forward = checkpointed(target.forward)
        modules.append(target)
    return modules


def master_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """dtypes of the trainable (sharded) parameters: {torch.float32} by construction."""
    return {p.dtype for p in model.parameters() if p.requires_grad}


def micro_batch_backward(model: torch.nn.Module, loss: torch.Tensor, micro: int, accum: int) -> None:
    """The backward of micro-batch `micro` of a step's `accum`. With HSDP (several slices)
    the micro-batches before the last are reduce-scattered within their slice and summed
    there (FSDP2's set_requires_all_reduce(False)); the last one's backward all-reduces that
    sum across the slices: one data-centre all-reduce per FSDP unit a step, not one per
    micro-batch. The sum held between them is one more fp32 copy of the unit's gradient shard.
    On one slice there is no all-reduce and this is a plain backward."""
    if accum > 1 and micro in (0, accum - 1) and hasattr(model, "set_requires_all_reduce"):
        model.set_requires_all_reduce(micro == accum - 1)
    loss.backward()


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so that their global L2 norm is at most `max_norm`;
    returns that norm before clipping (a device tensor, never read on the host here).

    The same arithmetic as torch.nn.utils.clip_grad_norm_ over FSDP2's DTensor gradients,
    done on the local shards: a foreach norm, one all_reduce of the squared sum over each
    mesh dimension the gradients are sharded on (a replicated dimension, HSDP's slices,
    holds copies and is not summed), a foreach scale. Through DTensor the same took 4.8 ms
    of a 0.18 s step on the throughput benchmark (each list op's sharding propagation and
    a redistribute of the norm); docs/trainer.md, "One step, profiled"."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                # Not FSDP2's reduced gradients: torch's own path knows what to sum.
                grads = [p.grad for p in params if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads, foreach=True)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
                return norm
            key = (grad.device_mesh, grad.placements)
            groups.setdefault(key, []).append(grad.to_local())
        else:
            groups.setdefault((None, ()), []).append(grad)
    if not groups:
        # On the parameters' device (a DTensor's is its shard's): progress stacks the norm
        # with the device's loss sum, and a host zero beside a device tensor fails there.
        device = params[0].device if params else None
        return torch.zeros((), dtype=torch.float32, device=device)
    total = None
    for (mesh, placements), local in groups.items():
        squared = torch.stack(torch._foreach_norm(local, 2.0)).float().square().sum()
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                torch.distributed.all_reduce(squared, group=mesh.get_group(dim))
        total = squared if total is None else total + squared
    norm = total.sqrt()
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for local in groups.values():
        torch._foreach_mul_(local, factor.to(local[0].dtype))
    return norm
