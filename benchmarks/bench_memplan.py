"""The memory planner against measured peaks: random Gemma 4 text models trained a few steps
on CPU, one process (world size 1, gloo), with the trainer's own parts (FSDP2 sharding,
its mixed-precision policy in fp32 or bfloat16 compute, LoRA's adapters as lora.inject puts
them, the label-position loss head, AdamW as train.py builds it).

Two sets of configurations: FITTED, the ones the planner's constants (core/memplan.py,
SAVED_*, UPCAST_*, LORA_*_BYTES per dtype) were fitted to, and HELD_OUT, other widths, depths,
lengths (512 to 8192), dtypes, methods, LoRA dropouts and targets, never used to fit
anything: the planner is judged on those. 8192-token rows use a narrow model (2 heads,
width 128) so that the eager L^2 scores fit the small machine and a step takes seconds.

Each configuration runs in a fresh process. The peak is the process's resident high-water
mark (VmHWM) over the training steps, reset once the model is built (so a transient of
initialisation does not count); the figure compared is that peak minus the resident size
before the model existed, after one step of the smallest model of the same code path
(WARM_UP: the process's fixed first-step allocations, which a chip's runtime keeps in the
planner's headroom, do not count; `--cold` counts them), against the planner's per-device
bytes (core/memplan.py's device_bytes) for the same compute dtype, attention, method and
LoRA settings, with the planner's long-sequence margin where it adds one.

    .venv/bin/python benchmarks/bench_memplan.py               # every configuration, both sets
    .venv/bin/python benchmarks/bench_memplan.py --set held    # the held-out set only
    .venv/bin/python benchmarks/bench_memplan.py --only s1     # one
    .venv/bin/python benchmarks/bench_memplan.py --table       # the planner's Gemma 4 tables (docs)
    .venv/bin/python benchmarks/bench_memplan.py --recorded    # the planner against MEASURED (docs)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _text(hidden: int, layers: int, heads: int, head_dim: int, vocab: int, intermediate: int | None = None,
          kv_heads: int = 1, global_head_dim: int | None = None, ple: int = 16) -> dict:
    return dict(hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                global_head_dim=global_head_dim or head_dim, hidden_size_per_layer_input=ple, vocab_size=vocab)


def case(text: dict, length: int, blocks: int, steps: int = 2, attention: str = "sdpa", dtype: str = "fp32",
         method: str = "full", dropout: float = 0.0, targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,"
                                                                   "up_proj,down_proj") -> dict:
    return dict(text=text, length=length, blocks=blocks, steps=steps, attention=attention, dtype=dtype,
                method=method, dropout=dropout, targets=targets)


S1 = _text(256, 6, 4, 64, 16384, kv_heads=2)
S3 = _text(384, 12, 6, 64, 8192, kv_heads=2)
E1 = _text(256, 6, 8, 32, 16384, kv_heads=2)
# The planner's constants were fitted to these (and only these).
FITTED = {
    "tiny": case(_text(64, 4, 2, 32, 2048, intermediate=128), 128, 2, 3),
    "s1": case(S1, 256, 2, 3),
    "s2": case(_text(512, 8, 8, 64, 32768, kv_heads=2, ple=32), 512, 2),
    "s3": case(S3, 1024, 2),
    "e1": case(E1, 1024, 2, attention="eager"),
    "b1": case(S1, 1024, 2, dtype="bf16"),
    "b2": case(E1, 1024, 2, attention="eager", dtype="bf16"),
    "l1": case(S1, 1024, 2, method="lora", dropout=0.05),
    "l2": case(E1, 1024, 2, method="lora"),
    "l3": case(S1, 1024, 2, dtype="bf16", method="lora", dropout=0.05),
    "l4": case(S1, 1024, 2, dtype="bf16", method="lora"),
    # The long-sequence terms (sdpa's one-layer score workspace, the masks): the narrow model
    # at 8192 sdpa and 4096 eager; the held-out rows run it otherwise (LoRA, bf16, 8192 eager).
    "f8": case(_text(128, 3, 2, 64, 4096, kv_heads=1, global_head_dim=128, ple=8), 8192, 1),
    "f9": case(_text(128, 3, 2, 64, 4096, kv_heads=1, global_head_dim=128, ple=8), 4096, 1, attention="eager"),
}
# Never fitted to: other widths, depths, head sizes (full-attention layers wider than the
# sliding ones, as Gemma 4's), lengths, targets. The narrow model carries the long lengths.
H1 = _text(320, 10, 5, 64, 12000, kv_heads=1, global_head_dim=128)
H2 = _text(192, 7, 3, 64, 20000, kv_heads=1, global_head_dim=128, ple=8)
H3 = _text(448, 6, 7, 64, 6000, kv_heads=1, global_head_dim=128)
NARROW = _text(128, 3, 2, 64, 4096, kv_heads=1, global_head_dim=128, ple=8)
HELD_OUT = {
    "h1": case(H1, 512, 2, attention="eager"),
    "h2": case(H2, 2048, 1, dtype="bf16"),
    "h3": case(H3, 1024, 2, attention="eager", dtype="bf16", method="lora", dropout=0.05),
    "h4": case(H1, 2048, 1, method="lora"),
    "h5": case(H2, 512, 4, attention="eager", dtype="bf16", method="lora"),
    "h6": case(H3, 1024, 2, method="lora", dropout=0.05, targets="q_proj,v_proj"),
    "h7": case(H1, 1024, 2, dtype="bf16"),
    "h8": case(H2, 2048, 1, attention="eager", dtype="bf16"),
    "n1": case(NARROW, 4096, 1, dtype="bf16", method="lora", dropout=0.05),
    "n2": case(NARROW, 8192, 1, dtype="bf16"),
    "n3": case(NARROW, 8192, 1, attention="eager"),
    "n4": case(NARROW, 8192, 1, attention="eager", dtype="bf16", method="lora", dropout=0.05),
    "n5": case(NARROW, 8192, 1, method="lora"),
}
CONFIGS = {**FITTED, **HELD_OUT}
# Measured peaks (MiB), each configuration once in its own process (`--only NAME`) on the
# project's 2-core machine, most of them while it was shared and loaded (s2, s3, e1 idle);
# `--recorded` prints the current planner against them (docs/trainer.md's tables), and
# tests/api/test_memplan.py holds the planner to them. A row not here has not been run.
MEASURED = {
    "tiny": 17.7, "s1": 352.6, "s2": 1636.8, "s3": 2187.7, "e1": 1327.6, "b1": 642.0, "b2": 1255.9,
    "l1": 1008.8, "l2": 783.9, "l3": 654.1, "l4": 558.8, "f8": 1666.1, "f9": 1022.7,
    "h1": 1039.6, "h2": 614.3, "h3": 1660.1, "h4": 1582.3, "h5": 611.8, "h6": 1082.8, "h7": 1188.6, "h8": 1428.8,
    "n1": 478.8, "n2": 1141.4, "n3": 3352.7, "n4": 3789.7, "n5": 1745.2,
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
WARM_UP = _text(16, 2, 2, 8, 64, intermediate=32, ple=4)


def _build(config: dict):
    """A model built and sharded (with its adapters for LoRA), its loss head, AdamW and one
    batch, as train.py has them. Returns one training step."""
    from types import SimpleNamespace

    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tpufinetune_trainer import lora
    from tpufinetune_trainer import loss as head
    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
    from tpufinetune_trainer.train import param_groups

    text, length, blocks = config["text"], config["length"], config["blocks"]
    dtype = torch.bfloat16 if config["dtype"] == "bf16" else torch.float32
    gemma = Gemma4Config(text_config=dict(text, vocab_size_per_layer_input=text["vocab_size"],
                                          max_position_embeddings=16384, sliding_window=256, pad_token_id=0,
                                          eos_token_id=1, bos_token_id=2),
                         vision_config=None, audio_config=None)
    gemma._attn_implementation = config["attention"]
    model = Gemma4ForConditionalGeneration(gemma)
    model.config.get_text_config().use_cache = False
    if config["method"] == "lora":
        lora.inject(model, SimpleNamespace(lora_rank=16, lora_alpha=32.0, lora_dropout=config["dropout"],
                                           lora_target_modules=config["targets"], model_id="random",
                                           lora_train_embeddings=False))
    model = apply_fsdp(model, build_mesh("cpu", 1), dtype, device=torch.device("cpu"))
    head.install(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, 0.01), lr=torch.tensor(1e-4), fused=True)
    masks = MaskBuilder(model.config, length, torch.device("cpu"), dtype, config["attention"])
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

    return step


def measure(name: str, warm_up: bool = True) -> dict:
    """Run in a fresh process: build, shard, train `steps` steps; bytes of peak over baseline.
    With `warm_up`, one step of the smallest model first (WARM_UP), outside the figure."""
    # What _build imports, imported before the baseline (as before WARM_UP: --cold's figure).
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: F401

    import peft  # noqa: F401
    import tpufinetune_trainer.lora, tpufinetune_trainer.loss, tpufinetune_trainer.masks  # noqa: E401,F401
    import tpufinetune_trainer.train  # noqa: F401

    return peak_over_steps(name, CONFIGS[name], _build, warm_up)


def peak_over_steps(name: str, config: dict, build, warm_up: bool = True) -> dict:
    """`build(config)`'s step run `steps` times on one gloo rank: bytes of peak over the
    baseline (what the caller imported before is in the baseline). With `warm_up`, one step
    of the smallest model first (WARM_UP), outside the figure. bench_memplan_dpo's too."""
    import gc

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    if warm_up:
        build(dict(config, text=WARM_UP, length=32, blocks=1))()
        gc.collect()
    baseline = _status_kib("VmRSS") * 1024
    step = build(config)
    _reset_peak()
    started = time.perf_counter()
    for _ in range(config["steps"]):
        step()
    peak = _status_kib("VmHWM") * 1024
    dist.destroy_process_group()
    return {"name": name, "measured": peak - baseline, "seconds": time.perf_counter() - started}


