"""Streamed data preparation: a dataset larger than the host's memory, tokenized to disk.

The driver reads the rows a chunk at a time (`datasets` keeps them in its Arrow cache,
memory-mapped, so the raw text is on disk too), tokenizes each chunk and appends its
token ids, labels and row lengths to flat files (int32 values, int64 offsets) in a cache
directory named by a fingerprint of everything the examples depend on (the dataset's
files, the split, the tokenizer, the prompt and label settings, the held-out split).
Workers memory-map those files: `MappedRagged` is a `data.Ragged` whose arrays are
read-only maps, so a host's workers share the pages and the kernel drops them when memory
is short; planning and packing read them as they read in-memory rows.

A cache directory is complete only when `meta.json` is in it: it is written last, after
every file is flushed, in a private `*.partial-*` directory renamed into place (one writer
per host at a time, under a file lock). A directory without it, or whose `meta.json`
names another fingerprint or other file sizes, is never read (a writer killed half-way
leaves at most a partial directory, removed by the next writer).

Workers on other hosts than the driver: the pickled `MappedRagged` is a description
(fingerprint, file names, sizes), opened where it is unpickled: the driver's directory when
that host sees it (a shared disk), else the copy `publish` uploaded to the run's storage
path, fetched once per host (`storage.local_copy`); until the driver publishes one, the
pickle also carries the arrays as out-of-band buffers (what Ray shipped before), used only
where no complete copy is found.

A retry of the run (a new attempt, perhaps on a new head host whose disk is empty): the
driver that finds no entry of its fingerprint on its own disk looks for the published copy
(`published_uri`) before tokenizing, fetches it once (`storage.local_copy`) and maps it;
`prepare` says where the data came from (`PreparedData.source`: `tokenized`,
`local_cache` or `published`; the `startup` event's `data_source`).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import data, storage
from .errors import DataError

FORMAT_VERSION = 1
META = "meta.json"  # the completeness marker: written last
CHUNK_ROWS = 1024  # rows tokenized at a time
COPY_TOKENS = 1 << 22  # tokens copied at a time when the held-out rows are split off
KEEP_UNUSED_S = 7 * 24 * 3600  # a cache entry nobody opened for this long is removed by the next writer
FILES = {"tokens": np.int32, "labels": np.int32, "offsets": np.int64}
ENTRY_NAME = re.compile(r"[0-9a-f]{32}(\.partial-[0-9a-f]{8})?")  # an entry, or a writer's directory


def cache_root() -> Path:
    """Where prepared datasets go on this host (the local disk)."""
    return storage.cache_home() / "data"


# --------------------------------------------------------------------------- fingerprint


def _files_of(dataset: str) -> list[str]:
    """(path, size, mtime) of a local dataset's files; [] for a hub id (its rows'
    fingerprint stands for it)."""
    path = Path(dataset).expanduser()
    if storage.is_uri(dataset) or not path.exists():
        return []
    found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [f"{p.resolve()}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}" for p in found]


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer's vocabulary, merges and normalisation (its serialised form), its
    special ids and its chat template."""
    digest = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([type(tokenizer).__name__, len(tokenizer), tokenizer.bos_token_id,
                              tokenizer.eos_token_id, tokenizer.pad_token_id,
                              getattr(tokenizer, "chat_template", None)]).encode())
    return digest.hexdigest()


def fingerprint(rows, dataset: str, split: str, tokenizer, settings: dict) -> str:
    """What the prepared examples depend on: this module's file format, the dataset (a
    local file's path, size and modification time; a download's cache entry, named by its
    listing; `datasets`' own fingerprint of the rows), the split, the tokenizer and the
    settings (max_seq_len, formats, labels, held-out fraction and seed)."""
    source = data.local_dataset(dataset) if storage.is_uri(dataset) else dataset
    what = {"version": FORMAT_VERSION, "dataset": dataset, "files": _files_of(str(source)), "split": split,
            "rows": getattr(rows, "_fingerprint", None), "count": len(rows),
            "tokenizer": tokenizer_digest(tokenizer), "settings": settings}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------- files


