"""The per-worker training loop, run by every Ray Train worker.

Built in a fixed order: device -> model -> parallelize -> optimizer -> restore ->
epochs (train, eval, sharded checkpoint) -> export of the best checkpoint. Only rank 0
prints; the loss and token counts are summed on-device and reduced once per epoch (one
host sync per epoch, which matters on TPU).
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .backends import BACKENDS, Backend, setup_device, torch_dtype
from .config import FinetuneConfig
from .data import IGNORE_INDEX, Packed, eval_order, shard_order
from .events import emit
from .model import load_causal_lm, load_tokenizer
from .parallelize import apply_fsdp, build_mesh


def quiet_progress_bars() -> None:
    import datasets
    from transformers.utils import logging

    logging.disable_progress_bar()
    datasets.disable_progress_bars()


def say(line: str) -> None:
    """A human log line. Not print(): Ray Train patches print in workers and the line
    would reach the job log twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def is_better(a: float, b: float, order: str) -> bool:
    return a < b if order == "min" else a > b


def best_entry(history: list[dict], attribute: str, order: str) -> dict | None:
    """The checkpointed epoch with the best score (earliest wins a tie, as in Ray)."""
    best = None
    for entry in history:
        score = entry.get(attribute)
        if entry.get("uri") and score is not None and (best is None or is_better(score, best[attribute], order)):
            best = entry
    return best


class Batches:
    """Fixed-shape batches of packed blocks for one rank."""

    def __init__(self, packed: Packed, device, pad_id: int):
        self.packed, self.device, self.pad_id = packed, device, pad_id

    def batch(self, index: np.ndarray) -> dict:
        p, length = self.packed, self.packed.input_ids.shape[1]
        real = index >= 0
        safe = np.where(real, index, 0)
        ids = np.where(real[:, None], p.input_ids[safe], self.pad_id)
        labels = np.where(real[:, None], p.labels[safe], IGNORE_INDEX)
        pos = np.where(real[:, None], p.position_ids[safe], np.arange(length)[None, :])
        tensors = {"input_ids": ids, "labels": labels, "position_ids": pos}
        out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in tensors.items()}
        out["real_tokens"] = int(np.where(real, p.real_tokens[safe], 0).sum())
        return out


