"""Benchmark: LoRA (--method lora) against full fine-tuning, on CPU. Not a test.

    .venv/bin/python benchmarks/bench_lora.py [--size 100m] [--steps 6] [--work DIR]

Each method runs the trainer's own Trainer (model load, steps, evaluation, checkpoint) in
2 rank processes over gloo (no Ray: the numbers are the trainer's, not Ray's), fp32 compute,
on the same offline assets and the same examples. The model is the randomly initialised
Gemma 4 of ~118M parameters (`--size 100m`, tpufinetune_trainer.assets): on the tiny test
model the interpreter and torch themselves (~1 GiB per process) dwarf the parameters, and
the RSS ratio would say nothing about the parameters.

Per method: the checkpoint's bytes (shards and metadata, the last one written), each
worker's peak RSS during training (the kernel's high-water mark, reset once the model is
loaded, read after the last checkpoint is written), the held-out loss after the last step,
real tokens per second over the epoch, and the checkpoint's write time (start to every
rank's shards and rank 0's trainer state written). LoRA: rank 16, alpha 32 on the attention
and MLP projections (the API's defaults); learning rates are each method's usual order
(full 3e-4, LoRA 3e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LENGTH = 256


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def worker(out: str, port: int, rank: int, world: int, settings: dict) -> None:
    import torch.distributed as dist
    import ray.train

    from tpufinetune_trainer import train
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.data import pad_id_of, prepare
    from tpufinetune_trainer.model import load_tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ray.train.report = lambda *args, **kwargs: None  # no Ray Train session in a plain process
    train.emit = lambda kind, **fields: None
    cfg = FinetuneConfig(model_id=settings["model"], dataset=settings["data"], dataset_split="train[:400]",
                         storage_path=settings["storage"], run_name=settings["method"], num_workers=world,
                         device="cpu", max_seq_len=LENGTH, batch_size_per_device=2, num_epochs=1,
                         max_steps=settings["steps"], eval_fraction=0.05, learning_rate=settings["lr"],
                         method=settings["method"]).validate()
    tokenizer = load_tokenizer(cfg.model_id)
    data = prepare(cfg.dataset, cfg.dataset_split, tokenizer, LENGTH, cfg.eval_fraction, cfg.seed)
    trainer = train.Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval,
                                                   "pad_id": pad_id_of(tokenizer)}, rank=rank, world=world,
                            local_rank=0)
    loaded_mib = _status_kib("VmRSS") / 1024
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here: training only
    trainer.started = time.perf_counter()
    metrics = trainer.train_epoch()
    trainer.report(metrics, epoch_end=True)
    trainer.settle_checkpoint(wait=True)
    peak_mib = _status_kib("VmHWM") / 1024
    last = trainer.history[-1]
    location = Path(last["uri"])
    row = {"rank": rank, "loaded_rss_mib": loaded_mib, "peak_rss_mib": peak_mib, "eval_loss": last.get("eval_loss"),
           "tokens_per_s": metrics["tokens_per_s"], "write_s": last["write_s"], "save_s": last["save_s"],
           "trained": sum(p.numel() for p in trainer.params),
           "checkpoint_bytes": sum(p.stat().st_size for p in location.iterdir() if p.is_file())}
    Path(f"{out}.{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def run_method(method: str, lr: float, assets: Path, work: Path, steps: int, world: int = 2) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from harness.ports import free_port

    port, out = free_port(), work / f"result-{method}"
    settings = {"model": str(assets / "model"), "data": str(assets / "data" / "train.jsonl"), "method": method,
                "lr": lr, "steps": steps, "storage": str(work / "storage")}
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(out), str(port), str(rank), str(world),
                               json.dumps(settings)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    for proc in procs:
        output = proc.communicate(timeout=900)[0]
        if proc.returncode:
            raise SystemExit(f"{method} rank failed:\n{output[-4000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m", choices=["tiny", "100m"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", default="")
    args = parser.parse_args()
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-lora-"))
    assets = work / f"assets-{args.size}"
    if not (assets / "model" / "config.json").is_file():
        from tpufinetune_trainer.assets import write_assets

        write_assets(assets, args.size)
    start = time.perf_counter()
    results = {method: run_method(method, lr, assets, work, args.steps)
               for method, lr in (("full", 3e-4), ("lora", 3e-3))}
    full, lora = results["full"], results["lora"]

    def worst(rows, key):
        return max(row[key] for row in rows)

    table = [
        ("trained parameters", f"{full[0]['trained']:,}", f"{lora[0]['trained']:,}", ""),
        ("checkpoint bytes", f"{full[0]['checkpoint_bytes']:,}", f"{lora[0]['checkpoint_bytes']:,}",
         f"{lora[0]['checkpoint_bytes'] / full[0]['checkpoint_bytes']:.3f}"),
        ("per-worker peak RSS in training MiB", f"{worst(full, 'peak_rss_mib'):.0f}",
         f"{worst(lora, 'peak_rss_mib'):.0f}", f"{worst(lora, 'peak_rss_mib') / worst(full, 'peak_rss_mib'):.2f}"),
        ("per-worker RSS after load MiB", f"{worst(full, 'loaded_rss_mib'):.0f}",
         f"{worst(lora, 'loaded_rss_mib'):.0f}", ""),
        ("held-out loss", f"{full[0]['eval_loss']}", f"{lora[0]['eval_loss']}", ""),
        ("tokens/s", f"{full[0]['tokens_per_s']:.0f}", f"{lora[0]['tokens_per_s']:.0f}",
         f"{lora[0]['tokens_per_s'] / full[0]['tokens_per_s']:.2f}"),
        ("checkpoint write s", f"{full[0]['write_s']:.2f}", f"{lora[0]['write_s']:.2f}", ""),
    ]
    print(f"| {args.size} Gemma 4, 2 workers, {args.steps} steps | full | LoRA r16 | LoRA / full |")
    print("|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print(f"({time.perf_counter() - start:.0f} s for both runs; assets in {assets})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6]))
    else:
        main()
