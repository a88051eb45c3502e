"""The trainer -> operator event protocol (docs/protocol.md). Standard library only.

A machine event is one line holding the prefix ``TPUFT-EVENT `` and one compact JSON
object: ``TPUFT-EVENT {"event":"epoch","v":1,...}``. Ray prefixes worker output
(``(RayTrainWorker pid=123) ``) and may colour it, so readers look for the prefix
anywhere in a line and ignore ANSI escape sequences around it.

The operator imports this module without torch or Ray installed: keep it pure.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Iterator, TextIO

PREFIX = "TPUFT-EVENT "
VERSION = 1
KINDS = frozenset({"start", "model", "plan", "progress", "epoch", "checkpoint", "result", "failure", "collectives",
                   "notice", "early_stop", "export_proof", "startup", "lmeval_start", "lmeval_task",
                   "lmeval_result"})

# A line longer than this (in bytes) without a newline is not one of ours; drop it rather
# than buffer a runaway log line forever.
MAX_LINE_BYTES = 1 << 20

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_DECODER = json.JSONDecoder()


class Event(dict):
    """One parsed event: a plain dict (``event["loss"]``) with the kind as ``.kind``."""

    @property
    def kind(self) -> str:
        return self["event"]


def _finite(value: Any) -> Any:
    # JSON has no NaN/Infinity; a diverged loss is reported as null, not as invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_event(event: str, **fields: Any) -> str:
    """The machine line for one event (without a trailing newline)."""
    if event not in KINDS:
        raise ValueError(f"unknown event kind {event!r}; expected one of {sorted(KINDS)}")
    payload = {"event": event, "v": VERSION, **_finite(fields)}
    return PREFIX + json.dumps(payload, separators=(",", ":"), ensure_ascii=True, default=str)


def emit(event: str, stream: TextIO | None = None, **fields: Any) -> str:
    """Print one event line, flushed at once so it reaches the job log before a crash."""
    line = format_event(event, **fields)
    out = stream if stream is not None else sys.stdout
    out.write(line + "\n")
    out.flush()
    return line


def parse_line(line: str | bytes) -> Event | None:
    """The event on this line, or None. Never raises on any input."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    if not isinstance(line, str) or PREFIX not in line:
        return None
    line = _ANSI.sub("", line)
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        payload, _ = _DECODER.raw_decode(line, start + len(PREFIX))
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("event"), str):
        return None
    return Event(payload)


class EventStream:
    """Incremental parser over arbitrary chunks of a log (str or bytes).

    ``feed`` returns the events completed by this chunk; a partial last line waits in
    the buffer for the next chunk (or for ``close``). Lines are split on bytes, so a chunk
    may end inside a UTF-8 sequence. ``offset`` is the byte offset where the unfinished
    line starts (a resume point on a line boundary, e.g. the operator's log cursor); the
    lines that start before ``skip`` were read by an earlier reader and are not parsed.
    """

    def __init__(self, skip: int = 0) -> None:
        self.skip = skip
        self.offset = 0
        self.lines_seen = 0
        self._buffer = b""
        self._dropped = 0  # bytes of an over-long line thrown away so far

    def feed(self, chunk: str | bytes) -> list[Event]:
        if isinstance(chunk, str):
            chunk = chunk.encode()
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        events = [e for e in (self._line(line, len(line) + 1) for line in lines) if e is not None]
        if len(self._buffer) > MAX_LINE_BYTES:
            self._dropped += len(self._buffer)
            self._buffer = b""
        return events

    def close(self) -> list[Event]:
        """Parse whatever is left (a final line without a newline)."""
        rest, self._buffer = self._buffer, b""
        if not rest and not self._dropped:
            return []
        event = self._line(rest, len(rest))
        return [event] if event is not None else []

    def _line(self, line: bytes, size: int) -> Event | None:
        start, dropped = self.offset, self._dropped
        self.offset += size + dropped
        self.lines_seen += 1
        self._dropped = 0
        if dropped or start < self.skip:  # the tail of an over-long line, or already read
            return None
        return parse_line(line.decode("utf-8", errors="replace"))


def parse_text(text: str | bytes) -> list[Event]:
    """Every event in a complete log."""
    stream = EventStream()
    return stream.feed(text) + stream.close()
