"""The towers in the memory plan (spec.training.towers; the trainer's multimodal path:
worker_setup.build_model, media.freeze_towers, methods/media_sft.py): their shapes for the
Gemma 4 models the planner knows, where each figure comes from, and what they add to a device
at a step's peak. Pure (no I/O).

The trainer loads the whole model, every tower its config has (E2B and E4B: an audio tower
too, never trained yet), and FSDP2 holds the towers and their projectors in the root unit,
beside the embedding: so, per device, beyond the text step of the same blocks (memplan.py
counts a block's tokens, media tokens included, as every other token):

- every tower and projector: with method full its fp32 master sharded over the shard group,
  with LoRA the frozen bf16 base sharded (lora.inject), and the root unit's gathered copy in
  the compute dtype, whole, through the step;
- what trains (the vision projector, embed_vision, with either method, in fp32 beside LoRA's
  adapters; with `vision: trained` the vision tower too: method full, all of it; LoRA, the
  adapters on its projections in targetModules, beside its frozen bf16 base):
  its fp32 gradient and AdamW's two moments, sharded, and its unsharded gradient on its way
  to the reduce-scatter (as the embedding's, memplan's head_grad);
- the vision tower's activations at the processor's resolution (every image resized to at most
  `soft_tokens` x pooling^2 patches): frozen, one encoder layer's transients at a time (no
  gradient reaches it); trained, every layer's saved activations as the language model's block
  keeps them (memplan_blocks' constants), with eager attention's heads x patches^2 per image.
  The tower runs first: what only its forward holds (a frozen tower's layer at a time, any
  tower's eager scores) is freed before the language model's activations and logits exist,
  so the device holds the larger of the two, not their sum (benchmarks/bench_memplan_media.py:
  a frozen eager tower of 14 images a micro-batch planned at 1.71 of its measured peak with both);
- the images of a micro-batch: as many as its blocks' tokens hold (maxSeqLen // the tokens of
  one image, each block), whatever maxImagesPerExample (packing puts several examples in a
  block), their fp32 pixels and the projected soft tokens. The loss of a multimodal step runs
  over transformers' full logits (media_sft: the label head runs the language model alone),
  which memplan_spec plans as --loss-head full.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import memplan_blocks as blocks
from .memplan_shapes import KNOWN_MODELS, ModelShape, known_shape
from .towersspec import TOWER_LORA_TARGETS, TOWER_MODES

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


@dataclass(frozen=True)
class ModelTowers:
    """The towers the trainer loads with a model: its vision tower, and its audio tower's
    parameters and output width (0 where it has none)."""

    vision: VisionShape
    audio_parameters: int = 0
    audio_width: int = 0  # output_proj_dims: embed_audio's input

    def projector_parameters(self, text_hidden: int) -> int:
        """embed_vision's and embed_audio's projections into the language model."""
        return self.vision.projector_parameters(text_hidden) + self.audio_width * text_hidden


# transformers' Gemma4VisionConfig defaults, documented there as google/gemma-4-e2b-it's
# (16 layers, width 768, MLP 3072, 12 heads of 64), and the image processor's max_soft_tokens.
VISION_CONFIG_DEFAULTS = dict(num_hidden_layers=16, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                              head_dim=64, num_key_value_heads=12, patch_size=16, pooling_kernel_size=3,
                              position_embedding_size=10240)
MAX_SOFT_TOKENS = 280  # Gemma4ImageProcessor's (image_processing_gemma4.py), the processor's image_seq_length


def vision_from_config(vision_config: dict, image_processor: dict | None = None, source: str = "") -> VisionShape:
    """A vision tower's shape from its config (a dict of transformers' Gemma4VisionConfig, as a
    model's config.json holds it under vision_config; a key it lacks takes transformers'
    default) and its image processor's settings (processor_config.json's image_processor:
    max_soft_tokens; absent, Gemma4ImageProcessor's). The table's entries are built here too."""
    config = {**VISION_CONFIG_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
    soft_tokens = (image_processor or {}).get("max_soft_tokens") or MAX_SOFT_TOKENS
    heads = int(config["num_attention_heads"])
    return VisionShape(layers=int(config["num_hidden_layers"]), hidden=int(config["hidden_size"]),
                       intermediate=int(config["intermediate_size"]), heads=heads,
                       head_dim=int(config["head_dim"]), kv_heads=int(config.get("num_key_value_heads") or heads),
                       patch_size=int(config["patch_size"]), pooling_kernel=int(config["pooling_kernel_size"]),
                       position_embeddings=int(config["position_embedding_size"]), soft_tokens=int(soft_tokens),
                       source=source)


def towers_from_config(vision_config: dict, image_processor: dict | None = None, audio_parameters: int = 0,
                       audio_width: int = 0, source: str = "") -> ModelTowers:
    """The towers of a model given its vision config (vision_from_config), for plan()."""
    return ModelTowers(vision_from_config(vision_config, image_processor, source), audio_parameters, audio_width)


# E2B and E4B: transformers' defaults (above) and the image processor's (patch 16, pooling 3,
# 280 soft tokens): 167.4M parameters, the model card's "~150M" encoder.
_SMALL = vision_from_config(VISION_CONFIG_DEFAULTS, source="transformers Gemma4VisionConfig defaults "
                            "(google/gemma-4-e2b-it); image processor: patch 16, pooling 3, 280 soft tokens")
# 31B and 26B A4B: width 1152 in 16 heads of 72 (the larger models' vision_config as published
# conversions write it); depth 27 and MLP 4304 are SigLIP so400m's, whose widths these are,
# and give 569.5M parameters, the model card's "~550M" encoder.
_LARGE = vision_from_config(dict(num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
                                 num_attention_heads=16, head_dim=72, num_key_value_heads=16),
                            source="width 1152, 16 heads of 72 (the 31B's vision_config); depth 27, MLP 4304: "
                                   "SigLIP so400m's (the card's ~550M); processor as E2B's")
# E2B's and E4B's audio tower: transformers' Gemma4AudioConfig defaults (12 conformer layers,
# width 1024, output 1536) as Gemma4AudioModel builds them, 304.8M parameters (the card's
# "~300M"); the larger models have none (the card).
_AUDIO_PARAMETERS, _AUDIO_WIDTH = 304_824_608, 1536
MODEL_TOWERS = {"gemma-4-E2B": ModelTowers(_SMALL, _AUDIO_PARAMETERS, _AUDIO_WIDTH),
                "gemma-4-E4B": ModelTowers(_SMALL, _AUDIO_PARAMETERS, _AUDIO_WIDTH),
                "gemma-4-31B": ModelTowers(_LARGE), "gemma-4-26B-A4B": ModelTowers(_LARGE)}
VISION_TOWERS = {name: towers.vision for name, towers in MODEL_TOWERS.items()}


def towers_of(shape: ModelShape | None) -> ModelTowers | None:
    """The towers of a model shape (memplan_shapes.ModelShape) the table knows; None for a
    model it does not (its towers are not counted)."""
    return MODEL_TOWERS.get(getattr(shape, "name", ""))


def towers_for(shape: ModelShape | None, model_config: dict | None) -> ModelTowers | None:
    """The towers a plan counts: the model's own vision_config where the trainer reported it
    (memplan_shapes.config_from_event's `vision`; the table's audio tower kept), else the
    table's (towers_of)."""
    table = towers_of(shape)
    vision = (model_config or {}).get("vision")
    if not vision:
        return table
    settings = {k: v for k, v in vision.items() if k != "max_soft_tokens"}
    return towers_from_config(settings, {"max_soft_tokens": vision.get("max_soft_tokens")},
                              audio_parameters=table.audio_parameters if table else 0,
                              audio_width=table.audio_width if table else 0,
                              source="the model's config.json (vision_config) and processor, as the trainer read them")


