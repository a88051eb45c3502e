"""Benchmark: time to quality, `tpufinetune-train finetune` against the tutorial's loop, on CPU.

    .venv/bin/python benchmarks/bench_time_to_quality.py [--rows 512] [--epochs 3] [--bases pretrained,scratch]
                                                         [--work DIR] [--plot FILE.png]

Not a test. Both loops run under Ray Train on a private local Ray head (2 workers, gloo,
fp32 compute: this machine kind emulates bf16 about 20x slower, which would decide the
figure instead of the loops; on a TPU both run in bf16), on the same training examples
for the same epochs, each with its own defaults, from two bases: a tiny Gemma 4
pretrained here on other tasks over the same words (`pretrained`), and the same model
with random weights (`scratch`).

- the tutorial's loop, re-implemented: every example padded to 512 tokens in the
  tutorial's `Instruction: ...\\nResponse: ...` format (plus dolly's context), labels on
  every token (DataCollatorForLanguageModeling), batch 4 per device, constant learning
  rate, FSDP2 on each layer's MLP, a full state dict on rank 0 every epoch;
- ours: `finetune.run` with its defaults (chat template, the tutorial's 4 examples per
  device per step packed into the run's fixed blocks, warmup + the peak held + a cosine
  decay over the last 20% of steps, clipping, token-weighted loss, sharded checkpoints),
  and the flags the operator's memory plan passes for the model (plan_flags.py: its
  sharding, on a TPU slice shape of 2 devices; the output prints the decision); beside
  it, ours with the trainer's own default, full sharding.

The peak learning rate is the one thing set for both: the defaults (2e-5) suit a
pretrained 2B model, not this tiny one, so both get --lr (1e-3).

The data is made here: dolly-format rows whose responses are a learnable function of
the instruction and context (filter the even numbers, classify fruit and vegetables,
count items, ...), and a held-out split of fresh rows from the same functions. Both are
scored on the same held-out response tokens: each row is rendered in the loop's own
prompt format, and the loss is taken over the response tokens the two formats share
(all but the first word's, whose leading space differs), so the numbers are directly
comparable. Scoring pauses the clock.

Goals, on both bases: after the same epochs ours' final held-out loss is no worse than the
tutorial loop's, in <= 1/3 of its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# This checkout's trainer, here and in every Ray worker (the head and the runs inherit it),
# before any installed copy.
SOURCES = [str(REPO / "trainer"), str(REPO / "tests")]
sys.path[:0] = SOURCES
os.environ["PYTHONPATH"] = os.pathsep.join(SOURCES + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p and p not in SOURCES])

# The peak learning rate both loops get (the defaults' 2e-5 suits a pretrained 2B model).
PEAK_LR = 1e-3

# ----------------------------------------------------------------------------- data

FRUITS = ["apple", "banana", "cherry", "mango", "pear", "plum", "grape", "peach", "orange", "lemon"]
VEGETABLES = ["carrot", "potato", "onion", "spinach", "cabbage", "pea", "leek", "radish", "celery", "beet"]
COLORS = ["red", "blue", "green", "yellow", "purple", "black", "white", "pink", "brown", "gray", "gold", "silver"]
ANIMALS = {"dog": 4, "cat": 4, "horse": 4, "chicken": 2, "spider": 8, "ant": 6, "duck": 2, "cow": 4,
           "crab": 10, "owl": 2, "goat": 4, "bee": 6}
SYLLABLES = ["ka", "lo", "ri", "ven", "tar", "mo", "sel", "dun", "bri", "va", "nor", "el", "sha", "zen"]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


# Fine-tuning tasks (a learnable function of the instruction: parity, a fixed mapping,
# counting, a fixed list) and pretraining tasks (copying from the context), so the base
# learns the words and to copy, but not the fine-tuning tasks or either prompt format.
FINETUNE_KINDS = (0, 1, 3, 4, 6)
PRETRAIN_KINDS = (2, 5, 7)


def _row(rng: random.Random, kinds: tuple[int, ...] = FINETUNE_KINDS) -> dict:
    kind = rng.choice(kinds)
    context = ""
    if kind == 0:
        numbers = rng.sample(range(1, 100), rng.randint(4, 30))
        instruction = f"Which of these numbers are even: {', '.join(map(str, numbers))}?"
        response = ", ".join(str(n) for n in numbers if n % 2 == 0) or "None of them."
    elif kind == 1:
        items = rng.sample(FRUITS + VEGETABLES, rng.randint(3, 14))
        instruction = f"Classify each of the following as a fruit or a vegetable: {', '.join(items)}"
        response = "\n".join(f"{i}: {'fruit' if i in FRUITS else 'vegetable'}" for i in items)
    elif kind == 2:
        words = rng.sample(COLORS, rng.randint(3, 7))
        instruction = f"Write these colors in reverse order: {', '.join(words)}."
        response = ", ".join(reversed(words)) + "."
    elif kind == 3:
        animal = rng.choice(sorted(ANIMALS))
        instruction = f"How many legs does a {animal} have?"
        response = f"A {animal} has {ANIMALS[animal]} legs."
    elif kind == 4:
        items = rng.sample(COLORS + FRUITS, rng.randint(2, 9))
        instruction = f"How many items are in this list: {', '.join(items)}?"
        response = f"There are {len(items)} items."
    elif kind == 5:
        country, capital, river = _name(rng) + "ia", _name(rng), _name(rng)
        others = [f"{_name(rng)}ia has {_name(rng)} as its capital." for _ in range(rng.randint(4, 30))]
        facts = [f"{country} has {capital} as its capital.", f"The {river} river flows through {country}."]
        sentences = others + facts
        rng.shuffle(sentences)
        context = " ".join(sentences)
        instruction = f"Based on the text, what is the capital of {country}?"
        response = f"The capital of {country} is {capital}."
    elif kind == 6:
        k = rng.randint(2, 10)
        instruction = f"Give me a list of {k} colors."
        response = "\n".join(f"- {c}" for c in COLORS[:k])
    else:
        words = [_name(rng).lower() for _ in range(rng.randint(20, 120))]
        context = " ".join(words)
        instruction = "Repeat the text exactly."
        response = context
    if not context and rng.random() < 0.5:
        # Dolly's contexts: here background text the answer does not need.
        context = " ".join(f"{_name(rng)}ia has {_name(rng)} as its capital." for _ in range(rng.randint(3, 14)))
    return {"instruction": instruction, "context": context, "response": response}


def make_rows(n: int, seed: int, kinds: tuple[int, ...] = FINETUNE_KINDS) -> list[dict]:
    rng = random.Random(seed)
    return [_row(rng, kinds) for _ in range(n)]


def pretrain(model, tokenizer, texts: list[str], steps: int, length: int = 256, batch: int = 8) -> float:
    """Plain causal-LM pretraining on untemplated text, so both loops fine-tune a base
    that knows the data's words but neither prompt format nor the tasks (as a real
    fine-tune starts from a pretrained model, not from random weights)."""
    import torch

    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = torch.tensor(stream[:len(stream) // length * length]).view(-1, length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids = blocks[torch.randint(len(blocks), (batch,), generator=generator)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


def build_assets(work: Path, rows: int, heldout: int, pretrain_steps: int) -> dict:
    """Train and held-out JSONL, and a tiny Gemma 4 with a BPE tokenizer (with a chat
    template) fitted to this data, pretrained on other rows as plain text (with
    `pretrain_steps` 0: random weights, the from-scratch base)."""
    from tpufinetune_trainer.assets import build_model, build_tokenizer

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, held, corpus = make_rows(rows, 1), make_rows(heldout, 2), make_rows(4 * rows, 3, PRETRAIN_KINDS)
    for name, part in (("train", train), ("heldout", held)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    texts = [" ".join(r.values()) for r in train + corpus] + ["Instruction: Context: Response: user model"] * 50
    tokenizer = build_tokenizer(texts, 2048)
    model = build_model("tiny", len(tokenizer), seed=0)
    if pretrain_steps:
        started = time.perf_counter()
        loss = pretrain(model, tokenizer,
                        [" ".join(v for v in r.values() if v) for r in corpus], pretrain_steps)
        print(f"  pretrained the base on {len(corpus)} plain-text rows: {pretrain_steps} steps, "
              f"loss {loss:.3f}, {time.perf_counter() - started:.0f}s", flush=True)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return {"model": str(work / "model"), "train": str(data / "train.jsonl"), "heldout": str(data / "heldout.jsonl")}


def cached_assets(where: Path, base: str, rows: int, heldout: int, pretrain_steps: int) -> dict:
    """build_assets for `base` under `where`, once: a later run with the same work dir (this
    script's or benchmarks/bench_lora.py's) reuses them."""
    assets_file = where / "assets.json"
    if not assets_file.exists():
        steps = pretrain_steps if base == "pretrained" else 0
        assets_file.write_text(json.dumps(build_assets(where, rows, heldout, steps)))
    return json.loads(assets_file.read_text())


# ----------------------------------------------------------------------------- scoring (in workers)


def scoring_batches(model_dir: str, heldout: str, prompt_format: str, rank: int, world: int, batch: int = 16):
    """This rank's share of the held-out rows as padded batches: (ids, labels, mask)."""
    import torch
    from transformers import AutoTokenizer

    from tpufinetune_trainer.data import format_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in Path(heldout).read_text().splitlines()]
    examples = []
    for r in rows:
        tutorial_response = tok(" " + r["response"], add_special_tokens=False)["input_ids"]
        chat_response = tok(r["response"], add_special_tokens=False)["input_ids"]
        shared = 0
        while (shared < min(len(tutorial_response), len(chat_response))
               and tutorial_response[-1 - shared] == chat_response[-1 - shared]):
            shared += 1
        if prompt_format == "tutorial":
            prompt = [tok.bos_token_id] + tok(format_prompt(r["instruction"], r["context"]),
                                              add_special_tokens=False)["input_ids"]
            response = tutorial_response
        else:
            user = f"{r['instruction']}\n\n{r['context']}" if r["context"] else r["instruction"]
            prompt = tok(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            response = chat_response
        ids = prompt + response
        labels = [-100] * (len(ids) - shared) + ids[len(ids) - shared:]
        examples.append((ids, labels))
    mine = examples[rank::world]
    out = []
    for start in range(0, len(mine), batch):
        part = mine[start:start + batch]
        length = max(len(ids) for ids, _ in part)
        ids = torch.full((len(part), length), tok.pad_token_id)
        labels = torch.full((len(part), length), -100)
        mask = torch.zeros((len(part), length), dtype=torch.long)
        for i, (x, y) in enumerate(part):
            ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        out.append((ids, labels, mask))
    return out


def heldout_loss(model, batches) -> float:
    """Mean cross-entropy over every rank's scored tokens (collective: all ranks call it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for ids, labels, mask in batches:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
            target = labels[:, 1:]
            total[0] += F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                                        reduction="sum").double()
            total[1] += (target != -100).sum()
    dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


class Clock:
    """Training wall time since the first step, with scoring pauses taken out."""

    def __init__(self):
        self.start = None
        self.paused = 0.0

    def begin(self):
        if self.start is None:
            self.start = time.perf_counter()

    def seconds(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start - self.paused


def record(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def score_point(out, clock, model, batches, rank, **fields) -> None:
    seconds = clock.seconds()
    paused_at = time.perf_counter()
    loss = heldout_loss(model, batches)
    clock.paused += time.perf_counter() - paused_at
    if rank == 0:
        record(out, {"kind": "point", "seconds": seconds, "heldout": loss, **fields})


# ----------------------------------------------------------------------------- the two loops


def make_ours_train_func(out: str, heldout: str, score_every: int):
    """The product's own train_func; every `score_every` steps the clock pauses for scoring."""

    def train_func(config):
        from tpufinetune_trainer import train as product

        clock, state = Clock(), {"steps": 0, "real": 0, "labels": 0, "shapes": set()}
        train_step = product.Trainer.train_step

        def scored_step(self, loss_sum):
            if "batches" not in state:
                state["batches"] = scoring_batches(self.cfg.model_id, heldout, config["prompt_format"],
                                                   self.rank, self.world)
                score_point(out, clock, self.model, state["batches"], self.rank, step=0, real_tokens=0,
                            label_tokens=0)
            clock.begin()
            train_step(self, loss_sum)
            state["steps"] += 1
            state["real"] += int(self.epoch_plan.real_tokens[self.epoch_step])  # train_epoch counts it after
            state["labels"] += int(self.epoch_plan.label_tokens[self.epoch_step])
            state["shapes"].add((self.plan.blocks, self.cfg.max_seq_len))
            last = self.global_step + 1 == self.total_steps
            if state["steps"] % score_every == 0 or last:
                score_point(out, clock, self.model, state["batches"], self.rank, step=state["steps"],
                            real_tokens=state["real"], label_tokens=state["labels"],
                            shapes=sorted(state["shapes"]))

        product.Trainer.train_step = scored_step
        product.train_func(config)

    return train_func


def make_baseline_train_func(out: str, heldout: str, score_every: int):
    """The tutorial's loop, re-implemented (CPU: fp32, gloo)."""

    def train_func(config):
        import tempfile as tf

        import ray.train
        import ray.train.torch
        import torch
        from datasets import load_dataset
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.utils.data import DataLoader
        from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

        from tpufinetune_trainer.data import format_prompt

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        length, batch_size = 512, 4
        tokenizer = AutoTokenizer.from_pretrained(config["model"])
        rows = load_dataset("json", data_files=config["data"], split="train")
        tokenized = rows.map(lambda x: tokenizer(format_prompt(x["instruction"], x["context"]) + " " + x["response"],
                                                 truncation=True, max_length=length, padding="max_length"),
                             remove_columns=rows.column_names)
        loader = DataLoader(tokenized, batch_size=batch_size, shuffle=True, drop_last=True,
                            collate_fn=DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False))
        loader = ray.train.torch.prepare_data_loader(loader)
        torch.manual_seed(42)
        model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32, attn_implementation="sdpa",
                                                     vision_config=None, audio_config=None)
        model.config.get_text_config().use_cache = False
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        text = model.model.language_model
        text.embed_tokens_per_layer.requires_grad_(False)
        for layer in text.layers:
            fully_shard(layer.mlp, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=set(text.embed_tokens_per_layer.parameters()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
        batches = scoring_batches(config["model"], heldout, "tutorial", rank, world)
        clock, steps, real, labels, shapes = Clock(), 0, 0, 0, set()
        score_point(out, clock, model, batches, rank, step=0, real_tokens=0, label_tokens=0)
        total = config["epochs"] * len(loader)
        for epoch in range(config["epochs"]):
            loader.sampler.set_epoch(epoch)
            model.train()
            clock.begin()
            for batch in loader:
                shapes.add(tuple(batch["input_ids"].shape))
                optimizer.zero_grad()
                out_ = model(input_ids=batch["input_ids"], labels=batch["labels"])
                out_.loss.backward()
                optimizer.step()
                steps += 1
                real += int(batch["attention_mask"].sum()) * world  # ranks hold equal-size batches
                labels += int((batch["labels"][:, 1:] != -100).sum()) * world
                if steps % score_every == 0 or steps == total:
                    score_point(out, clock, model, batches, rank, step=steps, real_tokens=real,
                                label_tokens=labels, shapes=sorted(list(s) for s in shapes))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                        ignore_frozen_params=True))
            metrics = {"epoch": epoch + 1}
            if rank == 0:
                with tf.TemporaryDirectory() as tmp:
                    torch.save(full, os.path.join(tmp, "model.pt"))
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            else:
                ray.train.report(metrics)
            del full

    return train_func


