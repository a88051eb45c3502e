"""The Hugging Face export: its weights streamed to the store, and its proof.

Weights (`write_weights`, called by checkpoint.export_hf): cast to the export dtype on each
rank's shard, gathered one tensor at a time (DTensor.full_tensor), copied to the host on rank
0 only and written straight to the destination (a path or URI, through the trainer's storage
code) as safetensors files of bounded size. Rank 0 never holds the whole model, no other
rank's host holds any of it, and nothing is copied locally first.

Proof (`prove_collective`): before a run may succeed, rank 0 loads what it exported back
from where it was written and generates a few tokens for a few held-out prompts. The model
is loaded from its destination, not from anything the export kept in memory: a path is read
in place, a URI (gs://) through storage.local_copy, which downloads the uploaded objects.
So the proof reads the bytes a user will read. Generation is greedy with a fixed seed, so
two proofs of the same export give the same text. For --method lora the adapter is also
loaded with peft onto the base and generates for the same prompts. A proof that fails ends
the run with ExportUnloadable; the checkpoints are left as they are (the export can be
written again from them).

Sized to rank 0's host: loading the export holds all of it in rank 0's process
(`proof_host_bytes`: 31B's bf16 weights are 57 GiB, in no plan's pod), beside the trainer's
own memory. When the need exceeds what the host can still give (`host_memory_free`: the
pod's cgroup limit less its usage, the host's MemAvailable), the proof is streamed instead
(`prove_streamed`): the export's config builds the model (on the meta device), every weight
it names is in the files with its shape and a dtype transformers reads (the check the sharded
load makes), and every byte of every tensor is read back a block at a time and is finite; the
adapter's config loads with peft and each of its layers is one of the base's. That holds at
most a block in memory; it generates nothing, and the `export_proof` event says which proof
ran and why (`mode`, `need_bytes`, `free_bytes`).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import ExportUnloadable

PROOF_PROMPTS = 3
PROOF_TOKENS = 8
PROOF_SEED = 0
# A prompt in the event and the status is cut to this many characters (the status stays small).
PROOF_TEXT_CHARS = 160
# Held-out examples whose labels start at once (--loss-on all) have no prompt: their
# first tokens, at most this many, stand in for one.
FALLBACK_PROMPT_TOKENS = 32


def _prompt_of(tokens: np.ndarray, labels: np.ndarray) -> list[int]:
    labelled = np.flatnonzero(labels != -100)
    end = int(labelled[0]) if labelled.size else len(tokens)
    if end <= 1:
        end = min(len(tokens) // 2 or 1, FALLBACK_PROMPT_TOKENS)
    return [int(t) for t in tokens[:end]]


def proof_prompts(eval_data, examples, count: int = PROOF_PROMPTS) -> list[list[int]]:
    """Token ids of up to `count` prompts: the first held-out examples (the evaluation's
    packed blocks, example by example), else the first training examples."""
    prompts: list[list[int]] = []
    if eval_data is not None:
        for block in range(len(eval_data)):
            segments = eval_data.segment_ids[block]
            real = int(eval_data.real_tokens[block])
            for segment in dict.fromkeys(segments[:real].tolist()):
                where = np.flatnonzero(segments[:real] == segment)
                prompts.append(_prompt_of(eval_data.input_ids[block][where], eval_data.labels[block][where]))
                if len(prompts) == count:
                    return prompts
    for tokens, labels in zip(examples.input_ids, examples.labels):
        if len(prompts) == count:
            break
        prompts.append(_prompt_of(np.asarray(tokens), np.asarray(labels)))
    return prompts


def _generate(model, prompts: list[list[int]], tokens: int, pad_id: int, pixels=None) -> list[list[int]]:
    """Greedy completions; `pixels(k)` (a multimodal export) the k-th prompt's image inputs."""
    import torch

    torch.manual_seed(PROOF_SEED)
    out = []
    with torch.no_grad():
        for k, prompt in enumerate(prompts):  # one at a time: no padding, so no attention-mask subtleties
            ids = torch.tensor([prompt], dtype=torch.long)
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                       min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=pad_id,
                                       **(pixels(k) if pixels is not None else {}))
            out.append(generated[0, len(prompt):].tolist())
    return out


