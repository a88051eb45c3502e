"""LoRA (--method lora): low-rank adapters from `peft` on a frozen bf16 base.

The adapters are injected into the model before FSDP2 shards it (on the meta device for
the sharded load), so each decoder block's FSDP unit holds its frozen base weights (bf16:
no fp32 master, no gradient, no optimizer state) beside its adapters (fp32 masters, the
only parameters the optimizer gets). FSDP2 checks one original dtype across a unit's
trainable parameters only, so the mix is allowed; the frozen ones are all-gathered in the
compute dtype like the rest.

Every rank makes the same adapters, whatever the load: A from a generator seeded by the run's
seed and the adapter's index (peft's Kaiming-uniform), B zero, so the adapted model starts
as the base. A checkpoint holds the trainable parameters and their optimizer state only
(checkpoint.py leaves frozen parameters out); a resume rebuilds the base from the model
source and loads the adapters into it.

The export writes the adapter as peft writes it (adapter_config.json and
adapter_model.safetensors, keys `base_model.model.<module>.lora_A.weight`), and, unless
--lora-export-merged false, the base with W + alpha / r x B A merged into each adapted layer.

A multimodal run (--vision-tower) trains the vision projector in full beside the adapters; with
--vision-tower trained, adapters also go on the vision tower's attention and MLP projections
named in --lora-target-modules (target_modules), its base frozen in bf16 like the language
model's, and the merged export folds them into the tower's weights.

--lora-train-embeddings true also trains the input embedding in full (fp32 master, gradient,
AdamW state; a head tied to it, Gemma's, is the same weight and trains with it): a base that
never saw the chat template's special tokens has them as initialised, and adapters on the
projections cannot move them. It stays a plain parameter of the model (no peft wrapper, so
the sharded load, the checkpoint and the merged export see the base's names); the adapter
export names it as peft's `modules_to_save` (with `ensure_weight_tying`, so the loaded
adapter's head follows it).
"""

from __future__ import annotations

import contextlib
import math
import re

from .errors import ModelError