# ----------------------------------------------------------------------------- one run (a subprocess)

# Ours as run: (whether it takes the memory plan's choices, its own settings). `ours` is the
# product's defaults: the trainer's, with the flags the operator's memory plan passes for the
# model (plan_flags.py: its sharding, activation checkpointing, blocks kept gathered). Beside
# it: full sharding, the trainer's own default; the loss on every token as the tutorial's
# loop has it (--loss-on all; its final held-out loss only, in the same-epochs table), and
# MaxText's way: a step of a fixed number of tokens, one full block of 512 per device
# (--tokens-per-step 1024 on 2 workers; its final loss, time and time to the tutorial's final).
TOKENS_PER_STEP = 1024
WORKERS, BATCH_PER_DEVICE, MAX_SEQ_LEN = 2, 4, 512  # the trainer's batch and length defaults
OURS = {"ours": (True, {}), "ours-full-sharding": (False, {}), "ours-loss-on-all": (True, {"loss_on": "all"}),
        "ours-tokens-per-step": (True, {"tokens_per_step": TOKENS_PER_STEP, "batch_size_per_device": 1})}


def run_one(args) -> None:
    out = str(args.out)
    if args.one in OURS:
        from tpufinetune_trainer import finetune
        from tpufinetune_trainer import train as product
        from tpufinetune_trainer.config import FinetuneConfig

        from plan_flags import trainer_settings

        product.train_func = make_ours_train_func(out, args.heldout_file, args.score_every)  # picked up by name
        takes_plan, own = OURS[args.one]
        settings = {**(trainer_settings(json.loads(args.trainer_flags)) if takes_plan else {}), **own}
        # Defaults (the plan's choices among them), except: the shared peak lr, the same
        # examples (no split of our own), CPU, 2 workers.
        cfg = FinetuneConfig(model_id=args.model, dataset=args.data, dataset_split="train", num_workers=WORKERS,
                             num_epochs=args.epochs, learning_rate=args.lr, eval_fraction=0.0, device="cpu",
                             storage_path=args.storage, run_name=f"ours-{int(time.time())}", **settings)
        finetune.run(cfg)
        return
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"])
    TorchTrainer(
        train_loop_per_worker=make_baseline_train_func(out, args.heldout_file, args.score_every),
        train_loop_config={"model": args.model, "data": args.data, "epochs": args.epochs, "lr": args.lr},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"baseline-{int(time.time())}", storage_path=args.storage),
    ).fit()


