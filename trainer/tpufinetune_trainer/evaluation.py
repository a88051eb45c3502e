"""What a checkpoint of the loop is made of (a mixin of train.Trainer): the held-out loss
(`evaluate`), at an epoch's end the generation metrics, the method's own figures, the
epoch's line and event and the TensorBoard scalars, early stopping, then the checkpoint
itself (`report`). Step checkpoints and notices come through `report` too."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import generation, notice, resume


class Evaluation:
    """Reads the trainer's model, method, held-out blocks, history and position."""

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_blocks is None:
            return None
        per_device, indices = self.plan.blocks, self.eval_index
        self.model.eval()
        self.method.start_eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for step in range(len(indices) // per_device):
            total += self.method.loss_sum(self, self.eval_blocks.gather(indices[step * per_device:(step + 1) * per_device]),
                                          self.eval_cap, training=False)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        label_tokens = int(self.eval_data.label_tokens.sum())  # known on the host
        return float(total.item()) / label_tokens if label_tokens else None

    def report(self, m: dict, epoch_end: bool, evaluate: bool = True, synchronous: bool = False) -> None:
        eval_loss = self.evaluate() if evaluate else None  # overlaps the previous save's writes
        # Each epoch's generation metrics (collective; --generate-examples), before a notice's
        # agreement as the loss: a SIGTERM during either makes this epoch's save the notice's.
        generated, samples = ({}, {})
        if epoch_end and eval_loss is not None and self.generation_items:
            generated, samples = generation.evaluate_generation(self)
        # A SIGTERM during the epoch's evaluation: the epoch's own checkpoint is the notice's,
        # written now (synchronously) instead of after the next step.
        terminating = epoch_end and not synchronous and self.agreed_at_epoch_end() == notice.TERMINATING
        synchronous = synchronous or terminating
        # The previous save completes first: at most one in flight, and early stopping and
        # the new checkpoint's history see every earlier checkpoint.
        self.settle_checkpoint(wait=True)
        metrics = {"epoch": m["epoch"], "step": m["step"], "loss": round(m["loss"], 4),
                   "eval_loss": None if eval_loss is None else round(eval_loss, 4),
                   "epoch_time_s": round(m["epoch_time_s"], 2), "tokens_per_s": round(m["tokens_per_s"], 1),
                   "padded_tokens_per_s": round(m["padded_tokens_per_s"], 1)}
        # The method's own figures (DPO: rewards, margin, accuracy, on the held-out pairs too),
        # new keys beside SFT's, which stay as they were.
        extra = dict(m.get("method") or {})
        if eval_loss is not None:
            extra.update(self.method.eval_sums(self))
        metrics.update({k: round(v, 4) for k, v in extra.items()})
        metrics.update(generated)
        if self.rank == 0 and epoch_end:
            self.epoch_event(m, metrics, samples)
        if self.rank == 0:  # every step up to this checkpoint's is in storage before it is
            self.board.evaluation(metrics, epoch_end)
            self.board.samples(metrics["step"], samples)
            self.board.flush()
        if eval_loss is not None:
            self.early_stop_check(eval_loss)
        state_extra = {"epoch_step": m["epoch_step"], "epoch_steps": self.epoch_steps,
                       "epoch_loss_sum": m["epoch_loss_sum"], "epoch_label_tokens": m["epoch_label_tokens"],
                       "training_s": round(self.training_s(), 3), "stale_evals": self.stale_evals}
        name = resume.checkpoint_name(epoch_end, m["epoch"], m["step"], self.start_id)
        args = (name, {k: v for k, v in metrics.items() if v is not None}, state_extra)
        # The flag only when set: benchmarks/bench_trainer.py wraps checkpoint(name, metrics, state_extra).
        if synchronous:
            self.checkpoint(*args, synchronous=True)
        else:
            self.checkpoint(*args)
        if epoch_end:
            self.epoch, self.epoch_step, self.carried = self.epoch + 1, 0, (0.0, 0)
            self.end_pending = False
        if terminating:
            self.on_notice(notice.TERMINATING, lambda: m)  # saved above: says so, and stops

    def early_stop_check(self, eval_loss: float) -> None:
        """After an evaluation: stop at --target-eval-loss, or after --early-stopping-patience
        evaluations in a row that did not lower the best eval loss."""
        cfg = self.cfg
        best = min((e["eval_loss"] for e in self.history if e.get("eval_loss") is not None), default=None)
        self.stale_evals = 0 if best is None or eval_loss < best else self.stale_evals + 1
        common = {"epoch": self.epoch, "step": self.global_step, "eval_loss": round(eval_loss, 4),
                  "training_s": round(self.training_s(), 3)}
        if cfg.target_eval_loss and eval_loss <= cfg.target_eval_loss:
            self.stopped = {"reason": "TargetEvalLoss", "target_eval_loss": cfg.target_eval_loss, **common}
        elif cfg.early_stopping_patience and self.stale_evals >= cfg.early_stopping_patience:
            self.stopped = {"reason": "Patience", "patience": cfg.early_stopping_patience,
                            "best_eval_loss": best, **common}