METHODS = ("full", "lora", "dpo")  # dpo: methods/dpo.py, full or (--dpo-lora) adapters
# The Linear layers of each family's language model a LoRA may adapt; the operator's table
# (tpufinetune/core/api.py, LORA_TARGET_MODULES) is the same (tests/api/test_trainer_agreement.py).
TARGET_MODULES = {
    "gemma4": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "per_layer_input_gate", "per_layer_projection"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_NAMES = tuple(dict.fromkeys(name for names in TARGET_MODULES.values() for name in names))
# Multimodal towers are not adapted (a text fine-tune drops them; the export adds them back
# from the base, and peft must not match their projections when it loads the adapter) ...
EXCLUDE_MODULES = r".*(vision_tower|audio_tower|embed_vision|embed_audio).*"
# ... except the vision tower with --vision-tower trained: adapters on its attention and MLP
# projections named in --lora-target-modules. Gemma 4's tower wraps each projection's Linear
# in a Gemma4ClippableLinear, as `<name>.linear`, the layer adapted.
TOWER = "vision_tower"
TOWER_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOWER_LINEAR = "linear"
ADAPTER_NAME = "default"
# The input embedding's module name in every family of the table (peft's modules_to_save
# matches modules by this name).
EMBEDDING_MODULE = "embed_tokens"
FIELD = "spec.training.lora.targetModules (--lora-target-modules)"


def parse_modules(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def family_of(config) -> str | None:
    """The model family of a transformers config (its model_type), or None if not in the table."""
    model_type = str(getattr(config, "model_type", "") or "")
    return next((family for family in TARGET_MODULES if model_type.startswith(family)), None)


def adapts_tower(cfg) -> bool:
    """LoRA on a multimodal run whose vision tower trains: adapters on the tower too."""
    return getattr(cfg, "vision_tower", "") == "trained"


def tower_names(names: list[str]) -> list[str]:
    return [name for name in names if name in TOWER_TARGET_MODULES]


def target_modules(cfg):
    """peft's target_modules: the names (peft matches a module by its name's last parts; the
    towers excluded by EXCLUDE_MODULES), or with adapters on the vision tower one pattern
    (peft matches it whole, and excludes nothing beside it): the names outside the towers and
    the tower's projections, since a name alone would also match the tower's wrappers."""
    names = parse_modules(cfg.lora_target_modules)
    if not adapts_tower(cfg):
        return names
    text, tower = ("|".join(re.escape(name) for name in chosen) for chosen in (names, tower_names(names)))
    outside = EXCLUDE_MODULES.removeprefix(".*").removesuffix(".*")
    return rf"(?!.*\.{outside}\.)(?:.*\.)?(?:{text})|.*\.{TOWER}\..*\.(?:{tower})\.{TOWER_LINEAR}"


def check_tower_targets(model, names: list[str]) -> None:
    """With adapters on the vision tower: the tower has the named projections (config.py checks
    some are named) as `<name>.linear` Linear layers (Gemma 4's); a ModelError otherwise."""
    import torch

    wanted = tower_names(names)
    found = {name.split(".")[-2] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and f".{TOWER}." in f".{name}"
             and name.endswith(f".{TOWER_LINEAR}")}
    if not set(wanted) & found:
        raise ModelError(f"{FIELD}: this model's vision tower has no {', '.join(wanted)} projection LoRA can adapt "
                         "(adapters on a vision tower are built for Gemma 4's); use --vision-tower frozen")


def check_targets(model, names: list[str]) -> None:
    """Every name must be one of the family's and name at least one Linear layer of the
    language model; a ModelError names the field and the valid names otherwise."""
    import torch

    family = family_of(model.config)
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and not re.fullmatch(EXCLUDE_MODULES, name)}
    valid = [n for n in TARGET_MODULES[family] if n in present] if family else sorted(present - {"lm_head"})
    wrong = [n for n in names if n not in valid]
    if wrong:
        kind = f"model family {family}" if family else f"model type {model.config.model_type}"
        raise ModelError(f"{FIELD}: {', '.join(wrong)} is not a layer LoRA can adapt in this model ({kind}); "
                         f"valid names: {', '.join(valid)}")


def lora_config(cfg, saved: bool = False):
    """peft's config of the run. `saved`: the exported adapter's, which names a trained
    embedding as modules_to_save; injection never gets it (peft would wrap the embedding)."""
    from peft import LoraConfig

    extra = ({"modules_to_save": [EMBEDDING_MODULE], "ensure_weight_tying": True}
             if saved and cfg.lora_train_embeddings else {})
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target_modules(cfg),
                      exclude_modules=None if adapts_tower(cfg) else EXCLUDE_MODULES,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=cfg.model_id, **extra)


def input_embedding(model):
    """The input embedding module --lora-train-embeddings trains; a ModelError if the model
    names it otherwise than the adapter export will (EMBEDDING_MODULE)."""
    embedding = model.get_input_embeddings()
    names = [name for name, module in model.named_modules() if module is embedding]
    if not names or names[0].rsplit(".", 1)[-1] != EMBEDDING_MODULE:
        raise ModelError(f"spec.training.lora.trainEmbeddings (--lora-train-embeddings): this model's input "
                         f"embedding is {names[0] if names else 'not a named module'}, not {EMBEDDING_MODULE}; "
                         "leave it unset for this model")
    return embedding


