"""Benchmark: LoRA (--method lora) against full fine-tuning, on CPU. Not a test.

    .venv/bin/python benchmarks/bench_lora.py [--size 100m] [--steps 6] [--work DIR]
    .venv/bin/python benchmarks/bench_lora.py --base pretrained [--methods full,lora,lora-embeddings] [--epochs 3]
                                              [--rows 512] [--lr 1e-3] [--work DIR]

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

`--base pretrained`: quality and cost on the time-to-quality benchmark's pretrained tiny
Gemma 4 and its data (benchmarks/bench_time_to_quality.py builds both, and with the same
--work DIR the two scripts share them). Each method trains its --epochs over every training
example with the product's defaults, as that benchmark's `ours` (data prepared as `finetune`
prepares it, a checkpoint each epoch), at --lr for full and LORA_LR_FACTOR x --lr for LoRA
(adapters start at zero and want a larger step); the held-out response loss is that
benchmark's scorer, before the first step and after the last. Peak RSS here is the whole
worker process's high-water mark (load included), tokens/s the real tokens over every
epoch's time, the checkpoint's bytes and seconds the last epoch's, wall s the training
from the first step to the last checkpoint written (scoring excluded). `lora-embeddings` is
LoRA with --lora-train-embeddings (the input embedding, and the head tied to it, trained in
full beside the adapters), at LoRA's learning rate.
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
# LoRA's learning rate over full fine-tuning's, in both modes.
LORA_LR_FACTOR = 10
# --base pretrained's --methods: the trainer's --method, --lora-train-embeddings, lr factor.
QUALITY_METHODS = {"full": ("full", False, 1), "lora": ("lora", False, LORA_LR_FACTOR),
                   "lora-embeddings": ("lora", True, LORA_LR_FACTOR)}


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def join(port: int, rank: int, world: int) -> None:
    """This rank's gloo group; Ray Train's report and the events made no-ops (a plain process)."""
    import torch.distributed as dist
    import ray.train

    from tpufinetune_trainer import run_events

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ray.train.report = lambda *args, **kwargs: None
    run_events.emit = lambda kind, **fields: None


def checkpoint_bytes(uri: str) -> int:
    return sum(p.stat().st_size for p in Path(uri).iterdir() if p.is_file())


def worker(out: str, port: int, rank: int, world: int, settings: dict) -> None:
    import torch.distributed as dist

    from tpufinetune_trainer import train
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.data import pad_id_of, prepare
    from tpufinetune_trainer.model import load_tokenizer

    join(port, rank, world)
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
           "checkpoint_bytes": checkpoint_bytes(str(location))}
    Path(f"{out}.{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def quality_worker(out: str, port: int, rank: int, world: int, settings: dict) -> None:
    """One rank of `--base pretrained`: every epoch as `finetune` runs it (no export), scored
    on the held-out responses before the first step and after the last."""
    import torch.distributed as dist

    import bench_time_to_quality as ttq
    from tpufinetune_trainer import train
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.finetune import prepare_data

    join(port, rank, world)
    # The time-to-quality benchmark's `ours`: defaults, but its lr, every example, CPU, 2 workers.
    cfg = FinetuneConfig(model_id=settings["model"], dataset=settings["data"], dataset_split="train",
                         num_workers=world, num_epochs=settings["epochs"], learning_rate=settings["lr"],
                         eval_fraction=0.0, device="cpu", storage_path=settings["storage"],
                         run_name=f"quality-{settings['label']}", method=settings["method"],
                         lora_train_embeddings=settings["train_embeddings"]).validate()
    data, pad_id = prepare_data(cfg)
    trainer = train.Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval, "pad_id": pad_id},
                            rank=rank, world=world, local_rank=0)
    batches = ttq.scoring_batches(cfg.model_id, settings["heldout"], data.prompt_format, rank, world)
    start_loss = ttq.heldout_loss(trainer.model, batches)
    load_peak_mib = _status_kib("VmHWM") / 1024
    Path("/proc/self/clear_refs").write_text("5")  # training's own high-water mark from here
    trainer.started = time.perf_counter()
    epochs = []
    while trainer.global_step < trainer.total_steps:
        epochs.append(trainer.train_epoch())
        trainer.report(epochs[-1], epoch_end=True)
    trainer.settle_checkpoint(wait=True)
    wall_s = time.perf_counter() - trainer.started
    peak_mib = max(load_peak_mib, _status_kib("VmHWM") / 1024)
    final_loss = ttq.heldout_loss(trainer.model, batches)
    last = trainer.history[-1]
    seconds = sum(m["epoch_time_s"] for m in epochs)
    row = {"rank": rank, "start_loss": start_loss, "final_loss": final_loss, "peak_rss_mib": peak_mib,
           "load_peak_rss_mib": load_peak_mib, "steps": trainer.global_step,
           "tokens_per_s": sum(m["tokens_per_s"] * m["epoch_time_s"] for m in epochs) / seconds,
           "write_s": last["write_s"], "wall_s": wall_s,
           "trained": sum(p.numel() for p in trainer.params), "checkpoint_bytes": checkpoint_bytes(last["uri"])}
    Path(f"{out}.{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


WORKERS = {"worker": worker, "quality-worker": quality_worker}


def run_ranks(kind: str, settings: dict, out: Path, world: int = 2) -> list[dict]:
    """`world` rank processes of WORKERS[kind]; each one's result row."""
    sys.path.insert(0, str(REPO / "tests"))
    from harness.ports import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, __file__, kind, str(out), str(port), str(rank), str(world),
                               json.dumps(settings)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    for proc in procs:
        output = proc.communicate(timeout=900)[0]
        if proc.returncode:
            raise SystemExit(f"{settings.get('label', settings['method'])} rank failed:\n{output[-4000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def run_method(method: str, lr: float, assets: Path, work: Path, steps: int) -> list[dict]:
    settings = {"model": str(assets / "model"), "data": str(assets / "data" / "train.jsonl"), "method": method,
                "lr": lr, "steps": steps, "storage": str(work / "storage")}
    return run_ranks("worker", settings, work / f"result-{method}")


def quality(args, work: Path) -> None:
    """`--base pretrained`: each method's held-out response loss and costs, one table."""
    import bench_time_to_quality as ttq

    where = work / "pretrained"
    assets = ttq.cached_assets(where, "pretrained", args.rows, args.heldout, args.pretrain_steps)
    table = []
    for method in args.methods:
        trainer_method, train_embeddings, factor = QUALITY_METHODS[method]
        lr = args.lr * factor
        started = time.perf_counter()
        ranks = run_ranks("quality-worker", {"model": assets["model"], "data": assets["train"],
                                             "heldout": assets["heldout"], "method": trainer_method,
                                             "train_embeddings": train_embeddings, "label": method, "lr": lr,
                                             "epochs": args.epochs, "storage": str(where / "lora-bench-storage")},
                          where / f"lora-bench-{method}")
        first = ranks[0]
        print(f"  {method}: {time.perf_counter() - started:.0f} s with load and scoring; "
              f"{first['trained']:,} parameters trained, {first['steps']} steps; peak RSS per rank MiB "
              + ", ".join(f"{r['peak_rss_mib']:.0f}" for r in ranks), flush=True)
        table.append((f"{method} (lr {lr:g})", f"{first['start_loss']:.3f} -> {first['final_loss']:.3f}",
                      f"{first['tokens_per_s']:.0f}", f"{max(r['peak_rss_mib'] for r in ranks):.0f}",
                      f"{first['checkpoint_bytes']:,}", f"{first['write_s']:.2f}",
                      f"{first['wall_s']:.1f}"))
    print(f"| pretrained tiny Gemma 4, 2 workers, {args.rows} examples x {args.epochs} epochs | held-out response "
          "loss, start -> final | tokens/s | peak RSS per worker MiB | checkpoint bytes | "
          "checkpoint write s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m", choices=["tiny", "100m"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", default="")
    parser.add_argument("--base", default="random", choices=["random", "pretrained"],
                        help="random: --size's random model, --steps; pretrained: bench_time_to_quality's base")
    parser.add_argument("--methods", default="full,lora",
                        help=f"with --base pretrained: some of {', '.join(QUALITY_METHODS)}, comma-separated")
    parser.add_argument("--epochs", type=int, default=3, help="with --base pretrained")
    parser.add_argument("--rows", type=int, default=512, help="with --base pretrained: training examples")
    parser.add_argument("--heldout", type=int, default=128, help="with --base pretrained: held-out examples")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="with --base pretrained")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"with --base pretrained: full's lr (LoRA's is {LORA_LR_FACTOR}x); "
                             "default bench_time_to_quality's")
    args = parser.parse_args()
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-lora-"))
    if args.base == "pretrained":
        import bench_time_to_quality as ttq

        args.methods = [m for m in args.methods.split(",") if m]
        unknown = [m for m in args.methods if m not in QUALITY_METHODS]
        if unknown or not args.methods:
            raise SystemExit(f"--methods: {','.join(unknown) or 'empty'}; give some of {','.join(QUALITY_METHODS)}")
        args.lr = ttq.PEAK_LR if args.lr is None else args.lr
        print(f"work dir: {work}", flush=True)
        quality(args, work)
        return
    assets = work / f"assets-{args.size}"
    if not (assets / "model" / "config.json").is_file():
        from tpufinetune_trainer.assets import write_assets

        write_assets(assets, args.size)
    start = time.perf_counter()
    results = {method: run_method(method, lr, assets, work, args.steps)
               for method, lr in (("full", 3e-4), ("lora", 3e-4 * LORA_LR_FACTOR))}
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
    if len(sys.argv) > 1 and sys.argv[1] in WORKERS:
        WORKERS[sys.argv[1]](sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                             json.loads(sys.argv[6]))
    else:
        main()
