"""Direct preference optimisation (--method dpo), on the same loop and FSDP2 model as SFT.

Trainable: every weight, or with --dpo-lora true LoRA's adapters (the --lora-* settings).
Data: preference pairs (preference.py), each packed whole as two segments (chosen,
rejected); a step takes the tutorial's batch of pairs and its loss is the mean of the
pairs' DPO losses (dpo_loss.py): each micro-batch sums its pairs' losses and the loop
divides by the step's global pair count, as SFT divides by label tokens.

A micro-batch: one forward of the policy over its blocks (transformers' full logits:
loss.py's label head sums a micro-batch into one number, and DPO needs a sum per
response), the log-probability of every response token summed per segment. The
reference (unless --dpo-reference-free):
- LoRA: the same model with its adapters switched off (lora.adapters_disabled), one more
  forward without gradients per micro-batch; no second copy of the weights;
- full: the starting model's sums computed once, before the first step (and again at each
  start, before a restore puts trained weights in), one forward over every training and
  held-out pair; stored beside the pairs (preference.PairExamples.reference) and handed to
  each micro-batch in its block layout. No second model in memory.

Reported per epoch, beside `loss` (the mean pair loss) and `eval_loss`: the mean chosen
and rejected rewards, the margin and the preference accuracy, on the training pairs and
(prefixed `eval_`) the held-out ones. A checkpoint and the export hold the policy as SFT's
do (the merged model and the adapter for LoRA)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from ..data import IGNORE_INDEX
from ..preference import PairExamples, fill_pair_blocks, pack_pairs, segment_columns
from .dpo_loss import SUM_KEYS, DPOSettings, dpo_loss, segment_logps


def settings_of(cfg) -> DPOSettings:
    return DPOSettings(beta=cfg.dpo_beta, loss=cfg.dpo_loss, label_smoothing=cfg.dpo_label_smoothing,
                       reference_free=cfg.dpo_reference_free)


class DPO:
    name = "dpo"
    label_head = False  # a sum per response, not one per micro-batch

    def __init__(self, cfg):
        self.cfg = cfg
        self.settings = settings_of(cfg)
        self.segments = segment_columns(cfg.max_seq_len)
        self.stored_reference = not self.settings.reference_free and not cfg.uses_lora
        self.train_sums: torch.Tensor | None = None
        self.eval_total: torch.Tensor | None = None

    def example_weights(self, examples) -> np.ndarray:
        """Each pair counts once in its step's divisor: the loss is the mean over pairs."""
        return np.ones(len(examples), dtype=np.int64)

    def fill(self, examples, blocks: list[list[int]], max_seq_len: int, pad_id: int):
        return fill_pair_blocks(examples, blocks, max_seq_len, pad_id, self.segments)

    # ------------------------------------------------------------------ reference
    def prepare(self, trainer, eval_pairs: PairExamples | None):
        """Before the first step and before any restore: the reference's sums for every
        pair (full fine-tuning, not reference-free), then the held-out pairs packed."""
        if self.stored_reference:
            for pairs in (trainer.examples, eval_pairs):
                if pairs is not None:
                    pairs.reference = self.reference_sums(trainer, pairs)
        if eval_pairs is None:
            return None
        packed, _ = pack_pairs(eval_pairs, self.cfg.max_seq_len, trainer.pad_id)
        return packed

    @torch.no_grad()
    def reference_sums(self, trainer, pairs: PairExamples) -> np.ndarray:
        """[pairs, 2] fp32: the current (starting) model's summed response log-probabilities.
        Every rank runs the same number of forwards (FSDP's collectives), each on its own
        share of the blocks; one all_reduce puts every pair's figures on every rank."""
        from ..device_blocks import DeviceBlocks

        blocks, per = self.pair_blocks(pairs), trainer.plan.blocks
        world, rank = trainer.world, trainer.rank
        rounds = -(-len(blocks) // (world * per))
        out = torch.zeros(len(pairs), 2, dtype=torch.float32, device=trainer.device)
        trainer.model.eval()
        for r in range(rounds):
            mine = [blocks[b] if b < len(blocks) else [] for b in
                    range((r * world + rank) * per, (r * world + rank + 1) * per)]
            packed = fill_pair_blocks(pairs, mine, self.cfg.max_seq_len, trainer.pad_id, self.segments)
            device = DeviceBlocks(packed, trainer.device, trainer.pad_id)
            batch = device.gather(torch.arange(len(mine), device=trainer.device))
            sums, _ = self.policy_sums(trainer, batch)
            for row, members in enumerate(mine):
                for k, i in enumerate(sorted(members)):
                    out[i] = sums[row, 2 * k:2 * k + 2]
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu().numpy()

    def pair_blocks(self, pairs: PairExamples) -> list[list[int]]:
        from ..data import bin_pack

        return bin_pack(pairs.lengths, self.cfg.max_seq_len)

    # ------------------------------------------------------------------ a micro-batch
    def policy_sums(self, trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        masks = trainer.masks(batch["segment_ids"])
        out = trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=masks,
                            use_cache=False)
        return segment_logps(out.logits, batch["targets"], batch["segment_ids"], self.segments, IGNORE_INDEX)

    def reference_of(self, trainer, batch: dict) -> torch.Tensor | None:
        if self.settings.reference_free:
            return None
        if self.stored_reference:
            return batch["reference"]
        from ..lora import adapters_disabled

        with torch.no_grad(), adapters_disabled(trainer.model):
            return self.policy_sums(trainer, batch)[0]

    def pair_losses(self, trainer, batch: dict):
        sums, counts = self.policy_sums(trainer, batch)
        reference = self.reference_of(trainer, batch)
        present = counts[:, 0::2] > 0  # a pair's chosen response has at least one token
        ref_chosen = ref_rejected = None
        if reference is not None:
            ref_chosen, ref_rejected = reference[:, 0::2], reference[:, 1::2]
        out = dpo_loss(sums[:, 0::2], sums[:, 1::2], ref_chosen, ref_rejected, self.settings,
                       counts[:, 0::2], counts[:, 1::2])
        zero = torch.zeros((), dtype=out.losses.dtype, device=out.losses.device)
        out.losses = torch.where(present, out.losses, zero)
        out.chosen_rewards = torch.where(present, out.chosen_rewards, zero)
        out.rejected_rewards = torch.where(present, out.rejected_rewards, zero)
        margin = out.chosen_rewards - out.rejected_rewards
        metric = torch.stack([out.losses.detach().sum(), out.chosen_rewards.sum(), out.rejected_rewards.sum(),
                              margin.sum(), ((margin > 0) & present).float().sum()]).float()
        return out.losses.sum(), metric

    def loss_sum(self, trainer, batch: dict, cap: int | None, training: bool = True) -> torch.Tensor:
        """The sum of the micro-batch's pair losses (what the loop divides by the pairs);
        its metric sums are added to the epoch's (or the evaluation's) on the device."""
        summed, metric = self.pair_losses(trainer, batch)
        if training:
            self.train_sums = metric if self.train_sums is None else self.train_sums + metric
        else:
            self.eval_total = metric if self.eval_total is None else self.eval_total + metric
        return summed

    # ------------------------------------------------------------------ per epoch
    def start_epoch(self) -> None:
        self.train_sums = None

    def start_eval(self) -> None:
        self.eval_total = None

    def _means(self, sums: torch.Tensor | None, pairs: int, device, prefix: str) -> dict:
        total = torch.zeros(len(SUM_KEYS), dtype=torch.float32, device=device) if sums is None else sums.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        values = total.tolist()
        return {f"{prefix}{key}": values[i] / max(pairs, 1) for i, key in enumerate(SUM_KEYS) if key != "loss"}

    def epoch_sums(self, trainer, pairs: int) -> dict:
        """Collective: the epoch's mean rewards, margin and accuracy over its `pairs` so far."""
        return self._means(self.train_sums, pairs, trainer.device, "")

    def eval_sums(self, trainer) -> dict:
        """Collective: the held-out pairs' means (after evaluate)."""
        pairs = int(trainer.eval_data.label_tokens.sum()) if trainer.eval_data is not None else 0
        return self._means(self.eval_total, pairs, trainer.device, "eval_")

    def words(self, metrics: dict) -> str:
        def part(prefix: str) -> str:
            if metrics.get(f"{prefix}accuracy") is None:
                return ""
            return (f" | {prefix}rewards chosen={metrics[f'{prefix}rewards_chosen']:.4f} rejected="
                    f"{metrics[f'{prefix}rewards_rejected']:.4f} margin={metrics[f'{prefix}margin']:.4f} "
                    f"accuracy={metrics[f'{prefix}accuracy']:.3f}")
        return part("") + part("eval_")
