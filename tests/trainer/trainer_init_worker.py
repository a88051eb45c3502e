"""One rank of a real gloo group that starts a run from another's checkpoint (--init-checkpoint).

Run as a process by tests/trainer/test_trainer_init_checkpoint.py, once per rank:
`python trainer_init_worker.py SETTINGS_JSON OUT_PREFIX PORT RANK WORLD`. SETTINGS_JSON names
the model, the SFT and preference data files and the source method (full or lora). Every
rank: trains the source SFT three steps and writes its checkpoint the trainer's way
(Trainer.checkpoint); gathers the source's weights (merged, W + alpha / r x B A, for LoRA);
starts a DPO run (full, or with --dpo-lora for a LoRA source) with --init-checkpoint, the LoRA
source's given as a file:// URI (the storage layer's reader); compares every base weight with
the source's; evaluates the held-out pairs before any step (the reference is the loaded
model: rewards 0); trains one step, checkpoints, and resumes a third start of that DPO run
from its own checkpoint (resume wins over the init). Writes `OUT_PREFIX.<rank>.json`.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpufinetune_trainer import lora, run_events, train
from tpufinetune_trainer.backends import BACKENDS
from tpufinetune_trainer.config import FinetuneConfig
from trainer_helpers import load_data_file


def full(tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: every rank calls it in the same order)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def trainer(settings: dict, data: dict, world: int, rank: int, **config) -> train.Trainer:
    base = dict(model_id=settings["model"], storage_path=settings["storage"], num_workers=world, device="cpu",
                max_seq_len=settings["length"], batch_size_per_device=2, num_epochs=1, learning_rate=1e-2,
                lr_schedule="constant", warmup_ratio=0.0, seed=7)
    cfg = FinetuneConfig(**{**base, **config}).validate()
    return train.Trainer(cfg, BACKENDS["cpu"], data, rank=rank, world=world, local_rank=0)


def steps(run: train.Trainer, count: int) -> None:
    for _ in range(count):
        run.train_step(torch.zeros(()))
        run.epoch_step += 1
        run.global_step += 1


def save(run: train.Trainer, name: str) -> str:
    state = {"epoch_step": run.epoch_step, "epoch_steps": run.epoch_steps, "epoch_loss_sum": 0.0,
             "epoch_label_tokens": 1, "training_s": 0.0, "stale_evals": 0}
    return run.checkpoint(f"{name}-{run.start_id}", {"epoch": 1, "step": run.global_step, "loss": 1.0}, state,
                          synchronous=True)


def merged_weights(run: train.Trainer, scaling: float) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """Every base weight of `run` by its base name (fp32, a LoRA layer's adapter merged in with
    `scaling`), and the dtype the run holds it in."""
    named = dict(run.model.named_parameters())
    out = {}
    for name, param in named.items():
        if lora.is_adapter(name):
            continue
        weight = full(param).float()
        if ".base_layer." in name:
            layer = name.removesuffix(".base_layer.weight")
            b, a = full(named[f"{layer}.lora_B.default.weight"]), full(named[f"{layer}.lora_A.default.weight"])
            weight = weight + scaling * (b.float() @ a.float())
        out[lora.base_name(name)] = (weight, param.dtype)
    return out


def main(settings: dict, out_prefix: str, port: int, rank: int, world: int) -> None:
    import ray.train

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ray.train.report = lambda *args, **kwargs: None
    run_events.emit = lambda kind, **fields: None
    sft_data, pairs = load_data_file(settings["sft_data"]), load_data_file(settings["pairs"])
    source_kind = settings["source"]
    lora_settings = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0)
    source = trainer(settings, sft_data, world, rank, run_name=f"sft-{source_kind}",
                     **({"method": "lora", **lora_settings} if source_kind == "lora" else {}))
    steps(source, 3)
    location = save(source, "step_0000003")
    expected = merged_weights(source, 8.0 / 4)
    base = merged_weights(trainer(settings, sft_data, world, rank, run_name="base"), 1.0)
    del source
    init = f"file://{location}" if source_kind == "lora" else location
    dpo = dict(method="dpo", run_name=f"dpo-{source_kind}", init_checkpoint=init, learning_rate=1e-3,
               max_seq_len=settings["pairs_length"],
               **({"dpo_lora": True, **lora_settings} if source_kind == "lora" else {}))
    target = trainer(settings, pairs, world, rank, **dpo)
    loaded = merged_weights(target, 0.0)  # this run's own adapters are B = 0: the base alone
    # As the target holds it: a LoRA run's base is bf16 (the merge rounded once, to it).
    differ = [name for name, (weight, _) in expected.items()
              if not torch.equal(loaded[name][0], weight.to(loaded[name][1]).float())]
    moved = sum(not torch.equal(weight, base[name][0]) for name, (weight, _) in expected.items())
    target.evaluate()
    before = target.method.eval_sums(target)
    steps(target, 1)
    own = save(target, "step_0000001")
    trained = merged_weights(target, 2.0 if source_kind == "lora" else 0.0)
    resumed = trainer(settings, pairs, world, rank, **dpo)
    resumed.restore()
    after_resume = merged_weights(resumed, 2.0 if source_kind == "lora" else 0.0)
    result = {"compared": len(expected), "differ": differ, "moved_by_sft": moved,
              "eval_margin": before["eval_margin"], "eval_rewards_chosen": before["eval_rewards_chosen"],
              "fingerprint_init": target.fingerprint.get("init_checkpoint"), "init": init,
              "resumed_from": resumed.resumed_from, "own": own, "resumed_step": resumed.global_step,
              "resume_differs": [n for n in trained if not torch.equal(trained[n][0], after_resume[n][0])],
              "trained_moved": sum(not torch.equal(trained[n][0], loaded[n][0]) for n in trained)}
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    settings_file, prefix, port_, rank_, world_ = sys.argv[1:]
    main(json.loads(open(settings_file).read()), prefix, int(port_), int(rank_), int(world_))
