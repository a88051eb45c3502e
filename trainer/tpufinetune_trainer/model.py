"""Loading a causal LM (hub id, local directory, or a directory in storage such as
gs://bucket/models/x), with the tutorial's Gemma 4 handling."""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import storage
from .errors import ModelError

# Multimodal sub-configs a text fine-tune does not need (Gemma 4 has both).
_TOWER_CONFIGS = ("vision_config", "audio_config")


@contextlib.contextmanager
def _quiet_transformers():
    """Loading a text-only view of a multimodal checkpoint prints a table of every
    dropped tower weight; keep job logs readable."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def check_local_model(model_id: str) -> None:
    """A path-looking --model-id must be a model directory (checked without transformers)."""
    path = Path(model_id).expanduser()
    looks_local = model_id.startswith(("/", "./", "../", "~")) or path.exists()
    if looks_local and not (path / "config.json").is_file():
        raise ModelError(f"--model-id {model_id}: no model directory there (no config.json)")


def check_model(model_id: str) -> None:
    """A path or URI --model-id must be a model directory (checked without downloading)."""
    if not storage.is_uri(model_id):
        check_local_model(model_id)
        return
    try:
        found = storage.exists(f"{model_id.rstrip('/')}/config.json", "file")
    except Exception as exc:
        raise ModelError(f"--model-id {model_id}: cannot read it: {type(exc).__name__}: {exc}") from exc
    if not found:
        raise ModelError(f"--model-id {model_id}: no model directory there (no config.json)")


def model_source(model_id: str) -> str:
    """What transformers loads: a hub id or local directory as it is; a directory in
    storage is downloaded once per host (storage.local_copy) and loaded from there."""
    check_model(model_id)
    if not storage.is_uri(model_id):
        return model_id
    try:
        return str(storage.local_copy(model_id))
    except Exception as exc:
        raise ModelError(f"--model-id {model_id}: cannot download it: {type(exc).__name__}: {exc}") from exc


def load_config(model_id: str):
    from transformers import AutoConfig

    source = model_source(model_id)
    try:
        return AutoConfig.from_pretrained(source)
    except Exception as exc:
        raise ModelError(f"cannot load the config of --model-id {model_id}: {type(exc).__name__}: {exc}") from exc


def load_tokenizer(model_id: str):
    from transformers import AutoTokenizer

    source = model_source(model_id)
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer of --model-id {model_id}: {type(exc).__name__}: {exc}") from exc


def text_only_kwargs(config) -> dict:
    """Drop vision/audio towers at load time (the tutorial's vision_config=None, audio_config=None)."""
    return {name: None for name in _TOWER_CONFIGS if getattr(config, name, None) is not None}


def _scalars(settings: dict) -> dict:
    return {key: value for key, value in settings.items()
            if isinstance(value, (int, float, str, bool)) and not (isinstance(value, str) and len(value) > 128)}


def config_report(config, image_processor=None) -> dict:
    """What the `model` event tells the operator of the model's config.json, so that its
    memory plan uses the model's own widths: the text model's scalar settings and its
    `layer_types`; for a multimodal run (`image_processor` given) also `vision_config`'s
    scalar settings with the image processor's `max_soft_tokens` (tokens per image) (the
    operator picks what its planner reads; docs/protocol.md)."""
    text = getattr(config, "text_config", None) or config
    settings = text.to_dict() if hasattr(text, "to_dict") else dict(text)
    report = _scalars(settings)
    if isinstance(settings.get("layer_types"), list):
        report["layer_types"] = [str(kind) for kind in settings["layer_types"]]
    vision = getattr(config, "vision_config", None)
    if image_processor is not None and vision is not None:
        report["vision_config"] = _scalars(vision.to_dict() if hasattr(vision, "to_dict") else dict(vision))
        soft_tokens = getattr(image_processor, "max_soft_tokens", None)
        if isinstance(soft_tokens, int):
            report["vision_config"]["max_soft_tokens"] = soft_tokens
    return report


def tower_attention(config, attn_implementation: str):
    """The attention kernel of each part of a whole multimodal model: `attn_implementation`,
    but eager for an audio tower (Gemma 4's has no sdpa path)."""
    kinds = {"": attn_implementation, "text_config": attn_implementation}
    for name in _TOWER_CONFIGS:
        if getattr(config, name, None) is not None:
            kinds[name] = "eager" if name == "audio_config" else attn_implementation
    return kinds


def load_causal_lm(model_id: str, dtype, attn_implementation: str, multimodal: bool = False):
    """The language model only (the towers dropped), or with `multimodal` the whole model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = load_config(model_id)
    source = model_source(model_id)
    auto, kwargs = (AutoModelForImageTextToText, {}) if multimodal else (AutoModelForCausalLM, text_only_kwargs(config))
    try:
        with _quiet_transformers():
            attention = tower_attention(config, attn_implementation) if multimodal else attn_implementation
            model = auto.from_pretrained(source, dtype=dtype, attn_implementation=attention, **kwargs)
    except Exception as exc:
        raise ModelError(f"cannot load --model-id {model_id} as a causal LM: {type(exc).__name__}: {exc}") from exc
    model.config.get_text_config().use_cache = False
    return model


def per_layer_embeddings(model):
    """Gemma's per-layer embedding table (PLE), or None. On E2B it is a 262144 x 8960 table
    used as a lookup only: the tutorial freezes it and keeps it out of FSDP."""
    getter = getattr(model, "get_per_layer_input_embeddings", None)
    try:
        return getter() if getter is not None else None
    except AttributeError:
        return None


def freeze_per_layer_embeddings(model) -> list:
    ple = per_layer_embeddings(model)
    if ple is None:
        return []
    ple.requires_grad_(False)
    return list(ple.parameters())


def freeze_input_embeddings(model) -> list:
    """--freeze-embeddings: the input embedding stops training (no gradient, so no AdamW
    state). A head tied to it (Gemma, `tie_word_embeddings`) is the same weight and is
    frozen with it; an untied head keeps training. Returns the frozen parameters."""
    embedding = model.get_input_embeddings()
    embedding.requires_grad_(False)
    return list(embedding.parameters())


def decoder_blocks(model) -> list:
    """The repeated transformer blocks, found by the class names transformers marks as
    not-to-be-split (Gemma4TextDecoderLayer, LlamaDecoderLayer, …), sharded or not (FSDP2
    makes a block an instance of a subclass, FSDPGemma4TextDecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    # A multimodal model's tower layers are no units of their own: a rank whose micro-batch has
    # no image skips its towers, and each unit's all-gather must be called by every rank. They
    # stay in the root unit, gathered with it on every rank (the operator's plan counts them so).
    inner = getattr(model, "model", model)
    in_towers = {id(m) for name in ("vision_tower", "audio_tower") if getattr(inner, name, None) is not None
                 for m in getattr(inner, name).modules()}
    blocks = [m for m in model.modules() if any(kind.__name__ in names for kind in type(m).__mro__)
              and id(m) not in in_towers]
    if not blocks:
        raise ModelError(f"{type(model).__name__}: cannot find its decoder blocks to shard")
    return blocks


# What a model directory holds that is weights: the export writes its own, and copies
# every other file of the base it lacks (processor, tokenizer, generation config, ...).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".safetensors.index.json", ".bin.index.json")


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def base_directory(model_id: str) -> Path | None:
    """A local directory with the base model's files: the directory itself, the host's copy
    of one in storage, or the hub snapshot's non-weight files (downloaded now if they are
    not in the cache; weights are never fetched here). None when none can be had."""
    source = model_source(model_id)
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, ignore_patterns=[f"*{s}" for s in WEIGHT_SUFFIXES]))
    except (ImportError, OSError, ValueError):  # offline, not on the hub, or not a repo id: nothing to copy
        return None


def export_dtype(base_config: dict):
    """The dtype the export is saved in: the base's own (config.json's `dtype`, or
    `torch_dtype` in older files) when it is a floating dtype, else bf16 (what Gemma 4 and
    most bases ship in). Training keeps fp32 master weights; an fp32 export is twice the
    size of the base for precision the base never had."""
    import torch

    text_config = base_config.get("text_config") or {}
    named = next((config.get(key) for config in (base_config, text_config) for key in ("dtype", "torch_dtype")
                  if config.get(key)), None)
    dtype = getattr(torch, str(named).removeprefix("torch."), None) if named else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
