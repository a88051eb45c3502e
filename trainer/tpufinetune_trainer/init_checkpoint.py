"""--init-checkpoint (spec.model.initFrom): a new run that starts from the weights a
checkpoint of this trainer holds (the SFT -> DPO chain), on the base of --model-id.

The base is loaded as always (sharded_load.py); then, before the method uses it (DPO's
stored reference is computed after, and this run's own LoRA adapters start at zero on top
of it), each rank reads from the checkpoint, in place (a path or a URI, DCP's reader), only
the rows of its own shards:
- a full fine-tune's checkpoint: every language-model weight it trained, and the persistent
  buffers, replace the base's (the per-layer embedding table is never trained nor saved;
  with the source's --freeze-embeddings, nor the embedding);
- a LoRA checkpoint: its adapters are merged into the base, W + alpha / r x B A (alpha and r
  from the checkpoint's fingerprint), on the base as that run held it (bf16, as its merged
  export does); an embedding it trained (--lora-train-embeddings) replaces the base's.
Nothing else is taken: no optimizer state, step, schedule or data position. A checkpoint
that does not fit the model (a name either lacks, another shape) is refused before any
read, naming the mismatch (`mismatches`: pure).

A resume of this run (its own checkpoints) loads over what this put in: the run's
checkpoint wins; it is still applied first at every start, since a LoRA run's checkpoint
holds its adapters only and DPO's stored reference is the starting model's."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ModelError

FIELD = "--init-checkpoint (spec.model.initFrom)"
PREFIX = "model."  # the model's keys in a checkpoint (checkpoint._state_dicts)
SHOWN = 6  # mismatches named in the message; the rest counted


@dataclass
class Plan:
    """What to read: `direct` checkpoint name -> the model's name it replaces; `adapters`
    the adapted layer's weight name -> (A's checkpoint name, B's); `scaling` alpha / r."""

    direct: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, tuple[str, str]] = field(default_factory=dict)
    scaling: float | None = None

    @property
    def lora(self) -> bool:
        return bool(self.adapters)


def adapter_parts(name: str) -> tuple[str, str] | None:
    """(the adapted layer's weight name, "A" or "B") for a LoRA adapter's name, else None:
    `….q_proj.lora_A.default.weight` -> (`….q_proj.weight`, "A")."""
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in name:
            return name.split(marker, 1)[0] + ".weight", part
    return None


def mismatches(model_shapes: dict[str, tuple], aliases: dict[str, str], stored: dict[str, tuple],
               never_saved: set[str], source: dict) -> tuple[Plan, list[str]]:
    """Pure: how a checkpoint's model tensors (`stored`: name -> shape, without "model.")
    fill a model (`model_shapes`: each tensor's canonical name -> shape; `aliases`: every
    other name a tensor has, a tied head's, -> its canonical one), and every way they do not
    fit. `never_saved`: canonical names no checkpoint holds (the per-layer table; the
    embedding when the source froze it). `source`: the checkpoint's fingerprint."""
    plan, problems = Plan(), []
    canonical = {**{name: name for name in model_shapes}, **aliases}
    parts: dict[str, dict[str, str]] = {}
    for name, shape in stored.items():
        adapter = adapter_parts(name)
        if adapter is not None:
            layer, part = adapter
            target = canonical.get(layer)
            if target is None:
                problems.append(f"the checkpoint adapts {layer.removesuffix('.weight')}, which the model lacks")
                continue
            parts.setdefault(target, {})[part] = name
            continue
        target = canonical.get(name)
        if target is None:
            problems.append(f"the checkpoint has {name}, which the model lacks")
        elif tuple(shape) != tuple(model_shapes[target]):
            problems.append(f"{name} is {list(shape)} in the checkpoint, {list(model_shapes[target])} in the model")
        elif target not in plan.direct.values():
            plan.direct[name] = target
    for target, found in parts.items():
        if set(found) != {"A", "B"}:
            problems.append(f"the checkpoint has only lora_{next(iter(found))} of {target.removesuffix('.weight')}")
            continue
        out_rows, in_columns = model_shapes[target]
        a, b = stored[found["A"]], stored[found["B"]]
        if len(a) != 2 or len(b) != 2 or a[1] != in_columns or b[0] != out_rows or a[0] != b[1]:
            problems.append(f"the adapter of {target.removesuffix('.weight')} is A {list(a)}, B {list(b)}: it does "
                            f"not fit the model's {[out_rows, in_columns]}")
            continue
        plan.adapters[target] = (found["A"], found["B"])
    lora = source.get("lora") or {}
    if plan.adapters:
        if not lora.get("rank") or lora.get("alpha") is None:
            problems.append("it holds LoRA adapters but no LoRA settings (rank, alpha) to merge them with: an "
                            "earlier trainer wrote it")
        else:
            plan.scaling = float(lora["alpha"]) / float(lora["rank"])
    elif not parts:  # a full fine-tune's: every weight it trained is there
        loaded = set(plan.direct.values())
        missing = [name for name in model_shapes if name not in loaded and name not in never_saved]
        problems += [f"the model's {name} is not in the checkpoint" for name in missing]
    return plan, problems


def refusal(location: str, model_id: str, problems: list[str]) -> ModelError:
    shown = "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    return ModelError(f"{FIELD} {location} does not fit --model-id {model_id}: {shown}. Start from a checkpoint of a "
                      "run of this base model (its --model-id), or from that run's export as --model-id")