class RaggedWriter:
    """Rows appended to `<prefix>.tokens` / `.labels` (int32) and `.offsets` (int64, one
    more than the rows: a leading 0)."""

    def __init__(self, prefix: Path):
        self.files = {name: open(f"{prefix}.{name}", "wb") for name in FILES}
        self.rows, self.tokens = 0, 0
        self.files["offsets"].write(np.zeros(1, dtype=np.int64).tobytes())

    def append(self, tokens, labels, lengths: np.ndarray) -> None:
        """Rows given flat (`tokens`, `labels`: arrays or iterables of int) with their lengths."""
        lengths = np.asarray(lengths, dtype=np.int64)
        count = int(lengths.sum())
        for name, values in (("tokens", tokens), ("labels", labels)):
            values = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=np.int64, count=count)
            if len(values) != count:
                raise ValueError(f"{name}: {len(values)} values for rows of {count}")
            self.files[name].write(np.asarray(values, dtype=np.int32).tobytes())
        self.files["offsets"].write((self.tokens + np.cumsum(lengths)).tobytes())
        self.rows, self.tokens = self.rows + len(lengths), self.tokens + count

    def close(self) -> dict:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return {"rows": self.rows, "tokens": self.tokens}


def _sizes(rows: int, tokens: int) -> dict:
    return {"tokens": 4 * tokens, "labels": 4 * tokens, "offsets": 8 * (rows + 1)}


def _map(path: Path, dtype, count: int) -> np.ndarray:
    """A read-only map of `count` values (a plain ndarray view; mmap cannot map 0 bytes)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", shape=(count,)))


@dataclass(frozen=True)
class Part:
    """One of a prepared dataset's row sets (`train`, `eval`) and its token ids or labels
    (`field`): what a worker needs to find and map it."""

    directory: str
    fingerprint: str
    name: str
    field: str  # "tokens" or "labels"
    rows: int
    tokens: int
    mirror: str | None = None  # the published copy (publish), for hosts that do not see `directory`


def read_meta(directory: Path, fingerprint: str | None = None) -> dict | None:
    """`meta.json` of a complete cache directory (of that fingerprint, when given) whose
    files all have the sizes it records; None otherwise."""
    try:
        meta = json.loads((Path(directory) / META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("version") != FORMAT_VERSION or (fingerprint and meta.get("fingerprint") != fingerprint):
        return None
    for name, counts in meta.get("parts", {}).items():
        for field, size in _sizes(counts["rows"], counts["tokens"]).items():
            try:
                if (Path(directory) / f"{name}.{field}").stat().st_size != size:
                    return None
            except OSError:
                return None
    return meta


class MappedRagged(data.Ragged):
    """`data.Ragged` rows whose values and offsets are read-only maps of a prepared
    dataset's files. It pickles as its `Part` (plus the arrays themselves while the
    dataset has no published copy) and maps the files again where it is unpickled."""

    __slots__ = ("part",)

    def __init__(self, part: Part, directory: Path | None = None):
        where = Path(directory or part.directory)
        prefix = where / part.name
        super().__init__(_map(Path(f"{prefix}.{part.field}"), np.int32, part.tokens),
                         _map(Path(f"{prefix}.offsets"), np.int64, part.rows + 1))
        self.part = part

    def __reduce__(self):
        carried = None if self.part.mirror else (np.ascontiguousarray(self.values), self.offsets)
        return (reopen, (self.part, carried))


def locate(part: Part) -> Path | None:
    """A complete copy of `part`'s dataset this host can read: the driver's directory, else
    the published copy (a path as it is, a URI fetched once per host)."""
    if read_meta(Path(part.directory), part.fingerprint):
        return Path(part.directory)
    if not part.mirror:
        return None
    try:
        where = Path(part.mirror) if not storage.is_uri(part.mirror) else storage.local_copy(part.mirror)
    except FileNotFoundError:
        return None
    return where if read_meta(where, part.fingerprint) else None


def reopen(part: Part, carried=None) -> data.Ragged:
    """What a pickled `MappedRagged` becomes: the files mapped from a complete copy this
    host sees, else the arrays the pickle carried."""
    where = locate(part)
    if where is not None:
        touch(where)
        return MappedRagged(part, where)
    if carried is not None:
        return data.Ragged(*carried)
    raise DataError(f"the prepared dataset {part.fingerprint} is neither in {part.directory} on this host nor "
                    f"at its published copy {part.mirror}: the driver must publish it to the run's storage "
                    "(data_stream.publish) when workers run on other hosts")


def touch(directory: Path) -> None:
    """Mark the entry used (pruning keeps entries used within KEEP_UNUSED_S)."""
    try:
        os.utime(Path(directory) / META)
    except OSError:
        pass


def prune(root: Path, keep: str) -> None:
    """Remove complete entries unused for KEEP_UNUSED_S and partial ones no writer holds
    (a worker that still maps a removed file keeps its pages until it unmaps them)."""
    now = time.time()
    for entry in root.glob("*"):
        if not entry.is_dir() or entry.name == keep or not ENTRY_NAME.fullmatch(entry.name):
            continue  # what is not an entry is not ours to remove
        if ".partial-" in entry.name:
            lock = root / f"{entry.name.split('.partial-')[0]}.lock"
            if _try_lock(lock):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        marker = entry / META if (entry / META).exists() else entry
        try:
            unused = now - marker.stat().st_mtime > KEEP_UNUSED_S
        except OSError:
            continue
        if unused and _try_lock(root / f"{entry.name}.lock"):
            shutil.rmtree(entry, ignore_errors=True)


def _try_lock(path: Path) -> bool:
    """Whether no process holds `path`'s lock now (taken and released at once)."""
    try:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- prepare


