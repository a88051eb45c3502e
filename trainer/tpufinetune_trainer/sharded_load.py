"""Loading the base model already sharded: each rank reads only its own slices.

The full load (model.load_causal_lm, then parallelize.apply_fsdp) holds the whole fp32
model in every process before FSDP2 keeps a 1/N shard of it: on a v6e host with four
workers that is four fp32 copies of the model, per-layer embedding table included, in
host memory at once. Here instead:

1. the model is built on the meta device (`from_config` under `torch.device("meta")`:
   shapes and dtypes, no storage), text-only as the full load builds it;
2. FSDP2 shards it there (apply_fsdp: the same units, policy and frozen per-layer table);
3. `to_empty` gives each rank storage for its own shards only (and the replicated frozen
   table, directly in the compute dtype);
4. each rank reads from the base's safetensors only the rows of each weight it holds
   (FSDP2 shards dim 0, so a rank's slice is one contiguous byte range of the file), with
   plain positioned reads into its shard, at most READ_CHUNK_BYTES at a time: no memory
   map, whose touched pages would count as the process's memory until it is unmapped,
   and no full-size tensor anywhere;
5. what the file does not hold is made as transformers makes it in `from_pretrained`:
   tied weights are one parameter (tied at construction), and non-persistent buffers
   (rotary frequencies, embedding scales) are computed by the model's own
   `initialize_weights`, which skips every tensor marked as loaded.

Why positioned reads of the safetensors rather than DCP's HuggingFaceStorageReader or a
rank-0 load with broadcast_from_rank0: a rank-0 load still holds one full fp32 copy in one
process (and the broadcast is one more all-gather-sized transfer per weight); DCP's reader
slices per rank but through safe_open, so a whole file stays mapped while a rank reads from
it (every touched page counts as its memory) and each slice is a tensor of its own before
it is copied into the shard; it also plans collectively and needs the state dict's keys to
equal the file's. The format is documented and small (an 8-byte header length, a JSON
header of dtype, shape and byte offsets, then the raw row-major data): reading the rows
needs no collective, works with any torch, and reads each byte once.

A checkpoint that cannot be read this way (no safetensors, as a `.bin`-only repository; a
weight the model has under a name or shape the file does not, as when transformers renames
or converts keys on load) fails the run with a ModelError naming the mismatch and the
bytes a full load would put in every worker: silently falling back would hold the whole
fp32 model in each process (4 x 114 GiB on one host for 31B). Only `--model-load
sharded-or-full`, for a run whose memory plan holds a full fp32 copy per worker, takes the
full load instead, with the reason in the log line.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelError
from .parallelize import RESHARD_AFTER_FORWARD

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The largest host buffer a read goes through (a weight in a dtype other than its shard's,
# or a shard that is not in host memory); a weight larger than this is read in row blocks.
READ_CHUNK_BYTES = 64 << 20

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file."""

    file: Path
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no plain counterpart for
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its first element

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        elements = 1
        for size in self.shape[1:]:
            elements *= size
        return elements * self.dtype.itemsize


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header alone. A file that is not one
    (truncated, overwritten) is a ModelError naming it, as transformers' own load says."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file.stat().st_size - 8:
                raise ValueError(f"its header says {length} bytes, more than the file holds")
            header = json.loads(f.read(length))
        data_start = 8 + length
        tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = StoredTensor(file, _DTYPES.get(entry["dtype"]), tuple(entry["shape"]),
                                         data_start + entry["data_offsets"][0])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error) as exc:
        raise ModelError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    return tensors


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files from_pretrained would read in a model directory (the index's,
    else model.safetensors), or [] when it has none."""
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else []


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    found: dict[str, StoredTensor] = {}
    for file in weight_files(directory):
        found.update(read_header(file))
    return found


def read_rows(stored: StoredTensor, start: int, stop: int, out: torch.Tensor, file=None) -> None:
    """Rows [start, stop) of a stored tensor into `out` (shape [stop - start, ...] of the
    stored one; any dtype, any device), in row blocks of at most READ_CHUNK_BYTES through a
    host buffer, or straight into `out` when it is contiguous host memory of the stored dtype."""
    if stop <= start:
        return
    if out.dim() == 0:  # a scalar is one row of one element
        out = out.view(1)
    own = file is None
    f = open(stored.file, "rb", buffering=0) if own else file
    try:
        row_bytes = stored.row_bytes
        direct = out.device.type == "cpu" and out.dtype == stored.dtype and out.is_contiguous()
        block = stop - start if direct else max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        for first in range(start, stop, block):
            last = min(stop, first + block)
            target = out[first - start:last - start]
            buffer = target.detach() if direct else torch.empty(target.shape, dtype=stored.dtype)
            f.seek(stored.start + first * row_bytes)
            _read_exactly(f, buffer.reshape(-1).view(torch.uint8).numpy(), stored.file)
            if not direct:
                target.copy_(buffer)
    finally:
        if own:
            f.close()


def _read_exactly(f, view, file: Path) -> None:
    done, size = 0, len(view)
    while done < size:
        n = f.readinto(memoryview(view)[done:])
        if not n:
            raise ModelError(f"{file}: ended {size - done} bytes early")
        done += n


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this rank's tensor, first row, end row) of a parameter or buffer: a DTensor's local
    shard and where it sits in the full tensor (FSDP2 shards dim 0 only), or a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, 0, (param.shape[0] if param.dim() else 1)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(offset[1:]) != (0,) * (len(offset) - 1) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ModelError(f"a shard of shape {tuple(shape)} at {tuple(offset)} is not whole rows of its weight")
    return local, offset[0], offset[0] + shape[0]


def expected_tensors(model) -> dict[str, list[str]]:
    """Every tensor the checkpoint must hold, by its first name, with every name it has
    (tied weights are one parameter under two names; the file holds one of them). LoRA's
    adapters are not the base's: they are made (lora.init_adapters), not read."""
    from .lora import is_adapter

    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not is_adapter(name):
            names.setdefault(id(param), []).append(name)
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            names.setdefault(id(buffer), []).append(name)
    return {found[0]: found for found in names.values()}


