"""Training data at scale: what a worker receives and holds, lists of Python ints against
the trainer's flat int32 rows (`data.Ragged`), at a million synthetic examples.

Each row of the table runs in a fresh process. The driver side builds the examples (token
ids drawn at random from a 262144 vocabulary, as Gemma 4's; 20 to 400 tokens, a prompt then
a labelled response) and pickles them as Ray does (protocol 5, buffers out of band); the
worker side is what a Ray worker does with that object: unpickle it (for lists, every
Python int rebuilt in each worker; for Ragged rows, the buffers taken as they are, which
the object store maps once per host) and plan what the trainer plans before its first
step, from the examples' lengths and label counts (`Examples.label_tokens`, timed on its
own): the run's static maxima over `--epochs` epochs (blocks per device, the loss head's
label cap: `data.plan_run`) and the first epoch (`data.plan_epoch`), on a v6e-16 at the
tutorial's batch (16 devices x 8 examples). That is timed, then run again under
tracemalloc for the planner's memory: its peak, and what it still holds after (the plans
the trainer keeps). RSS is the process's resident size, read from /proc after each stage
(Linux).

A trainer from before `data.plan_run` (commit e61390f and earlier) is measured as it
planned: every epoch up front, then the cap over all of their plans. To measure one, put
its package first on the path:

    .venv/bin/python benchmarks/bench_data.py                  # 1,000,000 examples
    .venv/bin/python benchmarks/bench_data.py --examples 100000
    mkdir -p /tmp/old && git archive e61390f trainer | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/trainer .venv/bin/python benchmarks/bench_data.py

`--stream`: a dataset larger than the memory its processes may use. A synthetic dolly JSONL
(the offline assets' rows, each made distinct; `--stream-mib` of text) and the offline
assets' tokenizer; each row of the table is one process in its own cgroup (v1 memory
controller, `memory.limit_in_bytes` = `--limit-mib`; page cache counts toward it, as in a
pod), with a fresh `datasets` cache. The driver row runs `data.prepare` as `finetune` does
(`load_dataset`'s JSON-to-Arrow conversion included): in memory (before), or streamed
into files (`data_stream`, after). The worker row is what a Ray worker does with the
examples the streamed driver wrote: map them (`data_stream.reopen` of the pickled
description), count their labels, plan the run (`data.plan_run`, 1 epoch, a v6e-16 at the
tutorial's batch) and the first epoch, and pack this rank's blocks of its first 64 steps.
Peak anon is the process's largest anonymous RSS (sampled every 20 ms: its own memory,
torch's import about 320 MiB of it), peak RSS its VmHWM (file pages it maps count while
resident, the shared libraries' too, though their pages are charged to whoever read them
first); the cgroup's peak is `memory.max_usage_in_bytes` (page cache it caused included). Needs root and cgroup v1:

    .venv/bin/python benchmarks/bench_data.py --stream                  # 800 MiB under 768 MiB
    .venv/bin/python benchmarks/bench_data.py --stream --stream-mib 60 --limit-mib 2048
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

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


def plan_startup(lengths: np.ndarray, labels: np.ndarray, epochs: int) -> list:
    """What the trainer plans before its first step; the plans it keeps."""
    from tpufinetune_trainer import data

    base = data.BatchPlan(world=16, per_device=8, accum=1)  # a v6e-16 at the tutorial's batch
    if hasattr(data, "plan_run"):
        shape = data.plan_run(lengths, labels, base, epochs, 0, MAX_SEQ_LEN)
        return [data.plan_epoch(lengths, labels, shape.plan, 1, 0, MAX_SEQ_LEN)]
    from tpufinetune_trainer.loss import most_label_tokens  # an older trainer: every epoch up front

    plan = data.BatchPlan(16, 8, 1, data.blocks_per_device(lengths, base, epochs, 0, MAX_SEQ_LEN))
    plans = [data.plan_epoch(lengths, labels, plan, epoch, 0, MAX_SEQ_LEN) for epoch in range(1, epochs + 1)]
    most_label_tokens(plans, labels)
    return plans


def planner_memory(lengths: np.ndarray, labels: np.ndarray, epochs: int) -> tuple[float, float]:
    """MiB: the planner's peak allocation, and what its plans hold after (tracemalloc)."""
    tracemalloc.start()
    plans = plan_startup(lengths, labels, epochs)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del plans
    return peak / 2**20, held / 2**20


