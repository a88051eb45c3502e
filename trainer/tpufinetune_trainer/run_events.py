"""What a training worker tells: the human lines (`say`) and the protocol's events
(docs/protocol.md) of a run, assembled from the trainer's state. Rank 0 emits them.

Every line and event of the worker goes through this module's `say` and `emit`, so a test
that records them replaces these two names."""

from __future__ import annotations

import sys
import time

import torch

from . import compile_cache, generation, tboard
from .events import emit


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


def device_layout(backend, world: int, local_world: int) -> list[str]:
    """One entry per rank, `host<N>/<device>:<local>` (Ray Train packs ranks by node)."""
    local_world = max(local_world, 1)
    return [f"host{r // local_world}/{backend.device_type}:{r % local_world}" for r in range(world)]


def start_event(cfg, backend, world: int, local_world: int, config: dict) -> None:
    emit("start", mode="finetune", world_size=world, backend=backend.dist_backend, device=backend.device_type,
         devices=device_layout(backend, world, local_world), run_name=cfg.run_name,
         prompt_format=config.get("prompt_format"), dataset_format=config.get("dataset_format"))


class ProgressWindow:
    """What rank 0 has seen since its last progress event (host numbers only)."""

    def __init__(self, start: float):
        self.loss_mark = 0.0
        self.reset(start)

    def reset(self, start: float) -> None:
        self.start, self.steps, self.label_tokens, self.real_tokens = start, 0, 0, 0

    def add(self, label_tokens: int, real_tokens: int) -> None:
        self.steps += 1
        self.label_tokens += label_tokens
        self.real_tokens += real_tokens

    def due(self, interval_s: float) -> bool:
        return self.steps > 0 and time.perf_counter() - self.start >= interval_s