def _load_model(location: str, dtype, multimodal: bool = False):
    from .model import load_causal_lm

    return load_causal_lm(location, dtype, "sdpa", multimodal).eval()


def _image_inputs(location: str, images: list[list[str]]):
    """A multimodal export's proof inputs: its own processor (loaded from the export, as a user
    loads it) making each prompt's pixels."""
    from .media import Pixels, load_media_processor
    from .model import model_source

    pixels = Pixels(load_media_processor(model_source(location)).image_processor)
    return lambda k: pixels(images[k], "cpu")


def _load_adapter(base_model_id: str, adapter_location: str, dtype):
    from peft import PeftModel

    from . import storage

    local = storage.local_copy(adapter_location) if storage.is_uri(adapter_location) else adapter_location
    return PeftModel.from_pretrained(_load_model(base_model_id, dtype), str(local)).eval()


def prove(model_uri: str | None, adapter_uri: str | None, base_model_id: str, tokenizer,
          prompts: list[list[int]], dtype, tokens: int = PROOF_TOKENS, images: list[list[str]] | None = None) -> dict:
    """Load the export (and the adapter onto the base) and greedy-generate `tokens` tokens
    for each prompt. Returns the proof's fields (the `export_proof` event's); raises
    ExportUnloadable naming what failed to load or to generate. `images` (a multimodal run,
    media.py): each prompt's images; the export is loaded whole, with its processor, and
    answers each prompt with its images."""
    if not prompts:
        raise ExportUnloadable("no prompt to prove the export with (no evaluation or training example)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    loaded, completions, adapter_completions = 0.0, None, None
    for what, location in (("model", model_uri), ("adapter", adapter_uri)):
        if not location:
            continue
        start = time.perf_counter()
        try:
            model = _load_model(location, dtype, images is not None) if what == "model" else \
                _load_adapter(base_model_id, location, dtype)
            pixels = _image_inputs(location, images) if images is not None and what == "model" else None
        except Exception as exc:  # noqa: BLE001 - whatever stops a load is the reason
            raise ExportUnloadable(f"the exported {what} at {location} does not load: "
                                   f"{type(exc).__name__}: {_first_line(exc)}") from exc
        loaded += time.perf_counter() - start
        try:
            generated = _generate(model, prompts, tokens, pad_id, pixels)
        except Exception as exc:  # noqa: BLE001
            raise ExportUnloadable(f"the exported {what} at {location} loads but does not generate: "
                                   f"{type(exc).__name__}: {_first_line(exc)}") from exc
        del model
        if what == "model":
            completions = generated
        else:
            adapter_completions = generated
    if completions is None and adapter_completions is None:
        raise ExportUnloadable("nothing was exported to prove (neither a model nor an adapter)")

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)[:PROOF_TEXT_CHARS]

    sample = []
    for index, prompt in enumerate(prompts):
        entry = {"prompt": tokenizer.decode(prompt, skip_special_tokens=True)[-PROOF_TEXT_CHARS:]}
        if images is not None:
            entry["images"] = list(images[index])
        if completions is not None:
            entry["completion"], entry["completion_ids"] = text(completions[index]), completions[index]
        if adapter_completions is not None:
            entry["adapter_completion"] = text(adapter_completions[index])
            entry["adapter_completion_ids"] = adapter_completions[index]
        sample.append(entry)
    return {"model_uri": model_uri, "adapter_uri": adapter_uri, "dtype": str(dtype).removeprefix("torch."),
            "tokens": tokens, "load_s": round(loaded, 3), "sample": sample}


# Rank 0's host bytes a proof needs beyond the weights it loads: transformers' and peft's
# objects and the generation of a few short prompts (its cache and logits). An allowance
# (the tiny model's proof adds about 0.3 GiB to its process), not a measurement of a large one.
PROOF_OVERHEAD_BYTES = 1 << 30


