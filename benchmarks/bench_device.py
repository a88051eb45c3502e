"""The trainer's device check: its own training step on one CUDA GPU, in one process.

    python3 benchmarks/bench_device.py [--quick] [--json FILE]   # one CUDA GPU
    python3 benchmarks/bench_device.py --cpu-smoke               # the plumbing, on CPU, in a minute

Nothing here re-implements the step. Each case writes a random Gemma 4 to a temporary
model directory (the offline assets' `100m` config, `assets.build_model`, or an E2B-shaped
text config built the same way), then builds the trainer's own `train.Trainer` on a
world-size-1 process group (NCCL on CUDA, as Ray Train starts it; no Ray): the model built
on the meta device and each shard read from the safetensors (`sharded_load`), FSDP2 with
fp32 master weights and the backend's compute dtype, `torch.compile` per decoder block
where the backend compiles (`parallelize`), the label-position loss head (`loss`), AdamW
and the schedule's table on the device. The data are random token ids in examples of
dolly-like lengths with the labels on each example's tail; the trainer packs them itself
(`data.plan_epoch` and `data.rank_blocks`, the run's fixed blocks per step). Each timed step
is `Trainer.train_step`: gather the micro-batch on the device, masks, forward, loss head,
backward, clipping, learning rate from the table, AdamW.

Per case it prints a row as soon as it is measured: parameters, positions and real
tokens per step, step time (median of the timed steps, CUDA events), tokens/s, model
FLOP/s and MFU against a bf16 matmul peak measured first in the same process
(8192^3), peak HBM (`torch.cuda.max_memory_allocated` over the timed steps) and bytes per
parameter, what the step holds between forward and backward, and the compile's cost.
"cuda" cases use the CUDA backend as the trainer picks it (bf16, sdpa, per-block compile);
"tpu-set" cases use the TPU backend's settings on the same GPU (bf16, eager attention, no
compile), to show how the TPU's attention grows with the sequence length. On an E2B-shaped
case the same trainer also runs `--loss-head full` (transformers' logits at every position,
vocabulary 262144) for the head's memory and time against the label head.

The model FLOPs counted: 6 x (parameters of every linear layer the tokens pass through) x
real tokens, attention 12 x head_dim x heads x the (query, key) pairs the masks allow
(causal within each packed example, the window on sliding layers), and the head 6 x vocab x
hidden x label tokens. Padding, elementwise work and the head's padding rows are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # the budget counts the imports too
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tpufinetune_trainer import assets  # noqa: E402
from tpufinetune_trainer.backends import BACKENDS  # noqa: E402
from tpufinetune_trainer.config import FinetuneConfig  # noqa: E402
from tpufinetune_trainer.data import IGNORE_INDEX, BatchPlan, Examples, plan_run, rank_blocks  # noqa: E402
from tpufinetune_trainer.model import per_layer_embeddings  # noqa: E402
from tpufinetune_trainer.train import Trainer  # noqa: E402

GIB = 1 << 30
FIRST_TOKEN = len(assets.SPECIAL_TOKENS)  # random ids avoid the special tokens

# E2B's text shape, as its published config describes it: 35 layers of hidden 1536, four
# sliding (window 512, head_dim 256) to one global (head_dim 512) layer, one KV head, the
# last 20 layers reusing earlier layers' keys and values with double-wide MLPs, a per-layer
# input of 256 per layer, the final softcap 30, vocabulary 262144. The per-layer embedding
# table's rows (E2B: 262144, ~2.35B frozen parameters, 4.4 GiB in bf16) are --ple-vocab.
E2B_TEXT = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                num_kv_shared_layers=20, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                sliding_window=512, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)
# The same shape, tiny, for --cpu-smoke (every kind of E2B layer, in seconds on a CPU).
E2B_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, global_head_dim=64, hidden_size_per_layer_input=16,
                     num_kv_shared_layers=4, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                     sliding_window=64, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2)


def say(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- models


def build_e2b_shape(text: dict, vocab: int, ple_vocab: int, seed: int = 0):
    """A random Gemma 4 of `text`'s shape, built as assets.build_model builds the offline
    ones (the tiny vision and audio towers too, so the trainer's text-only load runs)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(text, vocab_size=vocab, vocab_size_per_layer_input=ple_vocab, max_position_embeddings=32768,
                pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config = Gemma4Config(text_config=text, vision_config=assets.TINY_VISION, audio_config=assets.TINY_AUDIO)
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(config)


def write_model(kind: str, directory: Path, device: torch.device, ple_vocab: int) -> dict:
    """A random Gemma 4 and a small BPE tokenizer in `directory` (bf16 safetensors, as
    Gemma 4 ships). Built on `device` (initialisation there is fast), then freed."""
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    rows = assets.generate_dataset(200, seed=7)
    tokenizer = assets.build_tokenizer(assets.prompt_texts(rows), 512)
    with torch.device(device):
        if kind == "100m":
            model = assets.build_model("100m", assets.SIZES["100m"]["vocab"])
        elif kind == "e2b-shape":
            model = build_e2b_shape(E2B_TEXT, 262144, ple_vocab)
        elif kind == "e2b-tiny":
            model = build_e2b_shape(E2B_TINY_TEXT, 4096, 4096)
        else:
            raise ValueError(kind)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    text = model.config.get_text_config()
    # Token ids index the per-layer table too (Gemma 4 looks every id up there): ids stay
    # below its rows where --ple-vocab makes it smaller than the vocabulary.
    info = {"vocab": int(text.vocab_size), "ids_below": int(min(text.vocab_size, text.vocab_size_per_layer_input)),
            "layers": int(text.num_hidden_layers), "hidden": int(text.hidden_size),
            "write_s": 0.0}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    info["write_s"] = round(time.perf_counter() - start, 1)
    return info


# ----------------------------------------------------------------------------- data


def synthetic_examples(count: int, seq: int, vocab: int, seed: int) -> Examples:
    """`count` examples of random token ids: lengths log-normal around a fifth of the block
    (dolly's shape at 512: many short, a tail near the block), the response (labelled)
    the last 5-40% of each, as `data.encode_rows` labels assistant turns (every example's
    first token unlabelled)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(seq * 0.2), 0.6, count).astype(np.int64), 16, seq)
    input_ids, labels = [], []
    for n in lengths:
        ids = rng.integers(FIRST_TOKEN, vocab, int(n)).tolist()
        prompt = max(1, int(n * rng.uniform(0.6, 0.95)))
        input_ids.append(ids)
        labels.append([IGNORE_INDEX] * prompt + ids[prompt:])
    return Examples(input_ids, labels)


def examples_for(target_blocks: int, seq: int, vocab: int, steps: int, seed: int,
                 plan_seed: int) -> tuple[Examples, int]:
    """Examples for `steps` optimizer steps, with the most examples per device per step whose
    fullest step the trainer packs into at most `target_blocks` blocks (data.plan_run,
    with the run's seed, as the trainer plans it)."""
    mean = seq * 0.2 * math.exp(0.18)
    per_device = max(1, int(target_blocks * seq * 0.95 / mean))
    while True:
        examples = synthetic_examples(per_device * steps, seq, vocab, seed)
        if per_device == 1 or plan_run(examples.lengths, examples.label_tokens, BatchPlan(1, per_device, 1), 1,
                                       plan_seed, seq).plan.blocks <= target_blocks:
            return examples, per_device
        per_device = max(1, int(per_device * 0.95))


# ----------------------------------------------------------------------------- FLOPs


def allowed_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs of one causal example of n tokens, within `window` if given."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def sharded_blocks(model) -> list:
    """The decoder blocks of a sharded model (fully_shard renames each class FSDP<name>)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]


def model_shape(model) -> dict:
    """What the FLOP count needs: linear parameters on every token's path (the tied head
    apart), each layer's attention (head_dim, heads, window), the head's size."""
    head = model.get_output_embeddings()
    linear = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            linear += module.in_features * module.out_features
    for block in sharded_blocks(model):  # a KV-reusing layer's own k/v projections, if a version keeps them, idle
        attn = getattr(block, "self_attn", None)
        if attn is not None and getattr(attn, "is_kv_shared_layer", False):
            for name in ("k_proj", "v_proj"):
                proj = getattr(attn, name, None)
                if isinstance(proj, torch.nn.Linear):
                    linear -= proj.in_features * proj.out_features
    text = model.config.get_text_config()
    layers = []
    for block in sharded_blocks(model):
        attn = block.self_attn
        window = getattr(attn, "sliding_window", None)
        layers.append((int(attn.head_dim), int(text.num_attention_heads), int(window) if window else None))
    return {"linear": linear, "layers": layers, "vocab": int(head.weight.shape[0]), "hidden": int(head.weight.shape[1])}


def step_flops(shape: dict, packed, first_block: int, blocks: int, label_tokens: int) -> tuple[float, int]:
    """Model FLOPs of one step over `packed` blocks [first_block, first_block + blocks), and
    its real tokens."""
    real = 0
    pairs: dict[int | None, int] = {}
    windows = {w for _, _, w in shape["layers"]}
    for b in range(first_block, first_block + blocks):
        n_real = int(packed.real_tokens[b])
        real += n_real
        counts = np.bincount(packed.segment_ids[b, :n_real])
        for w in windows:
            pairs[w] = pairs.get(w, 0) + sum(allowed_pairs(int(n), w) for n in counts if n)
    flops = 6.0 * shape["linear"] * real
    flops += sum(12.0 * d * h * pairs[w] for d, h, w in shape["layers"])
    flops += 6.0 * shape["vocab"] * shape["hidden"] * label_tokens
    return flops, real


# ----------------------------------------------------------------------------- measuring


def matmul_peak(device: torch.device, size: int) -> float:
    """bf16 (CUDA) or fp32 (CPU) size^3 matmul, TFLOP/s: median of timed products."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for i in range(23 if device.type == "cuda" else 4):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return 2.0 * size ** 3 / float(np.median(times)) / 1e12


class CompileWatch(logging.Handler):
    """Counts dynamo's recompile-limit warnings (a block that falls back to eager)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.limit_hits: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_hits.append(message.splitlines()[0])


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Case:
    name: str
    model: str        # 100m | e2b-shape | e2b-tiny
    backend: str      # cuda | tpu-set | cpu | cpu-eager
    seq: int
    blocks: int       # target blocks per device per step
    full_logits: bool = False  # also time --loss-head full on the same trainer


def backend_of(name: str):
    if name == "cuda":
        return BACKENDS["cuda"]
    if name == "tpu-set":  # the TPU backend's choices (eager attention, no compile, bf16) on the GPU
        return dataclasses.replace(BACKENDS["tpu"], name="cuda", dist_backend="nccl", device_type="cuda",
                                   ray_resource="GPU")
    if name == "cpu":
        return BACKENDS["cpu"]
    if name == "cpu-eager":
        return dataclasses.replace(BACKENDS["cpu"], attn_implementation="eager")
    raise ValueError(name)


def run_steps(trainer: Trainer, loss_sum, count: int, cuda: bool, marks: dict | None) -> list[float]:
    """`count` of the epoch's next steps (Trainer.train_step), each timed (seconds)."""
    times = []
    for _ in range(count):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if marks is not None:
                marks["before"] = torch.cuda.memory_allocated()
            start.record()
            trainer.train_step(loss_sum)
            end.record()
            trainer.epoch_step += 1
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            trainer.train_step(loss_sum)
            trainer.epoch_step += 1
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in times]
    return times