class RunEvents:
    """The Trainer's lines and events (a mixin of train.Trainer: it reads the trainer's
    config, plan, schedule, model and position)."""

    def announce(self) -> None:
        cfg, plan = self.cfg, self.plan
        if plan.tokens_per_step:
            step_words = (f"{plan.world} devices x {plan.blocks} blocks of {cfg.max_seq_len} tokens x {plan.accum} "
                          f"accumulation = {plan.tokens_per_step} tokens per optimizer step (--tokens-per-step: full "
                          f"blocks, about {self.examples_per_step():.1f} examples); ")
        else:
            step_words = (f"{plan.world} devices x {plan.per_device} examples x {plan.accum} accumulation = "
                          f"{plan.global_examples} examples per optimizer step, packed into {plan.blocks} blocks of "
                          f"{cfg.max_seq_len} tokens per device per micro-batch "
                          f"({plan.global_blocks * cfg.max_seq_len} tokens per step); ")
        say("Plan: " + step_words +
            f"{self.epoch_steps} steps per epoch, {self.total_steps} in all; lr {cfg.learning_rate:g} "
            f"(warmup {self.warmup} steps, {self.schedule_words()}); "
            f"clip {cfg.max_grad_norm:g}; compute {str(self.dtype).removeprefix('torch.')}, master weights "
            f"float32{self.method_words()}; "
            + ("blocks resharded after forward" if cfg.reshard_after_forward
               else "blocks kept gathered from forward to backward") + f"; compile {'on' if self.compiled else 'off'}"
            + (f" (cache {self.compile_cache_dir})" if self.compile_cache else "") + "; loss head "
            + (f"at label positions ({self.train_cap} rows of {plan.blocks * cfg.max_seq_len} per micro-batch)"
               if self.label_head else "over every position (full logits)"))
        emit("plan", global_batch_examples=0 if plan.tokens_per_step else plan.global_examples,
             tokens_per_step=plan.tokens_per_step or None, blocks_per_device=plan.blocks,
             global_batch_blocks=plan.global_blocks, global_batch_tokens=plan.global_blocks * cfg.max_seq_len,
             accumulation=plan.accum, steps_per_epoch=self.epoch_steps, total_steps=self.total_steps,
             warmup_steps=self.warmup, lr_schedule=cfg.lr_schedule, compute_dtype=str(self.dtype).split(".")[-1],
             compile=self.compiled, reshard_after_forward=cfg.reshard_after_forward, resumed_step=self.global_step if self.resumed_from else None,
             resumed_from=self.resumed_from, tensorboard_uri=tboard.run_uri(cfg.storage_path, cfg.run_name))
        say(f"TensorBoard: this attempt's events go to {self.board.uri} (tensorboard --logdir "
            f"{tboard.run_uri(cfg.storage_path, cfg.run_name)})")

    def examples_per_step(self) -> float:
        """Examples per step of the current epoch's plan, on average."""
        epoch = self.epoch_plan
        return sum(map(len, epoch.blocks)) / max(1, len(epoch))

    def method_words(self) -> str:
        cfg = self.cfg
        if not cfg.uses_lora:
            return " (DPO)" if cfg.method == "dpo" else ""
        trained = sum(p.numel() for p in self.params)
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        what = "adapters and the embedding" if getattr(cfg, "lora_train_embeddings", False) else "adapters only"
        return (f" for LoRA's {what} (rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g} on "
                f"{cfg.lora_target_modules}: {trained:,} parameters trained, {frozen:,} frozen in bfloat16)")

    def schedule_words(self) -> str:
        cfg = self.cfg
        if cfg.lr_schedule == "constant":
            return "constant"
        return (f"peak held for {self.total_steps - self.warmup - self.decay} steps, {cfg.lr_schedule} to "
                f"{cfg.learning_rate * cfg.min_lr_ratio:g} over the last {self.decay}")

    def first_step_done(self, loss_sum: torch.Tensor) -> None:
        """This start's first optimizer step: rank 0 reports the start-up stages (event
        `startup`). With torch.compile the host calls return once the step is traced and
        compiled; one host read then waits for the device to finish it (once a start)."""
        self.startup.reported = True
        if self.rank != 0:
            return
        if self.compiled:
            self.startup.mark("first_step_compiled")
            self.startup.note(**compile_cache.counters())
        float(loss_sum.item())
        self.startup.mark("first_step")
        emit("startup", step=self.global_step, **self.startup.fields())

    def emit_progress(self, window: ProgressWindow, loss_sum: torch.Tensor) -> None:
        """Rank 0 only, throttled: the loss is rank 0's mean over the window, the gradient
        norm the last step's global norm before clipping (null with clipping off); reading
        both is this window's one host sync."""
        now = time.perf_counter()
        if self.grad_norm is None:
            current, grad_norm = float(loss_sum.item()), None
        else:
            current, grad_norm = torch.stack([loss_sum.detach().float(), self.grad_norm.detach().float()]).tolist()
        loss = (current - window.loss_mark) / max(window.label_tokens, 1)
        window.loss_mark = current
        seconds = now - window.start
        fields = dict(epoch=self.epoch, epochs=self.cfg.num_epochs, step=self.global_step,
                      total_steps=self.total_steps, epoch_step=self.epoch_step, epoch_steps=self.epoch_steps,
                      loss=round(loss, 4), lr=float(self.lr_host[min(self.global_step, self.total_steps) - 1]),
                      grad_norm=None if grad_norm is None else round(grad_norm, 4),
                      tokens_per_s=round(window.real_tokens / max(seconds, 1e-9), 1),
                      step_time_s=round(seconds / max(window.steps, 1), 4), training_s=round(self.training_s(), 1))
        emit("progress", **fields)
        self.board.progress(fields)
        window.reset(now)

    def print_epoch(self, m: dict) -> None:
        eval_part = f" | eval_loss={m['eval_loss']:.4f}" if m["eval_loss"] is not None else ""
        say(f"Epoch {m['epoch']}/{self.cfg.num_epochs} | loss={m['loss']:.4f} | epoch_time={m['epoch_time_s']:.2f}s"
            f" | tokens/s={m['tokens_per_s']:.1f}{eval_part}"
            f" | padded_tokens/s={m['padded_tokens_per_s']:.1f} (tokens/s counts real tokens only)"
            + self.method.words(m) + generation.words(m))

    def epoch_event(self, m: dict, metrics: dict, samples: dict) -> None:
        """Rank 0, at an epoch's end: its line and its `epoch` event (`m`: the loop's figures,
        `metrics`: the checkpoint's, evaluation included; `samples`: the generation's record)."""
        self.print_epoch(metrics)
        emit("epoch", epochs=self.cfg.num_epochs, steps=m["steps"], total_steps=self.total_steps,
             batch_shapes=m["batch_shapes"], **metrics,
             **({"eval_samples_uri": samples["uri"], "generate_s": round(samples["seconds"], 3),
                 "eval_samples": samples["samples"]} if samples else {}))

    def checkpoint_event(self, entry: dict, epoch_end: bool) -> None:
        """Rank 0: a checkpoint complete on every rank, and the early stop it decided, if it did."""
        emit("checkpoint", epoch=entry["epoch"], step=entry["step"], epoch_end=epoch_end, uri=entry["uri"],
             save_s=entry["save_s"], write_s=entry["write_s"])
        if self.stopped is not None and self.stopped["uri"] == entry["uri"]:
            emit("early_stop", **self.stopped)

    def notice_event(self, fields: dict) -> None:
        """Rank 0: a checkpoint written on notice (its fields: notice.REASONS', the step, the URI)."""
        emit("notice", **fields)
        self.board.flush()

    def export_event(self, best: dict, destination: str | None, adapter_uri: str | None, done: dict,
                     export_s: float, base, proof: dict) -> None:
        """Rank 0, after the export and its proof: what was exported, and the `result` event."""
        from . import export

        cfg = self.cfg
        which = (f"epoch {best.get('epoch')} step {best.get('step')} ({cfg.checkpoint_score_attribute}="
                 f"{best.get(cfg.checkpoint_score_attribute)})")
        if adapter_uri:
            say(f"Exported the LoRA adapter of {which} in peft's format to {adapter_uri}")
        if destination is not None:
            say(f"Exported {which} to {destination}{' (the adapter merged in)' if adapter_uri else ''} in "
                f"{done['dtype']} in {export_s:.1f}s; from the base: {done['towers']} tower "
                f"weights, {', '.join(done['copied']) or 'no other file'}"
                + ("" if base is not None else f" (no directory of {cfg.model_id} to copy its other files from)"))
        say(export.proof_words(proof))
        final = {k: v for k, v in self.history[-1].items() if k not in ("uri", "save_s", "write_s")}
        emit("result", best_checkpoint_uri=best["uri"], best_epoch=best["epoch"], best_step=best.get("step"),
             exported_model_uri=destination, exported_adapter_uri=adapter_uri, metrics=final,
             stopped_early=self.stopped["reason"] if self.stopped else None)

    def replay_record(self, history: list[dict]) -> None:
        """Rank 0, after a restore: the `epoch` and `checkpoint` events of every epoch the
        restored checkpoint holds, again (`replayed: true`). The checkpoint resumed from may
        be one whose events were lost with the previous attempt's cluster (written, then the
        cluster deleted before its lines were read); the operator keys its history by epoch,
        so a replay of what it already has changes nothing, and one it never saw fills the
        gap: every epoch once in status.history, none lost."""
        from .resume import is_epoch_end

        for entry in history:
            if not is_epoch_end(entry.get("uri", "")):
                continue
            fields = {k: entry.get(k) for k in ("epoch", "step", "loss", "eval_loss", "epoch_time_s",
                                                 "tokens_per_s", "padded_tokens_per_s")}
            fields.update({k: entry[k] for k in (*generation.METRIC_KEYS.values(), generation.EXAMPLES_KEY) if k in entry})
            emit("epoch", epochs=self.cfg.num_epochs, replayed=True, **fields)
            emit("checkpoint", epoch=entry.get("epoch"), step=entry.get("step"), epoch_end=True,
                 uri=entry["uri"], save_s=entry.get("save_s"), write_s=entry.get("write_s"), replayed=True)
