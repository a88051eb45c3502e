"""Benchmark: throughput and checkpoint cost, `finetune` against the tutorial's loop, on CPU.
Not a test; time to quality is `bench_time_to_quality.py`.

    .venv/bin/python benchmarks/bench_trainer.py [--rows 1024] [--epochs 3] [--work DIR]

Both run under Ray Train on a private local Ray head (2 workers, gloo, fp32, the same
attention kernel), on the same offline assets: the tiny random Gemma 4 and the
dolly-like dataset, batch 4 per worker, max length 512. The baseline re-implements the
tutorial's loop: every example padded to max length, DataCollatorForLanguageModeling,
DataLoader + prepare_data_loader, FSDP2 on each layer's MLP, and at every epoch a full
state dict gathered to rank 0 (cpu_offload) and written with torch.save. It sees the
same text as ours (our prompt format, context included) so the token streams match.

Ours runs with the product's defaults: the trainer's, with the flags the operator's memory
plan passes for the model (plan_flags.py: the plan made from the model's config.json on a
TPU slice shape of 2 devices; the output prints its decision), beside the trainer's own
default, full sharding. The same comparison runs on a much smaller model (`small`: the
tiny one's builder, tokenizer and data with narrower, fewer layers), where a step's fixed
costs weigh more.

Checkpoint cost is measured on a randomly initialised Gemma 4 of ~118M parameters built
offline (`--size 100m`): wall time of the checkpoint step on rank 0 (save + hand-off to
Ray Train + copy to storage) and rank 0's peak RSS during it, taken from the kernel's
high-water mark (reset through /proc/self/clear_refs just before the step).

    .venv/bin/python benchmarks/bench_trainer.py --loss-head [--vocab 262144] [--hidden 256]

measures only the loss head, in one process per case (no Ray): the head, softcap and
summed cross-entropy of 512-token blocks over Gemma's vocabulary, forward and backward in
fp32, as transformers' full logits (what the trainer did before) and at label positions
(loss.py), with 22% of the positions labelled: seconds per step and the step's peak RSS
over what was resident before it (hidden states, head weight and its gradient).

    .venv/bin/python benchmarks/bench_trainer.py --profile [--profile-warmup 6] [--profile-steps 12]

profiles one step of each loop, both run as for the table on the tiny model (stopped after
the profiled steps): torch.profiler (CPU) on each worker over --profile-steps steady-state
steps, after as many timed without it. Per step of the training thread: wall time, forward +
backward compute, FSDP's collectives (their ranges: copy-in, the gloo call, the wait,
copy-out), the optimizer, data, collectives outside FSDP, and the rest, by the outermost op
or range it was in (`step_breakdown`); then whatever a step of ours costs beyond its
compute and what the tutorial's loop also pays.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


# ----------------------------------------------------------------------------- measuring (in workers)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1))


class PeakRss:
    """Rank-local peak RSS over a block, from the kernel's high-water mark.

    malloc_trim first hands freed heap pages back to the OS: otherwise memory freed after
    the training step stays resident and a checkpoint that reuses it shows no increase."""

    def __enter__(self):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        self.before_mib = _status_kib("VmRSS") / 1024
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.peak_mib = _status_kib("VmHWM") / 1024
        self.increase_mib = self.peak_mib - self.before_mib
        return False


def record(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class HeldoutScore:
    """The mean loss over held-out response tokens, scored the same way for both loops
    (bench_time_to_quality's scorer: each row in the tutorial's format, the response tokens
    only). The training losses of the two loops average different tokens: ours the response
    tokens of its examples, the tutorial's loop every token, prompt included."""

    def __init__(self, heldout: str):
        self.heldout, self.batches = heldout, None
        if str(REPO / "benchmarks") not in sys.path:  # in a Ray worker: the scorer's module
            sys.path.insert(0, str(REPO / "benchmarks"))

    def __call__(self, model_dir: str, model, rank: int, world: int) -> float | None:
        if not self.heldout:  # the checkpoint runs
            return None
        from bench_time_to_quality import heldout_loss, scoring_batches

        if self.batches is None:
            self.batches = scoring_batches(model_dir, self.heldout, "tutorial", rank, world)
        return heldout_loss(model, self.batches)


# ----------------------------------------------------------------------------- one step under the profiler

# Main-thread time in these is FSDP's collectives: their ranges (copy-in, the gloo call, the
# wait, copy-out), and any collective op inside them.
FSDP_COLLECTIVE_RANGES = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")
COLLECTIVE_WORDS = ("all_gather", "allgather", "reduce_scatter", "allreduce", "all_reduce", "gloo", "c10d",
                    "broadcast", "barrier", "wait_tensor")
OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")  # torch.optim's own ranges
DATA_RANGES = ("enumerate(DataLoader)#", "bench::data")


def merged(spans) -> list:
    """Sorted, non-overlapping (start, end) spans covering `spans`."""
    out = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def minus(spans, taken) -> list:
    """Merged `spans` less merged `taken`."""
    out, taken = [], merged(taken)
    for start, end in merged(spans):
        for t0, t1 in taken:
            if t1 <= start or t0 >= end:
                continue
            if t0 > start:
                out.append((start, t0))
            start = max(start, t1)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def total(spans) -> float:
    return sum(end - start for start, end in merged(spans))


