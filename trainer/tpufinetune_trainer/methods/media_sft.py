"""Supervised fine-tuning of a multimodal model (--vision-tower): SFT's loop and loss, the
blocks carrying their images (media.py).

Trainable: the language model and the projectors, the vision tower unless --vision-tower
frozen, never the audio tower (media.freeze_towers); with LoRA, the language model's
adapters, the projector in full and, with --vision-tower trained, adapters on the tower's
projections (lora.py), every base frozen. A micro-batch: its images decoded,
resized and patched here, on the worker, by the model's image processor (media.Pixels),
then one forward of the whole model over its blocks with their block-diagonal masks (each
image's soft tokens sit in their example's segment, so an example sees only its own
images) and the summed cross-entropy of its label tokens over transformers' full logits
(loss.py's label head runs the language model alone, without the image features)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from ..media import Pixels, fill_media_blocks, image_groups, load_media_processor, sees_images_whole, with_images
from .sft import SFT


class MediaSFT(SFT):
    name = "sft"
    label_head = False  # the image features enter through the whole model's forward

    def __init__(self, cfg):
        super().__init__(cfg)
        self.pixels: Pixels | None = None
        self._idle: dict | None = None  # idle_pixels, made once

    def fill(self, examples, blocks: list[list[int]], max_seq_len: int, pad_id: int):
        return fill_media_blocks(examples, blocks, max_seq_len, pad_id)

    def prepare(self, trainer, eval_data):
        from ..model import model_source

        processor = load_media_processor(model_source(self.cfg.model_id))
        self.pixels = Pixels(processor.image_processor)
        # Each epoch's held-out prompts are answered with their images (generation.py).
        with_images(trainer.generation_items, eval_data, processor.ids(processor.boi_token))
        return eval_data

    def loss_sum(self, trainer, batch: dict, cap: int | None, training: bool = True):
        device = batch["input_ids"].device
        pixels = self.pixels(batch.get("media", []), device)
        masks = self.masks(trainer, batch)
        if pixels:
            return media_loss_sum(trainer.model, masks, batch, pixels)
        with towers_run_idle(trainer.model, self.idle_pixels(device)):
            return media_loss_sum(trainer.model, masks, batch, pixels)

    def idle_pixels(self, device) -> dict:
        """One black image's inputs, for a micro-batch without images (towers_run_idle); made
        once, the same every step."""
        from PIL import Image

        if self._idle is None:
            self._idle = self.pixels.of([Image.new("RGB", (64, 64))], device)
        return self._idle

    @staticmethod
    def masks(trainer, batch: dict):
        """The block-diagonal masks; for a model that sees each image whole (media.sees_images_whole),
        each image's soft tokens also attend to each other, as at inference."""
        config = trainer.model.config
        together = image_groups(batch["input_ids"], config.image_token_id) if sees_images_whole(config) else None
        return trainer.masks(batch["segment_ids"], together)


@contextlib.contextmanager
def towers_run_idle(model, pixels: dict):
    """A micro-batch without images still runs the vision tower and its projector, on one
    black image whose features are added times zero: FSDP2 reduce-scatters the gradients a
    rank has, so every rank's trainable tower weights must have one in every step (a rank
    without images would otherwise send fewer, and the collective fails). Inside the whole
    model's forward (a pre-hook of its language model), where the towers' weights are gathered."""
    inner = getattr(model, "model", model)

    def hook(module, args, kwargs):
        features = inner.get_image_features(pixels["pixel_values"], pixels["image_position_ids"], return_dict=True)
        nothing = torch.cat(list(features.pooler_output)).sum() * 0.0
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + nothing.to(kwargs["inputs_embeds"].dtype)
        return args, kwargs

    handle = inner.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def media_loss_sum(model, masks, batch: dict, pixels: dict) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch's label tokens (fp32), its images in."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=masks,
                use_cache=False, **pixels)
    return F.cross_entropy(out.logits.flatten(0, 1).float(), batch["targets"].flatten().long(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
