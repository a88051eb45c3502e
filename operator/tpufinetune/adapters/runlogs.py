"""`tpufinetune logs`: an attempt's logs, read from the run's storage (never from the Ray
head), so a live run and one whose RayCluster is gone read the same objects, in the same
format. The trainer writes them (tpufinetune_trainer/logship.py, whose reader this uses:
one definition of the chunks); the user needs `get` on the TPUFineTune and read access to
the bucket (docs/gke.md, "Reading a run's logs").
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tpufinetune.core.api import SpecError, parse_stored_spec
from tpufinetune.core.jobspec import logs_uri, run_logs_root

EXTRA_HINT = "pip install 'tpufinetune[logs]'"
POLL_S = 2.0
# After the attempt ended, how long a follow still looks for the last chunks: every
# process flushes at its exit, before Ray reports the job ended, so one flush period is
# ample.
SETTLE_S = 6.0


def attempt_of(obj: dict, wanted: int | None) -> tuple[int, dict]:
    """(attempt number, its status.attempts entry or {}): `wanted`, else the current one.
    LookupError says what there is instead."""
    status = obj.get("status") or {}
    entries = {int(e["attempt"]): e for e in status.get("attempts") or [] if "attempt" in e}
    number = wanted if wanted is not None else int(status.get("attempt") or max(entries, default=0))
    if number < 1:
        raise LookupError("it has no attempt yet (status.attempt is unset): wait until it is Provisioning")
    if wanted is not None and number > int(status.get("attempt") or 0) and number not in entries:
        raise LookupError(f"it has no attempt {number} (attempts so far: {status.get('attempt') or 0})")
    return number, entries.get(number, {})


def logs_uri_of(obj: dict, number: int, entry: dict) -> str:
    """The attempt's status.attempts[].logsURI; for an entry without one (folded out of the
    bounded list, or written before the field existed), the same URI from the spec."""
    if entry.get("logsURI"):
        return entry["logsURI"]
    meta = obj.get("metadata") or {}
    try:
        spec, _ = parse_stored_spec(obj.get("spec") or {})
    except SpecError as exc:
        raise LookupError(f"its spec cannot be read ({exc}), so where its logs are is unknown") from None
    root = run_logs_root(meta.get("name", ""), meta.get("uid", ""), spec)
    if not root:
        raise LookupError("it keeps no logs (mode collectives has no storage)")
    return logs_uri(root, number)


def ended(obj: dict | None, number: int) -> bool:
    """The attempt is over (or the resource is gone): nothing more will be written."""
    if obj is None:
        return True
    for entry in (obj.get("status") or {}).get("attempts") or []:
        if entry.get("attempt") == number:
            return "endTime" in entry
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def show(uri: str, stream: str, write: Callable[[bytes], None], follow: bool = False,
         read_obj: Callable[[], dict | None] | None = None, number: int = 0,
         poll_s: float = POLL_S, settle_s: float = SETTLE_S) -> bool:
    """Write the stream's chunks in order; with `follow`, keep writing new ones until the
    attempt has ended (read_obj: the TPUFineTune now, None once deleted) and settled.
    Returns whether anything was written."""
    from tpufinetune_trainer.logship import StreamReader

    reader = StreamReader(uri, stream)
    wrote = False
    settle_until = None
    while True:
        for data in reader.read():
            write(data)
            wrote = True
        if not follow:
            return wrote
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            return wrote
        if settle_until is None and ended(read_obj(), number):
            settle_until = now + settle_s
        time.sleep(poll_s)


def stream_name(worker: int | None) -> str:
    from tpufinetune_trainer.logship import DRIVER, worker_stream

    return DRIVER if worker is None else worker_stream(worker)


def available(uri: str) -> str:
    from tpufinetune_trainer.logship import streams

    found = streams(uri)
    return ", ".join(found) if found else "none"


def stdout_bytes(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def read_text(uri: str) -> str:
    """One object of the run's storage, whole, as text (an epoch's generation samples, for
    `tpufinetune eval --samples`), through the trainer's storage client: a gs:// URI with
    the user's credentials, a local path as it is. OSError or ValueError say why not."""
    from tpufinetune_trainer import storage

    fs, path = storage.filesystem(uri)
    with fs.open_input_stream(path) as stream:
        return stream.read().decode("utf-8")
