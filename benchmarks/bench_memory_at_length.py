"""Memory at length: peak host memory of training steps at 2k and 8k tokens a block on CPU,
before (every activation kept, eager attention, the tutorial's TPU kernel) and after
(activation checkpointing, sdpa), with the trainer's own parts (FSDP2 on one gloo rank,
parallelize.apply_activation_checkpointing, the label-position loss head, AdamW); and the
loss head's backward with and without its second weight-sized gradient.

Each configuration runs in a fresh process; the figure is the resident high-water mark
(VmHWM) over the steps, reset once the model is built, minus the resident size before the
model existed (as benchmarks/bench_memplan.py), beside the planner's estimate
(core/memplan.py's device_bytes, fp32 compute) and the step's loss (the same in every row
of a length: checkpointing and the kernel change memory, not the numbers).

    .venv/bin/python benchmarks/bench_memory_at_length.py             # the table (about 5 min, 2 cores)
    .venv/bin/python benchmarks/bench_memory_at_length.py --lengths 2048
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_memplan import _reset_peak, _status_kib  # one reader of the kernel's peak RSS

# A scaled-down Gemma 4 text model: few layers and heads, so 8k tokens of eager scores fit
# a small machine (2 heads x 8192^2 x 4 B = 512 MiB per matrix per layer).
TEXT = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=16,
            vocab_size=8192)
LENGTHS = (2048, 8192)
# (attention, activation checkpointing): the first is "before".
VARIANTS = (("eager", "none"), ("eager", "selective"), ("eager", "block"), ("sdpa", "none"), ("sdpa", "block"))
# One step: its peak is the backward (activations saved, gradients growing). AdamW creates its
# state at the step's end (8 B a parameter, ~40 MiB here), after the activations are gone.
STEPS = 1
# The loss head's backward: a vocabulary and width whose fp32 weight (256 MiB) stands out.
HEAD = dict(vocab=65536, hidden=1024, rows=512)
MIB = 2**20


def measure_step(length: int, attention: str, checkpointing: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tpufinetune_trainer import loss as head
    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.parallelize import apply_activation_checkpointing, apply_fsdp, build_mesh
    from tpufinetune_trainer.train import param_groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    baseline = _status_kib("VmRSS") * 1024
    config = Gemma4Config(text_config=dict(TEXT, vocab_size_per_layer_input=TEXT["vocab_size"],
                                           max_position_embeddings=2 * max(LENGTHS), sliding_window=512,
                                           pad_token_id=0, eos_token_id=1, bos_token_id=2),
                          vision_config=None, audio_config=None)
    config._attn_implementation = attention
    model = Gemma4ForConditionalGeneration(config)
    model.config.get_text_config().use_cache = False
    model = apply_fsdp(model, build_mesh("cpu", 1), torch.float32, device=torch.device("cpu"))
    apply_activation_checkpointing(model, checkpointing)
    head.install(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, 0.01), lr=torch.tensor(1e-4), fused=True)
    masks = MaskBuilder(model.config, length, torch.device("cpu"), torch.float32, attention)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, TEXT["vocab_size"], (1, length), generator=generator)
    positions = torch.arange(length)[None]
    segments = torch.ones(1, length, dtype=torch.int64)
    targets = torch.randint(3, TEXT["vocab_size"], (1, length), generator=generator)
    targets[:, : length // 2] = -100  # labels on the second half, as a response
    _reset_peak()
    started, losses = time.perf_counter(), []
    for _ in range(STEPS):
        summed = model.label_loss_sum(ids, positions, masks(segments), targets, length // 2)
        (summed / (length // 2)).backward()
        losses.append(float(summed) / (length // 2))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = _status_kib("VmHWM") * 1024
    dist.destroy_process_group()
    return {"measured": peak - baseline, "seconds": (time.perf_counter() - started) / STEPS, "loss": losses[0]}


def measure_head(old: bool) -> dict:
    """Peak of the loss head's backward alone: the weight's gradient handed on (now), or a
    product of it beside the kept one (the previous backward)."""
    import torch

    from tpufinetune_trainer import loss as head

    if old:
        def previous(ctx, grad):
            grad_rows, grad_weight = ctx.grads
            return grad_rows * grad, grad_weight * grad, None, None, None, None

        head.ChunkedHeadLoss.backward = staticmethod(previous)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(HEAD["rows"], HEAD["hidden"], generator=generator, requires_grad=True)
    weight = torch.randn(HEAD["vocab"], HEAD["hidden"], generator=generator).div_(32).requires_grad_()
    targets = torch.randint(0, HEAD["vocab"], (HEAD["rows"],), generator=generator)
    summed = head.ChunkedHeadLoss.apply(rows, weight, targets, 30.0, head.CHUNK_ROWS, True)
    before = _status_kib("VmRSS") * 1024
    _reset_peak()
    (summed / HEAD["rows"]).backward()
    peak = _status_kib("VmHWM") * 1024
    return {"measured": peak - before, "weight": weight.numel() * 4, "norm": float(weight.grad.norm())}


def planned(length: int, attention: str, checkpointing: str) -> int:
    from tpufinetune.core.memplan import device_bytes, shape_from_config

    shape = shape_from_config({"text_config": dict(TEXT, vocab_size_per_layer_input=TEXT["vocab_size"])})
    return device_bytes(shape, "full", 1, length, 1, compute_bytes=4, eager_attention=attention == "eager",
                        checkpointing=checkpointing).total


def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child[0] == "head":
            print(json.dumps(measure_head(args.child[1] == "old")))
        else:
            print(json.dumps(measure_step(int(args.child[0]), args.child[1], args.child[2])))
        return 0
    print("| tokens a block | attention | checkpointing | peak measured | planner | vs before | s/step | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        before = None
        for attention, checkpointing in VARIANTS:
            result = child([str(length), attention, checkpointing])
            before = before or result["measured"]
            print(f"| {length} | {attention} | {checkpointing} | {result['measured'] / MIB:.0f} MiB | "
                  f"{planned(length, attention, checkpointing) / MIB:.0f} MiB | "
                  f"{result['measured'] / before:.2f} | {result['seconds']:.1f} | {result['loss']:.6f} |", flush=True)
    old, new = child(["head", "old"]), child(["head", "new"])
    print(f"\nloss head backward ({HEAD['vocab']} x {HEAD['hidden']} fp32 weight, {old['weight'] / MIB:.0f} MiB): "
          f"peak {old['measured'] / MIB:.0f} MiB before, {new['measured'] / MIB:.0f} MiB now "
          f"(gradient norms {old['norm']:.6f} / {new['norm']:.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
