"""The vision tower in the memory plan (spec.training.towers; docs/trainer.md, the trainer's
multimodal path): its shape for the Gemma 4 models the planner knows, where each figure comes
from, and what it adds to a device at a step's peak. Pure (no I/O).

What a multimodal step holds beyond the text step of the same blocks (memplan.py counts the
block's tokens, media tokens included, as every other token):

- the tower's weights: frozen, in bfloat16 and not sharded (kept out of the optimizer, as
  Gemma's per-layer table is, so counted whole on every device: an upper bound); trained,
  fp32 master weights, gradients and AdamW's two moments, 16 B a parameter sharded over the
  shard group as the language model's;
- the projector into the language model (embed_vision: a norm and one hidden x text-hidden
  matrix): it trains with method full (16 B a parameter, sharded) and is frozen bf16 with LoRA;
- the tower's activations at the processor's resolution (every image resized to at most
  `soft_tokens` x pooling^2 patches): frozen, one encoder layer's transients at a time (the
  features are computed without gradients); trained, every layer's saved activations as the
  language model's block keeps them (encoder_activation_bytes, its constants), with eager
  attention's heads x patches^2 per image and layer;
- the images of a micro-batch: as many as its blocks' tokens hold (maxSeqLen // the tokens of
  one image, each block), whatever maxImagesPerExample (packing puts several examples in a
  block), their fp32 pixels and the projected soft tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import memplan_blocks as blocks
from .memplan_shapes import KNOWN_MODELS, ModelShape, known_shape
from .towersspec import TOWER_MODES

FROZEN, TRAINED = TOWER_MODES  # the spec's towers.vision, the trainer's --vision-tower choices
PIXEL_CHANNELS = 3
BOUNDARY_TOKENS = 2  # the processor's begin- and end-of-image tokens around each image's soft tokens


@dataclass(frozen=True)
class VisionShape:
    """What the planner needs of a Gemma 4 vision tower (transformers' Gemma4VisionConfig)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    kv_heads: int
    patch_size: int = 16
    pooling_kernel: int = 3
    position_embeddings: int = 10240  # position_embedding_size: a 2 x this x hidden table
    soft_tokens: int = 280  # the image processor's max_soft_tokens: tokens an image becomes at most
    source: str = ""

    @property
    def patches_per_image(self) -> int:
        """Patches the processor cuts an image into at most (soft tokens before pooling)."""
        return self.soft_tokens * self.pooling_kernel ** 2

    @property
    def tokens_per_image(self) -> int:
        """Tokens of the prompt one image takes at most: its soft tokens and its two boundaries."""
        return self.soft_tokens + BOUNDARY_TOKENS

    @property
    def parameters(self) -> int:
        """The tower's parameters as transformers builds it (Gemma4VisionModel): the patch
        embedder (its input projection and 2-D position table) and the encoder layers (q, k,
        v, o; a gated MLP; four norms and q/k norms)."""
        attention = (self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads)
                     + self.heads * self.head_dim * self.hidden)
        layer = attention + 3 * self.hidden * self.intermediate + 4 * self.hidden + 2 * self.head_dim
        embedder = PIXEL_CHANNELS * self.patch_size ** 2 * self.hidden + 2 * self.position_embeddings * self.hidden
        return embedder + self.layers * layer

    def projector_parameters(self, text_hidden: int) -> int:
        """embed_vision's projection into the language model (its norm has no scale)."""
        return self.hidden * text_hidden


# E2B and E4B: transformers' Gemma4VisionConfig defaults, documented there as
# google/gemma-4-e2b-it's (16 layers, width 768, MLP 3072, 12 heads of 64), and the image
# processor's (image_processing_gemma4.py: patch 16, pooling 3, max_soft_tokens 280; the
# processor's image_seq_length 280): 167.4M parameters, the model card's "~150M" encoder.
_SMALL = VisionShape(16, 768, 3072, 12, 64, 12, source="transformers Gemma4VisionConfig defaults "
                     "(google/gemma-4-e2b-it); image processor: patch 16, pooling 3, 280 soft tokens")
# 31B and 26B A4B: width 1152 in 16 heads of 72 (the larger models' vision_config as published
# conversions write it); depth 27 and MLP 4304 are SigLIP so400m's, whose widths these are,
# and give 569.5M parameters, the model card's "~550M" encoder.
_LARGE = VisionShape(27, 1152, 4304, 16, 72, 16, source="width 1152, 16 heads of 72 (the 31B's "
                     "vision_config); depth 27, MLP 4304: SigLIP so400m's (the card's ~550M); processor as E2B's")
VISION_TOWERS = {"gemma-4-E2B": _SMALL, "gemma-4-E4B": _SMALL, "gemma-4-31B": _LARGE, "gemma-4-26B-A4B": _LARGE}


def vision_of(shape: ModelShape | None) -> VisionShape | None:
    """The vision tower of a model shape (memplan_shapes.ModelShape) the table knows; None
    for a model it does not (its tower is not counted)."""
    return VISION_TOWERS.get(getattr(shape, "name", ""))


def tokens_per_image(model_id: str) -> int | None:
    """Tokens one image of `model_id` takes at most, for a model the table knows with a vision
    tower (None otherwise: its processor is read by the trainer alone)."""
    vision = vision_of(known_shape(model_id))
    return vision.tokens_per_image if vision is not None else None


def known_tokens_per_image() -> dict[str, int]:
    """Every hub id of the table (lower case, as known_shape compares them) with a vision
    tower, and its tokens per image: the admission rule's map."""
    return {model_id: vision.tokens_per_image for model_id, shape in KNOWN_MODELS.items()
            if (vision := vision_of(shape)) is not None}