def thread_cpu_ticks() -> dict:
    """CPU clock ticks (user + system) of each of this process's threads: {tid: (name, ticks)}."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        ticks[int(task.name)] = (name, int(fields[11]) + int(fields[12]))
    return ticks


def step_breakdown(events, window: tuple, steps: int) -> dict:
    """Milliseconds per step of the training thread (the one that ran `bench::forward`), by
    what it did, each span counted once, in this order: FSDP's collectives (their ranges,
    or a collective op inside an FSDP range); other collectives (a collective op outside
    them: ours' gradient norm, its agreements); the optimizer (torch.optim's step and
    zero_grad ranges); forward + backward compute (what is left of the `bench::forward` and
    `bench::backward` ranges: the model, the loss, FSDP's hooks' own work); data (the
    DataLoader's next batch, ours' gather of a step's blocks); other: the rest of the
    step's wall time, by the outermost op or range it was in ("no op": Python between ops)."""
    threads = {e.thread for e in events if e.name == "bench::forward"}
    if len(threads) != 1:
        raise RuntimeError(f"bench::forward ran on threads {threads}: expected one training thread")
    main = [e for e in events if e.thread in threads]
    span = lambda e: (e.time_range.start, e.time_range.end)  # noqa: E731 - microseconds
    fsdp_ranges = [span(e) for e in main if e.name.startswith("FSDP::")]
    collective_ops = [e for e in main if any(w in e.name.lower() for w in COLLECTIVE_WORDS)]

    def inside(e, spans) -> bool:
        return any(s <= e.time_range.start and e.time_range.end <= t for s, t in spans)

    fsdp = merged([span(e) for e in main if e.name.startswith(FSDP_COLLECTIVE_RANGES)]
                  + [span(e) for e in collective_ops if inside(e, fsdp_ranges)])
    other_coll = minus([span(e) for e in collective_ops if not inside(e, fsdp_ranges)], fsdp)
    taken = fsdp + other_coll
    optimizer = minus([span(e) for e in main if e.name.startswith(OPTIMIZER_RANGES)], taken)
    taken += optimizer
    compute = minus([span(e) for e in main if e.name in ("bench::forward", "bench::backward")], taken)
    taken += compute
    data = minus([span(e) for e in main if e.name.startswith(DATA_RANGES)], taken)
    taken += data
    rest = minus([window], taken)
    # The rest, by the outermost op or range around each part of it.
    by_name: dict = {}
    outer = [e for e in main if e.cpu_parent is None or e.cpu_parent.name == "bench::window"]
    for e in outer:
        part = total(minus([span(e)], minus([span(e)], rest)))  # span(e) within rest
        if part:
            by_name[e.name] = by_name.get(e.name, 0.0) + part
    by_name["no op (Python between ops)"] = total(minus(rest, [span(e) for e in outer]))
    per_step = lambda us: us / 1000 / steps  # noqa: E731
    ranges: dict = {}  # ours' own ranges, whole (what they hold included)
    for e in main:
        if e.name.startswith("bench::") and e.name not in ("bench::forward", "bench::backward"):
            ranges[e.name] = ranges.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    return {"step_ms": per_step(window[1] - window[0]), "compute_ms": per_step(total(compute)),
            "fsdp_ms": per_step(total(fsdp)), "other_collectives_ms": per_step(total(other_coll)),
            "optimizer_ms": per_step(total(optimizer)), "data_ms": per_step(total(data)),
            "other_ms": per_step(total(rest)),
            "other_by_name": {k: round(per_step(v), 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])
                              if per_step(v) >= 0.05},
            "ranges_ms": {k: round(per_step(v), 3) for k, v in ranges.items()}}


class StepProbe:
    """Times a loop's steps and profiles some, in a worker. `step()` is called at the top of
    every step: after `warmup` steps it times `steps` steps without the profiler, then
    profiles the next `steps` (CPU activities) and records their breakdown (`step_breakdown`,
    plus the collectives in the profiler's key_averages, every thread, and the CPU time of
    the process's other threads) as one `profile` row; it returns True from then on.
    `range(name)` is a `bench::<name>` record_function while profiling, nothing otherwise."""

    def __init__(self, out: str, loop: str, rank: int, warmup: int, steps: int):
        self.out, self.loop, self.rank, self.warmup, self.steps = out, loop, rank, warmup, steps
        self.calls, self.profiler, self.done = 0, None, False

    def range(self, name: str):
        import contextlib

        from torch.profiler import record_function

        return record_function(f"bench::{name}") if self.profiler is not None else contextlib.nullcontext()

    def step(self) -> bool:
        import threading

        from torch.profiler import ProfilerActivity, profile

        n, self.calls = self.calls, self.calls + 1
        if n == self.warmup:
            self.plain_start = time.perf_counter()
        elif n == self.warmup + self.steps:
            self.plain_ms = (time.perf_counter() - self.plain_start) * 1000 / self.steps
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.start()
            self.ticks = thread_cpu_ticks()
            self.start = time.perf_counter()
            self.marker = self.range("window")
            self.marker.__enter__()  # its start opens the window in the profiler's clock
        elif n == self.warmup + 2 * self.steps:
            self.marker.__exit__(None, None, None)
            wall = time.perf_counter() - self.start
            ticks = thread_cpu_ticks()
            self.profiler.stop()
            self.finish(wall, ticks, threading.get_native_id())
            self.profiler, self.done = None, True
        return self.done

    def finish(self, wall: float, ticks: dict, me: int) -> None:
        events = self.profiler.events()
        (marker,) = [e for e in events if e.name == "bench::window"]
        window = (marker.time_range.start, marker.time_range.end)
        row = {"kind": "profile", "loop": self.loop, "rank": self.rank, "steps": self.steps,
               "plain_step_ms": self.plain_ms, "wall_step_ms": wall * 1000 / self.steps,
               **step_breakdown([e for e in events if e is not marker], window, self.steps)}
        averages = self.profiler.key_averages()
        row["collective_ops"] = {a.key: [a.count / self.steps, round(a.cpu_time_total / 1000 / self.steps, 3)]
                                 for a in averages if any(w in a.key.lower() for w in COLLECTIVE_WORDS)
                                 or a.key.startswith(FSDP_COLLECTIVE_RANGES)}
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        others: dict = {}
        for tid, (name, after) in ticks.items():
            before = self.ticks.get(tid, (name, 0))[1]
            key = "training thread" if tid == me else name
            others[key] = others.get(key, 0.0) + (after - before) * tick_ms / self.steps
        row["thread_cpu_ms"] = {k: round(v, 1) for k, v in sorted(others.items(), key=lambda kv: -kv[1]) if v}
        record(self.out, row)