def inject(model, cfg) -> None:
    """Add the adapters to `model` in place (meta or real), freeze everything else and hold
    the frozen weights in bf16."""
    import torch
    from peft import inject_adapter_in_model

    check_targets(model, parse_modules(cfg.lora_target_modules))
    if adapts_tower(cfg):
        check_tower_targets(model, parse_modules(cfg.lora_target_modules))
    trained = {id(p) for p in input_embedding(model).parameters()} if cfg.lora_train_embeddings else set()
    if getattr(cfg, "multimodal", False):  # the vision projector trains in full beside the adapters (media.py)
        from .media import towers

        trained |= {id(p) for p in towers(model)["embed_vision"].parameters()}
    inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        train = is_adapter(name) or id(param) in trained  # a tied head is the embedding's parameter
        param.requires_grad_(train)
        param.data = param.data.to(torch.float32 if train else torch.bfloat16)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def base_name(name: str) -> str:
    """A parameter's name in the base checkpoint: peft keeps the adapted Linear as `base_layer`."""
    return name.replace(".base_layer.", ".")


def init_adapters(model, seed: int) -> int:
    """A: Kaiming-uniform (a=sqrt(5), as peft and nn.Linear) from a generator seeded by the
    run's seed and the adapter's index, the same on every rank; B: zero. Each rank writes
    its own rows (sharded_load.local_rows). Returns how many adapters."""
    import torch

    from .sharded_load import local_rows

    count = 0
    with torch.no_grad():
        for index, (name, param) in enumerate(sorted(model.named_parameters())):
            if not is_adapter(name):
                continue
            local, start, stop = local_rows(param)
            if ".lora_B." in name:
                local.zero_()
            else:
                full = torch.empty(tuple(param.shape), dtype=torch.float32)
                fan_in = full.shape[1]
                bound = math.sqrt(6 / ((1 + 5) * fan_in))  # kaiming_uniform_ with a=sqrt(5)
                full.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed * 1_000_003 + index))
                local.copy_(full[start:stop])
                count += 1
    return count


# ---------------------------------------------------------------------- export
def peft_key(name: str) -> str:
    """A trained adapter's name as peft saves it: under base_model.model., no adapter name."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_state(full: dict, cfg) -> dict:
    """`full`: the trained parameters by name (checkpoint.export_adapter). With a trained
    embedding, it is saved under its own name and a tied head's (lm_head.weight), as peft
    saves a modules_to_save embedding with ensure_weight_tying; separate copies, since
    safetensors refuses shared storage."""
    state = {peft_key(name): tensor.float().contiguous() for name, tensor in full.items() if is_adapter(name)}
    if cfg.lora_train_embeddings:
        state.update({peft_key(name): tensor.float().clone().contiguous() for name, tensor in full.items()
                      if not is_adapter(name)})
    return state


def write_adapter(directory, full: dict, cfg) -> None:
    """adapter_config.json and adapter_model.safetensors into a local directory."""
    from pathlib import Path

    from safetensors.torch import save_file

    lora_config(cfg, saved=True).save_pretrained(str(directory))
    save_file(adapter_state(full, cfg), str(Path(directory, "adapter_model.safetensors")), metadata={"format": "pt"})


def settings(cfg) -> dict:
    """The method and its settings, for the resume fingerprint (resume.py): --method dpo's
    (beta, loss, label smoothing, reference-free) too, and LoRA's shape wherever adapters train."""
    found = {"method": cfg.method}
    if cfg.method == "dpo":
        found["dpo"] = {"beta": cfg.dpo_beta, "loss": cfg.dpo_loss, "label_smoothing": cfg.dpo_label_smoothing,
                        "reference_free": cfg.dpo_reference_free, "lora": cfg.dpo_lora}
    if not getattr(cfg, "uses_lora", cfg.method == "lora"):
        return found
    return {**found, "lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                                           "target_modules": parse_modules(cfg.lora_target_modules),
                                           # only when on: a checkpoint from before the flag matches
                                           **({"train_embeddings": True} if cfg.lora_train_embeddings else {})}}


@contextlib.contextmanager
def adapters_disabled(model):
    """The base alone: every LoRA layer of `model` skips its adapter inside the block (DPO's
    reference with LoRA: no second copy of the weights). peft's forward reads the flag each
    call; it is set directly, not through enable_adapters, which would also change which
    parameters require gradients."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was
