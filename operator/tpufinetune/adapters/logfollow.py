"""Follows one Ray job's log and parses the trainer's events from it, each byte once (see
docs/architecture.md, "Following a job's log"). Its Ray calls go through RayJobs' pool,
with the token RayJobs holds for the address (the run authorized it before it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from tpufinetune.adapters.logresume import AnchoredStream, AnchorSearch
from tpufinetune.adapters.rayjobs import (
    RECONNECT_BACKOFF_S, RESUME_LINES, STREAM_QUIET_HEARTBEATS, RayJobs, TimedJobClient, event_dict,
)
from tpufinetune.core.phases import JOB_ACTIVE

log = logging.getLogger(__name__)


# The trainer's closing events: after one of them the log holds nothing more for us.
LAST_EVENTS = frozenset({"result", "failure", "collectives"})


@dataclass
class LogFollower:
    """Follows one job's log and parses trainer events.

    From the start of a log (nothing parsed yet) it follows the Job API's websocket,
    which always sends the log from byte 0 and ends when the job ended. Resuming at a
    cursor (`skip` and `anchor`: status.logCursor and status.logAnchor, after a restart
    or a reconnect), it asks the state API for the log's last lines (RESUME_LINES),
    finds the anchor among them and parses only what follows, then follows the state
    API's log stream from there. Only when the anchor is not among the most lines asked
    is the whole log read (then parsed from byte 0, skipping `skip` bytes), and a cursor
    without an anchor (a status older than anchors) replays the websocket the same way.
    `drained` is the (cursor, anchor) where the events handed out so far end.
    """

    jobs: RayJobs
    address: str
    submission_id: str
    skip: int = 0
    anchor: str = ""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    _stream: AnchoredStream | None = None
    _pending: list = field(default_factory=list)
    _task: asyncio.Task | None = None
    _finished: bool = False
    _saw_last_event: bool = False  # the trainer's result, failure or collectives line came
    _complete: bool = False  # read to the end after Ray said the job ended
    _on_websocket: bool = False  # following the websocket, which ends when the job ended
    _no_tail_at: int = -1  # the cursor whose anchor was not found: replay from the start
    backoff: tuple[float, float] = RECONNECT_BACKOFF_S  # (least, most) seconds before a reconnect
    reconnects: int = 0
    tail_resumes: int = 0  # resumes from a bounded tail of the log
    full_replays: int = 0  # resumes that replayed the log from byte 0 (no anchor found)

    def __post_init__(self) -> None:
        self._stream = AnchoredStream(skip=self.skip)
        self.drained = (self.skip, self.anchor)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"logs-{self.submission_id}")

    async def _follow(self) -> None:
        least, most = self.backoff
        delay = least
        while True:
            before = self.cursor
            try:
                client = await self.jobs.call(self.jobs.client, self.address)
                if self._can_resume():
                    if await self._follow_tail(client):
                        return  # the job ended and its log was read to the end
                    continue  # the anchor was not found: replay from the start, at once
                self._replay_from_start()
                self._on_websocket = True
                async for chunk in client.tail_job_logs(self.submission_id):
                    self._feed(chunk)
                self._on_websocket = False
                if not await self._still_running():
                    return  # the job ended and Ray closed the stream: every line came
                # A clean close while the job runs (a proxy, a restarting agent): the
                # lines after it come only on a new stream.
                log.info("log stream of %s closed while the job runs; reconnecting in %gs",
                         self.submission_id, delay)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the head may be briefly unreachable
                if not await self._still_running():
                    return  # the job is gone (a new head) or ended: nothing more to follow
                log.warning("log stream of %s interrupted: %s; reconnecting in %gs", self.submission_id, error, delay)
            finally:
                self._on_websocket = False
            self.reconnects += 1
            delay = least if self.cursor > before else delay  # a stream that delivered starts over
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)

    async def _still_running(self) -> bool:
        try:
            job = await self.jobs.call(self.jobs.job, self.address, self.submission_id)
        except Exception:
            return True  # unknown: reconnect rather than risk missing lines
        return job is not None and job.status in JOB_ACTIVE

    def position(self) -> tuple[int, str]:
        """The cursor (bytes, on a line boundary) and its anchor. While a replay from byte
        0 has not reached the saved cursor, that cursor still stands."""
        if self._stream.offset >= self.skip:
            return self._stream.offset, self._stream.anchor()
        return self.skip, self.anchor

    def _can_resume(self) -> bool:
        cursor, anchor = self.position()
        return cursor > 0 and cursor != self._no_tail_at and AnchorSearch.usable(anchor)

    async def _follow_tail(self, client: TimedJobClient) -> bool:
        """Catch up from a bounded tail, then follow the state API's stream from the
        cursor. True once the job ended and its log was read to the end; False when the
        anchor is not in the tail (the caller replays from the start); raises when the
        stream fails or the head stops answering."""
        node = await self.jobs.call(client.driver_node, self.submission_id)
        if not node:
            raise RuntimeError(f"the head names no driver node for {self.submission_id}")
        slack = RESUME_LINES[0]
        while True:
            if not await self._catch_up(client, node):
                return False
            search = AnchorSearch(self.position()[1])
            lines = search.k + slack
            quiet = 0
            # The stream starts `lines` lines before the log's end: the anchor is among
            # them unless more than `slack` lines came since the catch-up.
            async with contextlib.aclosing(client.stream_log(self.submission_id, node, lines)) as stream:
                async for text in stream:
                    if not text:  # a quiet log: is the head there, has the job ended?
                        job = await self.jobs.call(self.jobs.job, self.address, self.submission_id)
                        if job is None or job.status not in JOB_ACTIVE:
                            self._complete = await self._catch_up(client, node, final=True)
                            return self._complete
                        quiet += 1
                        if quiet >= STREAM_QUIET_HEARTBEATS:
                            log.info("log stream of %s quiet for %d heartbeats; opening it again",
                                     self.submission_id, quiet)
                            break
                        continue
                    quiet = 0
                    if search is not None:
                        text = search.feed(text)
                        if text is None:
                            if search.lines > lines:  # the anchor scrolled past: more slack
                                slack = min(slack * 2, RESUME_LINES[1])
                                break
                            continue
                        self._stream.resume_after(self.position()[0], search.recent)
                        search = None
                    self._feed(text)

    async def _catch_up(self, client: TimedJobClient, node: str, final: bool = False) -> bool:
        """Parse what follows the cursor in the log's last lines, asking for more lines
        (doubling) while the anchor is not among them, at last (or once the tail would
        outgrow the cursor's bytes) for the whole log, which is then parsed from its
        start, skipping the cursor's bytes. False, logged, only when the whole log is
        shorter than the cursor (not the log the cursor counted)."""
        cursor, anchor = self.position()
        more = RESUME_LINES[0]
        while True:
            search = AnchorSearch(anchor)
            text, whole = await self.jobs.call(client.log_lines, self.submission_id, node,
                                                  search.k + more if more else -1)
            rest = search.feed(text)
            if rest is not None:
                self._stream.resume_after(cursor, search.recent)
                self._feed(rest, final=final)
                self.tail_resumes += 1
                return True
            if whole:
                break
            # The whole log costs the cursor's bytes more than the lines after it, which
            # must be read anyway: once a bigger tail would cost more, read it all.
            bigger = more * 2 <= RESUME_LINES[1] and 2 * len(text.encode()) < cursor
            more = more * 2 if bigger else 0
        log.warning("log of %s: the lines before byte %d are not among its last %d lines; "
                    "parsing the whole log, skipping those bytes", self.submission_id, cursor, RESUME_LINES[1])
        self.full_replays += 1
        self._replay_from_start()
        self._feed(text, final=final)
        if self._stream.offset >= self.skip:
            return True
        self._no_tail_at = cursor
        return False

    def _replay_from_start(self) -> None:
        """A websocket starts at byte 0: skip what was parsed (a partial line is read again)."""
        self.skip, self.anchor = self.position()
        self._stream = AnchoredStream(skip=self.skip)

    def _feed(self, chunk: str | bytes, final: bool = False) -> None:
        """Parse complete lines only (the trainer's own parser); a partial line waits for
        the next chunk, so the cursor saved in status always sits on a line boundary."""
        events = [event_dict(e) for e in self._stream.feed(chunk) + (self._stream.close() if final else [])]
        self._saw_last_event = self._saw_last_event or any(e.get("event") in LAST_EVENTS for e in events)
        self._pending.extend(events)
        if self._pending:
            self.wake.set()

    @property
    def cursor(self) -> int:
        """Bytes of the log read up to the last complete line."""
        return self._stream.offset

    def drain(self) -> list[dict]:
        """The events parsed since the last drain; `drained` moves to where they end."""
        events, self._pending = self._pending, []
        self.drained = self.position()
        return events

    async def finish(self, timeout: float = 15.0) -> None:
        """The job has ended: let the stream deliver its last lines (Ray closes the
        websocket when the job ends; the state API's stream is closed at once). If the
        websocket does not close in time, or was cancelled, read the rest once, from the
        cursor on (a bounded tail, or the whole log when its anchor is not found), so no
        final event (result, failure) is ever missed. Never raises the stream's own error
        or cancellation."""
        if self._task is None or self._finished:
            return
        if self._on_websocket:
            await asyncio.wait({self._task}, timeout=timeout)
        # A websocket that ended by itself delivered every line only if the trainer's
        # last event came: a proxy may close it cleanly just before the job ends.
        if self._task.done() and not self._task.cancelled() and self._task.exception() is None and (
                self._saw_last_event or self._complete):
            self._feed(b"", final=True)
            self._finished = True
            return
        log.info("log stream of %s was cut, still open %ss after the job ended or following a tail; "
                 "reading the rest", self.submission_id, timeout)
        await self.close()
        client = await self.jobs.call(self.jobs.client, self.address)
        if self._can_resume():
            node = await self.jobs.call(client.driver_node, self.submission_id)
            if node and await self._catch_up(client, node, final=True):
                self._finished = True
                return
        text = await self.jobs.call(client.get_job_logs, self.submission_id)
        client.received(len(text.encode()))
        self._replay_from_start()  # the whole log, from byte 0: what was read is skipped
        self._feed(text, final=True)
        self._finished = True

    def give_up(self) -> None:
        """The rest of the log cannot be had (its head does not give it): what was read is
        all there is, and `finish` does not try again."""
        self._finished = True

    async def close(self) -> None:
        """Stop following. Waits for the stream task without swallowing a cancellation of
        the caller itself."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
        self._on_websocket = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