def make_ours_train_func(out: str, heldout: str, profile: tuple | None = None):
    """The product's own train_func, with the epoch and checkpoint steps timed and the
    held-out loss scored after each epoch; with `profile` (warmup, steps), a StepProbe
    on its steps (`probe_ours`)."""

    def train_func(config):
        from tpufinetune_trainer import train as product

        train_epoch, checkpoint = product.Trainer.train_epoch, product.Trainer.checkpoint
        score = HeldoutScore(heldout)
        if profile:
            probe_ours(product, out, *profile)

        def timed_epoch(self):
            m = train_epoch(self)
            heldout = score(self.cfg.model_id, self.model, self.rank, self.world)  # after the epoch's clock
            if self.rank == 0:
                record(out, {"kind": "epoch", "epoch": m["epoch"], "epoch_time_s": m["epoch_time_s"],
                             "steps": m["steps"], "tokens_per_s": m["tokens_per_s"], "loss": m["loss"],
                             "heldout": heldout, "shapes": m["batch_shapes"]})
            return m

        def timed_checkpoint(self, name, metrics, state_extra):
            with PeakRss() as peak:
                uri = checkpoint(self, name, metrics, state_extra)
            if self.rank == 0:
                record(out, {"kind": "checkpoint", "epoch": metrics["epoch"], "seconds": peak.seconds,
                             "peak_mib": peak.peak_mib, "increase_mib": peak.increase_mib})
            return uri

        product.Trainer.train_epoch, product.Trainer.checkpoint = timed_epoch, timed_checkpoint
        product.train_func(config)

    return train_func


def probe_ours(product, out: str, warmup: int, steps: int) -> None:
    """In a worker: a StepProbe on the Trainer's steps. Its `step()` runs at the start of
    each `train_step`, so a profiled step is everything the epoch's loop does between two
    steps (its bookkeeping and agreements included); ranges name the forward (the masks,
    the model, the label head's loss), the backward, and the work the tutorial's loop does
    not do: the gather of a step's blocks (data), the gradient clip, the agreements, the
    progress line. Nothing else in the product changes."""
    import torch

    from tpufinetune_trainer import notice

    holder: dict = {}
    trainer_cls = product.Trainer

    def ranged(owner, name: str, what: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            probe = holder.get("probe")
            if probe is None:
                return original(*a, **k)
            with probe.range(what):
                return original(*a, **k)

        setattr(owner, name, wrapper)

    train_step = trainer_cls.train_step

    def probed_step(self, loss_sum):
        if "probe" not in holder:
            holder["probe"] = StepProbe(out, "ours", self.rank, warmup, steps)
        holder["probe"].step()
        return train_step(self, loss_sum)

    trainer_cls.train_step = probed_step
    ranged(trainer_cls, "token_loss_sum", "forward")
    ranged(torch.Tensor, "backward", "backward")
    ranged(product.DeviceBlocks, "gather", "data")
    ranged(product, "clip_grad_norm", "clip")  # train.py calls it by its module name
    ranged(trainer_cls, "emit_progress", "progress")
    ranged(notice.NoticeWatch, "agreed", "agreement")


def make_baseline_train_func(out: str):
    """The tutorial's loop, re-implemented (CPU: fp32 params, gloo). With
    config["profile"] (warmup, steps), a StepProbe on its steps: its `step()` runs at the
    top of each step (so a step holds the DataLoader's next batch), ranges name the
    forward and backward, and the epoch ends after the profiled steps."""

    def train_func(config):
        import contextlib
        import tempfile as tf

        import ray.train
        import ray.train.torch
        import torch
        from datasets import load_dataset
        from torch.distributed import ReduceOp, all_reduce
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.utils.data import DataLoader
        from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

        from tpufinetune_trainer.data import format_prompt

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        length, batch_size = config["max_seq_len"], config["batch_size"]
        score = HeldoutScore(config["heldout"])
        probe = StepProbe(out, "tutorial", rank, *config["profile"]) if config.get("profile") else None
        span = probe.range if probe else (lambda name: contextlib.nullcontext())
        tokenizer = AutoTokenizer.from_pretrained(config["model"])
        rows = load_dataset("json", data_files=config["data"], split=config["split"])
        tokenized = rows.map(lambda x: tokenizer(format_prompt(x["instruction"], x["context"]) + " " + x["response"],
                                                 truncation=True, max_length=length, padding="max_length"),
                             remove_columns=rows.column_names)
        loader = DataLoader(tokenized, batch_size=batch_size, shuffle=True, drop_last=True,
                            collate_fn=DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False))
        loader = ray.train.torch.prepare_data_loader(loader)
        torch.manual_seed(42)
        model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32,
                                                     attn_implementation="sdpa", vision_config=None,
                                                     audio_config=None)
        model.config.get_text_config().use_cache = False
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        text = model.model.language_model
        text.embed_tokens_per_layer.requires_grad_(False)
        for layer in text.layers:
            fully_shard(layer.mlp, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=set(text.embed_tokens_per_layer.parameters()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
        for epoch in range(config["epochs"]):
            loader.sampler.set_epoch(epoch)
            model.train()
            start = time.perf_counter()
            running = torch.zeros(1)
            real = torch.zeros(1, dtype=torch.float64)
            shapes = set()
            for batch in loader:
                if probe and probe.step():
                    break
                shapes.add(tuple(batch["input_ids"].shape))
                optimizer.zero_grad()
                with span("forward"):
                    out_ = model(input_ids=batch["input_ids"], labels=batch["labels"])
                with span("backward"):
                    out_.loss.backward()
                optimizer.step()
                running += out_.loss.detach().float()
                real += batch["attention_mask"].sum()
            all_reduce(running, op=ReduceOp.AVG)
            all_reduce(real, op=ReduceOp.SUM)
            elapsed = time.perf_counter() - start
            metrics = {"epoch": epoch + 1, "loss": running.item() / len(loader)}
            heldout = score(config["model"], model, rank, world)
            if rank == 0:
                record(out, {"kind": "epoch", "epoch": epoch + 1, "epoch_time_s": elapsed, "steps": len(loader),
                             "tokens_per_s": real.item() / elapsed, "loss": metrics["loss"], "heldout": heldout,
                             "shapes": sorted(list(s) for s in shapes)})
            with PeakRss() as peak:
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                            ignore_frozen_params=True))
                if rank == 0:
                    with tf.TemporaryDirectory() as tmp:
                        torch.save(full, os.path.join(tmp, "model.pt"))
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
                else:
                    ray.train.report(metrics)
                del full
            if rank == 0:
                record(out, {"kind": "checkpoint", "epoch": epoch + 1, "seconds": peak.seconds,
                             "peak_mib": peak.peak_mib, "increase_mib": peak.increase_mib})

    return train_func