def vision_of(shape: ModelShape | None) -> VisionShape | None:
    """The vision tower of a model shape the table knows (None for one it does not)."""
    towers = towers_of(shape)
    return towers.vision if towers is not None else None


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
    tower_parameters: int  # the vision tower's
    projector_parameters: int  # embed_vision's and embed_audio's
    audio_parameters: int  # the audio tower's, loaded and frozen
    tokens_per_image: int
    images_per_block: int
    images_per_micro_batch: int
    weight_bytes: int  # the towers' and projectors' weights (sharded) and their gathered copy, per device
    trained_bytes: int  # what trains: gradients (sharded and on their way) and AdamW state, per device
    activation_bytes: int  # the tower's activations, its pixels and the projected soft tokens
    staged_bytes: int  # the sharded master weights and AdamW state a checkpoint stages on the host
    source: str = ""
    forward_bytes: int = 0  # of activation_bytes, what only the tower's own forward holds
    text_step_bytes: int = 0  # what the language model's step holds beyond that (its activations, logits)

    @property
    def bytes(self) -> int:
        """What the towers add to a device at the step's peak: the tower runs first, so what only
        its forward holds is gone before the language model's activations and logits exist;
        the device holds the larger of the two (the language model's are counted by memplan)."""
        return (self.weight_bytes + self.trained_bytes + self.activation_bytes
                - min(self.forward_bytes, self.text_step_bytes))

    @property
    def media_tokens_per_block(self) -> int:
        return self.images_per_block * self.tokens_per_image

    def status(self) -> dict:
        """status.plan.towers (planstatus.TowersPlanStatus)."""
        return {"vision": self.vision, "visionParameters": self.tower_parameters,
                "projectorParameters": self.projector_parameters, "audioParameters": self.audio_parameters,
                "bytesPerDevice": self.bytes,
                "activationBytes": self.activation_bytes, "tokensPerImage": self.tokens_per_image,
                "imagesPerBlock": self.images_per_block, "mediaTokensPerBlock": self.media_tokens_per_block,
                "widthsFrom": self.source}

    @property
    def parameters(self) -> int:
        """Every parameter the towers add to the language model's (the export holds them)."""
        return self.tower_parameters + self.projector_parameters + self.audio_parameters

    def words(self) -> str:
        audio = f", audio tower {self.audio_parameters / 1e6:.0f}M frozen" if self.audio_parameters else ""
        return (f"vision tower {self.vision} ({self.tower_parameters / 1e6:.0f}M parameters{audio}, "
                f"{self.bytes / 2**30:.1f} GiB a device with its activations), up to {self.images_per_block} "
                f"image(s) of {self.tokens_per_image} tokens a block")


