"""Google Cloud Storage on the test ground: fake-gcs-server (built by `make gcs` from its
pinned Go module, tests/gcs/) on a free loopback port, plain HTTP, with the filesystem
backend, so every object is a file under `<root>/<bucket>/`. It starts with one bucket,
`tpufinetune-ground`.

Clients reach it the way Google's client libraries reach an emulator: the
`STORAGE_EMULATOR_HOST` variable (`endpoint`), anonymously. The helpers below (upload,
list, read, download) go through pyarrow's own GCS client, the one the trainer uses.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from controlplane import ROOT, ControlPlaneError, module_pin  # noqa: E402
from ports import free_port  # noqa: E402
from processes import spawn, stop_process, wait_answering  # noqa: E402

BUCKET = "tpufinetune-ground"
GO_MODULE = ROOT / "tests" / "gcs"
MODULE = "github.com/fsouza/fake-gcs-server"


def gcs_version() -> str:
    """The fake-gcs-server release pinned in tests/gcs/go.mod (e.g. 'v1.56.1')."""
    return module_pin(GO_MODULE, MODULE)


def gcs_binary() -> Path:
    return ROOT / ".cache" / "gcs" / gcs_version() / "bin" / "fake-gcs-server"


class GcsEmulator:
    """start() returns once the server answers and the bucket exists."""

    def __init__(self, root: Path, log: Path, bucket: str = BUCKET):
        self.root = Path(root)
        self.log = Path(log)
        self.bucket = bucket
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """STORAGE_EMULATOR_HOST: where Google's clients send their requests instead."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "GcsEmulator":
        binary = gcs_binary()
        if not os.access(binary, os.X_OK):
            raise ControlPlaneError(f"fake-gcs-server {gcs_version()} is not built ({binary}): run `make gcs` "
                                    "(`make test` and `make cluster` run it for you)")
        self.root.mkdir(parents=True, exist_ok=True)
        _require_xattrs(self.root)
        self.port = free_port()
        self.proc = spawn([str(binary), "-backend", "filesystem", "-filesystem-root", str(self.root),
                           "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                           "-log-level", "warn"], self.log)
        try:
            wait_answering(self.proc, self._answers, "fake-gcs-server", self.log, timeout, error=ControlPlaneError)
        except ControlPlaneError:
            self.proc = None
            raise
        self._api("POST", "/storage/v1/b", {"name": self.bucket})
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=5)
            self.proc = None

    def _answers(self) -> bool:
        try:
            self._api("GET", "/storage/v1/b")
            return True
        except OSError:
            return False

    def _api(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read() or b"{}")

    # -- what tests use

    def filesystem(self):
        """pyarrow's GCS client on the emulator (what the trainer builds from
        STORAGE_EMULATOR_HOST)."""
        import pyarrow.fs as pafs

        return pafs.GcsFileSystem(anonymous=True, scheme="http", endpoint_override=f"127.0.0.1:{self.port}")

    def uri(self, *parts: str) -> str:
        """gs://<bucket>/<parts joined>."""
        return "/".join([f"gs://{self.bucket}", *[p.strip("/") for p in parts if p.strip("/")]])

    def unique_uri(self, *parts: str) -> str:
        """A fresh prefix: `uri(*parts)` with a random suffix, so runs never share objects."""
        return self.uri(*parts[:-1], f"{parts[-1] if parts else 'run'}-{secrets.token_hex(3)}")

    def _path(self, uri: str) -> str:
        prefix = f"gs://{self.bucket}"
        if not (uri == prefix or uri.startswith(prefix + "/")):
            raise ValueError(f"{uri} is not in the emulator's bucket {self.bucket}")
        return f"{self.bucket}{uri[len(prefix):]}".rstrip("/")

    def upload(self, local: Path, uri: str) -> str:
        """A file or a directory (every file under it) copied to `uri`; returns `uri`."""
        import pyarrow.fs as pafs

        local, fs = Path(local), self.filesystem()
        if local.is_dir():
            pafs.copy_files(str(local), self._path(uri), source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
        else:
            with fs.open_output_stream(self._path(uri)) as out:
                out.write(local.read_bytes())
        return uri

    def list(self, uri: str) -> list[str]:
        """Names of every object under `uri`, relative to it, sorted ([] if none)."""
        import pyarrow.fs as pafs

        base = self._path(uri)
        infos = self.filesystem().get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)

    def read(self, uri: str) -> bytes:
        with self.filesystem().open_input_stream(self._path(uri)) as f:
            return f.read()

    def download(self, uri: str, dest: Path) -> Path:
        """Every object under `uri` into the local directory `dest` (returned)."""
        import pyarrow.fs as pafs

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(self._path(uri), str(dest), source_filesystem=self.filesystem(),
                        destination_filesystem=pafs.LocalFileSystem())
        return dest


def _require_xattrs(root: Path) -> None:
    """The filesystem backend keeps object metadata in extended attributes when the root
    supports them, else in `<object>.metadata` side files that hide every object whose
    name ends in `.metadata` from listings (torch's checkpoints have one): refuse that."""
    probe = root / ".xattr-probe"
    probe.touch()
    try:
        os.setxattr(probe, "user.tpuft", b"1")
    except OSError as exc:
        raise ControlPlaneError(f"the GCS emulator's root {root} has no user extended attributes ({exc}); "
                                "put the ground's workdir (TMPDIR) on a filesystem that has them") from exc
    finally:
        probe.unlink()