# ----------------------------------------------------------------------------- one run (a subprocess)

# Ours as run: (whether it takes the memory plan's choices, its own settings). `ours` is the
# product's defaults: the trainer's, with the flags the operator's memory plan passes for the
# model (plan_flags.py: its sharding, activation checkpointing, blocks kept gathered). Beside
# it: full sharding, the trainer's own default (with every block kept gathered, what the
# operator passes where its plan holds them so); with the loss on every token, as the
# tutorial's loop; and with the tutorial's objective and schedule (that, and a constant rate
# from the first step): the settings that differ from the tutorial's loop in what is learned
# rather than how fast (measured on the tiny model only).
OURS = {"ours": (True, {}), "ours-full-sharding": (False, {}),
        "ours-loss-on-all": (True, {"loss_on": "all"}),
        "ours-tutorial-objective": (True, {"loss_on": "all", "lr_schedule": "constant", "warmup_ratio": 0.0}),
        "ours-kept-gathered": (False, {"reshard_after_forward": False})}
# Rows of the table on each model besides the tiny one's: the 118M one measures checkpoints.
RUNS_BY_SIZE = {"tiny": ("ours", "baseline", *(k for k in OURS if k != "ours")),
                "small": ("ours", "baseline", "ours-full-sharding"), "100m": ("ours", "baseline")}
# The much smaller model: the tiny one's tokenizer, data and builder with these text widths,
# where a step's fixed costs dominate its compute.
SMALL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=8,
                  layer_types=["sliding_attention", "full_attention"])


def run_one(args) -> None:
    out = str(args.out)
    profile = (args.profile_warmup, args.profile_steps) if args.profile else None
    if args.one in OURS:
        from plan_flags import trainer_settings
        from tpufinetune_trainer import finetune
        from tpufinetune_trainer import train as product
        from tpufinetune_trainer.config import FinetuneConfig

        product.train_func = make_ours_train_func(out, args.heldout, profile)  # finetune.run picks it up by name
        takes_plan, own = OURS[args.one]
        settings = {**(trainer_settings(json.loads(args.trainer_flags)) if takes_plan else {}), **own}
        # Profiling: the table's run, stopped one step after the probe's last.
        stop = {"max_steps": args.profile_warmup + 2 * args.profile_steps + 1} if profile else {}
        cfg = FinetuneConfig(model_id=args.model, dataset=args.data, dataset_split=args.split, num_workers=2,
                             num_epochs=args.epochs, batch_size_per_device=4, max_seq_len=512,
                             learning_rate=args.lr, eval_fraction=0.0, device="cpu", storage_path=args.storage,
                             prompt_format="tutorial", run_name=f"ours-{int(time.time())}", **settings, **stop)
        finetune.run(cfg)
        return
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"])
    TorchTrainer(
        train_loop_per_worker=make_baseline_train_func(out),
        train_loop_config={"model": args.model, "data": args.data, "split": args.split, "epochs": args.epochs,
                           "batch_size": 4, "max_seq_len": 512, "lr": args.lr, "heldout": args.heldout,
                           "profile": profile},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"baseline-{int(time.time())}", storage_path=args.storage),
    ).fit()


# ----------------------------------------------------------------------------- the loss head alone

LABEL_SHARE = 0.22  # dolly's response tokens in packed chat blocks
SOFTCAP = 30.0      # Gemma's final_logit_softcapping