def encoder_of(vision: VisionShape) -> ModelShape:
    """The tower's encoder as the planner's block shape (its activations are counted as the
    text block's are: encoder_activation_bytes)."""
    return ModelShape("vision tower", vision.parameters, vision.layers, vision.hidden, vision.intermediate,
                      vision.heads, vision.head_dim, vocab=0, kv_heads=vision.kv_heads)


def encoder_activation_bytes(vision: VisionShape, trained: bool, images: int, compute_bytes: int,
                           eager_attention: bool) -> tuple[int, int]:
    """A vision tower's encoder activations for `images` images (each its processor's patches
    at most, attending within itself), with the text block's constants: trained, every layer's
    saved activations (no checkpointing) and eager attention's probabilities; frozen (no
    gradients), one layer's transients at a time. Either way one layer's eager scores while it runs.
    Returns (all of them, what only the tower's forward holds: frozen, all; trained, the scores)."""
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
    return kept + transient, transient if trained else kept + transient


def tower_adapter_parameters(vision: VisionShape, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA's adapters on the vision tower (`vision: trained`): rank x (in + out) for each of
    its projections named in targetModules (the trainer's lora.TOWER_TARGET_MODULES)."""
    return encoder_of(vision).lora_parameters(rank, tuple(t for t in targets if t in TOWER_LORA_TARGETS))


def plan(towers: ModelTowers, mode: str, text_hidden: int, method: str, devices: int, max_seq_len: int,
         blocks_per_device: int, compute_bytes: int, eager_attention: bool, text_step_bytes: int = 0,
         lora_rank: int = 16, lora_targets: tuple[str, ...] = TOWER_LORA_TARGETS) -> MediaPlan:
    """The towers' share of a device: `mode` (towers.vision) frozen or trained, `method` the
    language model's (full or lora, with `lora_rank` and `lora_targets`), `devices` the shard
    group; `text_step_bytes` what the language model's step holds that does not exist while the
    tower runs (memplan's activations and loss head), which the tower's forward transients do
    not add to."""
    if mode not in (FROZEN, TRAINED):
        raise ValueError(f"unknown vision tower mode {mode!r}; expected {FROZEN} or {TRAINED}")
    vision = towers.vision
    tower, projectors = vision.parameters, towers.projector_parameters(text_hidden)
    full = method == "full"
    # The vision projector trains with either method (LoRA: in full beside the adapters,
    # lora.inject); with `trained` the tower too: all of it (full) or its adapters (LoRA,
    # fp32 beside its frozen bf16 base, which gradients pass through to reach them).
    adapters = tower_adapter_parameters(vision, lora_rank, lora_targets) if mode == TRAINED and not full else 0
    loaded = tower + projectors + towers.audio_parameters + adapters
    trained = (tower if mode == TRAINED and full else adapters) + vision.projector_parameters(text_hidden)
    per_block = images_per_block(vision, max_seq_len)
    images = per_block * blocks_per_device
    patches = images * vision.patches_per_image
    pixels = patches * PIXEL_CHANNELS * vision.patch_size ** 2 * 4  # the processor's fp32 pixel values
    soft = images * vision.soft_tokens * (vision.hidden + text_hidden) * compute_bytes
    shard = max(devices, 1)
    stored = -(-(4 * loaded if full else 2 * (loaded - trained) + 4 * trained) // shard)  # LoRA: the base in bf16
    optimizer = -(-8 * trained // shard)
    encoder, forward = encoder_activation_bytes(vision, mode == TRAINED, images, compute_bytes, eager_attention)
    return MediaPlan(
        vision=mode, tower_parameters=tower, projector_parameters=projectors,
        audio_parameters=towers.audio_parameters, tokens_per_image=vision.tokens_per_image,
        images_per_block=per_block, images_per_micro_batch=images,
        weight_bytes=stored + compute_bytes * loaded,
        trained_bytes=-(-4 * trained // shard) + optimizer + (compute_bytes + 4) * trained,
        activation_bytes=encoder + pixels + soft, staged_bytes=stored + optimizer, source=vision.source,
        forward_bytes=forward, text_step_bytes=text_step_bytes)