def measure(trainer: Trainer, args, cuda: bool, first_step: int, warmup: int, timed: int, shape: dict,
            peak_tflops: float, label: str) -> dict:
    """Warm-up steps (compile), then timed steps; one row."""
    device = trainer.device
    marks: dict = {"held": 0}
    if cuda:
        def track(fn):
            def wrapped(*a, **k):
                out = fn(*a, **k)
                marks["held"] = max(marks["held"], torch.cuda.memory_allocated() - marks.get("before", 0))
                return out
            return wrapped

        if trainer.label_head:
            trainer.model.label_loss_sum = track(trainer.model.label_loss_sum)
        trainer.full_logits_loss_sum = track(trainer.full_logits_loss_sum)
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    before = dynamo_counts()
    t0 = time.perf_counter()
    warm = run_steps(trainer, loss_sum, warmup, cuda, marks)
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    compiled = dynamo_counts()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        marks["held"] = 0
    t0 = time.perf_counter()
    times = run_steps(trainer, loss_sum, timed, cuda, marks)
    wall = time.perf_counter() - t0
    losses = float(loss_sum.item())  # the one host read
    plan, epoch = trainer.plan, trainer.epoch_plan
    per_step = plan.accum * plan.blocks
    flops, real = [], []
    timed_steps = range(first_step + warmup, first_step + warmup + timed)
    blocks = rank_blocks(trainer.examples, epoch, trainer.rank, trainer.cfg.max_seq_len, trainer.pad_id,
                         steps=slice(timed_steps.start, timed_steps.stop))  # the timed steps' blocks of this rank
    for row, step in enumerate(timed_steps):
        f, r = step_flops(shape, blocks, row * per_step, per_step, int(epoch.label_tokens[step]))
        flops.append(f)
        real.append(r)
    all_labels = int(epoch.label_tokens[first_step:first_step + warmup + timed].sum())
    median = float(np.median(times))
    row = {"case": label, "params_M": round(shape["trainable"] / 1e6, 1), "frozen_M": round(shape["frozen"] / 1e6, 1),
           "blocks": plan.blocks, "seq": trainer.cfg.max_seq_len, "positions": per_step * trainer.cfg.max_seq_len,
           "real_tokens": int(np.mean(real)), "step_ms": round(median * 1e3, 1),
           "step_ms_spread": [round(min(times) * 1e3, 1), round(max(times) * 1e3, 1)],
           "tokens_per_s": round(float(np.mean(real)) / median), "wall_tokens_per_s": round(sum(real) / wall),
           "tflops": round(float(np.mean(flops)) / median / 1e12, 1),
           "mfu": round(float(np.mean(flops)) / median / 1e12 / peak_tflops, 3),
           "loss_per_label": round(losses / max(all_labels, 1), 3),
           "first_steps_s": round(warm_s, 1), "warm_step_ms": [round(t * 1e3) for t in warm],
           "graphs": compiled["graphs"] - before["graphs"],
           "graph_breaks": compiled["graph_breaks"] - before["graph_breaks"],
           "label_rows": trainer.train_cap}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        total = shape["trainable"] + shape["frozen"]
        row.update(peak_gib=round(peak / GIB, 2), reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2),
                   peak_bytes_per_param=round(peak / total, 2),
                   held_gib=round(marks["held"] / GIB, 2),
                   held_kib_per_position=round(marks["held"] / 1024 / row["positions"], 1))
    return row