def loss_head_case(args) -> None:
    """One case in this process: `args.loss_head_case` is full, label or label-all (the cap at every
    position: a micro-batch whose blocks are all response); prints one JSON line."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tpufinetune_trainer import loss
    from tpufinetune_trainer.data import IGNORE_INDEX

    torch.manual_seed(0)
    blocks, length = args.blocks, 512
    hidden = (torch.randn(blocks, length, args.hidden) / args.hidden ** 0.5).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (blocks, length))
    unlabelled = torch.rand(blocks, length) >= LABEL_SHARE
    targets[unlabelled] = IGNORE_INDEX
    labels = int((~unlabelled).sum())
    cap = loss.label_cap(labels if args.loss_head_case == "label" else blocks * length, blocks * length)

    def step() -> float:
        if args.loss_head_case == "full":  # the trainer's former head: transformers' logits, then the loss
            logits = F.linear(hidden, weight)
            logits = torch.tanh(logits / SOFTCAP) * SOFTCAP
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum")
        else:
            summed = loss.head_loss_sum(hidden, targets, weight, SOFTCAP, cap)
        summed.backward()
        hidden.grad = weight.grad = None
        return float(summed.detach())

    value = step()  # warm-up: first-touch allocations
    seconds = []
    for _ in range(args.repeats):
        with PeakRss() as peak:
            step()
        seconds.append(peak.seconds)
    print(json.dumps({"case": args.loss_head_case, "blocks": blocks, "labels": labels, "rows": cap, "loss": value,
                      "seconds": float(np.median(seconds)), "increase_mib": peak.increase_mib}), flush=True)


def loss_head_table(args) -> None:
    cases = [(case, blocks) for blocks in args.blocks_list for case in ("full", "label", "label-all")]
    results = {}
    for case, blocks in cases:
        cmd = [sys.executable, __file__, "--loss-head-case", case, "--blocks", str(blocks), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden), "--repeats", str(args.repeats)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"loss head case {case} x{blocks} failed:\n{out.stderr[-3000:]}")
        results[case, blocks] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {case:9s} {blocks} block(s): {results[case, blocks]}", flush=True)
    print(f"\nLoss head alone, CPU fp32 ({os.cpu_count()} cores), vocabulary {args.vocab}, hidden {args.hidden}, "
          f"512-token blocks, {LABEL_SHARE:.0%} of positions labelled, softcap {SOFTCAP:g}, forward + backward, "
          f"median of {args.repeats}")
    header = ("blocks", "head", "rows through the head", "s per step", "peak RSS over the step MiB", "vs full")
    rows = []
    for blocks in args.blocks_list:
        full = results["full", blocks]
        for case, name in (("full", "full logits (before)"), ("label", "label positions, cap = labels"),
                           ("label-all", "label positions, cap = every position")):
            r = results[case, blocks]
            ratio = "" if case == "full" else (f"{r['seconds'] / full['seconds']:.2f}x time, "
                                               f"{r['increase_mib'] / full['increase_mib']:.2f}x memory")
            rows.append((str(blocks), name, str(r["rows"]), f"{r['seconds']:.2f}", f"{r['increase_mib']:.0f}", ratio))
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


# ----------------------------------------------------------------------------- the compute ceiling


def compute_ceiling(args) -> None:
    """Forward + backward of one step's tokens per worker, in this one process (one thread,
    as a Ray worker with one CPU; no FSDP, no collectives), for each loop: the tutorial's 4
    rows of 512 tokens (causal, loss over every position) and ours' one packed block of 512
    (its block-diagonal masks, the label head at `LABEL_SHARE` of the positions). Both steps
    hold the same examples, so the time ratio bounds the useful tokens/s ratio from above:
    what is left once per-step costs (collectives, optimizer) are taken away. Prints one
    JSON line."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tpufinetune_trainer import loss
    from tpufinetune_trainer.data import IGNORE_INDEX
    from tpufinetune_trainer.masks import MaskBuilder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa",
                                                 vision_config=None, audio_config=None)
    vocab, length = model.config.get_text_config().vocab_size, 512
    rows = torch.randint(3, vocab, (4, length))
    block = torch.randint(3, vocab, (1, length))
    segments = torch.arange(length)[None] * 4 // length  # four examples in the block
    positions = torch.arange(length)[None] - segments * (length // 4)
    targets = torch.full((1, length), IGNORE_INDEX)
    labelled = torch.rand(1, length) < LABEL_SHARE
    targets[labelled] = block[labelled]
    cap = loss.label_cap(int(labelled.sum()), length)
    masks = MaskBuilder(model.config, length, torch.device("cpu"), torch.float32, "sdpa")(segments)
    loss.install(model)

    def tutorial():
        model(input_ids=rows, labels=rows, use_cache=False).loss.backward()

    def ours():
        model.label_loss_sum(block, positions, masks, targets, cap).backward()

    seconds = {}
    for name, step in (("tutorial", tutorial), ("ours", ours)):
        step()  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        seconds[name] = float(np.median(times))
    print(json.dumps(seconds), flush=True)


# ----------------------------------------------------------------------------- orchestration


def measure(kind: str, model: Path, data: Path, split: str, epochs: int, lr: float, work: Path, env: dict,
            heldout: Path | None, extra: tuple = (), trainer_flags: tuple = ()) -> list:
    """One run in a subprocess; `trainer_flags`: the plan's (plan_flags.py), for a kind that takes them."""
    out = work / f"{kind}-{model.parent.name}-{int(time.time())}.jsonl"
    cmd = [sys.executable, __file__, "--one", kind, "--model", str(model), "--data", str(data), "--split", split,
           "--epochs", str(epochs), "--lr", str(lr), "--out", str(out), "--storage", str(work / "storage"),
           "--heldout", str(heldout or ""), "--trainer-flags", json.dumps(list(trainer_flags)), *extra]
    log = out.with_suffix(".log")
    started = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed (log: {log}):\n{log.read_text()[-3000:]}")
    print(f"  {kind:8s} {model.parent.name}: {time.time() - started:.0f}s (log: {log.name})", flush=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def summarize(rows: list) -> dict:
    epochs = [r for r in rows if r["kind"] == "epoch"]
    ckpts = [r for r in rows if r["kind"] == "checkpoint"]
    later = epochs[1:] or epochs  # epoch 1 includes one-off warm-up
    shapes = {tuple(s) for r in epochs for s in r["shapes"]}
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in later) / len(later),
        "epoch_time_s": sum(r["epoch_time_s"] for r in later) / len(later),
        "step_s": sum(r["epoch_time_s"] / r["steps"] for r in later) / len(later),
        "loss": [round(r["loss"], 3) for r in epochs],
        "heldout": [round(r["heldout"], 3) for r in epochs if r.get("heldout") is not None],
        "shapes": len(shapes),
        # Median: robust to other load on a shared machine.
        "ckpt_s": sorted(r["seconds"] for r in ckpts)[len(ckpts) // 2] if ckpts else 0.0,
        "ckpt_peak_mib": max((r["peak_mib"] for r in ckpts), default=0.0),
        "ckpt_increase_mib": max((r["increase_mib"] for r in ckpts), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="work dir (default: a temp dir)")
    parser.add_argument("--rows", type=int, default=1024, help="examples (the tutorial's train[:1024])")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--ckpt-rows", type=int, default=48,
                        help="examples for the 118M checkpoint runs (the baseline gets a third)")
    parser.add_argument("--ckpt-epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--redo", action="append", default=[],
                        help="re-measure ours-tiny, baseline-100m, … or all (others come from <work>/results.json)")
    parser.add_argument("--loss-head", action="store_true", help="measure only the loss head (no Ray)")
    parser.add_argument("--vocab", type=int, default=262144, help="loss head: vocabulary (Gemma's)")
    parser.add_argument("--hidden", type=int, default=256,
                        help="loss head: hidden size (the logits' memory does not depend on it)")
    parser.add_argument("--blocks-list", type=int, nargs="+", default=[1, 2], help="loss head: blocks per step")
    parser.add_argument("--repeats", type=int, default=2, help="loss head: timed steps per case")
    parser.add_argument("--profile", action="store_true",
                        help="profile some steady-state steps of both loops (tiny model) instead of the table")
    parser.add_argument("--profile-warmup", type=int, default=6, help="profile: steps before the timed ones")
    parser.add_argument("--profile-steps", type=int, default=12,
                        help="profile: steps timed without the profiler, then as many profiled")
    parser.add_argument("--one", choices=[*OURS, "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loss-head-case", choices=["full", "label", "label-all"], help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--heldout-rows", type=int, default=128,
                        help="rows after the training rows, scored after every epoch (response tokens)")
    for hidden in ("--model", "--data", "--split", "--out", "--storage", "--heldout", "--trainer-flags"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args)
        return
    if args.loss_head_case:
        loss_head_case(args)
        return
    if args.ceiling:
        compute_ceiling(args)
        return
    if args.loss_head:
        loss_head_table(args)
        return

    from harness.rayhead import RayHead
    from tpufinetune_trainer.assets import write_assets

    work = args.work or Path(tempfile.mkdtemp(prefix="tpuft-bench-"))
    print(f"work dir: {work}", flush=True)
    sizes = ("tiny",) if args.profile else tuple(RUNS_BY_SIZE)
    for size in sizes:
        if not (work / size / "model" / "config.json").exists():
            info = build_small(work) if size == "small" else write_assets(work / size, size)
            print(f"  built {size}: {info['parameters'] / 1e6:.2f}M parameters", flush=True)
    plans = {size: planned(work / size / "model") for size in sizes}
    for size, plan in plans.items():
        print(f"  {size}: {plan.words()}", flush=True)
    heldout = work / "tiny" / "heldout.jsonl"  # rows no run trains on
    rows = (work / "tiny" / "data" / "train.jsonl").read_text().splitlines()
    if len(rows) < args.rows + args.heldout_rows:
        raise SystemExit(f"{len(rows)} rows in the dataset: not enough for {args.rows} + {args.heldout_rows} held out")
    heldout.write_text("".join(line + "\n" for line in rows[args.rows:args.rows + args.heldout_rows]))
    if args.profile:
        profile_loops(args, work)
        return
    cache = work / "results.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}
    runs = [(k, s) for s, kinds in RUNS_BY_SIZE.items() for k in kinds]
    todo = [(k, s) for k, s in runs if f"{k}-{s}" not in results or f"{k}-{s}" in args.redo or "all" in args.redo]
    if todo:
        head = RayHead.start(num_cpus=4)
        env = dict(head.env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO / "tests"))
        try:
            for kind, size in todo:
                # The 118M runs only measure checkpoints: just enough rows for a step or
                # two per epoch (packing needs more rows than padding for one global batch).
                ckpt_rows = args.ckpt_rows if kind == "ours" else args.ckpt_rows // 3
                split, epochs = ((f"train[:{args.rows}]", args.epochs) if size != "100m"
                                 else (f"train[:{ckpt_rows}]", args.ckpt_epochs))
                flags = plans[size].flags if kind in OURS and OURS[kind][0] else ()
                data = work / ("tiny" if size == "small" else size) / "data" / "train.jsonl"  # small: tiny's
                measured = measure(kind, work / size / "model", data, split, epochs, args.lr, work, env,
                                   heldout if size != "100m" else None, trainer_flags=flags)
                results[f"{kind}-{size}"] = dict(summarize(measured), trainer_flags=list(flags))
                cache.write_text(json.dumps(results, indent=1))  # a later run can redo only some
        finally:
            head.stop()
    for size in sizes:
        results[f"parameters-{size}"] = text_parameters(work / size / "model")
    if "ceiling" not in results or "ceiling" in args.redo or "all" in args.redo:
        cmd = [sys.executable, __file__, "--ceiling", "--model", str(work / "tiny" / "model"), "--repeats", "5"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
        if done.returncode != 0:
            raise SystemExit(f"compute ceiling failed:\n{done.stderr[-3000:]}")
        results["ceiling"] = json.loads(done.stdout.strip().splitlines()[-1])
        cache.write_text(json.dumps(results, indent=1))
    print_table(results, args, plans)


def planned(model: Path):
    """The memory plan's choices for a run of `model` as the table runs it (plan_flags.py)."""
    from plan_flags import plan

    return plan(json.loads((model / "config.json").read_text()), str(model), workers=2, batch_per_device=4,
                max_seq_len=512)


def text_parameters(model: Path) -> int:
    """The text model's parameters (its per-layer embedding table included), from the
    safetensors headers: the towers, which neither loop trains, left out."""
    total = 0
    for file in model.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items()
                     if name != "__metadata__" and "language_model" in name)
    return total


def build_small(work: Path) -> dict:
    """The much smaller model: the tiny one's config with SMALL_TEXT's widths, built as the
    tiny one is (assets.build_model: the seed, the towers), saved with its tokenizer. Trained
    on the tiny one's data."""
    import shutil

    import torch
    from transformers import AutoConfig, Gemma4Config, Gemma4ForConditionalGeneration

    tiny, small = work / "tiny" / "model", work / "small" / "model"
    tiny_config = AutoConfig.from_pretrained(tiny)
    config = Gemma4Config(text_config=dict(tiny_config.text_config.to_dict(), **SMALL_TEXT),
                          vision_config=tiny_config.vision_config.to_dict(),
                          audio_config=tiny_config.audio_config.to_dict())
    torch.manual_seed(1234)  # write_assets' seed
    model = Gemma4ForConditionalGeneration(config)
    model.save_pretrained(small)
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, small / name.name)
    return {"model": str(small), "parameters": sum(p.numel() for p in model.parameters())}