def images_per_block(vision: VisionShape, max_seq_len: int) -> int:
    """Images one block of maxSeqLen tokens holds at most (at least one: a spec where none
    fits is refused at apply for the models the table knows)."""
    return max(1, max_seq_len // vision.tokens_per_image)


@dataclass(frozen=True)
class MediaPlan:
    """What the vision tower adds to one device at a step's peak, and the figures
    status.plan.towers shows."""

    vision: str  # frozen or trained
    tower_parameters: int
    projector_parameters: int
    tokens_per_image: int
    images_per_block: int
    images_per_micro_batch: int
    weight_bytes: int  # the tower's and the projector's weights, per device
    trained_bytes: int  # their gradients and AdamW state, per device
    activation_bytes: int  # the tower's activations, its pixels and the projected soft tokens
    staged_bytes: int  # the sharded master weights and AdamW state a checkpoint stages on the host
    source: str = ""

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.trained_bytes + self.activation_bytes

    @property
    def media_tokens_per_block(self) -> int:
        return self.images_per_block * self.tokens_per_image

    def status(self) -> dict:
        """status.plan.towers (planstatus.TowersPlanStatus)."""
        return {"vision": self.vision, "visionParameters": self.tower_parameters,
                "projectorParameters": self.projector_parameters, "bytesPerDevice": self.bytes,
                "activationBytes": self.activation_bytes, "tokensPerImage": self.tokens_per_image,
                "imagesPerBlock": self.images_per_block, "mediaTokensPerBlock": self.media_tokens_per_block,
                "widthsFrom": self.source}

    def words(self) -> str:
        return (f"vision tower {self.vision} ({self.tower_parameters / 1e6:.0f}M parameters, "
                f"{self.bytes / 2**30:.1f} GiB a device with its activations), up to {self.images_per_block} "
                f"image(s) of {self.tokens_per_image} tokens a block")


def encoder_of(vision: VisionShape) -> ModelShape:
    """The tower's encoder as the planner's block shape (its activations are counted as the
    text block's are: encoder_activation_bytes)."""
    return ModelShape("vision tower", vision.parameters, vision.layers, vision.hidden, vision.intermediate,
                      vision.heads, vision.head_dim, vocab=0, kv_heads=vision.kv_heads)


def encoder_activation_bytes(vision: VisionShape, trained: bool, images: int, compute_bytes: int,
                           eager_attention: bool) -> int:
    """A vision tower's encoder activations for `images` images (each its processor's patches
    at most, attending within itself), with the text block's constants: trained, every layer's
    saved activations (no checkpointing) and eager attention's probabilities; frozen (no
    gradients), one layer's transients at a time. Either way one layer's eager scores while it runs."""
    encoder, patches = encoder_of(vision), images * vision.patches_per_image
    square = images * vision.patches_per_image ** 2
    upcast = 4 if compute_bytes < 4 else 0
    if trained:
        per_element = blocks.SAVED_ATTENTION_MATRICES * compute_bytes + blocks.UPCAST_ATTENTION_MATRICES * upcast
        scores = per_element * vision.heads * square if eager_attention else 0
        kept = blocks.activation_bytes(encoder, patches, scores, compute_bytes, "none")
    else:
        kept = patches * compute_bytes * (blocks.SAVED_PER_HIDDEN * vision.hidden
                                          + blocks.SAVED_PER_INTERMEDIATE * vision.intermediate)
    transient = blocks.EAGER_TRANSIENT_MATRICES * compute_bytes * vision.heads * square if eager_attention else 0
    return kept + transient


def plan(vision: VisionShape, mode: str, text_hidden: int, method: str, devices: int, max_seq_len: int,
         blocks_per_device: int, compute_bytes: int, eager_attention: bool) -> MediaPlan:
    """The tower's share of a device: `mode` frozen or trained, `method` the language model's
    (full or lora: the projector trains with full only), `devices` the shard group."""
    if mode not in (FROZEN, TRAINED):
        raise ValueError(f"unknown vision tower mode {mode!r}; expected {FROZEN} or {TRAINED}")
    tower, projector = vision.parameters, vision.projector_parameters(text_hidden)
    trained = (tower if mode == TRAINED else 0) + (projector if method == "full" else 0)
    frozen = tower + projector - trained
    per_block = images_per_block(vision, max_seq_len)
    images = per_block * blocks_per_device
    patches = images * vision.patches_per_image
    pixels = patches * PIXEL_CHANNELS * vision.patch_size ** 2 * 4  # the processor's fp32 pixel values
    soft = images * vision.soft_tokens * (vision.hidden + text_hidden) * compute_bytes
    shard = max(devices, 1)
    master = -(-4 * trained // shard)
    optimizer = -(-8 * trained // shard)
    # A trained tower is sharded as the text blocks are: two of its layers gathered in the
    # compute dtype at a time and one layer's unsharded gradients on their way to the reduce.
    layer = encoder_of(vision).block_parameters if mode == TRAINED else 0
    gathered = (2 * compute_bytes + compute_bytes + 4) * layer
    return MediaPlan(
        vision=mode, tower_parameters=tower, projector_parameters=projector,
        tokens_per_image=vision.tokens_per_image, images_per_block=per_block, images_per_micro_batch=images,
        weight_bytes=2 * frozen + master, trained_bytes=-(-4 * trained // shard) + optimizer + gathered,
        activation_bytes=encoder_activation_bytes(vision, mode == TRAINED, images, compute_bytes, eager_attention)
        + pixels + soft,
        staged_bytes=master + optimizer, source=vision.source)