def measure(kind: str, count: int, epochs: int) -> dict:
    from tpufinetune_trainer import data
    from tpufinetune_trainer.data import Examples, Ragged

    if not hasattr(data, "plan_run"):
        import tpufinetune_trainer.loss  # noqa: F401  (imports torch: not the planner's time)

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
    lengths, labels = examples.lengths, examples.label_tokens
    labels_s = time.perf_counter() - start
    start = time.perf_counter()
    plans = plan_startup(lengths, labels, epochs)
    plan_s = time.perf_counter() - start
    del plans
    peak, kept = planner_memory(lengths, labels, epochs)
    return {"kind": kind, "examples": count, "tokens": int(examples.lengths.sum()),
            "driver_convert_s": round(convert_s, 2), "shipped_mib": round(shipped / 2**20, 1),
            "worker_unpickle_s": round(unpickle_s, 2), "worker_held_mib": round(held, 1),
            "label_counts_s": round(labels_s, 2), "epochs": epochs, "plan_run_s": round(plan_s, 2),
            "planner_peak_mib": round(peak, 1), "plans_held_mib": round(kept, 1)}


# --------------------------------------------------------------------------- --stream

CGROUP_ROOT = "/sys/fs/cgroup/memory"
STREAM_MAX_SEQ_LEN = 512
STREAM_EVAL_FRACTION = 0.001  # the held-out examples are packed in the driver's memory


def status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


class AnonPeak:
    """The process's largest anonymous RSS (its own memory, which the kernel cannot drop
    as it drops file pages), sampled every 20 ms."""

    def __init__(self):
        self.peak, self.done = 0.0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, status_mib("RssAnon"))

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return max(self.peak, status_mib("RssAnon"))


def write_stream_inputs(workdir: Path, mib: int) -> tuple[Path, Path]:
    """The offline assets' tokenizer, and a dolly JSONL of about `mib` MiB: the assets'
    rows over and over, each with its own number (so no two rows are alike)."""
    from tpufinetune_trainer import assets

    data_path, tokenizer_dir = workdir / "train.jsonl", workdir / "tokenizer"
    pool = assets.generate_dataset(n=20000, seed=7)
    if not tokenizer_dir.exists():
        assets.build_tokenizer(assets.prompt_texts(pool), assets.SIZES["tiny"]["vocab"]).save_pretrained(tokenizer_dir)
    if data_path.exists() and data_path.stat().st_size >= mib * 2**20:
        return data_path, tokenizer_dir
    with open(data_path, "w") as out:
        written, i = 0, 0
        while written < mib * 2**20:
            row = dict(pool[i % len(pool)])
            row["instruction"] = f"{row['instruction']} (request {i})"
            line = json.dumps(row) + "\n"
            out.write(line)
            written, i = written + len(line), i + 1
    return data_path, tokenizer_dir


def stream_driver(mode: str, data_path: str, tokenizer_dir: str, cache: str) -> dict:
    from transformers import AutoTokenizer

    from tpufinetune_trainer import data

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prepared = data.prepare(data_path, "train", tokenizer, STREAM_MAX_SEQ_LEN, STREAM_EVAL_FRACTION, 0,
                            prompt_format="tutorial", stream=mode == "stream", cache_dir=cache)
    seconds = time.perf_counter() - start
    train = prepared.train
    if mode == "stream":
        with open(Path(cache) / "parts.pkl", "wb") as f:
            pickle.dump((train.input_ids.part, train.labels.part), f)
    return {"seconds": round(seconds, 1), "examples": prepared.examples, "tokens": int(train.lengths.sum())}


def stream_worker(cache: str) -> dict:
    from tpufinetune_trainer import data, data_stream

    start = time.perf_counter()
    with open(Path(cache) / "parts.pkl", "rb") as f:
        parts = pickle.load(f)
    examples = data.Examples(*(data_stream.reopen(part) for part in parts))
    labels = examples.label_tokens
    base = data.BatchPlan(world=16, per_device=8, accum=1)
    shape = data.plan_run(examples.lengths, labels, base, 1, 0, STREAM_MAX_SEQ_LEN)
    epoch = data.plan_epoch(examples.lengths, labels, shape.plan, 1, 0, STREAM_MAX_SEQ_LEN)
    blocks = data.rank_blocks(examples, epoch, 0, STREAM_MAX_SEQ_LEN, 0, steps=slice(0, 64))
    return {"seconds": round(time.perf_counter() - start, 1), "examples": len(examples),
            "tokens": int(examples.lengths.sum()), "blocks": len(blocks)}