def state_row(trainer: Trainer, shape: dict) -> dict:
    """What stays between steps: fp32 weights, AdamW's two moments, the frozen table, the
    epoch's blocks (gradients are freed by zero_grad)."""
    allocated = torch.cuda.memory_allocated()
    frozen_bytes = shape["frozen_bytes"]
    return {"state_gib": round(allocated / GIB, 2),
            "state_bytes_per_trainable": round((allocated - frozen_bytes) / shape["trainable"], 2)}


def run_case(case: Case, args, device: torch.device, peak_tflops: float, workdir: Path, models: dict) -> list[dict]:
    cuda = device.type == "cuda"
    if case.model not in models:
        models[case.model] = write_model(case.model, workdir / case.model, device, args.ple_vocab)
        say(f"  wrote {case.model}: {models[case.model]}")
    info = models[case.model]
    warmup, timed = (1, 1) if args.cpu_smoke else (args.warmup, args.steps)
    extra = (1 + max(2, timed // 2)) if case.full_logits else 0
    steps = warmup + timed + extra + 1
    seed = FinetuneConfig.seed
    examples, per_device = examples_for(case.blocks, case.seq, info["ids_below"], steps, seed=11, plan_seed=seed)
    backend = backend_of(case.backend)
    cfg = FinetuneConfig(model_id=str(workdir / case.model), storage_path=str(workdir / "storage"), num_workers=1,
                         device=backend.name, max_seq_len=case.seq, batch_size_per_device=per_device, num_epochs=1,
                         run_name=f"bench-device-{case.name.replace(' ', '-')}", eval_fraction=0.0,
                         seed=seed).validate()
    start = time.perf_counter()
    trainer = Trainer(cfg, backend, {"train": examples, "eval": None, "pad_id": 0}, rank=0, world=1, local_rank=0)
    build_s = time.perf_counter() - start
    model = trainer.model
    ple = per_layer_embeddings(model)
    frozen = [p for p in (ple.parameters() if ple is not None else [])]
    shape = model_shape(model)
    shape.update(trainable=sum(p.numel() for p in trainer.params), frozen=sum(p.numel() for p in frozen),
                 frozen_bytes=sum(p.numel() * p.element_size() for p in frozen))
    say(f"  {case.name}: trainer built in {build_s:.1f} s ({per_device} examples per step in {trainer.plan.blocks} "
        f"blocks of {case.seq}; compile {'on' if trainer.compiled else 'off'}, attention "
        f"{backend.attn_implementation}, compute {str(trainer.dtype).removeprefix('torch.')}; label head rows "
        f"{trainer.train_cap})")
    rows = []
    row = measure(trainer, args, cuda, 0, warmup, timed, shape, peak_tflops, case.name)
    row["build_s"] = round(build_s, 1)
    if cuda:
        row.update(state_row(trainer, shape))
    rows.append(row)
    print_row(row)
    if case.full_logits:
        trainer.label_head = False  # --loss-head full: transformers' logits at every position
        try:
            full = measure(trainer, args, cuda, warmup + timed, 1, extra - 1, shape, peak_tflops,
                           case.name + " full-logits")
            full["build_s"] = row["build_s"]
            rows.append(full)
            print_row(full)
        except torch.cuda.OutOfMemoryError as exc:
            say(f"  {case.name} full-logits: out of memory ({str(exc).splitlines()[0]})")
            rows.append({"case": case.name + " full-logits", "error": "OOM"})
    del trainer, model, ple, frozen
    return rows


def cleanup(cuda: bool) -> None:
    gc.collect()
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()


def print_row(row: dict) -> None:
    say("  ROW " + json.dumps(row))


COLUMNS = [("case", "case"), ("params M (frozen)", lambda r: f"{r['params_M']} ({r['frozen_M']})"),
           ("blocks x seq", lambda r: f"{r['blocks']} x {r['seq']}"), ("real tok/step", "real_tokens"),
           ("step ms", "step_ms"), ("tokens/s", "tokens_per_s"), ("TFLOP/s", "tflops"),
           ("MFU", lambda r: f"{100 * r['mfu']:.1f}%"), ("peak GiB", "peak_gib"),
           ("B/param peak", "peak_bytes_per_param"), ("state B/train. param", "state_bytes_per_trainable"),
           ("fwd->bwd GiB", "held_gib"), ("KiB/position", "held_kib_per_position"),
           ("warm-up s", "first_steps_s"), ("graphs", "graphs")]


def print_table(rows: list[dict]) -> None:
    table = [[name for name, _ in COLUMNS]]
    for r in rows:
        if "error" in r:
            table.append([r["case"], r["error"]] + [""] * (len(COLUMNS) - 2))
            continue
        cells = []
        for _, get in COLUMNS:
            try:
                value = get(r) if callable(get) else r.get(get, "-")
            except KeyError:
                value = "-"
            cells.append(str(value if value is not None else "-"))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for k, line in enumerate(table):
        say(" | ".join(c.ljust(w) for c, w in zip(line, widths)))
        if k == 0:
            say("-+-".join("-" * w for w in widths))


def cases_for(args) -> list[Case]:
    if args.cpu_smoke:
        return [Case("100m s256 cpu", "100m", "cpu", 256, 1),
                Case("e2b-tiny s128 cpu", "e2b-tiny", "cpu", 128, 2, full_logits=True),
                Case("e2b-tiny s256 cpu-eager", "e2b-tiny", "cpu-eager", 256, 1)]
    tokens = args.tokens
    cases = [Case("e2b-shape s512 cuda", "e2b-shape", "cuda", 512, tokens // 512, full_logits=True),
             Case("100m s512 cuda", "100m", "cuda", 512, tokens // 512)]
    if args.quick:
        return cases
    return cases + [Case("e2b-shape s512 tpu-set", "e2b-shape", "tpu-set", 512, tokens // 512),
                    Case("e2b-shape s2048 tpu-set", "e2b-shape", "tpu-set", 2048, max(1, tokens // 2048)),
                    Case("e2b-shape s4096 tpu-set", "e2b-shape", "tpu-set", 4096, max(1, tokens // 4096)),
                    Case("e2b-shape s4096 cuda", "e2b-shape", "cuda", 4096, max(1, tokens // 4096)),
                    Case("e2b-shape s2048 cuda", "e2b-shape", "cuda", 2048, max(1, tokens // 2048))]


def estimate(case: Case, spent: dict) -> float:
    """Seconds a case should take: what the last case of its model and backend took (its
    model already written), else a guess (a compiled case compiles again per shape)."""
    kind = (case.model, case.backend)
    if kind in spent:
        return spent[kind]
    return 120.0 if backend_of(case.backend).compile_by_default else 45.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the E2B-shaped step at 512 (and its full-logits "
                        "head) and the 100m asset only")
    parser.add_argument("--cpu-smoke", action="store_true", help="the plumbing on CPU: small configs, 2 steps each")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile)")
    parser.add_argument("--tokens", type=int, default=8192, help="positions per step (blocks = tokens / seq)")
    parser.add_argument("--ple-vocab", type=int, default=32768,
                        help="rows of the E2B-shaped model's frozen per-layer table (E2B: 262144; fewer keep the "
                             "write and the loads short: the table is a frozen bf16 lookup, 2 bytes a parameter; "
                             "Gemma 4 looks every token id up in it, so the random ids stay below its rows)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip cases that would end past this")
    parser.add_argument("--json", default="", help="also write every row as a JSON line here")
    parser.add_argument("--workdir", default="", help="model directories and storage (default: a temporary one)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the cases whose name contains this (repeatable)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 2)

    started = STARTED
    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        say("no CUDA device: run with --cpu-smoke here")
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    import transformers

    say(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
        f"python {sys.version.split()[0]}")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        say(f"device: {props.name}, {props.total_memory / GIB:.1f} GiB, {props.multi_processor_count} SMs, "
            f"capability {props.major}.{props.minor}")
    else:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        say(f"device: CPU ({torch.get_num_threads()} threads), --cpu-smoke")
    watch = CompileWatch()
    logging.getLogger("torch._dynamo").addHandler(watch)
    if cuda:  # why each block recompiles, and any graph break, into the log
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
        say(f"dynamo: recompile limit {torch._dynamo.config.recompile_limit}, automatic dynamic shapes "
            f"{torch._dynamo.config.automatic_dynamic_shapes}")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    port = free_port()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(device)
    peak = matmul_peak(device, 8192 if cuda else 1024)
    say(f"matmul peak: {peak:.3g} TFLOP/s ({'bf16 8192^3, median of 20' if cuda else 'fp32 1024^3, rough'})")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-device-"))
    rows: list[dict] = []
    models: dict = {}
    spent: dict = {}
    out = open(args.json, "a", encoding="utf-8") if args.json else None
    try:
        queue = [c for c in cases_for(args) if not args.only or any(o in c.name for o in args.only)]
        while queue:
            case = queue.pop(0)
            elapsed = time.perf_counter() - started
            guess = estimate(case, spent)
            if not args.cpu_smoke and elapsed + guess > args.budget_s:
                say(f"skip {case.name}: {elapsed:.0f} s spent, ~{guess:.0f} s more would pass "
                    f"--budget-s {args.budget_s:.0f}")
                rows.append({"case": case.name, "error": "skipped (time budget)"})
                continue
            say(f"case {case.name} (at {elapsed:.0f} s)")
            t0 = time.perf_counter()
            hits = len(watch.limit_hits)
            try:
                got = run_case(case, args, device, peak, workdir, models)
            except torch.cuda.OutOfMemoryError as exc:
                say(f"  {case.name}: out of memory ({str(exc).splitlines()[0]})")
                got = [{"case": case.name, "error": "OOM"}]
                if case.blocks > 1:  # once more with half the blocks: the memory per position is the finding
                    queue.insert(0, dataclasses.replace(case, name=f"{case.name} {case.blocks // 2}blk",
                                                        blocks=case.blocks // 2, full_logits=False))
            for r in got:
                r["recompile_limit_hits"] = len(watch.limit_hits) - hits
            if len(watch.limit_hits) > hits:
                say(f"  {case.name}: dynamo hit its recompile limit {len(watch.limit_hits) - hits} times: "
                    f"{watch.limit_hits[hits]}")
            cleanup(cuda)
            spent[(case.model, case.backend)] = time.perf_counter() - t0
            say(f"  {case.name}: done in {time.perf_counter() - t0:.0f} s")
            rows += got
            if out:
                for r in got:
                    out.write(json.dumps(r) + "\n")
                out.flush()
    finally:
        if out:
            out.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        dist.destroy_process_group()
    say()
    say(f"The trainer's step, one process, world size 1 ({device.type}); matmul peak {peak:.3g} TFLOP/s; "
        f"{time.perf_counter() - started:.0f} s in all")
    print_table(rows)
    by_name = {r["case"]: r for r in rows}
    labels, full = by_name.get(rows[0]["case"]), by_name.get(rows[0]["case"] + " full-logits")
    if labels and full and "error" not in labels and "error" not in full and cuda:
        say(f"loss head at vocabulary {models[cases_for(args)[0].model]['vocab']}: label positions "
            f"{labels['peak_gib']} GiB peak, {labels['step_ms']} ms a step; transformers' full logits "
            f"{full['peak_gib']} GiB, {full['step_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
