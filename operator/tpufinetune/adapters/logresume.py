"""Resuming a job log near its cursor: Ray has no byte offset for job logs, only line
tails (the state API's `lines`), so the operator recognises where it stopped by content.

The anchor saved next to `status.logCursor` (`status.logAnchor`) names the last lines
parsed before the cursor: `K.LAST.WINDOW`, K the number of lines, LAST the digest of the
last one (a cheap first test) and WINDOW the digest of all K. K reaches back to the most
recent trainer event line (events carry their step, epoch or URI, so a window holding
one appears once in a job's log), at least ANCHOR_LINES[0] and at most ANCHOR_LINES[1]
lines. A tail of the log is searched for the window's first occurrence; what follows it
is exactly what the cursor had not parsed yet.

Every text here is in the websocket's view of the log (the Job API reads the file in
text mode: UTF-8, and "\\r\\n" and "\\r" end a line like "\\n"), so cursors and digests
agree whichever endpoint delivered the bytes. Pure: no I/O.
"""

from __future__ import annotations

import codecs
import hashlib
import io
from collections import deque

from tpufinetune_trainer.events import PREFIX, EventStream

ANCHOR_LINES = (8, 1024)  # (least, most) lines an anchor covers
_EVENT = PREFIX.encode()


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def as_logged(raw: bytes) -> str:
    """A finite piece of the raw log file as the Job API's websocket shows it."""
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def stream_decoder() -> io.IncrementalNewlineDecoder:
    """`as_logged` for a stream of chunks (a chunk may end inside "\\r\\n" or a UTF-8
    sequence): `.decode(chunk)`, and `.decode(b"", final=True)` at the end."""
    return io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors="replace"), translate=True)


def window_anchor(recent) -> str:
    """The anchor of the lines in `recent` ((digest, is_event) pairs, oldest first); ""
    when there are none (nothing parsed yet)."""
    lines = list(recent)
    if not lines:
        return ""
    back = next((i for i, (_, event) in enumerate(reversed(lines), 1) if event), len(lines))
    k = min(len(lines), max(back, ANCHOR_LINES[0]), ANCHOR_LINES[1])
    window = b"".join(d for d, _ in lines[-k:])
    return f"{k}.{lines[-1][0].hex()}.{digest(window).hex()}"


class AnchoredStream(EventStream):
    """The trainer's incremental parser, remembering a digest of each of its last lines:
    its `anchor()` names the lines before `offset` (the cursor). `offset` and `anchor`
    start where an earlier reader stopped."""

    def __init__(self, skip: int = 0, offset: int = 0, anchor: str = "") -> None:
        super().__init__(skip=skip)
        self.offset = offset
        self.recent: deque = deque(maxlen=ANCHOR_LINES[1])
        self._saved_anchor = anchor

    def _line(self, line: bytes, size: int):
        self.recent.append((digest(line), _EVENT in line))
        return super()._line(line, size)

    def anchor(self) -> str:
        return window_anchor(self.recent) if self.recent else self._saved_anchor

    def resume_after(self, offset: int, recent) -> None:
        """Continue at `offset` (a line boundary) with these lines before it: an unfinished
        line of an earlier source is dropped, the next source starts at the cursor."""
        self.offset, self.skip = offset, offset
        self._buffer, self._dropped = b"", 0
        self.recent.clear()
        self.recent.extend(recent)


class AnchorSearch:
    """Finds an anchor's window in a tail of the log fed in chunks (str), at its first
    occurrence. `feed` returns None until the window's last line came, then the text
    after it (the caller then stops searching). `lines` counts the complete lines
    searched; `recent` holds the lines up to the window's end once found."""

    def __init__(self, anchor: str) -> None:
        k, last, window = anchor.split(".")
        self.k, self._last, self._window = int(k), bytes.fromhex(last), bytes.fromhex(window)
        self.recent: deque = deque(maxlen=ANCHOR_LINES[1])
        self.lines = 0
        self._buffer = b""

    @staticmethod
    def usable(anchor: str) -> bool:
        parts = (anchor or "").split(".")
        return len(parts) == 3 and parts[0].isdigit() and int(parts[0]) > 0 and all(
            len(p) == 16 and all(c in "0123456789abcdef" for c in p) for p in parts[1:])

    def feed(self, text: str) -> str | None:
        data = self._buffer + text.encode()
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line = data[start:end]
            start = end + 1
            self.lines += 1
            line_digest = digest(line)
            self.recent.append((line_digest, _EVENT in line))
            if line_digest == self._last and len(self.recent) >= self.k and digest(
                    b"".join(d for d, _ in list(self.recent)[-self.k:])) == self._window:
                self._buffer = b""
                return data[start:].decode("utf-8", errors="replace")
        self._buffer = data[start:]
        return None
