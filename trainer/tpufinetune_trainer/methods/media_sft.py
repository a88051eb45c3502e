"""Supervised fine-tuning of a multimodal model (--vision-tower): SFT's loop and loss, the
blocks carrying their images (media.py).

Trainable: the language model and the projectors, the vision tower unless --vision-tower
frozen, never the audio tower (media.freeze_towers). A micro-batch: its images decoded,
resized and patched here, on the worker, by the model's image processor (media.Pixels),
then one forward of the whole model over its blocks with their block-diagonal masks (each
image's soft tokens sit in their example's segment, so an example sees only its own
images) and the summed cross-entropy of its label tokens over transformers' full logits
(loss.py's label head runs the language model alone, without the image features)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from ..media import Pixels, fill_media_blocks, image_groups, load_media_processor, sees_images_whole
from .sft import SFT


class MediaSFT(SFT):
    name = "sft"
    label_head = False  # the image features enter through the whole model's forward

    def __init__(self, cfg):
        super().__init__(cfg)
        self.pixels: Pixels | None = None

    def fill(self, examples, blocks: list[list[int]], max_seq_len: int, pad_id: int):
        return fill_media_blocks(examples, blocks, max_seq_len, pad_id)

    def prepare(self, trainer, eval_data):
        from ..model import model_source

        self.pixels = Pixels(load_media_processor(model_source(self.cfg.model_id)).image_processor)
        return eval_data

    def loss_sum(self, trainer, batch: dict, cap: int | None, training: bool = True):
        return media_loss_sum(trainer.model, self.masks(trainer, batch), batch,
                              self.pixels(batch.get("media", []), batch["input_ids"].device))

    @staticmethod
    def masks(trainer, batch: dict):
        """The block-diagonal masks; for a model that sees each image whole (media.sees_images_whole),
        each image's soft tokens also attend to each other, as at inference."""
        config = trainer.model.config
        together = image_groups(batch["input_ids"], config.image_token_id) if sees_images_whole(config) else None
        return trainer.masks(batch["segment_ids"], together)


def media_loss_sum(model, masks, batch: dict, pixels: dict) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch's label tokens (fp32), its images in."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=masks,
                use_cache=False, **pixels)
    return F.cross_entropy(out.logits.flatten(0, 1).float(), batch["targets"].flatten().long(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
