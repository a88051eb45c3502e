"""Packed blocks on the device: what a step (or the evaluation) gathers its micro-batches from."""

from __future__ import annotations

import numpy as np
import torch

from .data import IGNORE_INDEX, Packed


class DeviceBlocks:
    """Packed blocks copied to the device in one transfer (the evaluation's once, a
    window's training blocks). A micro-batch is gathered there by indices; from index `len(packed)`
    on, to `rows`, all-padding filler blocks (no labels; every window one shape: no recompile).

    Token ids, position ids and segment ids are int32 (the embedding lookup, the rotary
    positions and the masks take them; half of int64's device memory and bandwidth); the
    targets are int32 too and become int64 only per micro-batch, for cross_entropy."""

    def __init__(self, packed: Packed, device, pad_id: int, rows: int = 0):
        length, fillers = packed.input_ids.shape[1], max(rows - len(packed), 0) + 1  # padded to `rows` + 1

        def with_filler(array: np.ndarray, fill: np.ndarray) -> torch.Tensor:
            filled = np.concatenate([array, np.repeat(fill[None, :], fillers, axis=0)])
            return torch.from_numpy(filled.astype(np.int32)).to(device)

        self.input_ids = with_filler(packed.input_ids, np.full(length, pad_id, np.int64))
        # targets[t] = labels[t + 1]: what position t predicts, so the loss needs no slicing.
        targets = np.full_like(packed.labels, IGNORE_INDEX)
        targets[:, :-1] = packed.labels[:, 1:]
        self.targets = with_filler(targets, np.full(length, IGNORE_INDEX, np.int64))
        self.position_ids = with_filler(packed.position_ids, np.arange(length, dtype=np.int64))
        self.segment_ids = with_filler(packed.segment_ids, np.ones(length, np.int64))
        self.filler = len(packed)
        # --method dpo, full: the stored reference's sums in the blocks' segment layout (fp32).
        reference = getattr(packed, "reference", None)
        self.reference = None if reference is None else torch.from_numpy(np.concatenate(
            [reference, np.zeros((fillers, reference.shape[1]), np.float32)])).to(device)
        # A multimodal run's blocks (media.MediaPacked): each block's image locations, kept on
        # the host; a micro-batch's pixels are made where it is gathered (methods/media_sft.py).
        media = getattr(packed, "media", None)
        self.media = None if media is None else list(media) + [()] * fillers

    def gather(self, index: torch.Tensor) -> dict:
        names = ("input_ids", "targets", "position_ids", "segment_ids") + (() if self.reference is None
                                                                            else ("reference",))
        batch = {name: getattr(self, name).index_select(0, index) for name in names}
        if self.media is not None:  # the images in the order of their tokens (one host read of the indices)
            batch["media"] = [loc for block in index.tolist() for loc in self.media[block]]
        return batch