def mismatch(model, stored: dict[str, StoredTensor]) -> str | None:
    """Why this checkpoint cannot fill this model by name and shape, or None."""
    if not stored:
        return "no safetensors weights"
    conversions = _registered_conversions(model)
    if conversions:
        return f"transformers converts {type(model).__name__}'s checkpoint keys on load ({conversions})"
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for names in expected_tensors(model).values():
        name = next((n for n in names if base_name(n) in stored), None)
        if name is None:
            return f"the checkpoint has no {base_name(names[0])}"
        found, wanted = stored[base_name(name)], tensors[name]
        if found.shape != tuple(wanted.shape):
            return f"{name} is {list(found.shape)} in the checkpoint, {list(wanted.shape)} in the model"
        if found.dtype is None:
            return f"{name} is in a safetensors dtype this loader does not read"
        if found.dtype.is_floating_point != wanted.dtype.is_floating_point:  # quantized weights are not a cast
            return f"{name} is {found.dtype} in the checkpoint, {wanted.dtype} in the model"
    return None


def _registered_conversions(model) -> int:
    """How many key renames or conversions transformers applies to this model's checkpoint
    on load (0 for Gemma 4 and Llama); the loader here reads keys as they are."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return 0
    return len(get_model_conversion_mapping(model, add_legacy=False))


def fill_from_checkpoint(model, stored: dict[str, StoredTensor]) -> int:
    """Read every parameter's and persistent buffer's local rows from the checkpoint into
    the (materialised) model; marks each as loaded for initialize_weights. Returns the
    bytes read."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    by_name.update(model.named_buffers(remove_duplicate=False))
    files: dict[Path, object] = {}
    read = 0
    try:
        with torch.no_grad():
            for names in expected_tensors(model).values():
                name = next(n for n in names if base_name(n) in stored)
                tensor, source = by_name[names[0]], stored[base_name(name)]
                local, start, stop = local_rows(tensor)
                if source.file not in files:
                    files[source.file] = open(source.file, "rb", buffering=0)
                read_rows(source, start, stop, local, files[source.file])
                read += (stop - start) * source.row_bytes
                tensor._is_hf_initialized = True
    finally:
        for f in files.values():
            f.close()
    return read


def base_name(name: str) -> str:
    from .lora import base_name as lora_base_name

    return lora_base_name(name)


def local_directory(source: str) -> Path | None:
    """A directory with the model's config and safetensors: `source` itself, or the hub
    snapshot of them (downloaded now if not cached). None when there is none to read."""
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except (ImportError, OSError, ValueError):  # offline, or not a hub repository
        return None


# Config fields that make a model mixture-of-experts: Gemma 4's (enable_moe_block, with
# num_experts), Qwen's num_experts, Mixtral's num_local_experts, DeepSeek's n_routed_experts.
EXPERT_FIELDS = ("enable_moe_block", "num_experts", "num_local_experts", "n_routed_experts")


