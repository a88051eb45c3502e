"""The run's end (a mixin of train.Trainer): the best complete checkpoint (`best_entry`,
`exportable`), loaded if the model does not hold it, exported (the model, and LoRA's
adapter) and proven loadable before the `result` event (`export`; export.py)."""

from __future__ import annotations

import time

import torch.distributed as dist

from . import checkpoint as ckpt
from . import export as exporting
from . import run_events
from .model import base_directory

# Under <storage>/<run name>/, beside the model's `export`: the LoRA adapter (--method lora).
ADAPTER_EXPORT_DIR = "export-adapter"


def is_better(a: float, b: float, order: str) -> bool:
    return a < b if order == "min" else a > b


def best_entry(history: list[dict], attribute: str, order: str) -> dict | None:
    """The checkpoint with the best score (earliest wins a tie, as in Ray)."""
    best = None
    for entry in history:
        score = entry.get(attribute)
        if entry.get("uri") and score is not None and (best is None or is_better(score, best[attribute], order)):
            best = entry
    return best


class Finish:
    """Reads the trainer's history, stopped, weights_uri, model, tokenizer and held-out data."""

    def export(self) -> None:
        cfg = self.cfg
        self.settle_checkpoint(wait=True)  # the last checkpoint is complete and in the history
        self.stager.release()  # no more checkpoints: the host copy goes before rank 0 gathers the model
        best = best_entry(self.history, cfg.checkpoint_score_attribute, cfg.checkpoint_score_order)
        if self.stopped is not None and self.stopped["reason"] == "TargetEvalLoss":
            # The checkpoint that reached the target is the one asked for.
            best = next(e for e in self.history if e["uri"] == self.stopped["uri"])
        if best is None:
            raise RuntimeError("no checkpoint to export (was every epoch already done?)")
        best = self.exportable(best)
        if best["uri"] != self.weights_uri:
            ckpt.load_sharded(self.model, None, best["uri"], self.cpu_group)
        destination = ckpt.join_uri(cfg.storage_path, cfg.run_name, "export")
        start = time.perf_counter()
        base = base_directory(cfg.model_id) if self.rank == 0 else None
        adapter_uri = None
        if cfg.uses_lora:
            adapter_uri = ckpt.join_uri(cfg.storage_path, cfg.run_name, ADAPTER_EXPORT_DIR)
            ckpt.export_adapter(self.model, adapter_uri, cfg, self.cpu_group)
        done: dict = {}
        if not cfg.uses_lora or cfg.lora_export_merged:
            done = ckpt.export_hf(self.model, self.tokenizer, destination, self.cpu_group, base,
                                  lora_scaling=cfg.lora_alpha / cfg.lora_rank if cfg.uses_lora else None)
        else:
            destination = None  # --lora-export-merged false: the adapter only
        export_s = time.perf_counter() - start
        prompts = exporting.proof_prompts(self.eval_data, self.examples) if self.rank == 0 else []
        images = None
        if cfg.multimodal and self.rank == 0:  # each prompt's images: the export answers with them (media.py)
            from .media import proof_images

            images = proof_images(self.eval_data, self.examples, len(prompts), self.tokenizer)
        proof = exporting.prove_collective(self.rank, self.cpu_group, destination, adapter_uri, cfg.model_id,
                                           self.tokenizer, prompts, base, images=images)
        if self.rank == 0:
            self.export_event(best, destination, adapter_uri, done, export_s, base, proof)

    def exportable(self, best: dict) -> dict:
        """`best` if its weights are loaded or its files are all still there; else the newest
        complete checkpoint of this run. After --resume-from, the history carries the earlier
        run's checkpoints, and that run's --keep-checkpoints may have deleted the best one
        since. Rank 0 looks and says why; every rank exports the same one."""
        decision = [best]
        if self.rank == 0 and best["uri"] != self.weights_uri and not ckpt.is_complete(best["uri"]):
            run_dir = ckpt.join_uri(self.cfg.storage_path, self.cfg.run_name)
            newest = ckpt.latest_complete(run_dir) or self.weights_uri
            state = ckpt.read_trainer_state(newest) if newest != self.weights_uri else {}
            entries = self.history + list(state.get("history", []))
            decision[0] = next((e for e in reversed(entries) if e.get("uri") == newest),
                               {"uri": newest, "epoch": state.get("epoch"), "step": state.get("step")})
            run_events.say(f"The best checkpoint {best['uri']} ({self.cfg.checkpoint_score_attribute}="
                           f"{best.get(self.cfg.checkpoint_score_attribute)}) is gone or incomplete (an earlier "
                           f"run's --keep-checkpoints may have deleted it); exporting the newest complete one, "
                           f"{newest}")
        dist.broadcast_object_list(decision, src=0, group=self.cpu_group)
        return decision[0]