def stream_child(args) -> None:
    """One row, in the cgroup `args.cgroup` (joined first)."""
    Path(args.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    anon = AnonPeak()
    if args.stream_one == "worker":
        out = stream_worker(args.cache)
    else:
        out = stream_driver(args.stream_one, args.data, args.tokenizer, args.cache)
    out["peak_anon_mib"] = round(anon.stop())
    out["peak_rss_mib"] = round(status_mib("VmHWM"))
    print(json.dumps(out), flush=True)


def stream_row(name: str, one: str, limit_mib: int, workdir: Path, data_path: Path, tokenizer_dir: Path) -> dict:
    cgroup = Path(CGROUP_ROOT, f"benchstream-{os.getpid()}-{one}")
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_mib * 2**20))
        hf = workdir / "hf-datasets"
        if one != "worker":
            shutil.rmtree(hf, ignore_errors=True)  # each driver converts the JSON to Arrow itself
        env = dict(os.environ, HF_DATASETS_CACHE=str(hf))
        start = time.perf_counter()
        run = subprocess.run([sys.executable, __file__, "--stream-one", one, "--cgroup", str(cgroup),
                              "--data", str(data_path), "--tokenizer", str(tokenizer_dir),
                              "--cache", str(workdir / "cache")], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        cgroup_peak = int((cgroup / "memory.max_usage_in_bytes").read_text()) / 2**20
    finally:
        cgroup.rmdir()
    row = {"row": name, "limit_mib": limit_mib, "cgroup_peak_mib": round(cgroup_peak)}
    if run.returncode == 0:
        row.update(json.loads(run.stdout.strip().splitlines()[-1]), outcome="completed")
    else:
        row.update(seconds=round(wall, 1), outcome=f"killed (rc {run.returncode}) after {wall:.0f} s")
        sys.stderr.write(run.stderr[-2000:])
    return row


def stream_table(args) -> None:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-stream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        data_path, tokenizer_dir = write_stream_inputs(workdir, args.stream_mib)
        shutil.rmtree(workdir / "cache", ignore_errors=True)
        text_mib = data_path.stat().st_size / 2**20
        rows = [stream_row("driver: in memory (before)", "memory", args.limit_mib, workdir, data_path, tokenizer_dir),
                stream_row("driver: streamed to files (after)", "stream", args.limit_mib, workdir, data_path,
                           tokenizer_dir)]
        if rows[-1]["outcome"] == "completed":
            rows.append(stream_row("worker: map, plan, first 64 steps", "worker", args.limit_mib, workdir, data_path,
                                   tokenizer_dir))
        files = sum(p.stat().st_size for p in (workdir / "cache").rglob("*") if p.is_file())
        print(f"dataset: {text_mib:.0f} MiB of JSONL text; token files: {files / 2**20:.0f} MiB; "
              f"limit {args.limit_mib} MiB")
        columns = ["row", "outcome", "seconds", "peak_anon_mib", "peak_rss_mib", "cgroup_peak_mib", "examples",
                   "tokens"]
        print(" | ".join(columns))
        for row in rows:
            print(" | ".join(str(row.get(c, "")) for c in columns))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=3, help="the run's epochs (the trainer's default: 3)")
    parser.add_argument("--kinds", default="lists,ragged", help="which of lists,ragged to measure")
    parser.add_argument("--one", choices=("lists", "ragged"), help=argparse.SUPPRESS)
    parser.add_argument("--stream", action="store_true", help="the dataset-larger-than-memory table")
    parser.add_argument("--stream-mib", type=int, default=800, help="--stream: MiB of JSONL text")
    parser.add_argument("--limit-mib", type=int, default=768, help="--stream: each process's memory limit")
    parser.add_argument("--workdir", help="--stream: keep the inputs and files here (else a temporary directory)")
    parser.add_argument("--stream-one", choices=("memory", "stream", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_one:
        stream_child(args)
        return
    if args.stream:
        stream_table(args)
        return
    if args.one:
        print(json.dumps(measure(args.one, args.examples, args.epochs)))
        return
    rows = []
    for kind in args.kinds.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--examples", str(args.examples),
                              "--epochs", str(args.epochs)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))


if __name__ == "__main__":
    main()
