"""Sharded checkpoints (torch.distributed.checkpoint) and the Hugging Face export.

Each rank writes only its own shards (``__<rank>_<i>.distcp``, WRITE_THREADS files written
in parallel) straight into the checkpoint's directory: a path on a shared file system, or a
URI (gs://) through the trainer's pyarrow file system (`ArrowWriter`); nothing is staged on
a local disk or uploaded afterwards. Rank 0 adds the DCP ``.metadata`` and, once every
rank's shards and the metadata are written, ``trainer_state.json``: a checkpoint is complete
only with it and every byte its metadata places in its shard files (`is_complete`). Each
trainer start names its checkpoints its own (resume.checkpoint_name), so no directory is
ever written twice. No rank ever holds the whole model while checkpointing. The frozen per-layer embeddings
are left out: they never change, and a reload starts from the base model that has them.
With LoRA (--method lora) every base weight is frozen, so a checkpoint holds the adapters
and their optimizer state only (`without_frozen_aliases` also drops a tied head's second name).

A load reads straight from storage (a path, or a URI such as gs:// through
storage.filesystem): each rank reads only the byte ranges of the shards it owns, and nothing
downloads the whole checkpoint to every host.

DCP's own coordination (gathering plans, the final barrier) is pickled Python objects:
it runs on a CPU (gloo) process group made once per run, never on the accelerator's
collective backend. `async_save_sharded` stages a host copy of the shards and writes it on a
background thread, on a gloo group of its own (`cpu_group()` again): a group's collectives
must be issued in the same order on every rank, and the training thread's (the notice
agreement, loads, barriers) would interleave with the writer thread's differently per rank.

Before training, `startup_probe` saves and loads a tiny sharded state through the same
writer, reader, group and storage, so a storage, gloo or device-to-host problem ends the run
in seconds instead of at the first checkpoint, an epoch later.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from . import storage
from .errors import StorageError

STATE_FILE = "trainer_state.json"
# Files, and threads writing them, per rank and checkpoint. DCP splits a rank's shards by
# size into this many files written at once; torch.save's copies and the file writes release
# the GIL, so a disk or network that takes several streams (a Filestore share; the staging
# directory Ray Train uploads with one stream per file) writes faster, while a v6e host's 4
# workers make 16 streams, well within its cores. More than one thread also makes DCP take
# its plain loader (`.cpu()` of one tensor at a time) instead of the overlapping
# device-to-host loader it picks with one thread on an accelerator, which has never run on
# a TPU. benchmarks/bench_checkpoint.py measures 1 against this.
WRITE_THREADS = 4
# Under <storage>/<run name>/ for the few seconds of the startup probe, then removed. No
# trainer_state.json, so no restore ever takes it for a checkpoint.
PROBE_DIR = "startup_probe"
PROBE_ROWS, PROBE_COLS = 4, 8  # each rank's rows of the probe's sharded tensor
# What a probe step may raise: DCP gathers every rank's failure into a CheckpointException,
# which is a BaseException.
_PROBE_FAILURES = (Exception, CheckpointException)
_SHARDED = StateDictOptions(ignore_frozen_params=True)
_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


def cpu_group():
    """A gloo group over all ranks, for DCP and barriers (collective: every rank calls it)."""
    return dist.new_group(backend="gloo")


def checkpoint_writer(location: str) -> dcp.FileSystemWriter:
    """The writer of every checkpoint (and of the startup probe): WRITE_THREADS files per rank,
    straight to `location` (a path, or a URI through pyarrow). No fsync per file: durability
    is left to the storage (a bucket's object is durable once its upload completes)."""
    writer = ArrowWriter if storage.is_uri(location) else dcp.FileSystemWriter
    return writer(location, sync_files=False, thread_count=WRITE_THREADS)


def _state_dicts(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_SHARDED)
    return {"model": without_frozen_aliases(model, model_sd), "optim": optim_sd}


def without_frozen_aliases(model, model_sd: dict) -> dict:
    """`ignore_frozen_params` misses a frozen parameter's second name (a tied head,
    lm_head.weight = embed_tokens.weight): with LoRA's frozen base that would put the whole
    embedding in every checkpoint. Dropped here, on save and on load alike."""
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {key: value for key, value in model_sd.items() if key not in frozen}


def _planner():
    """Plan caching: from the second save on, ranks whose save plan has not changed skip
    shipping it to the coordinator."""
    return dcp.DefaultSavePlanner(enable_plan_caching=True)


def write_trainer_state(location: str, text: str) -> None:
    """Rank 0, after the DCP save completed on every rank: the file that makes the
    checkpoint complete. Atomic: on a path (a shared file system) it is written under a
    temporary name, synced and renamed into place, so a writer killed mid-write leaves no
    `trainer_state.json` and the checkpoint is incomplete, never torn; a bucket's object
    exists only once its upload completed."""
    data = text.encode("utf-8")
    if not storage.is_uri(location):
        target = Path(location, STATE_FILE)
        partial = Path(location, f".{STATE_FILE}.partial-{os.getpid()}-{time.monotonic_ns()}")
        try:
            with open(partial, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return
    fs, path = storage.filesystem(location)
    with fs.open_output_stream(f"{path.rstrip('/')}/{STATE_FILE}") as f:
        f.write(data)


def save_sharded(model, optimizer, location: str, trainer_state: dict, group=None) -> None:
    """Collective and synchronous: every rank calls it with the same path or URI; returns,
    on every rank, once the checkpoint is complete."""
    if not storage.is_uri(location):
        Path(location).mkdir(parents=True, exist_ok=True)
    dcp.save(_state_dicts(model, optimizer), storage_writer=checkpoint_writer(location), planner=_planner(),
             process_group=group)
    if dist.get_rank() == 0:
        write_trainer_state(location, json.dumps(trainer_state))
    dist.barrier(group=group)  # no rank reports it before rank 0 wrote the state


class HostStager(AsyncStager):
    """async_save's staging: a host copy of every tensor of the state dict, done before
    async_save returns, into buffers kept for the next save (the same tensors each time), so
    only the first save pays for fresh pages; a DTensor keeps its spec (mesh, placements,
    global shape) around the copy of its local shard. The peak is one copy, as with DCP's own
    stager, which also deep-copies each CPU DTensor, shard included, first: on CPU several
    times slower (benchmarks/bench_checkpoint.py). The buffers may be reused only once the
    save that wrote from them is done (`in_flight`); `release` drops them."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.used = 0
        self.in_flight: Future | None = None

    def stage(self, state_dict):
        if self.in_flight is not None and not self.in_flight.done():
            raise RuntimeError("a checkpoint is still being written from the staging buffers")
        self.used = 0
        return self._copy(state_dict)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self.used = self.used, self.used + 1
        if index < len(self.buffers) and self.buffers[index].shape == tensor.shape \
                and self.buffers[index].dtype == tensor.dtype:
            buffer = self.buffers[index]
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            self.buffers[index:index + 1] = [buffer]
        return buffer.copy_(tensor.detach())

    def _copy(self, obj):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            return DTensor(self._buffer(obj._local_tensor), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._buffer(obj)
        if isinstance(obj, dict):
            return {key: self._copy(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value) for value in obj)
        return obj

    def release(self) -> None:
        self.buffers = []

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """A checkpoint being written in the background (async_save_sharded). `future` is done on
    this rank once its shards and the metadata are written (DCP's final step gathers every
    rank's results to rank 0, which writes the metadata, then answers all) and, on rank 0,
    trainer_state.json too; so once every rank's is done the checkpoint is complete.
    `blocked_s`: what the call took from training (the host copy); `done_at`: when the
    future finished (perf_counter)."""

    def __init__(self, future: Future, started: float, blocked_s: float) -> None:
        self.future, self.started, self.blocked_s = future, started, blocked_s
        self.done_at: float | None = None

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> float:
        """Block until this rank's part is done (raising its failure); returns the seconds
        it waited."""
        start = time.perf_counter()
        self.future.result()
        return time.perf_counter() - start

    def failure(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    @property
    def write_s(self) -> float | None:
        """From the call to this rank's part written."""
        return None if self.done_at is None else self.done_at - self.started


def async_save_sharded(model, optimizer, location: str, trainer_state: dict, group=None,
                       stager: HostStager | None = None) -> PendingSave:
    """Collective: start a checkpoint of the current state and return while it is written.

    Blocks only for a host copy of this rank's shards (`stager`'s, kept for the next save;
    a copy even of CPU tensors, so the steps that follow cannot change what is written); the plans, the
    writes and the metadata run on DCP's writer thread on `group`, which must be a group
    nothing else uses while the save is in flight (see the module's docstring). Rank 0 writes
    trainer_state.json on that thread once DCP's save returned. At most one save may be in
    flight: wait for the previous one first."""
    start = time.perf_counter()
    if not storage.is_uri(location):
        Path(location).mkdir(parents=True, exist_ok=True)
    rank, text = dist.get_rank(), json.dumps(trainer_state)  # as of now: the caller's dicts may change
    saved = dcp.async_save(_state_dicts(model, optimizer), storage_writer=checkpoint_writer(location),
                           planner=_planner(), process_group=group, async_stager=stager or HostStager())
    blocked = time.perf_counter() - start
    complete: Future = Future()
    pending = PendingSave(complete, start, blocked)

    def finish(written: Future) -> None:  # on DCP's writer thread (or here, if already done)
        failure = None
        try:
            written.result()
            if rank == 0:
                write_trainer_state(location, text)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits (CheckpointException is one)
            failure = exc
        pending.done_at = time.perf_counter()
        if failure is None:
            complete.set_result(None)
        else:
            complete.set_exception(failure)

    if stager is not None:
        stager.in_flight = complete
    saved.add_done_callback(finish)
    return pending


def load_sharded(model, optimizer, location: str, group=None) -> dict:
    """Collective: load model (and optimizer, if given) shards in place from a path or
    URI; returns trainer state. dcp.load fails on any key the checkpoint lacks; setting
    back is non-strict only because the frozen per-layer embeddings are, by design, not
    in the checkpoint."""
    reader = storage_reader(location)
    if optimizer is None:
        state = {"model": without_frozen_aliases(model, get_model_state_dict(model, options=_SHARDED))}
        dcp.load(state, storage_reader=reader, process_group=group)
        set_model_state_dict(model, state["model"], options=_LOAD)
    else:
        state = _state_dicts(model, optimizer)
        dcp.load(state, storage_reader=reader, process_group=group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_LOAD)
    return read_trainer_state(location)


def readable_state(location: str) -> dict | None:
    """The checkpoint's trainer state, or None when it is missing or not a JSON object (a
    torn file from a writer that was killed mid-write before writes were atomic, or a
    file system that lost its tail): such a checkpoint is passed over, never resumed from."""
    try:
        state = read_trainer_state(location)
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return state if isinstance(state, dict) and state else None


def read_trainer_state(location: str) -> dict:
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(location)
    target = f"{path.rstrip('/')}/{STATE_FILE}"
    if fs.get_file_info(target).type != pafs.FileType.File:
        return {}
    with fs.open_input_stream(target) as f:
        return json.loads(f.read().decode("utf-8"))


class ArrowFileSystem(FileSystemBase):
    """DCP storage over a pyarrow file system (gs://, s3://, file://, hdfs://): random
    access reads, so a rank fetches only its own byte ranges."""

    def __init__(self) -> None:
        self.fs = None

    def init_path(self, path):
        self.fs, root = storage.filesystem(str(path))
        return root

    def concat_path(self, path, suffix: str):
        return f"{str(path).rstrip('/')}/{suffix}"

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" in mode:
            stream = RangeReader(self.fs.open_input_file(str(path)))
        else:
            stream = self.fs.open_output_stream(str(path))
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        self.fs.move(str(path), str(new_path))

    def mkdir(self, path) -> None:
        self.fs.create_dir(str(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return "://" in str(checkpoint_id)

    def exists(self, path) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        self.fs.delete_file(str(path))


class RangeReader(io.RawIOBase):
    """A pyarrow random-access file read by byte ranges. Seeking costs nothing (a GCS read
    that starts at the object's end is refused with 416, and torch.load seeks there), and
    small reads come from one read-ahead block, so a rank's items cost a few requests."""

    READ_AHEAD = 8 << 20

    def __init__(self, file) -> None:
        super().__init__()
        self.file, self.size, self.pos = file, file.size(), 0
        self.block_start, self.block = 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        if n == 0:
            return 0
        start = self.pos - self.block_start
        if start < 0 or start + n > len(self.block):
            if n >= self.READ_AHEAD:  # a large tensor: one request of its own
                buffer[:n] = self.file.read_at(n, self.pos)
                self.pos += n
                return n
            self.block_start, start = self.pos, 0
            self.block = self.file.read_at(min(self.READ_AHEAD, self.size - self.pos), self.pos)
        buffer[:n] = self.block[start:start + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


class ArrowReader(dcp.FileSystemReader):
    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.fs = ArrowFileSystem()
        self.path = self.fs.init_path(uri)


class ArrowWriter(dcp.FileSystemWriter):
    """DCP's file-system writer over a pyarrow file system: every file is an output stream
    straight to the URI. On GCS, directories are not real (mkdir writes a marker, harmless)
    and the metadata's rename from `.metadata.tmp` is a copy and a delete of one small
    object."""

    def __init__(self, uri: str, **kwargs) -> None:
        super().__init__(uri, **kwargs)
        self.fs = ArrowFileSystem()
        self.path = self.fs.init_path(uri)


def _files_under(fs, root: str) -> dict[str, int]:
    """Every file under `root`, relative to it, with its size (recursive: a bucket has
    objects, not directories, to list); empty when nothing is there."""
    import pyarrow.fs as pafs

    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=True))
    return {entry.path[len(root) + 1:]: entry.size for entry in entries if entry.type == pafs.FileType.File}


def _shard_files(location: str) -> dict[str, int]:
    """The files a checkpoint's DCP metadata names, each with the bytes its items reach
    (empty when the metadata cannot be read)."""
    try:
        metadata = storage_reader(location).read_metadata()
    except (OSError, EOFError, ValueError):
        return {}
    extents: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents


def _shards_present(shards: dict[str, int], present: dict[str, int], prefix: str = "") -> bool:
    """Every shard file the metadata names is there and as long as its items reach (a rank
    that died mid-write leaves one out, or short)."""
    return bool(shards) and all((present.get(prefix + name) or 0) >= size for name, size in shards.items())


def is_complete(location: str) -> bool:
    """Whether the checkpoint at `location` can be loaded: its trainer state (written last,
    once every rank's shards and the DCP metadata are) reads as JSON, its metadata is there,
    and every shard file the metadata names exists with every byte the metadata places in it."""
    fs, path = storage.filesystem(location)
    present = _files_under(fs, path.rstrip("/"))
    return STATE_FILE in present and _shards_present(_shard_files(location), present) \
        and readable_state(location) is not None


def resume_order(state: dict) -> tuple[int, str]:
    """How checkpoints of one run rank for a resume: the most optimizer steps, then the
    latest trainer start (its id sorts by start time; an earlier trainer's has none)."""
    return int(state.get("step") or 0), str(state.get("start") or "")


def latest_complete(run_dir: str) -> str | None:
    """The complete checkpoint under `run_dir` (Ray Train's `<storage>/<run name>`) a resume
    continues from: across every start of the run, the one with the most optimizer steps,
    the latest start's of those (`resume_order`); None when there is none. One listing of
    the run serves every candidate."""
    fs, path = storage.filesystem(run_dir)
    root = path.rstrip("/")
    try:
        present = _files_under(fs, root)
    except OSError:
        return None
    best: tuple[tuple[int, str], str] | None = None
    for name in present:
        checkpoint, _, file = name.partition("/")
        if file != STATE_FILE:
            continue  # only <run dir>/<checkpoint>/trainer_state.json
        location = storage.uri_of(fs, f"{root}/{checkpoint}")
        if not _shards_present(_shard_files(location), present, f"{checkpoint}/"):
            continue
        state = readable_state(location)
        if state is None or state.get("step") is None:
            continue  # torn or empty: the previous complete checkpoint is taken instead
        order = resume_order(state)
        if best is None or order > best[0]:
            best = (order, location)
    return best[1] if best else None


def storage_reader(location: str):
    """A DCP reader for a checkpoint path or URI (read in place, never copied first)."""
    return ArrowReader(location) if "://" in location else dcp.FileSystemReader(location)


def checkpoint_location(checkpoint) -> str:
    """A Ray Train Checkpoint's storage location as a path (local) or URI (remote)."""
    return storage.uri_of(checkpoint.filesystem, checkpoint.path)


def export_adapter(model, destination: str, cfg, group=None) -> None:
    """Collective (--method lora): gather the trained adapters (only they are trainable) on
    rank 0 and write them in peft's format to `destination` (path or URI)."""
    from . import lora

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))
    if dist.get_rank() == 0:
        with tempfile.TemporaryDirectory(prefix="tpuft-adapter-") as tmp:
            lora.write_adapter(tmp, full, cfg)
            storage.upload_dir(tmp, destination)
    del full
    dist.barrier(group=group)


def export_hf(model, tokenizer, destination: str, group=None, base_dir: Path | None = None,
              lora_scaling: float | None = None) -> dict:
    """Collective: write a `from_pretrained`-loadable directory (safetensors) to
    `destination` (path or URI), the weights streamed one tensor at a time (export.py,
    write_weights): rank 0 never holds the whole model, and nothing is copied locally first.

    The weights are saved in the base's dtype (model.export_dtype: bf16 unless the base's
    config names another floating dtype), a multimodal base's towers are added from its
    safetensors with its config, and every file of the base directory the export lacks that
    is not weights (processor and tokenizer files, chat template, generation config) is
    copied in. With `lora_scaling` (--method lora), the adapters are merged into their layers
    (W + alpha / r x B A) and the export is the base's shape. Returns, on rank 0, {"dtype",
    "copied", "towers", "files"}; elsewhere {}."""
    from .export import write_weights
    from .model import export_dtype, is_weight_file

    rank = dist.get_rank()
    base_config_file = base_dir / "config.json" if base_dir is not None else None
    base_config = json.loads(base_config_file.read_text()) if base_config_file and base_config_file.is_file() else {}
    dtype = export_dtype(base_config)
    # Every rank gathers in the same order; only rank 0 knows the base (its dtype is
    # broadcast so every rank plans the same tensors).
    chosen = [dtype]
    dist.broadcast_object_list(chosen, src=0, group=group)
    dtype = chosen[0]
    weights = write_weights(model, destination, dtype, rank, base_dir, base_config, set(tied_weight_copies(model)),
                            lora_scaling)
    done: dict = {}
    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="tpuft-export-") as tmp:  # the small files only
            # As save_pretrained names the class (FSDP2's wrapper class is not the model's).
            model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(tmp)
            if weights["towers"]:  # the base's own config: its towers, and its generation settings (use_cache)
                shutil.copy2(Path(base_dir, "config.json"), Path(tmp, "config.json"))
            set_config_dtype(Path(tmp, "config.json"), dtype)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            copied = []
            if base_dir is not None:
                written = {p.name for p in Path(tmp).iterdir()}
                for source in sorted(Path(base_dir).iterdir()):
                    if source.is_file() and source.name not in written and not is_weight_file(source.name):
                        shutil.copy2(source, Path(tmp, source.name))
                        copied.append(source.name)
            storage.upload_dir(tmp, destination)
        done = {"dtype": str(dtype).removeprefix("torch."), "copied": copied, "towers": weights["towers"],
                "files": weights["files"]}
    dist.barrier(group=group)
    return done


def add_base_towers(full: dict, base_dir: Path | None, base_config: dict, tied: set[str]) -> int:
    """For a multimodal base, add to a text model's whole state dict the base's tensors it
    lacks (export.tower_entries says which). Returns how many were added."""
    from safetensors import safe_open

    from .export import tower_entries

    entries = tower_entries(base_dir, base_config, set(full), tied)
    for entry in entries:
        with safe_open(entry.source, "pt") as f:
            full[entry.name] = f.get_tensor(entry.name)
    return len(entries)


def set_config_dtype(config_file: Path, dtype) -> None:
    """save_pretrained writes the dtype of the model it is called on (the fp32 master
    weights); the file must name the dtype the weights were saved in."""
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    for value in config.values():
        if isinstance(value, dict) and "dtype" in value:
            value["dtype"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tied_weight_copies(model) -> list[str]:
    """Keys that are tied to another weight (lm_head -> embed_tokens when embeddings are tied)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if not getattr(config, "tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False)):
        return []
    return list(tied) if isinstance(tied, (dict, list)) else []


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts if p.strip("/")]])


# ---------------------------------------------------------------------- startup probe
def _probe_state(mesh, device, rank: int, fill: bool) -> dict:
    """A tiny state shaped as a checkpoint's: a tensor sharded by rows over the mesh's last
    dim and replicated over any other (HSDP's slices), each rank's rows on its device, values
    that name its shard; and a replicated scalar."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import torch

    shard = mesh.get_local_rank(mesh.ndim - 1) if mesh.ndim > 1 else rank
    rows = torch.arange(PROBE_ROWS * PROBE_COLS, dtype=torch.float32).view(PROBE_ROWS, PROBE_COLS) + 1000.0 * shard
    local = rows if fill else torch.zeros_like(rows)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    sharded = DTensor.from_local(local.to(device), mesh, placements, run_check=False)
    return {"model": {"probe.weight": sharded}, "optim": {"probe.step": torch.tensor(7.0 if fill else 0.0)}}


def _agree(group, location: str, phase: str, error: str | None) -> None:
    """Every rank learns every rank's outcome of `phase`; all raise the same StorageError
    if any failed (a rank that raised alone would leave the others waiting in DCP)."""
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, error, group=group)
    by_cause: dict[str, list[int]] = {}
    for rank, cause in enumerate(outcomes):
        if cause:
            by_cause.setdefault(cause, []).append(rank)
    if by_cause:
        named = [f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranks(ranks)}: {cause}"
                 for cause, ranks in list(by_cause.items())[:4]]
        more = f" (and {len(by_cause) - 4} other causes)" if len(by_cause) > 4 else ""
        raise StorageError(f"Checkpoint storage {location}: the startup probe could not {phase}: "
                           f"{'; '.join(named)}{more}. Every checkpoint of the run would fail the same way, so the "
                           "run stops before training")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _described(exc: BaseException) -> str:
    """One line: the exception's type and message; for DCP's gathered failure, each failing
    rank's own exception (not the tracebacks)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"DCP on rank {rank}: {_described(failure[0] if isinstance(failure, tuple) else failure)}"
                         for rank, failure in sorted(exc.failures.items()))
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600]}" if text else type(exc).__name__


def _remove(location: str) -> str | None:
    """Delete the probe's directory; the error, if that failed."""
    try:
        fs, path = storage.filesystem(location)
        fs.delete_dir_contents(path, missing_dir_ok=True)
        try:
            fs.delete_dir(path)
        except OSError:
            if storage.exists(location):  # a bucket has no directory object once its files are gone
                raise
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: training does not need it gone
        return _described(exc)
    return None


def startup_probe(location: str, mesh, device, group) -> dict:
    """Collective: save a tiny sharded state to `location` (a path or URI under the run's
    storage) with the checkpoints' writer on the gloo `group`, load it back with the
    checkpoints' reader, check every rank's values, remove it. The path a checkpoint takes:
    every file written straight to the path or URI, then read in place. Raises StorageError on every
    rank, naming the location, the step and each failing rank's cause. Returns rank 0's
    {"seconds", "files", "removed", "remove_error"} (files: what the storage held)."""
    import torch

    rank, start = dist.get_rank(group), time.perf_counter()
    saved = _probe_state(mesh, device, rank, fill=True)
    error = None
    files: list[str] = []
    try:
        try:
            if not storage.is_uri(location):
                Path(location).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = _described(exc)
        _agree(group, location, "create its directory", error)
        try:
            dcp.save(saved, storage_writer=checkpoint_writer(location), planner=dcp.DefaultSavePlanner(),
                     process_group=group)
        except _PROBE_FAILURES as exc:  # every rank's cause is reported
            error = _described(exc)
        _agree(group, location, "save a sharded state (DCP, gloo)", error)
        loaded = _probe_state(mesh, device, rank, fill=False)
        try:
            dcp.load(loaded, storage_reader=storage_reader(location), process_group=group)
        except _PROBE_FAILURES as exc:
            error = _described(exc)
        _agree(group, location, "load the state back", error)
        same = torch.equal(loaded["model"]["probe.weight"].to_local().cpu(),
                           saved["model"]["probe.weight"].to_local().cpu()) and \
            torch.equal(loaded["optim"]["probe.step"], saved["optim"]["probe.step"])
        _agree(group, location, "read back what it wrote", None if same else "the loaded values differ")
        if rank == 0:
            fs, path = storage.filesystem(location)
            files = sorted(_files_under(fs, path.rstrip("/")))
    finally:
        dist.barrier(group=group)  # every rank done with the files (or failed together)
        remove_error = _remove(location) if rank == 0 else None
    return {"seconds": round(time.perf_counter() - start, 2), "files": files, "removed": remove_error is None,
            "remove_error": remove_error}
