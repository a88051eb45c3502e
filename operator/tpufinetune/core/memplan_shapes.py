"""The memory planner's model shapes: what it needs of a text decoder, the Gemma 4 table with
where each figure comes from, and a shape read from a transformers config.json (which wins
over the table where both are known: `shape_for`).

Pure (no I/O)."""
from __future__ import annotations

from dataclasses import dataclass, replace

# LoRA's default targets per decoder layer (core/api.py's DEFAULT_LORA_TARGET_MODULES).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' Gemma4TextConfig: every sixth layer attends to the whole sequence (the last
# always does), and those layers' heads are `global_head_dim` (512) wide.
FULL_ATTENTION_EVERY = 6
GLOBAL_HEAD_DIM = 512


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model's text decoder."""

    name: str
    parameters: int  # the text model's, tied embedding included; PLE and towers excluded
    layers: int
    hidden: int
    intermediate: int  # the MLP width a token passes through (MoE: shared + active experts)
    heads: int
    head_dim: int  # of the sliding-window layers (all layers when full_layers is 0)
    vocab: int
    per_layer_embedding: int = 0  # Gemma's PLE table: frozen, replicated
    experts: int = 0  # 0: dense
    active_parameters: int | None = None  # MoE: per token
    source: str = ""
    kv_heads: int = 0  # 0: half the heads
    full_layers: int = 0  # layers attending to the whole sequence with full_head_dim heads
    full_head_dim: int = 0  # 0: head_dim
    ple_width: int = 0  # hidden_size_per_layer_input
    widths_from: str = ""  # where the widths come from, in a few words (status.plan names it)

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def block_parameters(self) -> int:
        return max(self.parameters - self.embedding, 0) // max(self.layers, 1)

    @property
    def attention_width(self) -> int:
        """heads x head_dim, averaged over the layers (full-attention layers' heads are wider)."""
        full_dim = self.full_head_dim or self.head_dim
        sliding = self.layers - self.full_layers
        return self.heads * (sliding * self.head_dim + self.full_layers * full_dim) // max(self.layers, 1)

    def module_widths(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer LoRA may adapt, per layer on average."""
        attention = self.attention_width
        kv = (self.kv_heads or max(self.heads // 2, 1)) * attention // max(self.heads, 1)
        ple = self.ple_width
        return {"q_proj": (self.hidden, attention), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (attention, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden),
                "per_layer_input_gate": (self.hidden, ple), "per_layer_projection": (ple, self.hidden)}

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> int:
        """Adapter parameters: rank x (in + out) for each adapted linear layer."""
        widths = self.module_widths()
        return int(self.layers * rank * sum(sum(widths[name]) for name in targets if name in widths))

    def lora_inputs(self, targets: tuple[str, ...]) -> int:
        """Input elements per token and layer of the adapted layers (each gets its own dropout)."""
        widths = self.module_widths()
        return sum(widths[name][0] for name in targets if name in widths)


def full_attention_layers(layers: int, layer_types: list | None = None) -> int:
    """Gemma 4's full-attention layers: as `layer_types` says, else transformers' default."""
    if layer_types:
        return sum(1 for kind in layer_types[:-1] if kind == "full_attention") + 1
    return sum(1 for i in range(layers - 1) if (i + 1) % FULL_ATTENTION_EVERY == 0) + 1


# Sources of the table's figures. Google's model card gives the parameter counts (E2B 5.1B
# total / 2.3B effective, E4B 8B / 4.5B, 31B 30.7B dense, 26B A4B 25.2B total / 3.8B
# active, 128 experts, vocabulary 262144); the layer and width figures come from the
# implementations that load the checkpoints; the attention layout (every sixth layer full,
# its heads 512 wide) from the installed transformers' Gemma4TextConfig.
_CARD = "https://ai.google.dev/gemma/docs/core/model_card_4"
_E2B = "gemma.cpp configs (github.com/google/gemma.cpp pull 919): 35 layers, width 1536, FFN 6144/12288"
_E4B = ("NeMo Megatron-Bridge gemma4 recipe (docs.nvidia.com/nemo/megatron-bridge): 42 layers, "
        "hidden 2560, FFN 10240, 8 heads")
_31B = "60 layers (model summaries); width, MLP and heads not published: Gemma 3 27B's used"
_26B = ("Ollama's gemma4 26B-A4B GGUF metadata (ollama.com/library/gemma4): 30 blocks, width 2816, "
        "16 heads, FFN 2112 shared + 8 of 128 experts x 704")
_LAYOUT = "transformers Gemma4TextConfig: every 6th layer full attention, its head_dim 512"
_VOCAB = 262144
_PLE_WIDTH = 256  # per layer (hidden_size_per_layer_input)


def _gemma4(name, parameters, layers, hidden, intermediate, heads, source, widths_from, **extra) -> ModelShape:
    return ModelShape(name, parameters, layers, hidden, intermediate, heads, 256, _VOCAB, source=f"{_CARD}; {source}; "
                      f"{_LAYOUT}", full_layers=full_attention_layers(layers), full_head_dim=GLOBAL_HEAD_DIM,
                      widths_from=widths_from, **extra)


_SHAPES = (
    # MLP: 6144 on the first 15 layers, 12288 on the 20 that reuse earlier layers' keys and
    # values (gemma.cpp), averaged over the 35 as activations and parameters add up.
    _gemma4("gemma-4-E2B", 2_300_000_000, 35, 1536, (15 * 6144 + 20 * 12288) // 35, 8, _E2B,
            "gemma.cpp (MLP 6144/12288 averaged); layout: transformers",
            per_layer_embedding=35 * _PLE_WIDTH * _VOCAB, ple_width=_PLE_WIDTH),
    _gemma4("gemma-4-E4B", 4_500_000_000, 42, 2560, 10240, 8, _E4B, "NeMo Megatron-Bridge; layout: transformers",
            per_layer_embedding=42 * _PLE_WIDTH * _VOCAB, ple_width=_PLE_WIDTH),
    _gemma4("gemma-4-31B", 30_700_000_000, 60, 5376, 21504, 32, _31B,
            "layers: model summaries; width, MLP, heads: Gemma 3 27B's (31B's unpublished); layout: transformers"),
    _gemma4("gemma-4-26B-A4B", 25_200_000_000, 30, 2816, 2112 + 8 * 704, 16, _26B,
            "Ollama GGUF metadata; layout: transformers", experts=128, active_parameters=3_800_000_000),
)
# Hub ids (base and instruction-tuned), compared case-insensitively.
KNOWN_MODELS: dict[str, ModelShape] = {
    f"google/{shape.name}{suffix}".lower(): shape for shape in _SHAPES for suffix in ("", "-it")}


def known_shape(model_id: str) -> ModelShape | None:
    return KNOWN_MODELS.get(model_id.strip().lower())


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    """A ModelShape from a transformers config.json (a Gemma 4 one nests `text_config`),
    counting the parameters of its text decoder as transformers builds it (full-attention
    layers with their own head_dim, Gemma 4's `global_head_dim`)."""
    text = config.get("text_config") or config
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    intermediate = int(text.get("intermediate_size") or 4 * hidden)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    gemma4 = "global_head_dim" in text or str(text.get("model_type", "")).startswith("gemma4")
    full_dim = int(text.get("global_head_dim") or (GLOBAL_HEAD_DIM if gemma4 else head_dim))
    if "full_attention_layers" in text:  # config_from_event's count of `layer_types`
        full = int(text["full_attention_layers"]) if gemma4 else 0
    else:
        full = full_attention_layers(layers, text.get("layer_types")) if gemma4 else 0
    vocab = int(text["vocab_size"])
    ple_width = int(text.get("hidden_size_per_layer_input") or 0)
    ple_vocab = int(text.get("vocab_size_per_layer_input") or vocab)
    attention = (layers - full) * hidden * head_dim * (2 * heads + 2 * kv_heads) \
        + full * hidden * full_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    per_layer_inputs = 2 * hidden * ple_width if ple_width else 0
    blocks = attention + layers * (mlp + per_layer_inputs + 6 * hidden)
    ple_projection = hidden * layers * ple_width if ple_width else 0
    parameters = vocab * hidden + blocks + ple_projection + hidden
    return ModelShape(name, parameters, layers, hidden, intermediate, heads, head_dim, vocab,
                      per_layer_embedding=layers * ple_width * ple_vocab, source="config", kv_heads=kv_heads,
                      full_layers=full, full_head_dim=full_dim, ple_width=ple_width,
                      widths_from=f"{name}'s config.json")


def shape_for(model_id: str, config: dict | None = None) -> ModelShape | None:
    """The shape the plan uses: the model's own config.json where it is at hand (it wins over
    the table, every width and the parameter count; a mixture-of-experts model keeps the
    table's counts, which shape_from_config does not make), else the table's; None for neither."""
    table = known_shape(model_id)
    if config is None:
        return table
    shape = shape_from_config(config, table.name if table else model_id)
    if table is None:
        return shape
    counts = dict(parameters=table.parameters, experts=table.experts,
                  active_parameters=table.active_parameters) if table.experts else {}
    return replace(shape, **counts, source=f"config.json; {table.source}")


# What the planner reads of a config.json (shape_from_config), as the trainer's `model` event
# carries it (docs/protocol.md) and status.plan.modelConfig shows it.
CONFIG_INTEGERS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "global_head_dim", "vocab_size",
                   "hidden_size_per_layer_input", "vocab_size_per_layer_input")
CONFIG_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
_LARGEST = 10**9


def config_from_event(reported) -> dict | None:
    """The planner's part of the config.json the trainer reported (its text model's, a
    multimodal one's `text_config`), or None when it lacks a width the planner needs or a
    figure is not a positive integer. `layer_types` is kept as its count of full-attention
    layers (a list as long as the model is deep is not worth a status field)."""
    if not isinstance(reported, dict):
        return None
    text = reported.get("text_config") if isinstance(reported.get("text_config"), dict) else reported
    config: dict = {}
    for key in CONFIG_INTEGERS:
        value = text.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _LARGEST:
            return None
        config[key] = value
    if any(key not in config for key in CONFIG_REQUIRED):
        return None
    model_type = text.get("model_type")
    if isinstance(model_type, str) and model_type:
        config["model_type"] = model_type[:64]
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and all(isinstance(kind, str) for kind in layer_types):
        config["full_attention_layers"] = full_attention_layers(config["num_hidden_layers"], layer_types)
    vision = _vision_from_event(reported.get("vision_config"))
    if vision:
        config["vision"] = vision
    return config


# What the planner reads of a multimodal model's vision_config (memplan_media.vision_from_config),
# with the image processor's tokens per image, as a multimodal run's `model` event carries them.
VISION_INTEGERS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "patch_size", "pooling_kernel_size",
                   "position_embedding_size", "max_soft_tokens")


def _vision_from_event(reported) -> dict:
    """The vision tower's widths the trainer reported ({} when none, or any is not a positive
    integer: the plan then keeps the table's tower, or none)."""
    if not isinstance(reported, dict):
        return {}
    vision = {key: reported[key] for key in VISION_INTEGERS if reported.get(key) is not None}
    if any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v < _LARGEST for v in vision.values()):
        return {}
    return vision if {"num_hidden_layers", "hidden_size"} <= set(vision) else {}


def config_status(config: dict) -> dict:
    """status.plan.modelConfig: config_from_event's keys in the status' camelCase."""
    def camel(key: str) -> str:
        head, *rest = key.split("_")
        return head + "".join(part.capitalize() for part in rest)
    return {camel(key): value for key, value in config.items() if key != "vision"}  # in status.plan.towers
