"""DPO's terms in the memory plan (spec.training.method dpo; the trainer's methods/dpo.py).

Pure (no I/O). A DPO step holds what an SFT step of the same trainable set holds (every
weight, or LoRA's adapters on the frozen bf16 base), with these differences:

- The loss runs over transformers' full logits (a summed log-probability per response, not
  loss.py's label head), through dpo_loss.segment_logps: Gemma's softcap, an fp32 copy
  (bf16 only), log_softmax, a gather. Counted per logit from that code, not fitted: the
  policy's graph keeps the softcap's tanh output (compute dtype) and the fp32 log-softmax
  (`policy_saved`), and its backward adds two fp32 gradients (the gather's, the
  log-softmax's: BACKWARD_GRADS), 16 B a logit in fp32 and 14 in bf16. Measured on the head
  alone (benchmarks/bench_memplan_dpo.py --head: 2048 tokens x 32768, softcap 30, CPU):
  15.9 and 13.9 B. SFT's --loss-head full
  (cross_entropy) measured five fp32 tensors (FULL_LOGITS), not this.
- Pairs: a pair's chosen and rejected sequences are two segments of one block
  (preference.fill_pair_blocks), never split, so a micro-batch is still blocks x maxSeqLen
  tokens and its activations are SFT's for those tokens; the per-segment sums beside them
  ([blocks, maxSeqLen / 2 + 2] fp32) are negligible.
- The reference, one of REFERENCES (which one is the trainer's choice, `reference_of`):
  - `stored` (full fine-tuning): the starting model's summed response log-probabilities,
    computed once before the first step by a no-grad forward and kept with the pairs (8 B a
    pair on the host). No second copy of the weights; that forward keeps no activations and
    runs before AdamW's state exists, so it stays below a step's peak: nothing is added.
  - `adapters-off` (LoRA): the same model with its adapters disabled, one more no-grad
    forward per micro-batch, after the policy's and before its backward: while it runs,
    every saved activation and the policy's saved logits are held, and it makes its own
    logits, their fp32 copy (bf16 only) and log-softmax (`reference_logits`). The head's
    term is the larger of that and the backward's: in bf16 the reference's (16 B a logit
    against 14; measured 15.9 with it, 13.9 without), in fp32 the same 16 B (15.9, 15.9).
  - `none` (referenceFree): no reference.
"""
from __future__ import annotations

REFERENCES = ("stored", "adapters-off", "none")
WORDS = {"stored": "reference log-probabilities computed once before training (no second copy)",
         "adapters-off": "reference: the base with the adapters disabled (no second copy)",
         "none": "reference-free"}
# fp32 [tokens, vocab] gradients at the backward's start: the gather's and log_softmax's.
BACKWARD_GRADS = 2


def policy_saved(compute_bytes: int) -> int:
    """Bytes per logit the policy's graph keeps until its backward: the softcap's tanh
    output (compute dtype) and log_softmax's fp32 output (dpo_loss.segment_logps)."""
    return compute_bytes + 4


def reference_logits(compute_bytes: int) -> int:
    """Bytes per logit of the reference forward at its peak: its logits (compute dtype),
    their fp32 copy where the compute dtype is narrower, and the fp32 log-softmax."""
    return compute_bytes + (4 if compute_bytes < 4 else 0) + 4


def logit_bytes(tokens: int, vocab: int, compute_bytes: int, reference: str) -> int:
    """The loss head's logits at the step's peak: the policy's saved logits and the
    backward's fp32 gradients, or, where larger, the reference forward's beside the saved
    ones (LoRA)."""
    if reference not in REFERENCES:
        raise ValueError(f"unknown DPO reference {reference!r}; expected one of {', '.join(REFERENCES)}")
    per_logit = policy_saved(compute_bytes) + 4 * BACKWARD_GRADS
    if reference == "adapters-off":
        per_logit = max(per_logit, policy_saved(compute_bytes) + reference_logits(compute_bytes))
    return tokens * vocab * per_logit


def reference_of(lora: bool, reference_free: bool) -> str:
    """The reference the trainer holds (methods/dpo.py): none when reference-free, the base
    with adapters disabled for LoRA, stored log-probabilities for full fine-tuning."""
    return "none" if reference_free else "adapters-off" if lora else "stored"


def trainable(method: str, dpo_lora: bool) -> str:
    """What device_bytes counts as trained: full or lora (DPO trains one or the other)."""
    return ("lora" if dpo_lora else "full") if method == "dpo" else method
