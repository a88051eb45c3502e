"""The status side of a run (a part of driver.Run): every status write is conditional on
the resourceVersion last read or written, spaced within a phase, and counted by the
operator's progress tracker (core/progress.py); a failed write makes the next step re-read
the object first. The trainer events drained but not yet written are kept, bounded.

A new run's first write waits for kopf's own first writes (settle). A mixin: Run provides
`status`, `resource_version`, `status_stale`, `progress`, `backend`, `ident`, `settings`,
`unwritten`, `_last_write`, `body`, `wake`, `settling`, `status_taken` and `being_deleted`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import datetime, timezone

from tpufinetune.core.errors import StatusConflict
from tpufinetune.core.progress import recovered
from tpufinetune.core.skew import status_patch
from tpufinetune.core.status import checked_status
from tpufinetune.runray import _one_line

log = logging.getLogger(__name__)
# Trainer events drained but not yet in a written status (its writes refused) are kept up
# to this many: beyond it the oldest progress events go first (each newer one says more),
# then the oldest of any kind, with a warning. A run whose writes are refused for hours
# holds a bounded list, not every line its trainer printed.
UNWRITTEN_LIMIT = 1000
# A status write refused as a conflict (another writer came first) is retried after a
# re-read, at once the first time, then after this many seconds, doubling (with jitter),
# up to the poll interval.
CONFLICT_BACKOFF_S = 0.1
# A new run's first status write waits at most this long for kopf's own first writes (in a
# burst they queue behind its other requests for seconds: its connections are bounded).
KOPF_SETTLE_S = 10.0


class RunStatus:
    """Status reads and writes of one run (see the module)."""

    async def settle(self, done, stopped, most: float = KOPF_SETTLE_S) -> None:
        """Before a new run's first step: wait, at most `most` seconds, until `done()` (kopf
        has written its finalizer and status.kopf to the object). Those writes land while
        the daemon starts, and a status write made before them is refused as stale (409),
        re-read and made again: twice a run, a GET and a PATCH each, thousands in a burst."""
        deadline = asyncio.get_running_loop().time() + most
        self.settling = True
        try:
            while not done() and not stopped.is_set() and not self.being_deleted():
                self.wake.clear()
                remaining = deadline - asyncio.get_running_loop().time()
                if done() or remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self.wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        finally:
            self.settling = False
        if done():
            # Nothing of ours is written yet: the live body is the newest read there is.
            self.status = {k: v for k, v in (self.body.get("status") or {}).items() if k != "kopf"}
            self.resource_version = str(self.body["metadata"].get("resourceVersion") or "")
        self.status_taken = True

    def keep_unwritten(self, events) -> None:
        """Events drained from the log follower, held until a status write takes them."""
        self.unwritten.extend(events)
        over = len(self.unwritten) - UNWRITTEN_LIMIT
        if over <= 0:
            return
        progress = [i for i, e in enumerate(self.unwritten) if e.get("event") == "progress"][:over]
        dropped = set(progress) | set(range(over - len(progress)))
        self.unwritten = [e for i, e in enumerate(self.unwritten) if i not in dropped]
        if len(progress) < over:
            log.warning("%s/%s: %d trainer events dropped: the status has not been written for %d events",
                        self.ident.namespace, self.ident.name, over - len(progress), UNWRITTEN_LIMIT)

    async def _reread_status(self) -> None:
        """After a failed write our copy may not be what the object holds (the write may
        even have landed): decide from what the API server says."""
        try:
            found = await self.backend.read_status(self.ident)
        except Exception as error:
            self._status_failed(error)
            raise
        self.progress.reached(time.monotonic())
        if found is None:
            self.object_gone = True  # deleted, its finalizer gone: nothing left to write to
        else:
            status, self.resource_version = found
            self.status = {k: v for k, v in status.items() if k != "kopf"}
        self.status_stale = False

    async def _write(self, new: dict) -> None:
        # A misspelt key fails here, not in silence at the API server; keys read back
        # (a newer operator's) are carried, not checked.
        failing = self.progress.failing.get(self.progress_key)
        if failing is not None:  # written with the first write that lands (core/progress.py)
            recovered(new, failing, datetime.now(timezone.utc), time.monotonic())
        checked_status(new, self.status)
        patch = status_patch(self.status, new)
        if patch:
            await self._space_writes(transition=new.get("phase") != self.status.get("phase"))
            try:
                self.resource_version = await self.backend.write_status(
                    self.ident, patch, new, self.resource_version)
                self.progress.reached(time.monotonic())
            except BaseException as error:
                self.status_stale = True
                if getattr(error, "status", None) == 404:
                    # The object is gone (deleted, its finalizer removed): not a write that
                    # fails, and no Event can be attached to it; the loop ends (Run.run).
                    self.object_gone = True
                # A conflict is another writer's newer version, not a stall: re-read, go on.
                elif isinstance(error, Exception) and not isinstance(error, StatusConflict):
                    self._status_failed(error)
                raise
        self.status = new
        self.progress.written(self.progress_key)

    @property
    def progress_key(self) -> tuple[str, str, str]:
        return (self.ident.namespace, self.ident.name, self.ident.uid)

    def _status_failed(self, error: Exception) -> None:
        code = getattr(error, "status", None)
        # The API server answered and refused this object (admission, a rejected value,
        # RBAC on its namespace): the run's own trouble. No answer, a 5xx, the operator's
        # own credentials (401) or throttling are the operator's (core/progress.py).
        own = isinstance(code, int) and 400 <= code < 500 and code not in (401, 408, 429)
        message = _one_line(error)
        if self.progress.failed(self.progress_key, time.monotonic(), message, own=own):
            self.backend.record(self.ident, "Warning", "StatusWriteFailing",
                                f"the operator cannot write this run's status ({message}); it keeps "
                                "trying, and the run goes on")

    async def _space_writes(self, transition: bool) -> None:
        """At most one status write per TPUFT_STATUS_WRITE_INTERVAL for one run within a
        phase: a chatty trainer's events wait a moment and go together (the API server and
        etcd see each write). A write that changes the phase goes at once: a run has a
        handful of transitions, and each one spaced would hold its RayCluster's creation
        (New -> Pending -> Provisioning) a second or two."""
        now = time.monotonic()
        wait = self._last_write + self.settings.status_write_interval - now
        if wait > 0 and not transition:
            await asyncio.sleep(wait)
        self._last_write = max(now, time.monotonic())


def conflict_backoff(conflicts: int, most: float) -> float:
    """Seconds to wait before the step after `conflicts` conflicts in a row: none after the
    first (a re-read usually settles it), then CONFLICT_BACKOFF_S doubling with jitter, up
    to `most` (the poll interval)."""
    if conflicts <= 1:
        return 0.0
    return min(most, CONFLICT_BACKOFF_S * 2 ** (conflicts - 2)) * random.uniform(0.5, 1.0)
