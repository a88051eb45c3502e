"""Block-diagonal attention masks for packed blocks, built on the device from segment ids.

Given no mask, transformers derives one from position ids and, to decide whether a batch
is packed, reads a device tensor back to the host on every forward. Passing the masks in
skips that: they are built here once per micro-batch, with device ops only, and shared
by every layer. A token attends to earlier tokens of its own example (its segment), and
on sliding-window layers only to the last `sliding_window` of them, exactly as
transformers' own causal and sliding-window masks do for a lone example.
"""

from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


class MaskBuilder:
    """Per-model constants (causal and window bands) built once; `__call__` per batch."""

    def __init__(self, config, length: int, device, dtype: torch.dtype, attn_implementation: str):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = set(getattr(text, "layer_types", None) or [])
        # Models with mixed layer types (Gemma, Qwen's sliding layers) take a mapping
        # from layer type to mask; the others take one 4-D mask, which transformers uses
        # as given.
        self.by_layer_type = SLIDING in layer_types
        window = getattr(text, "sliding_window", None)
        q = torch.arange(length, device=device)
        distance = q[:, None] - q[None, :]
        self.causal = distance >= 0
        self.window = (distance < window) if (self.by_layer_type and window) else None
        # eager attention adds the mask to the scores; sdpa takes a boolean "may attend".
        self.additive = attn_implementation == "eager"
        self.dtype = dtype

    def _format(self, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[:, None, :, :]  # [batch, heads=1, query, key]
        if not self.additive:
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def __call__(self, segment_ids: torch.Tensor, together: torch.Tensor | None = None):
        """`together` ([batch, length], -1 elsewhere): groups of tokens that also see each
        other whole (each image's soft tokens, for a model that attends bidirectionally
        within an image: media.image_groups), on the sliding-window layers only where the
        model has both kinds (Gemma 4's rule: its global layers stay causal)."""
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        full = same & self.causal
        whole = full
        if together is not None:
            whole = full | ((together[:, :, None] == together[:, None, :]) & (together[:, :, None] >= 0))
        if not self.by_layer_type:
            return self._format(whole)
        sliding = whole & self.window if self.window is not None else whole
        return {FULL: self._format(full), SLIDING: self._format(sliding)}