def model_tensors(model) -> tuple[dict[str, object], dict[str, str]]:
    """The base's tensors a checkpoint may fill, by canonical name (the base's own: peft's
    `.base_layer.` left out; this run's adapters are not the base's), and the other names of
    a tensor (a tied head) -> its canonical one. Parameters and persistent buffers, as a
    checkpoint holds them."""
    from .lora import base_name, is_adapter

    tensors: dict[str, object] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    persistent = set(model.state_dict(keep_vars=True))
    named = list(model.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]
    for name, tensor in named:
        if is_adapter(name):
            continue
        canonical = base_name(name)
        if id(tensor) in first:
            aliases[canonical] = first[id(tensor)]
        else:
            first[id(tensor)] = canonical
            tensors[canonical] = tensor
    return tensors, aliases


def per_layer_table(model, tensors: dict[str, object]) -> set[str]:
    """The frozen per-layer embedding table's names (Gemma's; none elsewhere): never trained,
    never in a checkpoint, held in the compute dtype by every method (parallelize.apply_fsdp)."""
    from .model import per_layer_embeddings

    table = per_layer_embeddings(model)
    ids = {id(p) for p in table.parameters()} if table is not None else set()
    return {name for name, tensor in tensors.items() if id(tensor) in ids}


def never_saved(model, tensors: dict[str, object], source: dict) -> set[str]:
    """What no checkpoint of the source run holds: the per-layer table, and the input
    embedding (with a head tied to it) when the source ran with --freeze-embeddings."""
    frozen = {id(p) for p in model.get_input_embeddings().parameters()} if source.get("freeze_embeddings") else set()
    return per_layer_table(model, tensors) | {name for name, tensor in tensors.items() if id(tensor) in frozen}


def _empty_like(tensor, dtype, rows_of=None, columns: int | None = None):
    """A temporary in `dtype` sharded as `tensor` is (a DTensor's mesh and placements), or,
    with `rows_of` and `columns`, shaped [rows of `rows_of`, columns] and sharded as it."""
    import torch
    from torch.distributed.tensor import DTensor

    like = tensor if rows_of is None else rows_of
    if not isinstance(like, DTensor):
        shape = tuple(like.shape) if rows_of is None else (like.shape[0], columns)
        return torch.empty(shape, dtype=dtype, device=like.device)
    if rows_of is None:
        return torch.empty_like(like, dtype=dtype)
    local = torch.empty((like.to_local().shape[0], columns), dtype=dtype, device=like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size((like.shape[0], columns)), stride=(columns, 1))


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def load(model, location: str, model_id: str, group=None) -> str:
    """Collective (every rank, the same location): the checkpoint's weights into the freshly
    loaded base, in place. Raises ModelError (every rank alike: they read the same metadata)
    when it is not a complete checkpoint or does not fit. Returns the log line's words."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from . import checkpoint as ckpt

    if not ckpt.is_complete(location):
        raise ModelError(f"{FIELD} {location} is not a complete checkpoint of this trainer (its trainer state, DCP "
                         "metadata or a shard the metadata names is missing or short): start from a complete one")
    reader = ckpt.storage_reader(location)
    metadata = reader.read_metadata().state_dict_metadata
    stored_meta = {key[len(PREFIX):]: item for key, item in metadata.items()
                   if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)}
    source = ckpt.read_trainer_state(location).get("fingerprint") or {}
    tensors, aliases = model_tensors(model)
    plan, problems = mismatches({name: tuple(t.shape) for name, t in tensors.items()}, aliases,
                                {name: tuple(item.size) for name, item in stored_meta.items()},
                                never_saved(model, tensors, source), source)
    if problems:
        raise refusal(location, model_id, problems)
    state: dict[str, object] = {}
    for name, target in plan.direct.items():
        state[PREFIX + name] = _empty_like(tensors[target], stored_meta[name].properties.dtype)
    for target, (a_name, b_name) in plan.adapters.items():
        rank = stored_meta[a_name].size[0]
        weight = tensors[target]
        state[PREFIX + a_name] = torch.empty(tuple(stored_meta[a_name].size), dtype=torch.float32,
                                             device=_local(weight).device)  # A whole on every rank: r x in
        state[PREFIX + b_name] = _empty_like(weight, torch.float32, rows_of=weight, columns=rank)  # B: W's rows
    dcp.load(state, storage_reader=reader, process_group=group)
    with torch.no_grad():
        if plan.lora:  # the base as the LoRA run held it (lora.inject): bf16, as in its merged export
            kept = set(plan.direct.values()) | per_layer_table(model, tensors)
            for name, tensor in tensors.items():
                if name not in kept and isinstance(tensor, torch.nn.Parameter) and tensor.is_floating_point():
                    _local(tensor).copy_(_local(tensor).to(torch.bfloat16))
        for name, target in plan.direct.items():
            _local(tensors[target]).copy_(_local(state[PREFIX + name]))
        for target, (a_name, b_name) in plan.adapters.items():
            weight = _local(tensors[target])
            merged = weight.float() + plan.scaling * (_local(state[PREFIX + b_name]) @ state[PREFIX + a_name])
            weight.copy_(merged)
    del state
    kind = (f"a LoRA checkpoint ({len(plan.adapters)} adapters merged, alpha / r = {plan.scaling:g})" if plan.lora
            else "a full checkpoint")
    return (f"{FIELD}: the weights of {kind} at {location} ({len(plan.direct) + 2 * len(plan.adapters)} tensors "
            "read in place"
            f"{', from a run of ' + str(source.get('model_id')) if source.get('model_id') else ''}); no optimizer "
            "state, step or data position")