def proof_host_bytes(params: int, dtype_bytes: int = 2, adapter_params: int = 0) -> int:
    """Rank 0's host bytes at the proof's peak (what the memory plan adds to rank 0's pod):
    the model's `params` (every weight of the export, per-layer tables included) in the
    export's dtype (`dtype_bytes`: 2 for bf16), with a LoRA adapter's `adapter_params` on its
    base (the merged model is dropped before the adapter is proved: never both), plus
    PROOF_OVERHEAD_BYTES. Gemma 4 31B: 57 GiB of weights in bf16."""
    return (params + adapter_params) * dtype_bytes + PROOF_OVERHEAD_BYTES


def host_memory_free() -> int | None:
    """Bytes this process can still allocate on its host: the smaller of its cgroup's (the
    pod's memory limit less what the pod uses; cgroup v2, else v1) and the host's
    MemAvailable; None where neither is known."""
    from pathlib import Path

    def number(path: str) -> int | None:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    found = []
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         (f"{v1}limit_in_bytes", f"{v1}usage_in_bytes")):
        cap, used = number(limit), number(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 says "no limit" with a huge number
            found.append(max(cap - used, 0))
            break
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    return min(found) if found else None


def _export_bytes(directory, dtype) -> int:
    """Bytes of a model directory's weights in `dtype` (its safetensors headers only)."""
    from .sharded_load import stored_tensors

    size = 0
    for stored in stored_tensors(directory).values():
        elements = 1
        for dim in stored.shape:
            elements *= dim
        itemsize = dtype.itemsize if stored.dtype is not None and stored.dtype.is_floating_point else \
            (stored.dtype.itemsize if stored.dtype is not None else 0)
        size += elements * itemsize
    return size


def proof_need(model_dir, adapter_dir, base_dir, dtype) -> int:
    """What `prove` would hold on this host for these directories (proof_host_bytes's sum)."""
    from pathlib import Path

    model = _export_bytes(Path(model_dir), dtype) if model_dir is not None else 0
    adapter = 0
    if adapter_dir is not None:
        adapter = sum(f.stat().st_size for f in Path(adapter_dir).glob("*.safetensors"))
        adapter += _export_bytes(Path(base_dir), dtype) if base_dir is not None else model
    return max(model, adapter) + PROOF_OVERHEAD_BYTES


def _local(location: str):
    from pathlib import Path

    from . import storage

    return storage.local_copy(location) if storage.is_uri(location) else Path(location)


def _read_every_byte(stored: dict, where: str) -> tuple[int, int]:
    """Read each stored tensor a block of rows at a time (sharded_load.read_rows) and check
    that its floating values are finite; (tensors, bytes) read. ExportUnloadable otherwise."""
    import torch

    from .errors import ModelError
    from .sharded_load import READ_CHUNK_BYTES, read_rows

    files: dict = {}
    count = read = 0
    try:
        for name, tensor in stored.items():
            if tensor.dtype is None:
                raise ExportUnloadable(f"the exported {where}'s {name} is in a dtype transformers does not read")
            block = max(1, READ_CHUNK_BYTES // max(tensor.row_bytes, 1))
            if tensor.file not in files:
                files[tensor.file] = open(tensor.file, "rb", buffering=0)
            for start in range(0, tensor.rows, block):
                stop = min(tensor.rows, start + block)
                buffer = torch.empty((stop - start, *tensor.shape[1:]), dtype=tensor.dtype)
                try:
                    read_rows(tensor, start, stop, buffer, files[tensor.file])
                except ModelError as exc:  # a torn file
                    raise ExportUnloadable(f"the exported {where} does not load: {exc}") from exc
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    raise ExportUnloadable(f"the exported {where}'s {name} holds values that are not finite")
                read += buffer.numel() * buffer.element_size()
            count += 1
    finally:
        for f in files.values():
            f.close()
    return count, read


def prove_streamed(model_uri: str | None, adapter_uri: str | None, base_model_id: str, dtype) -> dict:
    """The proof in bounded memory (see the module's docstring): every weight there by name,
    shape and dtype, every byte readable and finite. Returns the event's fields; raises
    ExportUnloadable naming what is wrong."""
    from .errors import ModelError
    from .sharded_load import build_on_meta, mismatch, read_header, stored_tensors

    start, checked, read = time.perf_counter(), 0, 0
    if model_uri:
        try:
            directory = _local(model_uri)
            model = build_on_meta(str(directory), "sdpa")
            stored = stored_tensors(directory)
        except (ModelError, OSError, ValueError) as exc:
            raise ExportUnloadable(f"the exported model at {model_uri} does not load: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from exc
        reason = mismatch(model, stored)
        if reason is not None:
            raise ExportUnloadable(f"the exported model at {model_uri} does not load: {reason}")
        tensors, size = _read_every_byte(stored, "model")
        checked, read = checked + tensors, read + size
    if adapter_uri:
        from peft import PeftConfig

        try:
            directory = _local(adapter_uri)
            PeftConfig.from_pretrained(str(directory))
            stored = {}
            for file in sorted(directory.glob("*.safetensors")):
                stored.update(read_header(file))
            base = build_on_meta(base_model_id, "sdpa")
        except (ModelError, OSError, ValueError) as exc:
            raise ExportUnloadable(f"the exported adapter at {adapter_uri} does not load: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from exc
        modules = dict(base.named_modules())
        for name in stored:
            if ".lora_" in name:
                layer = name.removeprefix("base_model.model.").split(".lora_")[0]
                if layer not in modules:
                    raise ExportUnloadable(f"the exported adapter at {adapter_uri} does not load: its {name} "
                                           f"adapts {layer}, which {base_model_id} does not have")
        tensors, size = _read_every_byte(stored, "adapter")
        checked, read = checked + tensors, read + size
    return {"model_uri": model_uri, "adapter_uri": adapter_uri, "dtype": str(dtype).removeprefix("torch."),
            "tokens": 0, "load_s": round(time.perf_counter() - start, 3), "sample": [], "mode": "streamed",
            "tensors": checked, "bytes_read": read}


def prove_sized(model_uri: str | None, adapter_uri: str | None, base_model_id: str, tokenizer,
                prompts: list[list[int]], dtype, base_dir=None, free_bytes: int | None = None,
                images: list[list[str]] | None = None) -> dict:
    """`prove` when what it holds fits this host's free memory (`free_bytes`, else
    host_memory_free()), else `prove_streamed`; the event's fields say which and why."""
    model_dir = _local(model_uri) if model_uri else None
    adapter_dir = _local(adapter_uri) if adapter_uri else None
    need = proof_need(model_dir, adapter_dir, base_dir, dtype)
    free = host_memory_free() if free_bytes is None else free_bytes
    sizes = {"need_bytes": need, "free_bytes": free}
    if free is None or need <= free:
        return {**prove(model_uri, adapter_uri, base_model_id, tokenizer, prompts, dtype, images=images),
                "mode": "generated", **sizes}
    return {**prove_streamed(model_uri, adapter_uri, base_model_id, dtype), **sizes}


def proof_words(proof: dict) -> str:
    """Rank 0's log line of a proof."""
    if proof.get("mode") == "streamed":
        return (f"Proved the export streamed, not loaded (rank 0's host needs {proof['need_bytes'] / 2**30:.1f} GiB "
                f"to load it, has {proof['free_bytes'] / 2**30:.1f} GiB free): every weight there by name and shape, "
                f"{proof['tensors']} tensors ({proof['bytes_read'] / 2**30:.2f} GiB) read back finite in "
                f"{proof['load_s']:.1f}s")
    return (f"Proved the export: loaded in {proof['load_s']:.1f}s, {proof['tokens']} tokens generated for each of "
            f"{len(proof['sample'])} held-out prompts")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:400]


def prove_collective(rank: int, group, model_uri: str | None, adapter_uri: str | None, base_model_id: str,
                     tokenizer, prompts: list[list[int]], base_dir=None, free_bytes: int | None = None,
                     images: list[list[str]] | None = None) -> dict:
    """Collective: rank 0 proves the export (`prove_sized`: loaded and generating where its
    host holds it, else streamed) and emits the `export_proof` event;
    every rank learns the outcome and raises the same ExportUnloadable when it failed (a rank
    that raised alone would leave the others waiting). Returns the proof on rank 0, else {}."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from .events import emit
    from .model import export_dtype

    outcome: list = [None]
    proof: dict = {}
    if rank == 0:
        config_file = Path(base_dir, "config.json") if base_dir is not None else None
        base_config = json.loads(config_file.read_text()) if config_file and config_file.is_file() else {}
        try:
            proof = prove_sized(model_uri, adapter_uri, base_model_id, tokenizer, prompts, export_dtype(base_config),
                                base_dir, free_bytes, images)
        except ExportUnloadable as exc:
            outcome[0] = str(exc)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone must not raise: the others wait below
            outcome[0] = f"the export's proof failed: {type(exc).__name__}: {_first_line(exc)}"
        else:
            emit("export_proof", **proof)
    dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise ExportUnloadable(outcome[0])
    return proof


# ---------------------------------------------------------------------- streamed weights
# Each safetensors file of the export holds at most this many bytes of tensors (one larger
# tensor gets a file of its own); Hugging Face's own default shard size.
SHARD_BYTES = 5 * 2**30
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_TORCH_OF_SAFETENSORS = {code: name for name, code in SAFETENSORS_DTYPES.items()}
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# Module wrappers whose names are not the checkpoint's (compile, activation checkpointing).
_WRAPPER_NAMES = ("_orig_mod.", "_checkpoint_wrapped_module.")


class Entry:
    """One tensor of the export: its name in the file, shape, dtype, and how rank 0 gets it."""

    __slots__ = ("name", "shape", "dtype", "source", "parts")

    def __init__(self, name: str, shape, dtype: str, source: str, parts: tuple):
        self.name, self.shape, self.dtype, self.source, self.parts = name, list(shape), dtype, source, parts

    @property
    def nbytes(self) -> int:
        import torch

        count = 1
        for size in self.shape:
            count *= size
        return count * getattr(torch, _TORCH_OF_SAFETENSORS[self.dtype]).itemsize


def _clean(name: str) -> str:
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


def model_entries(state: dict, dtype, skip: set[str], lora_scaling: float | None) -> list[Entry]:
    """The model's tensors, in state-dict order (the order every rank gathers them in): the
    floating ones in `dtype`, LoRA's adapters merged into their base layers (`lora_scaling`)."""
    from . import lora

    target = SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")]
    entries = []
    for key, value in state.items():
        name = _clean(key)
        if name in skip or lora.is_adapter(name):
            continue
        kind = target if value.is_floating_point() else SAFETENSORS_DTYPES[str(value.dtype).removeprefix("torch.")]
        parts: tuple = (key,)
        if lora_scaling is not None and name.endswith(".base_layer.weight"):
            prefix = key[: -len(".base_layer.weight")]
            parts = (key, f"{prefix}.lora_A.{lora.ADAPTER_NAME}.weight", f"{prefix}.lora_B.{lora.ADAPTER_NAME}.weight")
        entries.append(Entry(lora.base_name(name), value.shape, kind, "model", parts))
    return entries


def tower_entries(base_dir, base_config: dict, names: set[str], tied: set[str], dtype=None) -> list[Entry]:
    """For a multimodal base (its config has a vision or audio tower), every tensor of the
    base's safetensors the trained text model lacks (the towers and their projections, which
    the fine-tune never loaded and so never changed), read from the base at write time. None
    when the base is text-only, its files are not here, or the trained model names its
    weights differently from the base (the base's "missing" keys would bring its untrained
    text weights back in)."""
    from pathlib import Path

    from safetensors import safe_open

    if base_dir is None or not any(base_config.get(name) for name in ("vision_config", "audio_config")):
        return []
    found: dict[str, Entry] = {}
    for file in sorted(Path(base_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                kind = piece.get_dtype()
                if dtype is not None and kind in _FLOATING:
                    kind = SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")]
                found[key] = Entry(key, piece.get_shape(), kind, str(file), ())
    if not names - tied <= set(found):
        return []
    return [entry for key, entry in found.items() if key not in names and key not in tied]


def plan_shards(entries: list[Entry], limit: int = SHARD_BYTES) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[Entry]) -> bytes:
    import json
    import struct

    header, offset = {}, 0
    for entry in shard:
        header[entry.name] = {"dtype": entry.dtype, "shape": entry.shape,
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _full(value, rank: int, dtype=None):
    """Collective for a sharded parameter: the whole tensor on rank 0's host, None on every
    other rank. A floating tensor is cast to `dtype` (the export's) on each rank's shard
    first, so the all-gather moves and lands that dtype's bytes (half of fp32's in bf16); the
    gathered copy every rank gets is dropped at once except on rank 0, the only one to copy
    it to its host (E4B's 2.7 GB fp32 embedding used to land on every worker's host)."""
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().to("cpu") if rank == 0 else None


def _tensor_of(entry: Entry, state: dict, lora_scaling: float | None, rank: int):
    """The entry's tensor on rank 0 (None elsewhere). A model entry is a collective: every
    rank gathers its parts, in the same order."""
    import torch
    from safetensors import safe_open

    if entry.source != "model":
        with safe_open(entry.source, "pt") as f:
            return f.get_tensor(entry.name).to(getattr(torch, _TORCH_OF_SAFETENSORS[entry.dtype]))
    target = getattr(torch, _TORCH_OF_SAFETENSORS[entry.dtype])
    # A merged LoRA layer is summed in fp32 from its parts as they are; any other in the export's dtype.
    parts = [_full(state[key], rank, target if len(entry.parts) == 1 else None) for key in entry.parts]
    if rank != 0:
        return None
    tensor = parts[0]
    if len(parts) == 3:  # W + scaling x B A, summed in fp32
        tensor = tensor.float() + lora_scaling * (parts[2].float() @ parts[1].float())
    return tensor.to(target)


def write_weights(model, destination: str, dtype, rank: int, base_dir=None, base_config: dict | None = None,
                  tied: set[str] | None = None, lora_scaling: float | None = None,
                  shard_bytes: int = SHARD_BYTES) -> dict:
    """Collective: the model's weights in `dtype` (and a multimodal base's towers) as
    safetensors files of at most `shard_bytes`, written by rank 0 straight to `destination`
    (a path or URI: an output stream of the trainer's storage code, no local copy), one
    tensor gathered (DTensor.full_tensor) at a time, in the export's dtype, and copied to
    the host on rank 0 only. Rank 0's host holds at most one full tensor in that dtype (a
    merged LoRA layer: its fp32 sum and the cast copy). Returns, on rank 0, {"files",
    "towers", "bytes"}; else {}."""
    import json

    import torch

    from . import storage

    state = model.state_dict()
    tied = tied or set()
    entries = model_entries(state, dtype, tied, lora_scaling)
    if rank != 0:
        for entry in entries:
            _tensor_of(entry, state, lora_scaling, rank)
        return {}
    towers = tower_entries(base_dir, base_config or {}, {e.name for e in entries}, tied, dtype)
    shards = plan_shards(entries + towers, shard_bytes)
    names = shard_names(len(shards))
    fs, root = storage.filesystem(destination)
    root = root.rstrip("/")
    fs.create_dir(root, recursive=True)
    written = 0
    for name, shard in zip(names, shards):
        with fs.open_output_stream(f"{root}/{name}") as out:
            out.write(_header(shard))
            for entry in shard:
                tensor = _tensor_of(entry, state, lora_scaling, rank).contiguous()
                out.write(tensor.reshape(-1).view(torch.uint8).numpy())
                written += entry.nbytes
                del tensor
    if len(shards) > 1:
        index = {"metadata": {"total_size": written},
                 "weight_map": {entry.name: name for name, shard in zip(names, shards) for entry in shard}}
        with fs.open_output_stream(f"{root}/model.safetensors.index.json") as out:
            out.write(json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
    return {"files": names, "towers": len(towers), "bytes": written}
