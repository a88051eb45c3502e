"""Where the trainer reads and writes: one pyarrow file system per location.

A `gs://bucket/path` URI is Google Cloud Storage through pyarrow's own client, with the
default credentials (on GKE: Workload Identity, from the metadata server); when
`STORAGE_EMULATOR_HOST` is set (the variable Google's client libraries honour) it goes,
anonymously, to that emulator instead. Other URIs (s3://, hdfs://, file://) are pyarrow's
own; a plain path is the local file system (a shared mount).

Models and datasets in storage are read by libraries that want local files
(transformers, datasets): `local_copy` downloads them once per host into a cache that
every process of that host shares.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
GCS_SCHEMES = ("gs", "gcs")


def is_uri(location: str) -> bool:
    return "://" in location


def filesystem(location: str):
    """(pyarrow file system, path on it) for a path or URI. A local path becomes absolute."""
    import pyarrow.fs as pafs

    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))
    scheme, _, rest = location.partition("://")
    if scheme in GCS_SCHEMES:
        return gcs_filesystem(), rest.strip("/")
    return pafs.FileSystem.from_uri(location)


def gcs_filesystem():
    """GCS with the default credentials, or the emulator STORAGE_EMULATOR_HOST names
    (`http://host:port` or `host:port`), anonymously."""
    import pyarrow.fs as pafs

    emulator = os.environ.get(EMULATOR_ENV, "").strip()
    if not emulator:
        return pafs.GcsFileSystem()
    parts = urlsplit(emulator if "://" in emulator else f"http://{emulator}")
    return pafs.GcsFileSystem(anonymous=True, scheme=parts.scheme, endpoint_override=parts.netloc)


def uri_of(fs, path: str) -> str:
    """The inverse of `filesystem`: a location string for `path` on `fs`."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        return path
    scheme = "gs" if isinstance(fs, pafs.GcsFileSystem) else fs.type_name
    return f"{scheme}://{path.lstrip('/')}"


def ray_storage(location: str) -> dict:
    """Ray Train's RunConfig storage arguments: a URI goes through `filesystem` (so the
    emulator and the credentials are the trainer's), a path as it is."""
    if not is_uri(location):
        return {"storage_path": location}
    fs, path = filesystem(location)
    return {"storage_path": path, "storage_filesystem": fs}


def exists(location: str, kind: str = "any") -> bool:
    """Whether a file ("file"), a directory ("dir") or either is at `location`."""
    import pyarrow.fs as pafs

    fs, path = filesystem(location)
    found = fs.get_file_info(path).type
    wanted = {"file": (pafs.FileType.File,), "dir": (pafs.FileType.Directory,),
              "any": (pafs.FileType.File, pafs.FileType.Directory)}[kind]
    return found in wanted


def upload_dir(local: str, destination: str) -> None:
    """Copy a local directory to a path or URI."""
    import pyarrow.fs as pafs

    fs, path = filesystem(destination)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(local, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def cache_home() -> Path:
    """The trainer's caches on this host's local disk (XDG's cache directory)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpufinetune"


def cache_root() -> Path:
    return cache_home() / "storage"


def _keep_mtimes(files, path: str, copy: Path, directory: bool) -> None:
    """Each copied file keeps its object's modification time, so every host's copy (a new
    head pod's too) has the same (path, size, mtime): the data fingerprint, and `datasets`'
    own, then find what an earlier attempt prepared from it."""
    for info in files:
        if info.mtime_ns is None:
            continue
        local = copy / PurePosixPath(info.path).relative_to(path) if directory else copy
        os.utime(local, ns=(info.mtime_ns, info.mtime_ns))


def local_copy(location: str) -> Path:
    """The file or directory at a URI as a local path, downloaded once per host.

    The cache entry is named by the URI and the listing (names, sizes, modification
    times), so a changed object is fetched again. One process of the host downloads
    (under a file lock) while the others wait, then find its done marker.
    FileNotFoundError when nothing is there."""
    import pyarrow.fs as pafs

    fs, path = filesystem(location)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        files = [info]
    elif info.type == pafs.FileType.Directory:
        files = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                 if i.type == pafs.FileType.File]
    else:
        files = []
    if not files:
        raise FileNotFoundError(f"{location}: no such object or directory")
    listing = "\n".join(f"{i.path}\t{i.size}\t{i.mtime_ns}" for i in sorted(files, key=lambda i: i.path))
    entry = cache_root() / hashlib.sha256(f"{location}\n{listing}".encode()).hexdigest()[:20]
    target = entry / (PurePosixPath(path).name or "root")
    done = entry / "done"
    if done.exists():
        return target
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():  # another process of this host downloaded it meanwhile
            return target
        partial = entry / "partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        if info.type == pafs.FileType.Directory:
            partial.mkdir()
        pafs.copy_files(path, str(partial), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        _keep_mtimes(files, path, partial, info.type == pafs.FileType.Directory)
        os.rename(partial, target)
        done.write_text(location + "\n")
    return target
