"""The memory planner against measured peaks for DPO (training.method dpo): random Gemma 4
text models trained a few DPO steps on CPU, one process (world size 1, gloo), with the
trainer's own parts: FSDP2 sharding and its mixed-precision policy, LoRA's adapters as
lora.inject puts them, preference pairs laid out by preference.fill_pair_blocks (each
pair's chosen and rejected two segments of one block), and methods/dpo.py's loss over
transformers' full logits with the reference as the trainer holds it:

- full fine-tuning: the reference's summed log-probabilities computed before the first step
  by a no-grad forward of the starting model (dpo.reference_sums' way; inside the measured
  window), then handed to each micro-batch: no second copy of the weights;
- LoRA: the same model with its adapters disabled, one no-grad forward per micro-batch;
- reference-free rows: no reference at all.

The measurement is bench_memplan.py's (a fresh process per row; VmHWM over the steps minus
what was resident before the model existed, after one step of the smallest model of the
same code path), against core/memplan.py's device_bytes with the row's DPO reference.
Every row here is held out: no constant was fitted to a DPO row. The DPO terms (the full
logits' bytes, the reference forward's) are counted from the code's structure
(core/memplan_dpo.py) and checked on the head alone (`--head`); the rest are SFT's.

    .venv/bin/python benchmarks/bench_memplan_dpo.py              # every row
    .venv/bin/python benchmarks/bench_memplan_dpo.py --only d1    # one
    .venv/bin/python benchmarks/bench_memplan_dpo.py --recorded   # the planner against MEASURED (docs)
    .venv/bin/python benchmarks/bench_memplan_dpo.py --head       # the loss head alone, B a logit
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memplan import H1, H2, H3, MIB, NARROW, S1, TOLERANCE, case, in_child, peak_over_steps  # noqa: E402

# Gemma's final-logit softcap (the planner counts its saved tanh output; transformers'
# Gemma4TextConfig leaves it unset, the "Loss head" benchmark and loss.py use 30).
SOFTCAP = 30.0
# Pairs per block: each pair a prompt and two responses of PROMPT and RESPONSE shares of the
# block (two sequences of prompt + response each), the block filled exactly.
PAIRS_PER_BLOCK = 2


def dpo_case(text: dict, length: int, blocks: int, reference: str, **kw) -> dict:
    """`reference`: stored (full), adapters-off (LoRA) or none (reference-free)."""
    return dict(case(text, length, blocks, **kw), reference=reference)


# Never fitted to: full (stored reference) and LoRA (adapters off), fp32 and bf16, sdpa and
# eager, with and without dropout, 512 to 8192 tokens, and one reference-free row of each.
HELD_OUT = {
    "d1": dpo_case(S1, 1024, 2, "stored"),
    "d2": dpo_case(H1, 512, 2, "stored", attention="eager"),
    "d3": dpo_case(H2, 1024, 1, "stored", dtype="bf16"),
    "d4": dpo_case(S1, 1024, 2, "adapters-off", method="lora", dropout=0.05),
    "d5": dpo_case(H3, 1024, 1, "adapters-off", method="lora", attention="eager"),
    "d6": dpo_case(H2, 1024, 2, "adapters-off", method="lora", dtype="bf16", dropout=0.05),
    "d7": dpo_case(H1, 1024, 1, "none"),
    "d8": dpo_case(H3, 512, 2, "none", method="lora"),
    # Long blocks on the narrow model (bench_memplan's NARROW): 4096 and 8192 tokens.
    "d9": dpo_case(NARROW, 4096, 1, "adapters-off", method="lora", dtype="bf16", dropout=0.05),
    "d10": dpo_case(NARROW, 8192, 1, "stored"),
}
CONFIGS = HELD_OUT
# Measured peaks (MiB), each row once in its own process (`--only NAME`) on the project's
# shared 2-core machine, with the softcap. `--recorded` prints the current planner against
# them; tests/api/test_memplan_dpo.py holds the planner to them. A row not here has not been run.
MEASURED: dict[str, float] = {
    "d1": 1305.7, "d2": 1176.6, "d3": 574.8, "d4": 1491.7, "d5": 1130.4, "d6": 1147.0, "d7": 1036.0, "d8": 812.1,
    "d9": 778.3, "d10": 2141.6,
}


def _pairs(vocab: int, length: int, blocks: int):
    """PAIRS_PER_BLOCK pairs a block, filling it: a pair's chosen and rejected sequences the
    same prompt (a quarter of the pair's share) and a response each (labelled)."""
    import numpy as np

    from tpufinetune_trainer.data import IGNORE_INDEX
    from tpufinetune_trainer.preference import PairExamples

    share = length // PAIRS_PER_BLOCK
    prompt, response = share // 4, share // 2 - share // 4
    rng = np.random.default_rng(0)
    ids, labels, cuts = [], [], []
    for _ in range(blocks * PAIRS_PER_BLOCK):
        p = rng.integers(3, vocab, prompt)
        chosen, rejected = rng.integers(3, vocab, response), rng.integers(3, vocab, response)
        ignore = np.full(prompt, IGNORE_INDEX)
        ids.append(np.concatenate([p, chosen, p, rejected]))
        labels.append(np.concatenate([ignore, chosen, ignore, rejected]))
        cuts.append(prompt + response)
    pairs = PairExamples(ids, labels, chosen_lengths=np.array(cuts))
    return pairs, [list(range(b * PAIRS_PER_BLOCK, (b + 1) * PAIRS_PER_BLOCK)) for b in range(blocks)]


def _build(config: dict):
    """A model built and sharded (with its adapters for LoRA), AdamW, DPO as methods/dpo.py
    runs it and one micro-batch of pairs. Returns one training step (the first one also
    computes a stored reference, as the trainer does before its first step)."""
    from types import SimpleNamespace

    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tpufinetune_trainer import lora
    from tpufinetune_trainer.masks import MaskBuilder
    from tpufinetune_trainer.methods.dpo import DPO
    from tpufinetune_trainer.parallelize import apply_fsdp, build_mesh
    from tpufinetune_trainer.preference import fill_pair_blocks
    from tpufinetune_trainer.train import DeviceBlocks, param_groups

    text, length, blocks = config["text"], config["length"], config["blocks"]
    dtype = torch.bfloat16 if config["dtype"] == "bf16" else torch.float32
    gemma = Gemma4Config(text_config=dict(text, vocab_size_per_layer_input=text["vocab_size"],
                                          max_position_embeddings=16384, sliding_window=256, pad_token_id=0,
                                          eos_token_id=1, bos_token_id=2, final_logit_softcapping=SOFTCAP),
                         vision_config=None, audio_config=None)
    gemma._attn_implementation = config["attention"]
    model = Gemma4ForConditionalGeneration(gemma)
    model.config.get_text_config().use_cache = False
    uses_lora = config["method"] == "lora"
    if uses_lora:
        lora.inject(model, SimpleNamespace(lora_rank=16, lora_alpha=32.0, lora_dropout=config["dropout"],
                                           lora_target_modules=config["targets"], model_id="random",
                                           lora_train_embeddings=False, uses_lora=True))
    model = apply_fsdp(model, build_mesh("cpu", 1), dtype, device=torch.device("cpu"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, 0.01), lr=torch.tensor(1e-4), fused=True)
    cfg = SimpleNamespace(dpo_beta=0.1, dpo_loss="sigmoid", dpo_label_smoothing=0.0,
                          dpo_reference_free=config["reference"] == "none", max_seq_len=length, uses_lora=uses_lora)
    method = DPO(cfg)
    assert method.stored_reference == (config["reference"] == "stored"), "the row's reference is not the trainer's"
    trainer = SimpleNamespace(model=model, masks=MaskBuilder(model.config, length, torch.device("cpu"), dtype,
                                                             config["attention"]))
    pairs, layout = _pairs(text["vocab_size"], length, blocks)
    packed = fill_pair_blocks(pairs, layout, length, 0, method.segments)
    batch = DeviceBlocks(packed, torch.device("cpu"), 0).gather(torch.arange(blocks))
    state = {"first": True}

    def step() -> None:
        if state["first"] and method.stored_reference:  # the starting model's sums, once
            with torch.no_grad():
                model.eval()
                batch["reference"] = method.policy_sums(trainer, batch)[0]
                model.train()
        state["first"] = False
        summed = method.loss_sum(trainer, batch, None)
        (summed / (blocks * PAIRS_PER_BLOCK)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(name: str) -> dict:
    """Run in a fresh process: build, shard, train `steps` DPO steps; bytes of peak over baseline."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: F401

    import peft  # noqa: F401
    import tpufinetune_trainer.lora, tpufinetune_trainer.masks, tpufinetune_trainer.train  # noqa: E401,F401
    import tpufinetune_trainer.methods.dpo  # noqa: F401

    return peak_over_steps(name, CONFIGS[name], _build)


def head(dtype: str, reference: bool, tokens: int = 2048, vocab: int = 32768, hidden: int = 64) -> float:
    """The DPO loss head alone (Gemma's softcapped logits, dpo_loss.segment_logps, backward),
    with the reference's no-grad forward between the policy's and its backward where
    `reference`: peak bytes per logit over what was resident before, less the head weight's
    gradient. What core/memplan_dpo.py counts (policy_saved, BACKWARD_GRADS, reference_logits)."""
    import gc

    import torch

    from tpufinetune_trainer.methods.dpo_loss import segment_logps

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32

    def logits_of(h, w):
        return torch.tanh((h @ w.t()) / SOFTCAP) * SOFTCAP  # transformers' Gemma head, one op a line

    def run(n: int) -> int:
        h = torch.randn(1, n, hidden, dtype=dt, requires_grad=True)
        w = torch.randn(vocab, hidden, dtype=dt, requires_grad=True)
        targets, segments = torch.randint(0, vocab, (1, n)), torch.ones(1, n, dtype=torch.long)
        segments[:, n // 2:] = 2
        gc.collect()
        _reset_peak()
        base = _status_kib("VmRSS") * 1024
        sums, _ = segment_logps(logits_of(h, w), targets, segments, 4)
        if reference:
            with torch.no_grad():
                segment_logps(logits_of(h, w), targets, segments, 4)
        sums.sum().backward()
        return _status_kib("VmHWM") * 1024 - base - vocab * hidden * dt.itemsize

    run(64)  # first-call allocations
    return run(tokens) / (tokens * vocab)


def planned(name: str) -> int:
    """The planner's bytes for row `name` on one CPU device (core/memplan.py's device_bytes)."""
    from tpufinetune.core.memplan import device_bytes, shape_from_config

    config = CONFIGS[name]
    text = dict(config["text"], vocab_size_per_layer_input=config["text"]["vocab_size"])
    shape = shape_from_config({"text_config": text}, name)
    return device_bytes(shape, config["method"], 1, config["length"], config["blocks"],
                        compute_bytes=2 if config["dtype"] == "bf16" else 4,
                        eager_attention=config["attention"] == "eager", lora_rank=16,
                        lora_targets=tuple(config["targets"].split(",")), lora_dropout=config["dropout"],
                        dpo_reference=config["reference"]).total


def describe(name: str) -> str:
    config = CONFIGS[name]
    method = config["method"] + (f" d{config['dropout']:g}" if config["method"] == "lora" else "")
    return f"{config['dtype']:>4} {config['attention']:>5} {method:>10} {config['reference']:>12}"


HEADER = (f"{'name':5} {'width x layers':>14} {'L x b':>9} {'dtype':>4} {'attn':>5} {'method':>10} "
          f"{'reference':>12} {'plan MiB':>8} {'measured':>8} {'error':>6}")


def row(name: str, measured_mib: float | None) -> str:
    config = CONFIGS[name]
    estimate = planned(name) / MIB
    shape = f"{config['text']['hidden_size']} x {config['text']['num_hidden_layers']}"
    error = f"{(estimate / measured_mib - 1) * 100:+5.0f}%" if measured_mib else ""
    return (f"{name:5} {shape:>14} {config['length']:>5} x {config['blocks']} {describe(name)} {estimate:8.1f} "
            f"{(f'{measured_mib:8.1f}' if measured_mib else 'not run'):>8} {error:>6}").rstrip()


def recorded() -> str:
    """The current planner against MEASURED: the table docs/trainer.md shows."""
    lines = ["DPO, held-out (no constant fitted to these):", HEADER]
    within = []
    for name in CONFIGS:
        measured = MEASURED.get(name)
        lines.append(row(name, measured))
        if measured:
            within.append(abs(planned(name) / MIB / measured - 1) <= TOLERANCE)
    lines.append(f"within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)} measured "
                 f"({len(CONFIGS) - len(within)} not run)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--recorded", action="store_true",
                        help="print the planner against the recorded measurements (MEASURED), and exit")
    parser.add_argument("--head", action="store_true",
                        help="measure the DPO loss head alone, bytes per logit (fp32, bf16; with and without the "
                             "reference's forward), and exit")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.head:
        for dtype in ("fp32", "bf16"):
            for reference in (False, True):
                print(f"{dtype} {'with' if reference else 'without':>7} the reference forward: "
                      f"{head(dtype, reference):5.1f} B a logit", flush=True)
        return 0
    if args.recorded:
        print(recorded())
        return 0
    if args.child:
        print(json.dumps(measure(args.child)))
        return 0
    print(HEADER + f" {'s':>6}", flush=True)
    within = []
    for name in [n for n in CONFIGS if not args.only or n in args.only]:
        result, failure = in_child(__file__, name)
        if result is None:
            print(f"{name:5} failed: {failure}", flush=True)
            within.append(False)
            continue
        measured = result["measured"] / MIB
        within.append(abs(planned(name) / MIB / measured - 1) <= TOLERANCE)
        print(f"{row(name, measured)} {result['seconds']:6.1f}", flush=True)
    print(f"within {TOLERANCE:.0%} of the measured peak: {sum(within)} of {len(within)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
