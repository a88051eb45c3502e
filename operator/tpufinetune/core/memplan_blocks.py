"""The text block's saved activations, the planner's fitted constants (memplan.py's
docstring says what a step holds; benchmarks/bench_memplan.py fits and checks them): what a
decoder block keeps for the backward per token, and its attention's L x L matrices. A vision
tower's encoder block (memplan_media.py) is counted with the same constants. Pure (no I/O)."""
from __future__ import annotations

from .memplan_shapes import ModelShape

# Elements saved for the backward per token and layer, in the compute dtype, as multiples
# of the widths (a Gemma block: norms, q/k/v/o, gate/up/act/product, residuals); fitted to
# the FITTED configurations of benchmarks/bench_memplan.py (its HELD_OUT ones check them).
SAVED_PER_HIDDEN = 16
SAVED_PER_INTERMEDIATE = 4
SAVED_PER_ATTENTION_WIDTH = 4
# Eager attention keeps every layer's probabilities (the softmax's output is the next
# matmul's input), and while a layer runs its scores, scaled and masked, exist beside them
# (one layer at a time). Fitted to e1 (1024 tokens) and f9 (4096): 0.92 and 1.07 of the
# measured peaks, where 2 kept matrices a layer gave 1.12 and 1.20.
SAVED_ATTENTION_MATRICES = 1
EAGER_TRANSIENT_MATRICES = 2
# In bfloat16 the block also keeps fp32 copies (4 B an element) the fp32 fit never saw:
# Gemma 4's RMSNorm upcasts its input and keeps it and the normed fp32 tensor, two fp32
# copies per element of every norm (five hidden-wide a layer; q's over the attention width,
# k's and v's over the kv width), and eager softmax runs in fp32 and keeps its fp32 output
# beside the bf16 probabilities: 10 x hidden + 2 x (attention + 2 x kv width) fp32 elements
# per token and layer, one fp32 heads x L^2 per layer. Fitted to bench_memplan's b1 (bf16
# sdpa: 642 MiB measured, 462 planned without them, 630 with); b2 (bf16 eager) then measured
# 1256 against 1259 (0.57 without), the held-out h2 (bf16 sdpa, 2048 tokens) 1.04 (0.79).
UPCAST_PER_HIDDEN = 10
UPCAST_PER_ATTENTION_WIDTH = 2  # over the attention width and twice the kv width (q, k, v norms)
UPCAST_ATTENTION_MATRICES = 1


def activation_bytes(shape: ModelShape, tokens: int, scores: int, compute_bytes: int, checkpointing: str,
                     lora_bytes: int = 0) -> int:
    """Activations saved for the backward at its start, and the one block recomputed in it.
    `scores`: one block's eager attention matrices (0 with sdpa); `lora_bytes`: bytes per
    token and layer LoRA keeps beyond full fine-tuning (its adapters and their dropout)."""
    upcast = 4 if compute_bytes < 4 else 0  # fp32 copies a lower-precision step keeps
    width = shape.attention_width
    normed = width + 2 * shape.module_widths()["k_proj"][1]  # q, k and v norms
    attention = tokens * (compute_bytes * SAVED_PER_ATTENTION_WIDTH * width
                          + upcast * UPCAST_PER_ATTENTION_WIDTH * normed) + scores
    rest = tokens * (compute_bytes * (SAVED_PER_HIDDEN * shape.hidden + SAVED_PER_INTERMEDIATE * shape.intermediate)
                     + upcast * UPCAST_PER_HIDDEN * shape.hidden
                     + lora_bytes)
    block_input = tokens * compute_bytes * shape.hidden
    if checkpointing == "block":
        return shape.layers * block_input + rest + attention
    if checkpointing == "selective":
        return shape.layers * (rest + block_input) + attention
    return shape.layers * (rest + attention)
