"""Training data at scale: what a worker receives and holds, lists of Python ints against
the trainer's flat int32 rows (`data.Ragged`), at a million synthetic examples.

Each row of the table runs in a fresh process. The driver side builds the examples (token
ids drawn at random from a 262144 vocabulary, as Gemma 4's; 20 to 400 tokens, a prompt then
a labelled response) and pickles them as Ray does (protocol 5, buffers out of band); the
worker side is what a Ray worker does with that object: unpickle it (for lists, every
Python int rebuilt in each worker; for Ragged rows, the buffers taken as they are, which
the object store maps once per host) and plan one epoch (`data.plan_epoch`). RSS is the
process's resident size, read from /proc after each stage (Linux).

    .venv/bin/python benchmarks/bench_data.py                  # 1,000,000 examples
    .venv/bin/python benchmarks/bench_data.py --examples 100000
"""
from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import time

import numpy as np

VOCAB = 262144
MAX_SEQ_LEN = 512


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def synthetic(count: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    from tpufinetune_trainer.data import IGNORE_INDEX

    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 401, count)
    prompts = (lengths * rng.uniform(0.2, 0.6, count)).astype(np.int64)
    tokens = rng.integers(3, VOCAB, int(lengths.sum()))
    ids, labels, at = [], [], 0
    for length, prompt in zip(lengths.tolist(), prompts.tolist()):
        row = tokens[at:at + length].tolist()
        at += length
        ids.append(row)
        labels.append([IGNORE_INDEX] * prompt + row[prompt:])
    return ids, labels


def measure(kind: str, count: int) -> dict:
    from tpufinetune_trainer.data import BatchPlan, Examples, Ragged, blocks_per_device, plan_epoch

    ids, labels = synthetic(count)
    start = time.perf_counter()
    if kind == "ragged":
        payload = Examples(Ragged.of(ids), Ragged.of(labels))
    else:
        payload = (ids, labels)
    convert_s = time.perf_counter() - start
    buffers: list = []
    inline = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    shipped = len(inline) + sum(b.raw().nbytes for b in buffers)
    del ids, labels, payload
    frames = [bytes(b.raw()) for b in buffers]  # as the object store hands them over
    base = rss_mib()
    start = time.perf_counter()
    received = pickle.loads(inline, buffers=frames)
    unpickle_s = time.perf_counter() - start
    held = rss_mib() - base + (sum(len(f) for f in frames) / 2**20 if kind == "ragged" else 0.0)
    examples = received if kind == "ragged" else Examples(*received)
    start = time.perf_counter()
    plan = BatchPlan(world=16, per_device=8, accum=1)  # a v6e-16 at the tutorial's batch
    plan = BatchPlan(16, 8, 1, blocks_per_device(examples.lengths, plan, 1, 0, MAX_SEQ_LEN))
    plan_epoch(examples.lengths, examples.label_tokens, plan, epoch=1, seed=0, max_seq_len=MAX_SEQ_LEN)
    plan_s = time.perf_counter() - start
    return {"kind": kind, "examples": count, "tokens": int(examples.lengths.sum()),
            "driver_convert_s": round(convert_s, 2), "shipped_mib": round(shipped / 2**20, 1),
            "worker_unpickle_s": round(unpickle_s, 2), "worker_held_mib": round(held, 1),
            "plan_epoch_s": round(plan_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--one", choices=("lists", "ragged"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.examples)))
        return
    rows = []
    for kind in ("lists", "ragged"):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--examples", str(args.examples)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))


if __name__ == "__main__":
    main()
