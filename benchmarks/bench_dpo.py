"""Benchmark: DPO learns preferences (--method dpo, full and LoRA), on CPU, in one process.

    .venv/bin/python benchmarks/bench_dpo.py [--epochs 3] [--work DIR] [--methods full,lora]

The tiny random Gemma 4 (the offline test assets) and synthetic pairs of a learnable task:
8 made-up countries, each asked for its capital in 3 phrasings; chosen the right capital,
rejected each of the 7 wrong ones (168 pairs, 20% held out, seed 7). The trainer's own
loop (train.Trainer.train_epoch / evaluate on a one-rank gloo group: FSDP2, the packed
pair blocks, DPO's loss and metrics), batch 8 pairs, blocks of 64 tokens, constant
learning rate, beta 0.1, sigmoid. "before": the held-out pairs the untrained policy
already prefers (log-probability of chosen above rejected; the reward accuracy itself is 0
there, every reward being 0); then each epoch's training loss and the held-out pairs'
loss, rewards, margin and preference accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

CAPITALS = {"Briquia": "Riva", "Kavenia": "Qunor", "Lotrand": "Mespa", "Orvania": "Tellis", "Sundor": "Pakka",
            "Velmar": "Ostra", "Zenthia": "Corbel", "Harlan": "Duvik"}
PHRASINGS = ("What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?")


def capital_pairs(wrong: int = 7) -> list[dict]:
    return [{"prompt": p.format(country), "chosen": f"The capital is {capital}.",
             "rejected": f"The capital is {other}."}
            for country, capital in CAPITALS.items() for p in PHRASINGS
            for other in [c for c in CAPITALS.values() if c != capital][:wrong]]


def policy_preference(trainer) -> float:
    """Held-out pairs whose chosen response the policy finds likelier (reference-free
    accuracy), read through the trainer's evaluation."""
    method = trainer.method
    kept = method.settings
    method.settings = dataclasses.replace(kept, reference_free=True)
    try:
        trainer.evaluate()
        return method.eval_sums(trainer)["eval_accuracy"]
    finally:
        method.settings = kept


def run(method: str, epochs: int, work: Path, lr: float) -> list[dict]:
    from tpufinetune_trainer.assets import write_assets
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.data import pad_id_of
    from tpufinetune_trainer.model import load_tokenizer
    from tpufinetune_trainer.preference import prepare_pairs
    from tpufinetune_trainer.train import Trainer

    model = work / "assets" / "model"
    if not model.exists():
        write_assets(work / "assets", "tiny")
    path = work / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in capital_pairs()))
    tokenizer = load_tokenizer(str(model))
    data = prepare_pairs(str(path), "train", tokenizer, 64, 0.2, 7, prompt_format="tutorial")
    lora = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0} if method == "lora" else {}
    cfg = FinetuneConfig(model_id=str(model), storage_path=str(work / "store"), num_workers=1, device="cpu",
                         max_seq_len=64, learning_rate=lr, batch_size_per_device=8, num_epochs=epochs,
                         method="dpo", dpo_lora=method == "lora", lr_schedule="constant", warmup_ratio=0.0,
                         eval_fraction=0.2, seed=7, **lora).validate()
    start = time.perf_counter()
    trainer = Trainer(cfg, BACKENDS["cpu"], {"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)},
                      rank=0, world=1, local_rank=0)
    rows = [{"epoch": 0, "policy_prefers": policy_preference(trainer), "s": time.perf_counter() - start}]
    for _ in range(epochs):
        m = trainer.train_epoch()
        eval_loss = trainer.evaluate()
        rows.append({"epoch": trainer.epoch, "loss": m["loss"], "accuracy": m["method"]["accuracy"],
                     "eval_loss": eval_loss, **trainer.method.eval_sums(trainer),
                     "s": time.perf_counter() - start})
        trainer.epoch, trainer.epoch_step = trainer.epoch + 1, 0
    rows[0]["policy_prefers_after"] = policy_preference(trainer)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--work", default="")
    parser.add_argument("--methods", default="full,lora")
    parser.add_argument("--lr-full", type=float, default=1e-3)
    parser.add_argument("--lr-lora", type=float, default=3e-3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from trainer_helpers import single_process_group

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-dpo-"))
    print(f"{'method':6} {'epoch':>5} {'loss':>7} {'acc':>6} {'eval_loss':>9} {'chosen':>8} {'rejected':>8} "
          f"{'margin':>7} {'eval_acc':>8} {'s':>6}")
    with single_process_group():
        for method in args.methods.split(","):
            lr = args.lr_full if method == "full" else args.lr_lora
            rows = run(method, args.epochs, work / method, lr)
            first = rows[0]
            print(f"{method:6} {'before':>5}  policy prefers chosen on {first['policy_prefers']:.2f} of the held-out "
                  f"pairs ({first['policy_prefers_after']:.2f} after training); start {first['s']:.1f} s")
            for r in rows[1:]:
                print(f"{method:6} {r['epoch']:>5} {r['loss']:7.4f} {r['accuracy']:6.3f} {r['eval_loss']:9.4f} "
                      f"{r['eval_rewards_chosen']:8.4f} {r['eval_rewards_rejected']:8.4f} {r['eval_margin']:7.4f} "
                      f"{r['eval_accuracy']:8.3f} {r['s']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
