"""The trainer -> operator event protocol (docs/protocol.md). Standard library only.

A machine event is one line holding the prefix ``TPUFT-EVENT `` and one compact JSON
object: ``TPUFT-EVENT {"event":"epoch","v":1,...}``. Ray prefixes worker output
(``(RayTrainWorker pid=123) ``) and may colour it, so readers look for the prefix
anywhere in a line and ignore ANSI escape sequences around it.

The operator imports this module without torch or Ray installed: keep it pure.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
from typing import Any, Iterator, TextIO

PREFIX = "TPUFT-EVENT "
VERSION = 1
KINDS = frozenset({"start", "plan", "progress", "epoch", "checkpoint", "result", "failure", "collectives"})

# A line longer than this without a newline is not one of ours; drop it rather than
# buffer a runaway log line forever.
MAX_LINE_CHARS = 1 << 20

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
    the buffer for the next chunk (or for ``close``). Bytes may split a UTF-8 sequence.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._discarding = False
        self.lines_seen = 0

    def feed(self, chunk: str | bytes) -> list[Event]:
        if isinstance(chunk, bytes):
            chunk = self._decoder.decode(chunk)
        return list(self._consume(chunk))

    def close(self) -> list[Event]:
        """Parse whatever is left (a final line without a newline)."""
        rest = self._buffer + self._decoder.decode(b"", final=True)
        self._buffer = ""
        if self._discarding:
            self._discarding = False
            return []
        event = parse_line(rest) if rest else None
        return [event] if event is not None else []

    def _consume(self, chunk: str) -> Iterator[Event]:
        data = self._buffer + chunk
        lines = data.split("\n")
        self._buffer = lines.pop()
        for line in lines:
            self.lines_seen += 1
            if self._discarding:
                self._discarding = False  # the tail of an over-long line
                continue
            event = parse_line(line)
            if event is not None:
                yield event
        if len(self._buffer) > MAX_LINE_CHARS:
            self._buffer = ""
            self._discarding = True


def parse_text(text: str | bytes) -> list[Event]:
    """Every event in a complete log."""
    stream = EventStream()
    return stream.feed(text) + stream.close()