class _Chunk:
    """A batch of rows from `Dataset.iter` (a dict of columns) as `data.encode_rows` reads rows."""

    def __init__(self, columns: dict):
        self.columns, self.column_names = columns, list(columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, name: str):
        return self.columns[name]


def write_examples(rows, prefix: Path, tokenizer, max_seq_len: int, prompt_format: str, dataset_format: str,
                   loss_on: str, stop_at_long_prompt: bool = False) -> dict:
    """Every row tokenized (`data.encode_rows`, CHUNK_ROWS at a time) and appended to the
    files at `prefix`; the rows' counts, the skipped rows and the truncated ones. With
    `stop_at_long_prompt` (--long-prompts fail) it stops after the first chunk holding a
    prompt too long: the run is refused anyway, and a large dataset need not be read to
    its end first (`complete` is then False)."""
    writer, skipped, truncated, first_skipped, start = RaggedWriter(prefix), 0, 0, None, 0
    try:
        for columns in rows.iter(batch_size=CHUNK_ROWS):
            chunk = _Chunk(columns)
            enc = data.encode_rows(chunk, tokenizer, max_seq_len, prompt_format, dataset_format, loss_on)
            if enc.skipped_long_prompts and first_skipped is None:
                first_skipped = start + enc.skipped_long_prompts[0]
            skipped, truncated = skipped + len(enc.skipped_long_prompts), truncated + enc.truncated
            lengths = np.fromiter(map(len, enc.input_ids), dtype=np.int64, count=len(enc.input_ids))
            writer.append(itertools.chain.from_iterable(enc.input_ids), itertools.chain.from_iterable(enc.labels),
                          lengths)
            start += len(chunk)
            if stop_at_long_prompt and skipped:
                break
    finally:
        counts = writer.close()
    return dict(counts, skipped=skipped, first_skipped=first_skipped, truncated=truncated, read=start,
                complete=not (stop_at_long_prompt and skipped))


def split_files(directory: Path, rows: int, tokens: int, eval_index: np.ndarray) -> dict:
    """The written examples (`all.*`) split into `train.*` and `eval.*` (the held-out rows),
    each keeping the rows' order; COPY_TOKENS at a time."""
    held = np.zeros(rows, dtype=bool)
    held[eval_index] = True
    offsets = _map(directory / "all.offsets", np.int64, rows + 1)
    values = {f: _map(directory / f"all.{f}", np.int32, tokens) for f in ("tokens", "labels")}
    train, evals = RaggedWriter(directory / "train"), RaggedWriter(directory / "eval")
    start = 0
    while start < rows:
        end = min(rows, int(np.searchsorted(offsets, offsets[start] + COPY_TOKENS, side="right")))
        end = max(end, start + 1)
        lengths = np.diff(offsets[start:end + 1])
        mine = np.repeat(held[start:end], lengths)
        part = {f: v[offsets[start]:offsets[end]] for f, v in values.items()}
        train.append(part["tokens"][~mine], part["labels"][~mine], lengths[~held[start:end]])
        evals.append(part["tokens"][mine], part["labels"][mine], lengths[held[start:end]])
        start = end
    del offsets, values
    out = {"train": train.close(), "eval": evals.close()}
    for field in FILES:
        (directory / f"all.{field}").unlink()
    return out