def check_dense(config, model_id: str) -> None:
    """ModelError for a mixture-of-experts model: the transformers implementation runs its
    experts one after another, which wastes most of a TPU; until a grouped-experts path
    exists such a run is refused by name rather than run badly."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in EXPERT_FIELDS:
        value = getattr(text, name, None)
        if value is True or (type(value) is int and value > 1):
            experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or \
                getattr(text, "n_routed_experts", None)
            raise ModelError(f"--model-id {model_id} is a mixture-of-experts model (its config's {name} is {value!r}"
                             + (f", {experts} experts" if experts and name != "num_experts" else "")
                             + "), which the trainer cannot run well yet (no grouped-experts path): fine-tune a "
                               "dense model instead, e.g. google/gemma-4-31B-it or google/gemma-4-E4B-it")


def build_on_meta(model_id: str, attn_implementation: str, multimodal: bool = False):
    """The model the full load builds (fp32, text-only, use_cache off, in eval mode as
    from_pretrained returns it), with every parameter and buffer on the meta device.
    `multimodal` (--vision-tower): the whole model, its towers included."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    from .model import _quiet_transformers, load_config, model_source, text_only_kwargs, tower_attention

    source = model_source(model_id)
    try:
        config = AutoConfig.from_pretrained(source, **({} if multimodal else text_only_kwargs(load_config(model_id))))
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        with _quiet_transformers(), torch.device("meta"):
            attention = tower_attention(config, attn_implementation) if multimodal else attn_implementation
            model = auto.from_config(config, dtype=torch.float32, attn_implementation=attention)
    except Exception as exc:
        raise ModelError(f"cannot build --model-id {model_id} as a causal LM: {type(exc).__name__}: {exc}") from exc
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(source)
        except OSError:
            pass  # none in the directory: from_pretrained keeps the one derived from the config
    model.config.get_text_config().use_cache = False
    return model.eval()


def initialise_unloaded_buffers(model) -> None:
    """Non-persistent buffers (rotary frequencies, embedding scales) as from_pretrained
    makes them: the model's own initialize_weights, which leaves every tensor marked as
    loaded (`_is_hf_initialized`) as it is."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()


def load_sharded(model_id: str, attn_implementation: str, mesh, compute_dtype: torch.dtype,
                 compile: bool = False, device: torch.device | None = None, full: bool = False, lora=None,
                 reshard_after_forward: bool = RESHARD_AFTER_FORWARD, fallback: bool = False,
                 multimodal: bool = False):
    """The base model, FSDP2-sharded over `mesh`, each rank having read only its own slices.
    Returns (model, how): how it was loaded, for the log. `full` (--model-load full) takes
    the full load (the same model). A checkpoint that cannot be read by name and shape is a
    ModelError naming the mismatch (`refuse_full_load`) unless `fallback` (--model-load
    sharded-or-full: the plan holds a full fp32 copy per worker), which takes the full load.
    `lora` (the run's config, --method lora): LoRA's adapters are added before sharding
    (lora.py) and made the same on every rank after it. `multimodal` (--vision-tower): the
    whole model with its towers (media.py)."""
    import time

    from . import lora as adapters
    from .model import load_causal_lm, load_config, model_source
    from .parallelize import apply_fsdp

    check_dense(load_config(model_id), model_id)  # the driver refused it already; this guards any other caller
    start = time.perf_counter()
    stored: dict[str, StoredTensor] = {}
    reason = "--model-load full"
    if not full:
        model = build_on_meta(model_id, attn_implementation, multimodal)
        if lora is not None:
            adapters.inject(model, lora)
        directory = local_directory(model_source(model_id))
        stored = stored_tensors(directory) if directory is not None else {}
        reason = mismatch(model, stored)
        if reason is not None and not fallback:
            raise refuse_full_load(model_id, reason, model)
    if reason is not None:
        model = load_causal_lm(model_id, torch.float32, attn_implementation, multimodal)
        if lora is not None:
            adapters.inject(model, lora)
        apply_fsdp(model, mesh, compute_dtype, compile=compile, device=device,
                   reshard_after_forward=reshard_after_forward)
        if lora is not None:
            adapters.init_adapters(model, lora.seed)
        return model, (f"every rank loaded the whole model ({reason}) in {time.perf_counter() - start:.1f} s"
                       f"{peak_rss_words()}")
    apply_fsdp(model, mesh, compute_dtype, compile=compile, reshard_after_forward=reshard_after_forward)
    model.to_empty(device=device if device is not None else torch.device("cpu"))
    read = fill_from_checkpoint(model, stored)
    initialise_unloaded_buffers(model)
    if lora is not None:
        adapters.init_adapters(model, lora.seed)
    return model, (f"each rank read its own slices ({read / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s"
                   f"{peak_rss_words()}")


def full_load_bytes(model) -> int:
    """Host bytes of one full load: every parameter and buffer in fp32 (a tied weight once)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * max(tensor.element_size(), 4)
    return total


def refuse_full_load(model_id: str, reason: str, model) -> ModelError:
    return ModelError(
        f"--model-id {model_id}: the sharded load cannot read its checkpoint by name and shape ({reason}). The "
        f"full load instead would hold the whole fp32 model, {full_load_bytes(model) / 2**30:.1f} GiB, in every "
        "worker at once (a host's workers each hold one). Fix the checkpoint (safetensors named as the model "
        "names its weights), or pass --model-load sharded-or-full (or full) only where the memory plan holds a "
        "full fp32 copy per worker on the host")


def peak_rss_words() -> str:
    """`; peak RSS N MiB`: this process's host memory high-water mark so far (Linux), what
    a host's workers must fit in beside /dev/shm; empty where the kernel does not say."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return ""
    return f"; peak RSS {kib / 1024:.0f} MiB"