PROFILE_COLUMNS = (("step_ms", "step ms"), ("compute_ms", "fwd+bwd compute ms"),
                   ("fsdp_ms", "FSDP collectives ms"), ("optimizer_ms", "optimizer ms"), ("data_ms", "data ms"),
                   ("other_collectives_ms", "other collectives ms"), ("other_ms", "other ms"))


def profile_loops(args, work: Path) -> None:
    """Both loops as the table runs them (tiny model, `--rows` examples, the same Ray head
    and workers), each stopped after its profiled steps (one epoch: ours by --max-steps,
    the tutorial's by its probe), then one row per loop (the mean over the 2 workers) and
    the details of each worker: where "other" goes, ours' own ranges, the collectives in the
    profiler's key_averages and the CPU time of each thread over the profiled steps."""
    from harness.rayhead import RayHead

    extra = ("--profile", "--profile-warmup", str(args.profile_warmup), "--profile-steps", str(args.profile_steps))
    rows = []
    head = RayHead.start(num_cpus=4)
    env = dict(head.env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO / "tests"))
    try:
        flags = planned(work / "tiny" / "model").flags
        for kind in ("ours", "baseline"):
            rows += measure(kind, work / "tiny" / "model", work / "tiny" / "data" / "train.jsonl",
                            f"train[:{args.rows}]", 1, args.lr, work, env, None, extra,
                            trainer_flags=flags if kind == "ours" else ())
    finally:
        head.stop()
    profiles = [r for r in rows if r["kind"] == "profile"]
    (work / f"profile-{int(time.time())}.json").write_text(json.dumps(profiles, indent=1))
    print_profile(profiles, args)