def build(rows, directory: Path, fp: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
          long_prompts: str, prompt_format: str, dataset_format: str, loss_on: str) -> dict:
    """Write the cache entry into `directory` (a private one), `meta.json` last."""
    written = write_examples(rows, directory / "all", tokenizer, max_seq_len, prompt_format, dataset_format,
                             loss_on, stop_at_long_prompt=long_prompts == "fail")
    data.check_long_prompts(written["skipped"], written["read"], written["first_skipped"], written["rows"],
                            max_seq_len, long_prompts, complete=written["complete"])
    eval_index = data.held_out(written["rows"], eval_fraction, seed)
    if len(eval_index):
        parts = split_files(directory, written["rows"], written["tokens"], eval_index)
    else:
        for field in FILES:
            os.rename(directory / f"all.{field}", directory / f"train.{field}")
        parts = {"train": {"rows": written["rows"], "tokens": written["tokens"]}}
    train = data.Examples(*(data.Ragged(_map(directory / f"train.{field}", np.int32, parts["train"]["tokens"]),
                                        _map(directory / "train.offsets", np.int64, parts["train"]["rows"] + 1))
                            for field in ("tokens", "labels")))
    meta = {"version": FORMAT_VERSION, "fingerprint": fp, "parts": parts, "skipped_long_prompts": written["skipped"],
            "truncated": written["truncated"], "dataset_format": dataset_format, "prompt_format": prompt_format,
            "train_digest": data.hash_examples(train)}  # the resume fingerprint's, hashed once here
    del train
    with open(directory / META, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    return meta


def published_uri(published: str, fp: str) -> str:
    """Where the entry of fingerprint `fp` is published under a run's data folder
    (`<storage>/<run>/data`, run_data_uri)."""
    return f"{published.rstrip('/')}/{fp}"


def run_data_uri(storage_path: str, run_name: str) -> str:
    """The run's folder of published entries."""
    return f"{storage_path.rstrip('/')}/{run_name}/data"


def fetch_published(published: str | None, fp: str) -> tuple[Path, dict] | None:
    """The published entry of `fp` fetched to this host (once per host) and its meta, or
    None when none complete is there (or it cannot be read: the driver then tokenizes)."""
    if not published:
        return None
    try:
        where = storage.local_copy(published_uri(published, fp)) if storage.is_uri(published) \
            else Path(published_uri(published, fp))
    except (OSError, FileNotFoundError):
        return None
    meta = read_meta(where, fp)
    return (where, meta) if meta else None


def ensure(rows, dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
           long_prompts: str, prompt_format: str, dataset_format: str, loss_on: str,
           cache_dir: str | Path | None = None, published: str | None = None) -> tuple[Path, dict, str]:
    """The complete cache entry of these rows and settings and where it came from
    (startup.DATA_SOURCES): this host's cache, else the run's published copy (`published`,
    the run's data folder), else built here: one writer per host (a file lock); the others
    wait and then take its entry."""
    settings = {"max_seq_len": max_seq_len, "eval_fraction": eval_fraction, "seed": seed,
                "long_prompts": long_prompts, "prompt_format": prompt_format, "dataset_format": dataset_format,
                "loss_on": loss_on}
    fp = fingerprint(rows, dataset, split, tokenizer, settings)
    root = Path(cache_dir) if cache_dir else cache_root()
    entry = root / fp
    meta = read_meta(entry, fp)
    if meta:
        touch(entry)
        return entry, meta, "local_cache"
    found = fetch_published(published, fp)
    if found:
        return (*found, "published")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir:
            raise
        root = Path(tempfile.gettempdir()) / "tpufinetune-data"  # a read-only home
        root.mkdir(parents=True, exist_ok=True)
        return ensure(rows, dataset, split, tokenizer, max_seq_len, eval_fraction, seed, long_prompts,
                      prompt_format, dataset_format, loss_on, root, published)
    with open(root / f"{fp}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = read_meta(entry, fp)
        if meta:  # another process of this host built it meanwhile
            return entry, meta, "local_cache"
        prune(root, keep=fp)
        shutil.rmtree(entry, ignore_errors=True)  # an entry without a valid marker is never read
        for dead in root.glob(f"{fp}.partial-*"):  # a killed writer's (the lock is ours now)
            shutil.rmtree(dead, ignore_errors=True)
        partial = root / f"{fp}.partial-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        try:
            meta = build(rows, partial, fp, tokenizer, max_seq_len, eval_fraction, seed, long_prompts,
                         prompt_format, dataset_format, loss_on)
            os.rename(partial, entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return entry, meta, "tokenized"


def opened(entry: Path, meta: dict, name: str) -> data.Examples:
    """A row set of a complete entry as `data.Examples` of mapped rows."""
    counts = meta["parts"][name]

    def part(field: str) -> Part:
        return Part(str(entry.resolve()), meta["fingerprint"], name, field, counts["rows"], counts["tokens"])

    return data.Examples(MappedRagged(part("tokens")), MappedRagged(part("labels")), meta.get(f"{name}_digest"))


def prepare(rows, dataset: str, split: str, tokenizer, max_seq_len: int, eval_fraction: float, seed: int,
            long_prompts: str, prompt_format: str, dataset_format: str, loss_on: str,
            cache_dir: str | Path | None = None, published: str | None = None) -> data.PreparedData:
    """`data.prepare` streamed: the examples tokenized to this host's cache (or found there,
    or fetched from the run's published copy, `published`) and mapped; the held-out
    examples packed in memory, as `data.prepare` packs them."""
    entry, meta, source = ensure(rows, dataset, split, tokenizer, max_seq_len, eval_fraction, seed, long_prompts,
                                 prompt_format, dataset_format, loss_on, cache_dir, published)
    train = opened(entry, meta, "train")
    if train.digest is None:  # an entry written before meta.json kept it: hashed once, here on the driver
        data.with_digest(train)
    packed = None
    if "eval" in meta["parts"] and meta["parts"]["eval"]["rows"]:
        held = opened(entry, meta, "eval")
        packed = data.pack(held.input_ids, held.labels, max_seq_len, data.pad_id_of(tokenizer))
    return data.PreparedData(train=train, eval=packed, examples=len(train),
                             eval_examples=meta["parts"].get("eval", {"rows": 0})["rows"],
                             skipped_long_prompts=meta["skipped_long_prompts"], truncated=meta["truncated"],
                             dataset_format=meta["dataset_format"], prompt_format=meta["prompt_format"],
                             source=source)


# --------------------------------------------------------------------------- other hosts


def publish(examples: data.Examples, storage_path: str, run_name: str) -> data.Examples:
    """Upload the entry of `examples` (mapped rows) to the run's storage, `meta.json` last,
    unless a complete copy is there already; the returned examples pickle without their
    arrays and are mapped, on a host that does not see the driver's directory, from that
    copy (fetched once per host). In-memory examples are returned as they are."""
    if not isinstance(examples.input_ids, MappedRagged):
        return examples
    part = examples.input_ids.part
    uri = published_uri(run_data_uri(storage_path, run_name), part.fingerprint)
    fs, path = storage.filesystem(uri)
    if not _published(fs, path, part.fingerprint):
        fs.create_dir(path, recursive=True)
        local = Path(part.directory)
        for name in sorted(p.name for p in local.iterdir() if p.name != META):
            with open(local / name, "rb") as src, fs.open_output_stream(f"{path}/{name}") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        with fs.open_output_stream(f"{path}/{META}") as dst:
            dst.write((local / META).read_bytes())
    return data.Examples(*(MappedRagged(replace(rows.part, mirror=uri)) for rows in
                           (examples.input_ids, examples.labels)), examples.digest)


def _published(fs, path: str, fp: str) -> bool:
    try:
        with fs.open_input_stream(f"{path}/{META}") as f:
            return json.loads(f.read()).get("fingerprint") == fp
    except (OSError, ValueError, FileNotFoundError):
        return False