def measure(kind: str, assets: dict, args, work: Path, env: dict, score_every: int,
            trainer_flags: tuple = ()) -> list:
    """One run in a subprocess; `trainer_flags`: the plan's (plan_flags.py), for a kind that takes them."""
    out = work / f"{kind}-{int(time.time())}.jsonl"
    cmd = [sys.executable, __file__, "--one", kind, "--model", assets["model"], "--data", assets["train"],
           "--heldout-file", assets["heldout"], "--epochs", str(args.epochs), "--lr", str(args.lr), "--out", str(out),
           "--storage", str(work / "storage"), "--score-every", str(score_every),
           "--trainer-flags", json.dumps(list(trainer_flags))]
    log = out.with_suffix(".log")
    started = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed (log: {log}):\n{log.read_text()[-3000:]}")
    print(f"  {kind:8s}: {time.time() - started:.0f}s (log: {log.name})", flush=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


# ----------------------------------------------------------------------------- report


def time_to_reach(points: list[dict], target: float) -> float | None:
    """First training second at which the held-out loss is <= target (linear between
    scored points)."""
    for a, b in zip(points, points[1:]):
        if b["heldout"] <= target:
            if a["heldout"] <= target:
                return a["seconds"]
            share = (a["heldout"] - target) / (a["heldout"] - b["heldout"])
            return a["seconds"] + share * (b["seconds"] - a["seconds"])
    return None


def summarize(results: dict) -> list[tuple]:
    ours, base = results["ours"], results["baseline"]
    target, base_time = base[-1]["heldout"], base[-1]["seconds"]
    reach = time_to_reach(ours, target)
    ours_end, ours_final = ours[-1]["seconds"], ours[-1]["heldout"]
    base_reach = time_to_reach(base, ours_final)
    base_then = next((p["heldout"] for p in base if p["seconds"] >= ours_end), base[-1]["heldout"])

    def rate(points, key):
        return points[-1][key] / points[-1]["seconds"]

    def shapes(points):
        return len({tuple(s) for p in points for s in p.get("shapes", [])})

    rows = [
        ("held-out loss, start -> end", f"{ours[0]['heldout']:.3f} -> {ours[-1]['heldout']:.3f}",
         f"{base[0]['heldout']:.3f} -> {base[-1]['heldout']:.3f}", "", ""),
        ("training wall time s (all epochs)", f"{ours[-1]['seconds']:.1f}", f"{base_time:.1f}",
         f"{ours[-1]['seconds'] / base_time:.2f}x", ""),
        (f"time to the tutorial's final held-out loss ({target:.3f}) s",
         "not reached" if reach is None else f"{reach:.1f}", f"{base_time:.1f}",
         "" if reach is None else f"{reach / base_time:.2f}x", "<= 0.33x"),
        (f"time to ours' final held-out loss ({ours_final:.3f}) s", f"{ours_end:.1f}",
         "not reached" if base_reach is None else f"{base_reach:.1f}",
         "" if base_reach is None else f"{ours_end / base_reach:.2f}x", ""),
        (f"held-out loss after {ours_end:.0f} s (first scored point at or past it)", f"{ours_final:.3f}",
         f"{base_then:.3f}", "", ""),
        ("useful (non-padding) tokens/s", f"{rate(ours, 'real_tokens'):.0f}", f"{rate(base, 'real_tokens'):.0f}",
         f"{rate(ours, 'real_tokens') / rate(base, 'real_tokens'):.2f}x", ">= 3x"),
        ("tokens with a loss /s (ours: responses; tutorial: every real token)", f"{rate(ours, 'label_tokens'):.0f}",
         f"{rate(base, 'label_tokens'):.0f}", f"{rate(ours, 'label_tokens') / rate(base, 'label_tokens'):.2f}x", ""),
        ("optimizer steps", str(ours[-1]["step"]), str(base[-1]["step"]), "", ""),
        *([("ours with full sharding (the trainer's default): final held-out loss, s",
            f"{full[-1]['heldout']:.3f}, {full[-1]['seconds']:.1f}", f"{base[-1]['heldout']:.3f}, {base_time:.1f}",
            f"{full[-1]['seconds'] / base_time:.2f}x", "")] if (full := results.get("ours-full-sharding")) else []),
        ("distinct batch shapes", str(shapes(ours)), str(shapes(base)), "", "1"),
    ]
    return rows


def print_table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def print_curves(results: dict) -> None:
    print("\nHeld-out loss against training seconds (scoring paused the clock):")
    for kind in ("ours", "baseline"):
        points = results[kind]
        print(f"  {kind}: " + ", ".join(f"{p['seconds']:.0f}s {p['heldout']:.3f}" for p in points))


BASES = ("pretrained", "scratch")


def plot(by_base: dict, path: Path, rows: int, epochs: int) -> bool:
    """Both loops' held-out loss against training seconds, one panel per base, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(by_base), figsize=(6 * len(by_base), 4.2), dpi=110, squeeze=False)
    for ax, (base, results) in zip(axes[0], by_base.items()):
        for kind, label in (("ours", "tpufinetune-train finetune (defaults)"), ("baseline", "tutorial loop")):
            points = results[kind]
            ax.plot([p["seconds"] for p in points], [p["heldout"] for p in points], marker="o", markersize=3,
                    label=label)
        ax.axhline(results["baseline"][-1]["heldout"], color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("training wall time, s (CPU, 2 workers, fp32)")
        ax.set_ylabel("held-out loss on shared response tokens")
        ax.set_title(f"{base} base: {rows} examples, {epochs} epochs")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: a rerun differs only in data
    return True


def overview(by_base: dict) -> list[tuple]:
    """One line per base: same epochs, final held-out loss and wall time of both loops."""
    rows = []
    for base, results in by_base.items():
        ours, tutorial = results["ours"], results["baseline"]
        reach = time_to_reach(ours, tutorial[-1]["heldout"])
        full = results.get("ours-full-sharding")
        full_words = (f"{full[-1]['heldout']:.3f} in {full[-1]['seconds']:.1f} s "
                      f"({full[-1]['seconds'] / tutorial[-1]['seconds']:.2f}x)" if full else "not run")
        rows.append((base, f"{ours[-1]['heldout']:.3f}", f"{tutorial[-1]['heldout']:.3f}",
                     "yes" if ours[-1]["heldout"] <= tutorial[-1]["heldout"] else "no",
                     f"{ours[-1]['seconds']:.1f}", f"{tutorial[-1]['seconds']:.1f}",
                     f"{ours[-1]['seconds'] / tutorial[-1]['seconds']:.2f}x",
                     "not reached" if reach is None else f"{reach:.1f} ({reach / tutorial[-1]['seconds']:.2f}x)",
                     f"{ours[-1]['step']} / {tutorial[-1]['step']}",
                     full_words, f"{results['ours-loss-on-all'][-1]['heldout']:.3f}",
                     tokens_words(results, tutorial)))
    return rows


def tokens_words(results: dict, tutorial: list[dict]) -> str:
    """--tokens-per-step's run: final held-out loss, seconds and steps, and when it reached
    the tutorial loop's final loss."""
    run = results.get("ours-tokens-per-step")
    if not run:
        return "not run"
    reach = time_to_reach(run, tutorial[-1]["heldout"])
    return (f"{run[-1]['heldout']:.3f} in {run[-1]['seconds']:.1f} s ({run[-1]['seconds'] / tutorial[-1]['seconds']:.2f}x), "
            f"{run[-1]['step']} steps; tutorial's final at "
            + ("not reached" if reach is None else f"{reach:.1f} s ({reach / tutorial[-1]['seconds']:.2f}x)"))


def planned(model: str, batch_per_device: int):
    """The memory plan's choices for a run of `model` as this script runs it (plan_flags.py)."""
    from plan_flags import plan

    return plan(json.loads((Path(model) / "config.json").read_text()), model, WORKERS, batch_per_device, MAX_SEQ_LEN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="work dir (default: a temp dir)")
    parser.add_argument("--rows", type=int, default=512, help="training examples")
    parser.add_argument("--heldout", type=int, default=128, help="held-out examples")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=PEAK_LR, help="peak learning rate of both loops")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="plain-text pretraining of the pretrained base")
    parser.add_argument("--bases", default=",".join(BASES),
                        help="pretrained (pretrained here first), scratch (random weights), or both")
    parser.add_argument("--redo", action="append", default=[],
                        help="ours, ours-loss-on-all, ours-tokens-per-step, baseline or all (else cached)")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves as a PNG here (needs matplotlib)")
    parser.add_argument("--one", choices=[*OURS, "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--score-every", type=int, default=8, help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--heldout-file", "--out", "--storage", "--trainer-flags"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args)
        return

    from harness.rayhead import RayHead

    work = args.work or Path(tempfile.mkdtemp(prefix="tpuft-ttq-"))
    print(f"work dir: {work}", flush=True)
    bases = [b for b in args.bases.split(",") if b]
    unknown = set(bases) - set(BASES)
    if unknown:
        raise SystemExit(f"--bases: unknown {sorted(unknown)}; choose from {', '.join(BASES)}")
    # Both loops take the same optimizer steps (the tutorial's 8 examples a step): ~8
    # scored points per epoch each.
    every = max(1, args.rows // 64)
    by_base, plans = {}, {}
    head = None
    try:
        for base in bases:
            where = work / base
            assets = cached_assets(where, base, args.rows, args.heldout, args.pretrain_steps)
            plans[base] = {kind: planned(assets["model"], own.get("batch_size_per_device", BATCH_PER_DEVICE))
                           for kind, (takes_plan, own) in OURS.items() if takes_plan}
            print(f"  {base}: {plans[base]['ours'].words()}", flush=True)
            cache = where / "results.json"
            results = json.loads(cache.read_text()) if cache.exists() else {}
            todo = [k for k in (*OURS, "baseline") if k not in results or k in args.redo or "all" in args.redo]
            if todo and head is None:
                head = RayHead.start(num_cpus=4)
            for kind in todo:
                env = dict(head.env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
                flags = plans[base][kind].flags if kind in plans[base] else ()
                rows = measure(kind, assets, args, where, env, every, flags)
                results[kind] = [r for r in rows if r["kind"] == "point"]
                results.setdefault("trainer_flags", {})[kind] = list(flags)
                cache.write_text(json.dumps(results, indent=1))
            by_base[base] = results
    finally:
        if head is not None:
            head.stop()
    for base, results in by_base.items():
        print(f"\n{base} base -- CPU, 2 workers (gloo), fp32 compute, {args.rows} training examples x "
              f"{args.epochs} epochs, {args.heldout} held-out examples, peak lr {args.lr:g} for both")
        mode = plans[base]["ours"].choices.sharding
        if results.get("trainer_flags", {}).get("ours") != list(plans[base]["ours"].flags):
            print("  Note: ours ran with trainer flags other than the plan's now: --redo ours")
        print_table(("metric", f"ours (plan's choice: {mode})", "tutorial loop", "ratio", "target"),
                    summarize(results))
        print_curves(results)
    print(f"\nSame epochs ({args.epochs}), both bases; ours: the plan's choice ("
          + ", ".join(f"{base} {plans[base]['ours'].choices.sharding}" for base in by_base) + "):")
    print_table(("base", "ours final", "tutorial final", "ours <= tutorial", "ours s", "tutorial s", "time ratio",
                 "ours to the tutorial's final, s", "steps ours / tutorial", "ours with full sharding",
                 "ours --loss-on all final",
                 f"ours --tokens-per-step {TOKENS_PER_STEP}"),
                overview(by_base))
    if args.plot:
        print(f"\nplot: {args.plot}" if plot(by_base, args.plot, args.rows, args.epochs)
              else "\nplot skipped: matplotlib is not installed")


if __name__ == "__main__":
    main()