class Trainer:
    def __init__(self, cfg: FinetuneConfig, backend: Backend, data: dict, rank: int, world: int, local_rank: int):
        self.cfg, self.backend, self.rank, self.world = cfg, backend, rank, world
        self.device = setup_device(backend, local_rank)
        self.train_data, self.eval_data = data["train"], data.get("eval")
        self.pad_id = int(data["pad_id"])
        self.tokenizer = load_tokenizer(cfg.model_id) if rank == 0 else None
        torch.manual_seed(cfg.seed)
        model = load_causal_lm(cfg.model_id, torch_dtype(backend), backend.attn_implementation).to(self.device)
        self.model = apply_fsdp(model, build_mesh(backend.device_type, world), torch_dtype(backend))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.history: list[dict] = []
        self.start_epoch = 0
        self.weights_epoch = 0  # which epoch's weights the model holds (0: the base model)

    # ------------------------------------------------------------------ restore
    def restore(self) -> None:
        """Ray Train's restore (same run name + storage) wins over --resume-from."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None and self.cfg.resume_from:
            checkpoint = ray.train.Checkpoint(self.cfg.resume_from)
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            state = ckpt.load_sharded(self.model, self.optimizer, directory)
        self.start_epoch = self.weights_epoch = int(state.get("epoch", 0))
        self.history = list(state.get("history", []))
        if self.rank == 0:
            say(f"Resumed from {checkpoint.path} at epoch {self.start_epoch}")

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> dict:
        cfg, batches = self.cfg, Batches(self.train_data, self.device, self.pad_id)
        order = shard_order(len(self.train_data), self.world, cfg.batch_size_per_device, epoch, cfg.seed, self.rank)
        steps = len(order) // cfg.batch_size_per_device
        self.model.train()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        counts = torch.zeros(2, device=self.device, dtype=torch.float64)  # label tokens, real tokens
        shapes = set()
        start = time.perf_counter()
        for step in range(steps):
            batch = batches.batch(order[step * cfg.batch_size_per_device:(step + 1) * cfg.batch_size_per_device])
            shapes.add(tuple(batch["input_ids"].shape))
            self.optimizer.zero_grad(set_to_none=True)
            out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
            out.loss.backward()
            self.optimizer.step()
            label_tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
            loss_sum += out.loss.detach().float() * label_tokens
            counts[0] += label_tokens
            counts[1] += batch["real_tokens"]
        totals = torch.cat([loss_sum.double().reshape(1), counts])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        loss, label_tokens, real_tokens = totals.tolist()
        elapsed = time.perf_counter() - start
        padded = steps * cfg.batch_size_per_device * self.world * cfg.max_seq_len
        return {"loss": loss / max(label_tokens, 1), "epoch_time_s": elapsed,
                "tokens_per_s": real_tokens / elapsed, "padded_tokens_per_s": padded / elapsed, "steps": steps,
                "batch_shapes": sorted(list(s) for s in shapes)}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_data is None or len(self.eval_data) == 0:
            return None
        batch_size = self.cfg.batch_size_per_device
        batches = Batches(self.eval_data, self.device, self.pad_id)
        order = eval_order(len(self.eval_data), self.world, batch_size, self.rank)
        self.model.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for step in range(len(order) // batch_size):
            batch = batches.batch(order[step * batch_size:(step + 1) * batch_size])
            out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
            label_tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
            # An all-filler batch has no labels: its mean loss is NaN and weighs nothing.
            totals[0] += torch.nan_to_num(out.loss.float(), nan=0.0).double() * label_tokens
            totals[1] += label_tokens
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        loss, label_tokens = totals.tolist()
        return loss / label_tokens if label_tokens else None

    def checkpoint(self, epoch: int, metrics: dict) -> str:
        """Sharded save + report; returns the checkpoint's URI in storage.

        A file-system storage path (shared by all hosts, as Ray Train requires) is written
        in place and reported without an upload: one write of each shard instead of a
        write plus a copy. A URI (gs://) is staged in a local directory that Ray Train
        uploads, every rank its own files, in parallel."""
        import ray.train
        from ray.train import CheckpointUploadMode

        name = f"epoch_{epoch:04d}"
        uri = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name, name)
        entry = dict(metrics, uri=uri)
        state = {"epoch": epoch, "history": self.history + [entry], "run_name": self.cfg.run_name}
        start = time.perf_counter()
        if "://" in uri:
            with tempfile.TemporaryDirectory(prefix="tpuft-ckpt-") as local:
                ckpt.save_sharded(self.model, self.optimizer, local, state)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(local),
                                 checkpoint_dir_name=name)
        else:
            ckpt.save_sharded(self.model, self.optimizer, uri, state)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint(uri), checkpoint_dir_name=name,
                             checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        entry["save_s"] = round(time.perf_counter() - start, 3)
        self.history.append(entry)
        self.weights_epoch = epoch
        return uri

    def run(self) -> None:
        cfg = self.cfg
        for epoch in range(self.start_epoch + 1, cfg.num_epochs + 1):
            m = self.train_epoch(epoch)
            eval_loss = self.evaluate()
            metrics = {"epoch": epoch, "loss": round(m["loss"], 4),
                       "eval_loss": None if eval_loss is None else round(eval_loss, 4),
                       "epoch_time_s": round(m["epoch_time_s"], 2), "tokens_per_s": round(m["tokens_per_s"], 1),
                       "padded_tokens_per_s": round(m["padded_tokens_per_s"], 1)}
            if self.rank == 0:
                self.print_epoch(metrics)
                emit("epoch", epochs=cfg.num_epochs, steps=m["steps"], batch_shapes=m["batch_shapes"], **metrics)
            uri = self.checkpoint(epoch, {k: v for k, v in metrics.items() if v is not None})
            if self.rank == 0:
                emit("checkpoint", epoch=epoch, uri=uri, save_s=self.history[-1]["save_s"])
        self.export()

    def print_epoch(self, m: dict) -> None:
        eval_part = f" | eval_loss={m['eval_loss']:.4f}" if m["eval_loss"] is not None else ""
        say(f"Epoch {m['epoch']}/{self.cfg.num_epochs} | loss={m['loss']:.4f} | epoch_time={m['epoch_time_s']:.2f}s"
            f" | tokens/s={m['tokens_per_s']:.1f}{eval_part}"
            f" | padded_tokens/s={m['padded_tokens_per_s']:.1f} (tokens/s counts real tokens only)")

    # ------------------------------------------------------------------ export
    def export(self) -> None:
        cfg = self.cfg
        best = best_entry(self.history, cfg.checkpoint_score_attribute, cfg.checkpoint_score_order)
        if best is None:
            raise RuntimeError("no checkpoint to export (was every epoch already done?)")
        if best["epoch"] != self.weights_epoch:
            import ray.train

            with ray.train.Checkpoint(best["uri"]).as_directory() as directory:
                ckpt.load_sharded(self.model, None, directory)
        destination = ckpt.join_uri(cfg.storage_path, cfg.run_name, "export")
        start = time.perf_counter()
        ckpt.export_hf(self.model, self.tokenizer, destination)
        if self.rank == 0:
            say(f"Exported epoch {best['epoch']} ({cfg.checkpoint_score_attribute}="
                f"{best[cfg.checkpoint_score_attribute]}) to {destination} in {time.perf_counter() - start:.1f}s")
            final = {k: v for k, v in self.history[-1].items() if k not in ("uri", "save_s")}
            emit("result", best_checkpoint_uri=best["uri"], best_epoch=best["epoch"],
                 exported_model_uri=destination, metrics=final)


def device_layout(backend: Backend, world: int, local_world: int) -> list[str]:
    """One entry per rank, `host<N>/<device>:<local>` (Ray Train packs ranks by node)."""
    local_world = max(local_world, 1)
    return [f"host{r // local_world}/{backend.device_type}:{r % local_world}" for r in range(world)]


def train_func(config: dict) -> None:
    """Ray Train entry point (one call per worker)."""
    import ray
    import ray.train
    import ray.train.torch

    quiet_progress_bars()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    backend = BACKENDS[config["backend"]]
    cfg = FinetuneConfig(**config["cfg"])
    if rank == 0:
        emit("start", mode="finetune", world_size=world, backend=backend.dist_backend, device=backend.device_type,
             devices=device_layout(backend, world, ctx.get_local_world_size()), run_name=cfg.run_name)
    data = ray.get(config["data"])
    # On GPU, Ray Train decides which visible CUDA device is this worker's.
    local = ray.train.torch.get_device().index if backend.name == "cuda" else ctx.get_local_rank()
    trainer = Trainer(cfg, backend, data, rank, world, local)
    trainer.restore()
    trainer.run()
