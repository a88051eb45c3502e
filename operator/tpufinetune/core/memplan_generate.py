"""Generation's terms in the memory plan (spec.training.evaluation.generate; the trainer's
generation.py). Pure (no I/O).

After each epoch's held-out loss, every rank answers its share of the held-out prompts on its
own FSDP2 shard of the model, greedily, one training micro-batch of prompts at a time (fewer
where its share is smaller), each batch left-padded to its longest prompt (at most maxSeqLen
tokens) and run by transformers' `generate` for up to maxNewTokens new tokens with its
dynamic cache. What it adds on a device, beside what stays there between steps:

- the key/value cache of one batch: per layer that computes keys and values (Gemma 4's
  KV-shared layers reuse an earlier layer's and cache none), batch x tokens x 2 x kv heads x
  head dim in the compute dtype, a sliding-window layer keeping its last window - 1 tokens
  only (transformers' DynamicSlidingWindowLayer), and while a layer appends a token the old
  and the new copy of that layer's cache (torch.cat);
- the prompt's forward (the prefill), with no gradient: one layer's transients at a time
  (hidden- and MLP-wide tensors, the query and keys, eager attention's scores and their fp32
  softmax or sdpa's additive mask), the two attention masks of the batch, and Gemma's
  per-layer inputs for every prompt token;
- the last position's logits only (`generate` passes logits_to_keep=1): the compute-dtype
  logits, the softcap's copies and generate's fp32 copy, batch x vocab.

When it runs, the training step's activations, its gradients (the optimizer step sets them
to None) and the loss head's buffers are freed: what stays is the sharded weights, AdamW's
state, the replicated per-layer table and the gathered copies (FSDP2 gathers each block in a
no-grad forward as in training; with every block kept gathered, a no-grad forward reshards
none of them). So a device's peak is the larger of the training step's and the generation's
(that resident state plus the terms above), never their sum (`peak`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .memplan_shapes import FULL_ATTENTION_EVERY, ModelShape

# The refusal's words where generating sets the peak.
WHILE = " while generating (spec.training.evaluation.generate)"
# transformers' Gemma4TextConfig default sliding window; a config.json's `sliding_window` wins.
SLIDING_WINDOW = 512
# Layers reusing an earlier layer's keys and values (config.json's num_kv_shared_layers):
# E2B's last 20 (gemma.cpp, as memplan_shapes' E2B row). Not found for the others: every
# layer is counted (an upper bound).
KV_SHARED_LAYERS = {"gemma-4-E2B": 20}
# One layer's prefill transients per prompt token, as multiples of the widths, in the compute
# dtype: hidden-wide tensors (the layer's input, its normed copy, the attention's and the
# MLP's outputs), the MLP's (gate's activation, up, their product) and the attention's (query,
# its normed and rotated copy, the output). In a narrower dtype RMSNorm's fp32 copies
# (its upcast input and normed output) come on top.
PREFILL_PER_HIDDEN = 4
PREFILL_PER_INTERMEDIATE = 3
PREFILL_PER_ATTENTION_WIDTH = 3
PREFILL_UPCAST_PER_HIDDEN = 2
# Gemma's per-layer inputs for the prompt (layers x PLE width a token): the embedding's rows,
# their projection, and the sum kept through the forward, in the compute dtype.
PREFILL_PLE_COPIES = 2
# The last position's logits, bytes per vocabulary entry beyond the compute dtype's three
# (the logits, the softcap's division and tanh): generate's fp32 copy and its processed copy.
LOGITS_FP32_COPIES = 2


@dataclass(frozen=True)
class GenerationPlan:
    """What one device's generation holds, beside the resident state it runs on."""

    batch: int  # prompts a device answers at a time
    prompt_tokens: int  # the longest prompt of a batch, at most maxSeqLen
    new_tokens: int  # maxNewTokens
    bytes: int  # what it adds per device: the cache, the prefill's transients, the logits
    peak_bytes: int  # the resident state between steps plus `bytes`, per device

    def words(self, training_bytes: int) -> str:
        """status.plan's message part: what it adds, and whether it sets the peak."""
        sets = "; it sets the peak" if self.peak_bytes > training_bytes else ""
        return (f"generation ({self.batch} prompts of up to {self.prompt_tokens} tokens at a time, "
                f"{self.new_tokens} new tokens) adds {self.bytes / 2**30:.1f} GiB per device to the state kept "
                f"between steps{sets}")