def planned(name: str) -> tuple[int, int]:
    """The planner's bytes for configuration `name` on one CPU device, and the margin it adds
    (core/memplan.py: device_bytes, the long-sequence margin included)."""
    from tpufinetune.core.memplan import device_bytes, shape_from_config

    config = CONFIGS[name]
    text = dict(config["text"], vocab_size_per_layer_input=config["text"]["vocab_size"])
    shape = shape_from_config({"text_config": text}, name)
    part = device_bytes(shape, config["method"], 1, config["length"], config["blocks"],
                        compute_bytes=2 if config["dtype"] == "bf16" else 4,
                        eager_attention=config["attention"] == "eager", lora_rank=16,
                        lora_targets=tuple(config["targets"].split(",")), lora_dropout=config["dropout"])
    return part.total, part.margin


def describe(name: str) -> str:
    config = CONFIGS[name]
    method = config["method"] + (f" d{config['dropout']:g}" if config["method"] == "lora" else "")
    if config["method"] == "lora" and config["targets"].count(",") != 6:
        method += " qv"
    return f"{config['dtype']:>4} {config['attention']:>5} {method:>10}"


# The slices docs/trainer.md's table shows: (name, generation, topology).
TABLE_SLICES = (("v6e-8", "v6e", "2x4"), ("v6e-16", "v6e", "4x4"), ("v7x-8", "v7x", "2x2x1"),
                ("v7x-16", "v7x", "2x2x2"))
