"""Supervised fine-tuning (--method full or lora): the seed's method.

Trainable: every weight (full), or LoRA's adapters on the frozen bf16 base (lora.py).
A micro-batch's loss: the summed cross-entropy of its label tokens (loss.py's head at
label positions, or transformers' full logits), divided by the step's global label
count. No reference. Per epoch: the loss and eval loss the loop reports already. A
checkpoint holds the trained parameters and their AdamW state; the export the model (and,
for LoRA, the adapter)."""

from __future__ import annotations

import numpy as np

from ..data import fill_blocks


class SFT:
    name = "sft"
    label_head = True  # loss.py's head at label positions serves it

    def __init__(self, cfg):
        self.cfg = cfg

    def example_weights(self, examples) -> np.ndarray:
        """What each example adds to its step's divisor: its label tokens."""
        return examples.label_tokens

    def fill(self, examples, blocks: list[list[int]], max_seq_len: int, pad_id: int):
        return fill_blocks(examples.input_ids, examples.labels, blocks, max_seq_len, pad_id)

    def prepare(self, trainer, eval_data):
        """Before the first step (and before a restore): nothing to compute; the held-out
        data as the loop takes it (packed blocks)."""
        return eval_data

    def start_epoch(self) -> None:
        pass

    def loss_sum(self, trainer, batch: dict, cap: int | None, training: bool = True):
        return trainer.token_loss_sum(batch, cap)

    def start_eval(self) -> None:
        pass

    def epoch_sums(self, trainer, counted: int) -> dict:
        return {}

    def eval_sums(self, trainer) -> dict:
        return {}

    def words(self, metrics: dict) -> str:
        return ""
