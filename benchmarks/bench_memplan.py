"""The memory planner against measured peaks: random Gemma 4 text models trained a few steps
on CPU, one process (world size 1, gloo), with the trainer's own parts (FSDP2 sharding,
its mixed-precision policy, the label-position loss head, AdamW as train.py builds it).

Each configuration runs in a fresh process. The peak is the process's resident high-water
mark (VmHWM) over the training steps, reset once the model is built (so a transient of
initialisation does not count); the figure compared is that peak minus the resident size
before the model existed, after one step of the smallest model of the same code path
(WARM_UP: the process's fixed first-step allocations, which a chip's runtime keeps in the
planner's headroom, do not count; `--cold` counts them), against the planner's per-device bytes for a CPU device (fp32
compute, sdpa attention: core/memplan.py's device_bytes).

    .venv/bin/python benchmarks/bench_memplan.py            # every configuration
    .venv/bin/python benchmarks/bench_memplan.py --only s1  # one
    .venv/bin/python benchmarks/bench_memplan.py --table    # the planner's Gemma 4 table (docs)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name: (text config, block length, blocks per device, steps[, attention]). The trainer's
# CPU backend runs sdpa; "eager" (the TPU's kernel) checks the planner's L^2 score term.
CONFIGS = {
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, global_head_dim=32, hidden_size_per_layer_input=16,
                  vocab_size=2048), 128, 2, 3),
    "s1": (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=16,
                vocab_size=16384), 256, 2, 3),
    "s2": (dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=32,
                vocab_size=32768), 512, 2, 2),
    "s3": (dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=16,
                vocab_size=8192), 1024, 2, 2),
    "e1": (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, global_head_dim=32, hidden_size_per_layer_input=16,
                vocab_size=16384), 1024, 2, 2, "eager"),
}
MIB = 2**20
TOLERANCE = 0.25


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident size (VmHWM)
        f.write("5")


# The smallest model of the same code path: one step of it, before the baseline, takes the
# process's fixed first-step allocations (gloo's buffers, lazily imported modules, the CPU
# kernels' first-call workspaces: ~30 MiB here, whatever the model) out of the figure.
WARM_UP = (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=4,
                vocab_size=64), 32, 1)


def _build(text: dict, length: int, blocks: int, attention: str):
    """A model built and sharded, its loss head, AdamW and one batch, as train.py has them.
    Returns (step: one training step, what `planned` needs of the configuration)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tpufinetune_trainer import loss as head
    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
    from tpufinetune_trainer.train import param_groups

    config = Gemma4Config(text_config=dict(text, vocab_size_per_layer_input=text["vocab_size"],
                                           max_position_embeddings=4096, sliding_window=256, pad_token_id=0,
                                           eos_token_id=1, bos_token_id=2),
                          vision_config=None, audio_config=None)
    config._attn_implementation = attention
    model = Gemma4ForConditionalGeneration(config)
    model.config.get_text_config().use_cache = False
    model = apply_fsdp(model, build_mesh("cpu", 1), torch.float32, device=torch.device("cpu"))
    head.install(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, 0.01), lr=torch.tensor(1e-4), fused=True)
    masks = MaskBuilder(model.config, length, torch.device("cpu"), torch.float32, attention)
    vocab = text["vocab_size"]
    ids = torch.randint(3, vocab, (blocks, length))
    positions = torch.arange(length).repeat(blocks, 1)
    segments = torch.ones(blocks, length, dtype=torch.int64)
    targets = torch.randint(3, vocab, (blocks, length))

    def step() -> None:
        summed = model.label_loss_sum(ids, positions, masks(segments), targets, blocks * length)
        (summed / targets.numel()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, {"eager": model.config.get_text_config()._attn_implementation == "eager", "length": length,
                  "blocks": blocks, "config": dict(text, vocab_size_per_layer_input=vocab)}


def measure(name: str, warm_up: bool = True) -> dict:
    """Run in a fresh process: build, shard, train `steps` steps; bytes of peak over baseline.
    With `warm_up`, one step of the smallest model first (WARM_UP), outside the figure."""
    import gc

    import torch
    import torch.distributed as dist
    # What _build imports, imported before the baseline (as before WARM_UP: --cold's figure).
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: F401

    import tpufinetune_trainer.loss, tpufinetune_trainer.masks, tpufinetune_trainer.train  # noqa: E401,F401

    text, length, blocks, steps, *rest = CONFIGS[name]
    attention = rest[0] if rest else "sdpa"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    if warm_up:
        _build(*WARM_UP, attention)[0]()
        gc.collect()
    baseline = _status_kib("VmRSS") * 1024
    step, result = _build(text, length, blocks, attention)
    _reset_peak()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    peak = _status_kib("VmHWM") * 1024
    dist.destroy_process_group()
    return {"name": name, "measured": peak - baseline, "seconds": time.perf_counter() - started, **result}


def planned(result: dict) -> int:
    from tpufinetune.core.memplan import device_bytes, shape_from_config

    shape = shape_from_config({"text_config": result["config"]}, result["name"])
    part = device_bytes(shape, "full", 1, result["length"], result["blocks"], compute_bytes=4,
                        eager_attention=result["eager"])
    return part.total


# The slices docs/trainer.md's table shows: (name, generation, topology).
TABLE_SLICES = (("v6e-8", "v6e", "2x4"), ("v6e-16", "v6e", "4x4"), ("v7x-8", "v7x", "2x2x1"),
                ("v7x-16", "v7x", "2x2x2"))
TABLE_MODELS = ("E2B", "E4B", "31B", "26B-A4B")


def planner_table(max_seq_len: int = 512, batch_per_device: int = 4) -> str:
    """HBM per chip, estimated / usable (GiB), per model, method and slice, as markdown."""
    from tpufinetune.core.memplan import GIB, Request, estimate

    lines = ["| model | method | " + " | ".join(f"{n} ({t})" for n, _, t in TABLE_SLICES) + " |",
             "|---|---|" + "---|" * len(TABLE_SLICES)]
    for model in TABLE_MODELS:
        for method in ("full", "lora"):
            cells = []
            for _, generation, topology in TABLE_SLICES:
                plan = estimate(Request(f"google/gemma-4-{model}-it", method, generation, topology, max_seq_len,
                                        batch_per_device))
                verdict = "fits" if plan.fits else f"no: {plan.smallest_fit}"
                cells.append(f"{plan.per_chip_bytes / GIB:.1f} / {plan.limit_bytes / GIB:.1f} {verdict}")
            lines.append(f"| gemma-4-{model} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--table", action="store_true", help="print the planner's Gemma 4 table and exit")
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up: the first step's fixed allocations count in the measured peak")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(planner_table())
        return 0
    if args.child:
        print(json.dumps(measure(args.child, warm_up=not args.cold)))
        return 0
    print(f"{'config':8} {'params':>10} {'L x b':>10} {'attention':>9} {'estimate':>12} {'measured':>12} "
          f"{'ratio':>6} {'s':>6}")
    within = []
    for name in args.only or CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--child", name] + (["--cold"] if args.cold else []),
                             capture_output=True, text=True,
                             check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        from tpufinetune.core.memplan import shape_from_config

        estimate = planned(result)
        ratio = estimate / result["measured"]
        within.append(abs(ratio - 1) <= TOLERANCE)
        params = shape_from_config({"text_config": result["config"]}).parameters
        print(f"{name:8} {params / 1e6:9.1f}M {result['length']:>6} x {result['blocks']} "
              f"{'eager' if result['eager'] else 'sdpa':>9} "
              f"{estimate / MIB:9.1f} MiB {result['measured'] / MIB:9.1f} MiB {ratio:6.2f} {result['seconds']:6.1f}",
              flush=True)
    print(f"within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)} configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