TABLE_MODELS = ("E2B", "E4B", "31B", "26B-A4B")


def planner_table(max_seq_len: int = 512, batch_per_device: int = 4) -> str:
    """HBM per chip, estimated / usable (GiB), per model, method and slice, as markdown; then
    each model's widths and where they come from."""
    from tpufinetune.core.memplan import GIB, Request, estimate, known_shape

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
    lines += ["", "| model | layers (full attention) | hidden | MLP | heads (kv) | head_dim (full layers) | "
                  "where from |", "|---|---|---|---|---|---|---|"]
    for model in TABLE_MODELS:
        s = known_shape(f"google/gemma-4-{model}")
        lines.append(f"| gemma-4-{model} | {s.layers} ({s.full_layers}) | {s.hidden} | {s.intermediate} | "
                     f"{s.heads} ({s.kv_heads or f'{max(s.heads // 2, 1)}, assumed'}) | {s.head_dim} ({s.full_head_dim}) | {s.widths_from} |")
    return "\n".join(lines)


def recorded() -> str:
    """Both sets, the current planner against MEASURED: the tables docs/trainer.md shows."""
    out = []
    for label, configs in (("fitted", FITTED), ("held-out", HELD_OUT)):
        out += [f"{label}:", f"{'name':5} {'width x layers':>14} {'L x b':>9} {'dtype':>5} {'attn':>5} {'method':>13} "
                             f"{'plan MiB':>8} {'margin':>6} {'measured':>8} {'ratio':>6}"]
        ratios = []
        for name, config in configs.items():
            estimate, margin = planned(name)
            measured = MEASURED.get(name)
            ratio = f"{estimate / MIB / measured:6.2f}" if measured else ""
            if measured:
                ratios.append(abs(estimate / MIB / measured - 1) <= TOLERANCE)
            dtype, attention, method = describe(name).split(None, 2)
            shape = f"{config['text']['hidden_size']} x {config['text']['num_hidden_layers']}"
            out.append(f"{name:5} {shape:>14} {config['length']:>5} x {config['blocks']} {dtype:>5} {attention:>5} "
                       f"{method:>13} {estimate / MIB:8.1f} "
                       f"{(f'{margin / MIB:6.1f}' if margin else ''):>6} "
                       f"{(f'{measured:8.1f}' if measured else 'not run'):>8} {ratio}".rstrip())
        out += [f"{label}: within {TOLERANCE:.0%} of the measured peak: {sum(ratios)} of {len(ratios)} measured "
                f"({len(configs) - len(ratios)} not run)", ""]
    return "\n".join(out).rstrip()


