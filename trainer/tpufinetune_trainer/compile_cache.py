"""The compile cache kept in the run's storage, so a retried attempt compiles nothing an
earlier attempt compiled (without --compile-cache-dir: no volume outlives the pod).

Each host keeps a local directory (under storage.cache_home(), named by the run's cache
URI) that its workers use as --compile-cache-dir would be used (backends.compile_cache_env:
inductor's FX-graph and AOTAutograd caches, on TPU TorchTPU's persistent cache). At a
worker's start it is seeded from `<storage>/<run>/compile-cache/` (one process of the host
downloads, under a file lock; files there already are not fetched again); at each
checkpoint and at the end, local rank 0 of each host uploads the files the storage does not
have yet. Cache files are written whole under a temporary name and renamed, on both sides,
so a reader never takes half a file; lock files are never copied.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path

from . import storage
from .backends import Backend, compile_enabled

REMOTE = "compile-cache"
# Not cache entries: locks, and files a writer has not renamed into place yet.
SKIPPED = re.compile(r"(^|/)locks?(/|$)|\.lock$|\.partial-[0-9a-f]{8}$|\.tmp[^/]*$|(^|/)tmp[^/]*$")


def run_cache_uri(cfg, backend: Backend) -> str:
    """The run's compile cache in its storage, where one is kept: compile on and no
    --compile-cache-dir (a volume, which keeps the cache itself); else ""."""
    if cfg.compile_cache_dir or not cfg.storage_path or not compile_enabled(backend, cfg.compile):
        return ""
    return f"{cfg.storage_path.rstrip('/')}/{cfg.run_name}/{REMOTE}"


def local_dir(remote: str) -> Path:
    """This host's copy of the run's cache `remote`."""
    return storage.cache_home() / "compile" / hashlib.sha256(remote.encode()).hexdigest()[:20]


def _remote_files(fs, path: str) -> dict[str, int]:
    """Relative path -> size of the cache entries under `path` ({} when there is none)."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except (OSError, FileNotFoundError):
        return {}
    root = path.rstrip("/") + "/"
    found = {}
    for info in infos:
        if info.type == pafs.FileType.File and info.path.startswith(root):
            relative = info.path[len(root):]
            if not SKIPPED.search(relative):
                found[relative] = info.size
    return found


def _local_files(local: Path) -> dict[str, int]:
    found = {}
    for path in local.rglob("*"):
        relative = path.relative_to(local).as_posix()
        if path.is_file() and not path.is_symlink() and not SKIPPED.search(relative) and relative != "seed.lock":
            found[relative] = path.stat().st_size
    return found


def seed(remote: str) -> tuple[Path, int]:
    """This host's cache directory with every entry of `remote` in it, and how many files
    were fetched now. One process of the host fetches; the others wait and find them."""
    local = local_dir(remote)
    local.mkdir(parents=True, exist_ok=True)
    fs, path = storage.filesystem(remote)
    fetched = 0
    with open(local / "seed.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = _local_files(local)
        for relative, size in sorted(_remote_files(fs, path).items()):
            if have.get(relative) == size:
                continue
            target = local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:8]}")
            with fs.open_input_stream(f"{path}/{relative}") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            os.replace(partial, target)
            fetched += 1
    return local, fetched


def upload(local: Path, remote: str) -> int:
    """Copy the entries of `local` that `remote` lacks there; how many were copied."""
    fs, path = storage.filesystem(remote)
    there = _remote_files(fs, path)
    copied = 0
    for relative, size in sorted(_local_files(local).items()):
        if relative in there:
            continue
        target = f"{path}/{relative}"
        parent = target.rsplit("/", 1)[0]
        fs.create_dir(parent, recursive=True)
        partial = f"{target}.partial-{uuid.uuid4().hex[:8]}"
        try:
            with open(local / relative, "rb") as src, fs.open_output_stream(partial) as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        except FileNotFoundError:  # removed locally meanwhile (inductor replaced it)
            continue
        fs.move(partial, target)
        copied += 1
    return copied


def counters() -> dict[str, int]:
    """This process's inductor FX-graph cache hits and misses so far (the `startup` event's
    compile_cache_hits / compile_cache_misses)."""
    from torch._dynamo.utils import counters as dynamo_counters

    inductor = dynamo_counters["inductor"]
    return {"compile_cache_hits": int(inductor.get("fxgraph_cache_hit", 0)),
            "compile_cache_misses": int(inductor.get("fxgraph_cache_miss", 0))}