def print_profile(profiles: list, args) -> None:
    loops = {loop: sorted((r for r in profiles if r["loop"] == loop), key=lambda r: r["rank"])
             for loop in ("ours", "tutorial")}
    mean = {loop: {k: sum(r[k] for r in rs) / len(rs) for k in ("plain_step_ms", *(c for c, _ in PROFILE_COLUMNS))}
            for loop, rs in loops.items()}
    print(f"\nCPU, 2 workers (gloo), tiny Gemma 4, batch 4/worker, max length 512; steps {args.profile_warmup + 1}-"
          f"{args.profile_warmup + args.profile_steps} timed without the profiler, the next {args.profile_steps} "
          f"under torch.profiler (CPU); ms per step of the training thread, mean of the 2 workers")
    header = ("loop", "step ms, no profiler", *(name for _, name in PROFILE_COLUMNS))
    table = [(loop, f"{mean[loop]['plain_step_ms']:.1f}", *(f"{mean[loop][c]:.1f}" for c, _ in PROFILE_COLUMNS))
             for loop in ("ours", "tutorial")]
    table.append(("ours / tutorial", f"{mean['ours']['plain_step_ms'] / mean['tutorial']['plain_step_ms']:.2f}x",
                  *(f"{mean['ours'][c] / mean['tutorial'][c]:.2f}x" if mean["tutorial"][c] > 0.05 else "-"
                    for c, _ in PROFILE_COLUMNS)))
    widths = [max(len(str(r[i])) for r in table + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in table:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    # What a step costs beyond its compute and what both loops pay (FSDP's collectives, the
    # optimizer, its batch): collectives of its own, and the rest.
    extra = {loop: m["other_collectives_ms"] + m["other_ms"] for loop, m in mean.items()}
    ranges: dict = {}
    for r in loops["ours"]:
        for name, ms in r["ranges_ms"].items():
            ranges[name] = ranges.get(name, 0.0) + ms / len(loops["ours"])
    print(f"\nBeyond compute, FSDP's collectives, the optimizer and data, per step: ours {extra['ours']:.1f} ms "
          f"({extra['ours'] / mean['ours']['step_ms']:.1%} of its step), the tutorial's loop "
          f"{extra['tutorial']:.1f} ms "
          f"({extra['tutorial'] / mean['tutorial']['step_ms']:.1%}); ours' ranges, whole (mean of the workers, ms): "
          + ", ".join(f"{name.removeprefix('bench::')} {ms:.2f}" for name, ms in ranges.items()))
    for loop, rs in loops.items():
        for r in rs:
            print(f"\n{loop}, rank {r['rank']}: step {r['step_ms']:.1f} ms (wall {r['wall_step_ms']:.1f}), "
                  f"no profiler {r['plain_step_ms']:.1f}")
            print(f"  other, by outermost op or range (ms/step): {r['other_by_name']}")
            if r["ranges_ms"]:
                print(f"  ranges, whole (ms/step): {r['ranges_ms']}")
            ops: dict = {}
            for key, (count, ms) in r["collective_ops"].items():  # FSDP's ranges carry the module's name
                name = re.sub(r" \(.*\)$", "", key)
                ops[name] = [round(ops.get(name, [0, 0])[0] + count, 2), round(ops.get(name, [0, 0])[1] + ms, 2)]
            print(f"  collectives in key_averages, every thread ([calls, CPU ms] per step): {ops}")
            print(f"  CPU ms per step by thread: {r['thread_cpu_ms']}")


def print_table(results: dict, args, plans: dict) -> None:
    o, b = results["ours-tiny"], results["baseline-tiny"]
    om, bm = results["ours-100m"], results["baseline-100m"]
    c, a, t = results["ceiling"], results["ours-loss-on-all-tiny"], results["ours-tutorial-objective-tiny"]
    f, k = results["ours-full-sharding-tiny"], results["ours-kept-gathered-tiny"]
    so, sb, sf = results["ours-small"], results["baseline-small"], results["ours-full-sharding-small"]
    mode = {size: plan.choices.sharding for size, plan in plans.items()}

    def tokens(name: str, ours: dict, base: dict, target: str = "") -> tuple:
        return (name, f"{ours['tokens_per_s']:.0f}", f"{base['tokens_per_s']:.0f}" if target else "",
                f"{ours['tokens_per_s'] / base['tokens_per_s']:.2f}x", target)

    rows = [
        tokens(f"real tokens/s (tiny, epochs 2+), ours (plan's choice: {mode['tiny']})", o, b, ">= 3.5x"),
        tokens("  ours with full sharding (the trainer's default)", f, b),
        tokens("  ours with full sharding, every block kept gathered", k, b),
        tokens(f"real tokens/s (small, epochs 2+), ours (plan's choice: {mode['small']})", so, sb, "> full's"),
        tokens("  ours with full sharding (the trainer's default)", sf, sb),
        ("fwd+bwd of one step, 1 process, s (bound)", f"{c['ours']:.3f}", f"{c['tutorial']:.3f}",
         f"{c['tutorial'] / c['ours']:.2f}x", ""),
        ("epoch time s (tiny, epochs 2+)", f"{o['epoch_time_s']:.1f}", f"{b['epoch_time_s']:.1f}",
         f"{o['epoch_time_s'] / b['epoch_time_s']:.2f}x", ""),
        # The 118M runs take different rows (packing needs more for a step); a step holds the
        # tutorial's 8 examples in both, so seconds per step compare like for like.
        (f"s per step of 8 examples (118M, epochs 2+; plan's choice: {mode['100m']})", f"{om['step_s']:.1f}",
         f"{bm['step_s']:.1f}", f"{bm['step_s'] / om['step_s']:.2f}x faster", ""),
        ("distinct batch shapes", str(o["shapes"]), str(b["shapes"]), "", "1"),
        ("held-out loss per epoch (tiny, response tokens)", str(o["heldout"]), str(b["heldout"]),
         "", "ours <= tutorial"),
        ("  ours with full sharding", str(f["heldout"]), "", "", ""),
        ("  ours with --loss-on all", str(a["heldout"]), "", "", ""),
        ("  ours with --loss-on all, constant lr", str(t["heldout"]), "", "", ""),
        ("held-out loss per epoch (small)", str(so["heldout"]), str(sb["heldout"]), "", ""),
        ("  ours with full sharding", str(sf["heldout"]), "", "", ""),
        ("training loss per epoch (tiny; see below)", str(o["loss"]), str(b["loss"]), "", ""),
        ("training blocked by a checkpoint s (118M, median)", f"{om['ckpt_s']:.2f}", f"{bm['ckpt_s']:.2f}",
         f"{om['ckpt_s'] / bm['ckpt_s']:.2f}x", "<= 1x"),
        ("rank-0 RSS increase during ckpt MiB", f"{om['ckpt_increase_mib']:.0f}", f"{bm['ckpt_increase_mib']:.0f}",
         f"{om['ckpt_increase_mib'] / max(bm['ckpt_increase_mib'], 1e-9):.2f}x", "<= 0.6x"),
        ("rank-0 peak RSS during ckpt MiB", f"{om['ckpt_peak_mib']:.0f}", f"{bm['ckpt_peak_mib']:.0f}",
         f"{om['ckpt_peak_mib'] / bm['ckpt_peak_mib']:.2f}x", ""),
    ]
    print(f"\nCPU, 2 workers (gloo), batch 4/worker, max length 512, {args.rows} examples x {args.epochs} epochs "
          f"(text model: tiny {results['parameters-tiny'] / 1e6:.2f}M parameters, small "
          f"{results['parameters-small'] / 1e6:.2f}M); checkpoints: 118M-parameter Gemma 4, {args.ckpt_epochs} epochs")
    header = ("metric", "finetune", "tutorial loop", "ratio", "target")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    stale = [key for key, plan in ((f"ours-{size}", plan) for size, plan in plans.items())
             if key in results and results[key].get("trainer_flags") != list(plan.flags)]
    if stale:
        print(f"\nNote: {', '.join(stale)} ran with trainer flags other than the plan's now: --redo them.")
    print(f"\nBound: a step holds the same 8 examples in both loops; one process computing one step's forward and "
          f"backward per worker (ours: 1 packed block of 512; the tutorial's: 4 rows of 512), with no collectives "
          f"and no optimizer, takes {c['tutorial'] / c['ours']:.2f}x less time for ours: the most its useful "
          f"tokens/s can be above the tutorial loop's at these steps. Training losses average different tokens "
          f"(ours: the responses; the tutorial's loop: every token, prompt included); the held-out rows score both "
          f"on the same {args.heldout_rows} unseen rows' response tokens.")


if __name__ == "__main__":
    main()