def in_child(script: str, name: str, *args: str, env: dict | None = None) -> tuple[dict | None, str]:
    """Row `name` measured by `script --child name` in a fresh process (its peak is its
    own): (its JSON result, "") or (None, why it failed: the child's last stderr line)."""
    out = subprocess.run([sys.executable, script, "--child", name, *args], capture_output=True, text=True,
                         env=None if env is None else dict(os.environ, **env))
    if out.returncode:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else str(out.returncode)
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def run(names: list[str], cold: bool) -> list[bool]:
    from tpufinetune.core.memplan import shape_from_config

    within = []
    for name in names:
        result, failure = in_child(__file__, name, *(["--cold"] if cold else []))
        if result is None:
            print(f"{name:5} failed: {failure}", flush=True)
            within.append(False)
            continue
        config = CONFIGS[name]
        estimate, margin = planned(name)
        ratio = estimate / result["measured"]
        within.append(abs(ratio - 1) <= TOLERANCE)
        text = dict(config["text"], vocab_size_per_layer_input=config["text"]["vocab_size"])
        params = shape_from_config({"text_config": text}).parameters
        print(f"{name:5} {params / 1e6:6.1f}M {config['text']['hidden_size']:>4} x {config['text']['num_hidden_layers']:<2} "
              f"{config['length']:>5} x {config['blocks']} {describe(name)} {estimate / MIB:8.1f} "
              f"{(f'{margin / MIB:6.1f}' if margin else ''):>6} {result['measured'] / MIB:8.1f} {ratio:6.2f} "
              f"{result['seconds']:6.1f}", flush=True)
    return within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--set", choices=("fitted", "held", "both"), default="both")
    parser.add_argument("--table", action="store_true", help="print the planner's Gemma 4 tables and exit")
    parser.add_argument("--recorded", action="store_true",
                        help="print both sets, the planner against the recorded measurements (MEASURED), and exit")
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up: the first step's fixed allocations count in the measured peak")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(planner_table())
        return 0
    if args.recorded:
        print(recorded())
        return 0
    if args.child:
        print(json.dumps(measure(args.child, warm_up=not args.cold)))
        return 0
    header = (f"{'name':5} {'params':>7} {'width x layers':>14} {'L x b':>9} {'dtype':>4} {'attn':>5} {'method':>10} "
              f"{'plan MiB':>8} {'margin':>6} {'measured':>8} {'ratio':>6} {'s':>6}")
    sets = [("fitted", FITTED), ("held-out", HELD_OUT)]
    for label, configs in sets:
        if args.set not in ("both", label[:len(args.set)]):
            continue
        names = [n for n in configs if not args.only or n in args.only]
        if not names:
            continue
        print(f"{label} ({'the constants were fitted to these' if label == 'fitted' else 'never fitted to'}):")
        print(header)
        within = run(names, args.cold)
        print(f"{label}: within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