def prompts_at_a_time(batch_per_device: int, examples: int, world: int) -> int:
    """generation.generate_share: each rank answers ceil(examples / world) prompts, a training
    micro-batch at a time."""
    return max(1, min(batch_per_device, math.ceil(examples / max(world, 1))))


def cache_bytes(shape: ModelShape, batch: int, tokens: int, compute_bytes: int, window: int = SLIDING_WINDOW,
                shared_layers: int = 0) -> int:
    """The key/value cache of `batch` sequences of `tokens` tokens: every layer that computes
    keys and values, its sliding-window layers keeping window - 1 tokens."""
    stored = max(shape.layers - shared_layers, 0)
    # A model without Gemma 4's layout (no full-attention count) attends to everything in every layer.
    full = _full_layers_among(shape, stored) if shape.full_layers else stored
    sliding = stored - full
    kv = shape.kv_heads or max(shape.heads // 2, 1)
    per_layer_token = 2 * kv * compute_bytes * batch
    return per_layer_token * (full * (shape.full_head_dim or shape.head_dim) * tokens
                              + sliding * shape.head_dim * min(tokens, max(window - 1, 1)))


def _full_layers_among(shape: ModelShape, first: int) -> int:
    """Full-attention layers among the first `first` (every sixth; all of them when none is shared)."""
    if first >= shape.layers:
        return shape.full_layers
    return min(shape.full_layers, sum(1 for i in range(first) if (i + 1) % FULL_ATTENTION_EVERY == 0))


def prefill_bytes(shape: ModelShape, batch: int, prompt: int, compute_bytes: int, eager: bool) -> int:
    """The prompt's no-grad forward beyond the cache: its widest layer's transients (the
    attention scores of every head for eager, fp32 softmax included; sdpa's additive mask),
    the batch's two masks and the per-layer inputs."""
    tokens = batch * prompt
    upcast = 4 if compute_bytes < 4 else 0
    widest_attention = shape.heads * (shape.full_head_dim or shape.head_dim)
    layer = tokens * (compute_bytes * (PREFILL_PER_HIDDEN * shape.hidden + PREFILL_PER_INTERMEDIATE * shape.intermediate
                                       + PREFILL_PER_ATTENTION_WIDTH * widest_attention)
                      + upcast * PREFILL_UPCAST_PER_HIDDEN * shape.hidden)
    # Eager: the masked scores beside softmax's fp32 output, and in a narrower dtype its cast back.
    per_score = compute_bytes + 4 + (compute_bytes if compute_bytes < 4 else 0)
    scores = batch * prompt ** 2 * (per_score * shape.heads if eager else compute_bytes)
    masks = 2 * batch * prompt ** 2 * (compute_bytes if eager else 1)
    per_layer_inputs = PREFILL_PLE_COPIES * tokens * shape.layers * shape.ple_width * compute_bytes
    return layer + scores + masks + per_layer_inputs


def logits_bytes(shape: ModelShape, batch: int, compute_bytes: int) -> int:
    return batch * shape.vocab * (3 * compute_bytes + 4 * LOGITS_FP32_COPIES)


def generation_bytes(shape: ModelShape, batch: int, prompt: int, new_tokens: int, compute_bytes: int, eager: bool,
                     window: int = SLIDING_WINDOW, shared_layers: int = 0) -> int:
    """What generating `new_tokens` after `batch` prompts of `prompt` tokens adds on a device:
    the larger of the prefill (the prompt's cache and its forward's transients) and the last
    decoding step (the whole cache, one layer's old copy beside its new one)."""
    logits = logits_bytes(shape, batch, compute_bytes)
    prefill = (cache_bytes(shape, batch, prompt, compute_bytes, window, shared_layers)
               + prefill_bytes(shape, batch, prompt, compute_bytes, eager) + logits)
    total = prompt + new_tokens
    one_layer = cache_bytes(ModelShape("one layer", 0, 1, shape.hidden, 0, shape.heads, shape.full_head_dim
                                       or shape.head_dim, 0, kv_heads=shape.kv_heads), batch, total, compute_bytes)
    decode = cache_bytes(shape, batch, total, compute_bytes, window, shared_layers) + one_layer + logits
    return max(prefill, decode)


def resident_bytes(weights: int, optimizer: int, frozen_tables: int, gathered: int, block_grads: int) -> int:
    """What a device holds between steps, as generation finds it: no gradient (set to None by
    the optimizer step), no activation; the gathered copies without a block's gradients."""
    return weights + optimizer + frozen_tables + gathered - block_grads


def plan(shape: ModelShape, model_name: str, config: dict | None, batch: int, max_seq_len: int, new_tokens: int,
         compute_bytes: int, eager: bool, resident: int) -> GenerationPlan:
    """The generation of a run: its prompts of up to maxSeqLen tokens, the model's window and
    KV-shared layers from its config.json where at hand, else the defaults above."""
    text = (config or {}).get("text_config") or config or {}
    window = int(text.get("sliding_window") or SLIDING_WINDOW)
    shared = text.get("num_kv_shared_layers")
    if shared is None:
        shared = next((n for name, n in KV_SHARED_LAYERS.items() if name.lower() in model_name.lower()), 0)
    added = generation_bytes(shape, batch, max_seq_len, new_tokens, compute_bytes, eager, window, int(shared))
    return GenerationPlan(batch, max_seq_len, new_tokens, added, resident + added)


def of_request(request, shape: ModelShape, part, full: bool, compute_bytes: int, eager: bool,
               devices: int) -> GenerationPlan | None:
    """The generation of a memplan.Request whose step holds `part` (a Breakdown; `full`: every
    weight trains), on `devices` devices a slice; None when nothing is generated."""
    if not request.generate_max_new_tokens:
        return None
    block_grads = (compute_bytes + 4) * shape.block_parameters if full else 0
    resident = resident_bytes(part.weights, part.optimizer, part.frozen_tables, part.gathered, block_grads)
    batch = prompts_at_a_time(request.batch_per_device, request.generate_examples or request.batch_per_device,
                              devices * request.slices)
    return plan(shape, request.model_id, request.model_config, batch, request.max_seq_len,
                request.generate_max_new_tokens, compute_bytes, eager, resident)


def fix(request, fits) -> str:
    """Where the step fits and the generation does not: the largest maxNewTokens that fits,
    else generation off (`fits(request)`: the plan of a changed memplan.Request fits). Fewer
    examples are no fix: a device answers a micro-batch at a time. '' where the step itself
    does not fit, or nothing is generated."""
    if not request.generate_max_new_tokens or not fits(replace(request, generate_max_new_tokens=0)):
        return ""
    most = largest_fitting(lambda tokens: bool(fits(replace(request, generate_max_new_tokens=tokens))),
                           request.generate_max_new_tokens - 1)
    off = "training.evaluation.generate unset (no generation)"
    return f"training.evaluation.generate.maxNewTokens {most} or fewer, or {off}" if most else off


def peak(training_bytes: int, generation: GenerationPlan | None) -> int:
    """A device's peak: generation runs between steps, on the resident state alone, so the
    larger of the two, not their sum."""
    return max(training_bytes, generation.peak_bytes) if generation is not None else training_bytes


def largest_fitting(fits, most: int) -> int:
    """The largest maxNewTokens in 1..most for which `fits(tokens)`; 0 when none (the figure
    grows with the tokens: a bisection)."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
