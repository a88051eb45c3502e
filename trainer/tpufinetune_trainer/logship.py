"""Each attempt's logs, kept in the run's storage while it runs: the driver's output and
every Ray Train worker's stdout and stderr, beside the run's checkpoints:

    <storage>/<run name>/logs/attempt-N/driver/<start ms>-<seq>.log    the job's driver (what the Job API shows)
    <storage>/<run name>/logs/attempt-N/worker-<rank>/<start ms>-<seq>.log   one Ray Train worker (world rank)

N is the operator's attempt (TPUFINETUNE_ATTEMPT, in every process of the job); the
operator computes the same place for status.attempts[].logsURI (tpufinetune.core.jobspec
.logs_uri). `TPUFT_LOGS_URI` names the attempt's directory outright (a run by hand).

A stream is the name-ordered concatenation of its chunks. GCS objects are immutable, so
each flush writes one new object (a chunk) instead of appending: no read-modify-write, no
compose (which pyarrow's file systems do not offer and a local path has no use for), the
same code for `gs://` and a shared path, and a process killed between two flushes loses
only what it printed since the last one (`FLUSH_S`). `<start ms>` (when the writer began)
keeps a restarted worker (Ray Train's `maxFailures`) from overwriting its predecessor's
chunks.

Capture is at the file descriptors (1 and 2): C and subprocess output and loggers that
hold the original `sys.stderr` are caught too. A thread copies each pipe to the original
descriptor first, so the job log and Ray's worker files see what they did before (line by
line, so stdout's and stderr's lines never cut into each other in a shared file);
storage I/O happens only on the flusher thread, never on the path of a write.

Bounded by `TPUFT_LOGS_MAX_BYTES` (the attempt's total, `DEFAULT_MAX_BYTES` unless the Ray
pods' environment sets it; 0 keeps none): the driver gets half, the workers share the other
half. A stream over its share keeps its first chunk (the start) and its newest ones (the
end, where a failure is), deleting the oldest others; the reader marks the gap.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import storage

ATTEMPT_ENV = "TPUFINETUNE_ATTEMPT"  # the operator's attempt number, in the job's runtime env
LOGS_URI_ENV = "TPUFT_LOGS_URI"
LOGS_MAX_BYTES_ENV = "TPUFT_LOGS_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 * 2**20
DRIVER = "driver"
FLUSH_S = 5.0
CHUNK_LIMIT = 1 << 20  # bytes per chunk at most
BUFFER_CHUNKS = 4  # chunks held in memory while storage is slow; older bytes are dropped
CHUNK_NAME = re.compile(r"^(\d{13})-(\d{6})\.log$")


def worker_stream(rank: int) -> str:
    return f"worker-{rank}"


def chunk_name(started_ms: int, seq: int) -> str:
    return f"{started_ms:013d}-{seq:06d}.log"


def stream_budget(max_bytes: int, stream: str, num_workers: int) -> int:
    """A stream's share of the attempt's bound: half for the driver (it carries every
    worker's lines too, as Ray forwards them), the other half split over the workers."""
    if stream == DRIVER:
        return max_bytes // 2
    return max_bytes // 2 // max(1, num_workers)


def attempt_logs_uri(storage_path: str, run_name: str) -> str:
    """Where this attempt's logs go ('' when they are not kept: no attempt number, as in a
    run by hand without TPUFT_LOGS_URI)."""
    explicit = os.environ.get(LOGS_URI_ENV, "").strip()
    if explicit:
        return explicit
    attempt = os.environ.get(ATTEMPT_ENV, "").strip()
    if not (attempt.isdigit() and int(attempt) >= 1 and storage_path and run_name):
        return ""
    return f"{storage_path.rstrip('/')}/{run_name}/logs/attempt-{int(attempt)}"


def max_bytes() -> int:
    """The attempt's bound: TPUFT_LOGS_MAX_BYTES, else DEFAULT_MAX_BYTES (unreadable: the
    default, said once)."""
    text = os.environ.get(LOGS_MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return max(0, int(text))
    except ValueError:
        print(f"{LOGS_MAX_BYTES_ENV}={text!r} is not a number of bytes; keeping up to {DEFAULT_MAX_BYTES}",
              file=sys.stderr, flush=True)
        return DEFAULT_MAX_BYTES


class ChunkWriter:
    """Buffers a stream's bytes and writes them as numbered chunk objects under
    `<logs uri>/<stream>/`, keeping the stream within `budget` bytes."""

    def __init__(self, logs_uri: str, stream: str, budget: int, started_ms: int | None = None):
        self.fs, root = storage.filesystem(logs_uri)
        self.directory = f"{root.rstrip('/')}/{stream}"
        self.budget = budget
        self.chunk_limit = max(1, min(CHUNK_LIMIT, budget // 4))
        self.started_ms = started_ms if started_ms is not None else int(time.time() * 1000)
        self.seq = 0
        self.kept: list[tuple[str, int]] = []  # (path, size) of the chunks in storage
        self.buffer = bytearray()
        self.dropped = 0  # bytes dropped from memory while storage was slow
        self.lock = threading.Lock()  # the buffer
        self.io_lock = threading.Lock()  # one flush at a time
        self.errors = 0
        self.fs.create_dir(self.directory, recursive=True)

    def append(self, data: bytes) -> bool:
        """Buffer `data`; True when a chunk's worth is waiting (flush soon)."""
        with self.lock:
            self.buffer += data
            self._hold()
            return len(self.buffer) >= self.chunk_limit

    def _hold(self) -> None:
        """Memory stays bounded while storage is slow or failing: the oldest bytes go."""
        cut = len(self.buffer) - self.chunk_limit * BUFFER_CHUNKS
        if cut > 0:
            self.dropped += cut
            del self.buffer[:cut]

    def flush(self, full_only: bool = False) -> None:
        """Write what is buffered, a chunk at a time (`full_only`: whole chunks only, the
        rest waits for the next timed flush). A failed write keeps its bytes for the next
        flush (bounded: `append` drops the oldest)."""
        with self.io_lock:
            while True:
                with self.lock:
                    if not self.buffer or (full_only and len(self.buffer) < self.chunk_limit):
                        return
                    cut = self.buffer.rfind(b"\n", 0, self.chunk_limit) + 1 or self.chunk_limit  # whole lines
                    data, dropped = bytes(self.buffer[:cut]), self.dropped
                    del self.buffer[:cut]
                    self.dropped = 0
                note = f"[tpufinetune: {dropped} bytes dropped: storage was too slow]\n".encode() if dropped else b""
                path = f"{self.directory}/{chunk_name(self.started_ms, self.seq + 1)}"
                try:
                    with self.fs.open_output_stream(path) as out:
                        out.write(note + data)
                except Exception:  # noqa: BLE001 - storage trouble must never stop training
                    self.errors += 1
                    with self.lock:
                        self.buffer[:0] = data
                        self.dropped += dropped
                        self._hold()
                    return
                self.seq += 1
                self.kept.append((path, len(data)))
                self._trim()

    def _trim(self) -> None:
        """Over budget: delete the oldest chunks but the first. (Per writer: a worker that
        Ray Train restarted in the job starts its own count.)"""
        while sum(size for _, size in self.kept) > self.budget and len(self.kept) > 2:
            path, _ = self.kept.pop(1)
            try:
                self.fs.delete_file(path)
            except Exception:  # noqa: BLE001
                self.errors += 1


class FdTee:
    """Copies what the process writes to fds 1 and 2 to their original destinations and to
    `sink(bytes)`: whole lines, each descriptor's in order, the two interleaved as read."""

    FDS = (1, 2)
    PARTIAL_S = 1.0

    def __init__(self, sink, on_chunk=None):
        self.sink, self.on_chunk = sink, on_chunk
        self.saved: dict[int, int] = {}
        self.pipes: dict[int, int] = {}  # read end -> fd it stands for
        self.thread: threading.Thread | None = None

    def start(self) -> "FdTee":
        _flush_python_streams()
        try:
            for fd in self.FDS:
                read, write = os.pipe()
                self.pipes[read] = fd
                self.saved[fd] = os.dup(fd)
                os.dup2(write, fd)
                os.close(write)
        except OSError:
            # Never leave a descriptor on a pipe nobody reads: its writer would block.
            for fd, original in self.saved.items():
                os.dup2(original, fd)
                os.close(original)
            for read in self.pipes:
                os.close(read)
            self.saved, self.pipes = {}, {}
            raise
        self.thread = threading.Thread(target=self._copy, name="tpuft-log-tee", daemon=True)
        self.thread.start()
        return self

    def _copy(self) -> None:
        open_ends = set(self.pipes)
        originals = {read: self.saved[fd] for read, fd in self.pipes.items()}  # stop() clears saved
        # Whole lines go on, to the original and to the sink, so stdout's and stderr's
        # lines never cut into each other where both land in one file (a Ray job's log):
        # print writes a line's text and its newline apart, and a pipe hands a long write
        # over in pieces. A partial line goes after PARTIAL_S, at the end, or once large.
        partial: dict[int, tuple[float, bytes]] = {}
        while open_ends:
            try:
                ready, _, _ = select.select(list(open_ends), [], [], self.PARTIAL_S)
            except (OSError, ValueError):
                return
            for read in ready:
                try:
                    data = os.read(read, 65536)
                except OSError:
                    data = b""
                if not data:
                    open_ends.discard(read)
                    continue
                since, pending = partial.pop(read, (time.monotonic(), b""))
                pending += data
                cut = pending.rfind(b"\n") + 1
                if len(pending) - cut >= 65536:
                    cut = len(pending)
                self._forward(originals[read], pending[:cut])
                if cut < len(pending):
                    partial[read] = (since if not cut else time.monotonic(), pending[cut:])
            now = time.monotonic()
            for read, (since, pending) in list(partial.items()):
                if now - since >= self.PARTIAL_S or read not in open_ends:
                    del partial[read]
                    self._forward(originals[read], pending)
        for read, (_, pending) in partial.items():
            self._forward(originals[read], pending)

    def _forward(self, original: int, data: bytes) -> None:
        if data:
            _write_all(original, data)
            self._emit(data)

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        try:
            if self.sink(data) and self.on_chunk is not None:
                self.on_chunk()
        except Exception:  # noqa: BLE001 - the copy to the original must go on
            pass

    def stop(self, timeout: float = 2.0) -> None:
        """Point fds 1 and 2 back at their originals and copy what is left in the pipes
        (up to `timeout`: a child process may still hold a pipe open)."""
        if not self.saved:
            return
        _flush_python_streams()
        for fd, original in self.saved.items():
            os.dup2(original, fd)
        if self.thread is not None:
            self.thread.join(timeout)
        if self.thread is None or not self.thread.is_alive():
            for read in self.pipes:
                os.close(read)
            for original in self.saved.values():
                os.close(original)
        self.saved, self.pipes = {}, {}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


class Shipper:
    """One process's stream: the tee, the writer and the flusher thread."""

    def __init__(self, writer: ChunkWriter, flush_s: float | None = None):
        self.writer = writer
        self.flush_s = flush_s or FLUSH_S
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.tee = FdTee(writer.append, self.wake.set)
        self.thread = threading.Thread(target=self._flusher, name="tpuft-log-flush", daemon=True)
        self.closed = False

    def start(self) -> "Shipper":
        self.tee.start()
        self.thread.start()
        return self

    def _flusher(self) -> None:
        while not self.stopping.is_set():
            full = self.wake.wait(self.flush_s)  # woken: a chunk's worth is waiting
            self.wake.clear()
            self.writer.flush(full_only=full and not self.stopping.is_set())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.tee.stop()
        self.stopping.set()
        self.wake.set()
        self.thread.join(30)
        self.writer.flush()


@contextmanager
def shipping(stream: str, uri: str, num_workers: int = 1, on_sigterm: bool = False) -> Iterator[Shipper | None]:
    """Keep this process's output as `stream` under the attempt's logs `uri` until the
    block ends; nothing when `uri` is '' or the bound is 0. `on_sigterm` (the driver's main
    thread only): a SIGTERM (`ray job stop`) flushes first, then acts as before."""
    limit = max_bytes() if uri else 0
    if not limit:
        yield None
        return
    try:
        shipper = Shipper(ChunkWriter(uri, stream, stream_budget(limit, stream, num_workers))).start()
    except Exception as exc:  # noqa: BLE001 - a run without its logs kept still trains
        print(f"logs are not kept: {uri}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        yield None
        return
    previous = _flush_on_sigterm(shipper) if on_sigterm else None
    try:
        yield shipper
    finally:
        shipper.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _flush_on_sigterm(shipper: Shipper):
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        shipper.close()
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    return previous


# ---- reading (tpufinetune logs) -------------------------------------------------------------


def streams(logs_uri: str) -> list[str]:
    """The streams kept under an attempt's logs URI: the driver first, then the workers by
    rank."""
    import pyarrow.fs as pafs

    fs, root = storage.filesystem(logs_uri)
    root = root.rstrip("/")
    # From the chunks' own paths: a bucket has no directories, only names with slashes.
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    names = {i.path[len(root) + 1:].split("/", 1)[0] for i in infos
             if i.type == pafs.FileType.File and CHUNK_NAME.match(i.base_name)}
    workers = sorted((n for n in names if re.fullmatch(r"worker-\d+", n)), key=lambda n: int(n.split("-")[1]))
    return ([DRIVER] if DRIVER in names else []) + workers


def chunks(logs_uri: str, stream: str) -> list[str]:
    """The stream's chunk names, in order."""
    return StreamReader(logs_uri, stream).names()


def gap_note(previous: str | None, name: str) -> str:
    """The line that stands for chunks deleted to keep the stream under its bound."""
    if previous is None:
        return ""
    (start_a, seq_a), (start_b, seq_b) = (CHUNK_NAME.match(n).groups() for n in (previous, name))
    if start_a == start_b and int(seq_b) > int(seq_a) + 1:
        return f"[tpufinetune: chunks {int(seq_a) + 1}-{int(seq_b) - 1} dropped to keep the attempt's logs under " \
               f"their bound]\n"
    return ""


class StreamReader:
    """Reads a stream's chunks in order, each once: `read()` again returns only what was
    written since (for following a live run)."""

    def __init__(self, logs_uri: str, stream: str):
        self.fs, root = storage.filesystem(logs_uri)
        self.directory = f"{root.rstrip('/')}/{stream}"
        self.last: str | None = None

    def names(self) -> list[str]:
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.directory, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File and CHUNK_NAME.match(i.base_name))

    def read(self) -> Iterator[bytes]:
        for name in self.names():
            if self.last is not None and name <= self.last:
                continue
            note = gap_note(self.last, name)
            try:
                with self.fs.open_input_stream(f"{self.directory}/{name}") as f:
                    data = f.read()
            except FileNotFoundError:  # deleted by the bound between the listing and now
                continue
            if note:
                yield note.encode()
            self.last = name
            yield data
