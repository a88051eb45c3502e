"""Thin adapter over Ray's Job API (JobSubmissionClient) plus an incremental log follower.

The client is synchronous (requests); callers run it in a thread. The log follower uses
the Job API's websocket tail, so each byte of a multi-megabyte log is parsed once, not on
every poll.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

from ray.job_submission import JobSubmissionClient

from tpufinetune.core.phases import JobView
from tpufinetune_trainer.events import parse_line

log = logging.getLogger(__name__)
LOG_TAIL_CHARS = 2000


# Ray's JobSubmissionClient replaces the address it is given with either of these when
# they are set; a stray one would send every run to one cluster.
ADDRESS_OVERRIDES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def drop_address_overrides(environ=os.environ) -> list[str]:
    """Remove Ray's address variables from this process: each run talks to its own
    cluster's head, always. Returns the names removed (logged once)."""
    removed = [name for name in ADDRESS_OVERRIDES if environ.pop(name, None) is not None]
    if removed:
        log.warning("ignoring %s: each run uses its own RayCluster's head address", ", ".join(removed))
    return removed


class RayJobs:
    """One JobSubmissionClient per dashboard address, created on first use."""

    def __init__(self, headers: dict | None = None):
        drop_address_overrides()
        self._headers = headers or {}
        self._clients: dict[str, JobSubmissionClient] = {}

    def client(self, address: str) -> JobSubmissionClient:
        if address not in self._clients:
            self._clients[address] = JobSubmissionClient(address, headers=self._headers)
        return self._clients[address]

    def forget(self, address: str) -> None:
        self._clients.pop(address, None)

    def job(self, address: str, submission_id: str) -> JobView | None:
        try:
            info = self.client(address).get_job_info(submission_id)
        except RuntimeError as error:
            if "404" in str(error) or "does not exist" in str(error):
                return None
            raise
        return JobView(status=str(info.status), message=info.message or "")

    def submit(self, address: str, submission_id: str, entrypoint: str, runtime_env: dict, metadata: dict) -> None:
        """Submit once. Ray refuses a second job with the same submission id; that refusal
        means an earlier submit (before a crash) went through, which is what we want."""
        try:
            self.client(address).submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                runtime_env=runtime_env or None,
                metadata=metadata or None,
            )
        except RuntimeError as error:
            if "already exists" not in str(error):
                raise
            log.info("job %s already submitted; attaching", submission_id)

    def stop(self, address: str, submission_id: str) -> None:
        try:
            self.client(address).stop_job(submission_id)
        except RuntimeError as error:
            if "404" not in str(error) and "does not exist" not in str(error):
                raise

    def log_tail(self, address: str, submission_id: str) -> str:
        """Last lines of the log, read once when a job failed without a failure event."""
        text = self.client(address).get_job_logs(submission_id)
        tail = text[-LOG_TAIL_CHARS:]
        return " | ".join(line.strip() for line in tail.splitlines()[-8:] if line.strip())


@dataclass
class LogFollower:
    """Follows one job's log over the Job API websocket and parses trainer events.

    `skip` bytes (the status' logCursor) are not parsed again after a restart: the
    stream replays the log from its start, and those events are already in status.
    """

    jobs: RayJobs
    address: str
    submission_id: str
    skip: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cursor: int = 0
    _partial: bytes = b""
    _pending: list = field(default_factory=list)
    _task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"logs-{self.submission_id}")

    async def _follow(self) -> None:
        while True:
            try:
                client = await asyncio.to_thread(self.jobs.client, self.address)
                async for chunk in client.tail_job_logs(self.submission_id):
                    self._feed(chunk)
                return  # the job ended and the stream closed
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the head may be briefly unreachable
                log.warning("log stream of %s interrupted: %s; reconnecting", self.submission_id, error)
                self.skip = max(self.skip, self.cursor)
                self.cursor, self._partial = 0, b""
                await asyncio.sleep(2)

    def _feed(self, chunk: str | bytes, final: bool = False) -> None:
        """Parse complete lines only; a partial line waits for the next chunk, so the
        cursor saved in status always sits on a line boundary."""
        self._partial += chunk.encode() if isinstance(chunk, str) else chunk
        *lines, self._partial = self._partial.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        for line in lines:
            start = self.cursor
            self.cursor += len(line) + 1
            if start < self.skip:
                continue
            event = parse_line(line.decode(errors="replace"))
            if event is not None:
                self._pending.append(event_dict(event))
        if self._pending:
            self.wake.set()

    @property
    def parsed_bytes(self) -> int:
        return self.cursor

    def drain(self) -> list[dict]:
        events, self._pending = self._pending, []
        return events

    async def finish(self, timeout: float = 15.0) -> None:
        """The job has ended: let the stream deliver its last lines (Ray closes it when
        the job ends). If it does not close in time, read the rest once from the full
        log, from the cursor on, so no final event (result, failure) is ever missed."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
            self._feed(b"", final=True)
            return
        except asyncio.TimeoutError:
            log.warning("log stream of %s still open %ss after the job ended; reading the rest", self.submission_id, timeout)
        await self.close()
        text = await asyncio.to_thread(self.jobs.client(self.address).get_job_logs, self.submission_id)
        self._partial = b""
        self._feed(text.encode()[self.cursor :], final=True)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


def event_dict(event) -> dict:
    """The parser's event as a plain dict (the pure core works on dicts)."""
    if isinstance(event, dict):
        return event
    for attr in ("as_dict", "to_dict"):
        if hasattr(event, attr):
            return getattr(event, attr)()
    return dict(event.fields, event=event.kind)
