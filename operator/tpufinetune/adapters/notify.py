"""Delivers spec.notify's notices (core/notify.py) to the admin's sinks, off the reconcile
loop: a bounded queue served by a few threads, each notice retried with exponential
backoff. Every try's outcome goes back to its run (RunNotices), whose next status write
records it in status.notifications.

The queue holds at most QUEUE_LIMIT notices (waiting or between retries); a notice that
finds it full is not lost: it stays due, and the run offers it again at its next step.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tpufinetune.adapters import metrics
from tpufinetune.core import notify
from tpufinetune.core.conditions import timestamp

log = logging.getLogger(__name__)
QUEUE_LIMIT = 1000  # notices held at once, across runs and sinks
SENDERS = 4  # threads sending: one slow sink holds one of them, not the others
SEND_TIMEOUT_S = 10.0  # one try: connect and answer


@dataclass(order=True)
class Delivery:
    due: float  # time.monotonic() of its next try
    order: int
    notice: notify.Notice = field(compare=False)
    sink: notify.Sink = field(compare=False)
    event: dict = field(compare=False)
    report: Callable[[dict], None] = field(compare=False)
    tries: int = field(default=0, compare=False)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # The admin's URL is the only one called: a redirect is an answer, not a new address.
    def redirect_request(self, *args, **kwargs):
        return None


class Notifier:
    """The operator's sinks and its delivery queue. `post` sends one try and returns the
    HTTP status (None: no answer) and an error text; tests may pass their own clock."""

    def __init__(self, sinks: dict[str, notify.Sink], limit: int = QUEUE_LIMIT, senders: int = SENDERS,
                 retry_base: float = notify.RETRY_BASE_S, retry_cap: float = notify.RETRY_CAP_S,
                 max_tries: int = notify.MAX_DELIVERY_TRIES, sinks_error: str = ""):
        self.sinks = sinks
        self.sinks_error = sinks_error  # the sinks file could not be read: every notice says why
        self.limit = limit
        self.retry_base, self.retry_cap, self.max_tries = retry_base, retry_cap, max_tries
        self._heap: list[Delivery] = []
        self._held = 0  # queued + being sent
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._threads = [threading.Thread(target=self._serve, name=f"notify-{i}", daemon=True)
                         for i in range(senders)]
        for thread in self._threads:
            thread.start()

    def offer(self, notice: notify.Notice, event: dict, report: Callable[[dict], None]) -> bool:
        """Queue one notice; False (nothing queued) when the queue is full. Never blocks."""
        sink = self.sinks[notice.sink]
        with self._cond:
            if self._held >= self.limit or self._closed:
                return False
            self._held += 1
            heapq.heappush(self._heap, Delivery(time.monotonic(), next(self._order), notice, sink, event, report))
            self._cond.notify()
        return True

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0].due > time.monotonic()):
                    self._cond.wait(timeout=(self._heap[0].due - time.monotonic()) if self._heap else None)
                if self._closed:
                    return
                delivery = heapq.heappop(self._heap)
            self._try(delivery)

    def _try(self, delivery: Delivery) -> None:
        delivery.tries += 1
        code, error = self.post(delivery.sink, delivery.event)
        delivered = code is not None and 200 <= code < 300
        final = delivered or not notify.retryable(code) or delivery.tries >= self.max_tries
        state = "Delivered" if delivered else "Failed" if final else "Pending"
        metrics.notice_tried(delivery.sink.name, state)
        record = _record(delivery.notice, delivery.event, state, delivery.tries, "" if delivered else error)
        if not final:
            delivery.due = time.monotonic() + notify.retry_delay(delivery.tries, self.retry_base, self.retry_cap)
        with self._cond:
            if final:
                self._held -= 1
            else:
                heapq.heappush(self._heap, delivery)
                self._cond.notify()
        if not delivered:
            log.log(logging.WARNING if final else logging.INFO, "notice %s to sink %s, try %d: %s",
                    delivery.event["id"], delivery.sink.name, delivery.tries, error)
        try:
            delivery.report(record)
        except Exception:  # the run's loop is gone (the operator stops): nothing to tell
            log.debug("notice outcome not reported", exc_info=True)

    def post(self, sink: notify.Sink, event: dict) -> tuple[int | None, str]:
        headers, body = http_message(event, sink)
        if sink.token_file:
            try:
                headers["Authorization"] = "Bearer " + Path(sink.token_file).read_text().strip()
            except OSError as error:
                return None, f"cannot read the token file {sink.token_file}: {error.strerror or error}"
        request = urllib.request.Request(sink.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=SEND_TIMEOUT_S) as answer:
                return answer.status, ""
        except urllib.error.HTTPError as refusal:
            return refusal.code, f"HTTP {refusal.code} {refusal.reason}"
        except (OSError, ValueError) as error:  # refused, unreachable, timed out, TLS
            return None, str(getattr(error, "reason", None) or error) or type(error).__name__


def http_message(event: dict, sink: notify.Sink) -> tuple[dict[str, str], bytes]:
    """(headers, body) of the POST that carries `event` (core/notify.cloud_event) to `sink`:
    for a `cloudevents` sink, the CloudEvents SDK's HTTP protocol binding in the sink's mode
    (binary: ce-* headers and the summary as the body; structured: the whole event as
    application/cloudevents+json); for a `webhook`, the event as plain JSON."""
    if sink.type != "cloudevents":
        return notify.webhook_message(event)
    from cloudevents.core.bindings import http as binding
    from cloudevents.core.formats.json import JSONFormat
    from cloudevents.core.v1.event import CloudEvent

    attributes = {key: value for key, value in event.items() if key != "data"}
    if "time" in attributes:  # the SDK takes a datetime and writes RFC 3339 itself
        attributes["time"] = datetime.fromisoformat(attributes["time"].replace("Z", "+00:00"))
    to_message = binding.to_binary if sink.mode == "binary" else binding.to_structured
    message = to_message(CloudEvent(attributes, event["data"]), JSONFormat())
    return dict(message.headers), message.body


def _record(notice: notify.Notice, event: dict, state: str, tries: int, error: str) -> dict:
    record = {"sink": notice.sink, "event": notice.event, "attempt": notice.attempt, "id": event["id"],
              "state": state, "tries": tries, "time": timestamp(datetime.now(timezone.utc))}
    if error:
        record["lastError"] = error[:512]
    return record


_NOTIFIERS: dict[str, Notifier] = {}
_NOTIFIERS_LOCK = threading.Lock()


def notifier_for(sinks_file: str) -> Notifier:
    """The operator's one Notifier for its sinks file (read once; a change needs a restart)."""
    with _NOTIFIERS_LOCK:
        if sinks_file not in _NOTIFIERS:
            sinks, error = {}, ""
            if sinks_file:
                try:  # no file (a run outside a cluster, nothing mounted): no sinks
                    sinks = {} if not Path(sinks_file).exists() else notify.parse_sinks(Path(sinks_file).read_text(), f"TPUFT_NOTIFY_SINKS_FILE ({sinks_file})")
                except OSError as failure:
                    error = f"TPUFT_NOTIFY_SINKS_FILE: cannot read {sinks_file}: {failure.strerror or failure}"
                except notify.SinksError as failure:
                    error = str(failure)
                if error:
                    log.error("%s; no notice can be delivered until it is fixed and the operator restarted", error)
            _NOTIFIERS[sinks_file] = Notifier(sinks, sinks_error=error)
        return _NOTIFIERS[sinks_file]


class RunNotices:
    """One run's side: offers its due notices after each status write and keeps the
    outcomes its next write records. Outcomes arrive on sender threads; `wake` (the run's
    asyncio.Event) is set on the run's loop so the write follows at once."""

    def __init__(self, notifier: Notifier, wake: asyncio.Event):
        self.notifier = notifier
        self.wake = wake
        self._lock = threading.Lock()
        self._outcomes: dict[tuple, dict] = {}
        self._in_flight: set[tuple] = set()
        self._unoffered = False  # a due notice found the queue full
        self._loop: asyncio.AbstractEventLoop | None = None

    def records(self) -> list[dict]:
        """The outcomes not yet written, taken: the caller writes them."""
        with self._lock:
            taken, self._outcomes = list(self._outcomes.values()), {}
        return taken

    def put_back(self, records: list[dict]) -> None:
        """Outcomes whose write failed: written with the next one (a newer one wins)."""
        with self._lock:
            for record in records:
                self._outcomes.setdefault((record["sink"], record["event"], record["attempt"]), record)

    def waiting(self) -> bool:
        """Notices queued, unwritten outcomes, or due notices the full queue refused."""
        with self._lock:
            return bool(self._in_flight or self._outcomes or self._unoffered)

    def offer_due(self, ident, subscriptions, status: dict, record_event) -> None:
        """Queue each sink's next due notice (core/notify.next_per_sink: one at a time per
        sink, in order). A sink not configured for the run's namespace (or a sinks file that
        is not valid) fails its due notices at once, with one Warning Event that names no
        other sink."""
        with self._lock:  # an outcome not yet written is not due again
            busy = self._in_flight | self._outcomes.keys()
        due = notify.due_notices(subscriptions, status)
        refused = [n for n in due if n.key not in busy and self._refusal(n.sink, ident.namespace)]
        sendable = notify.next_per_sink([n for n in due if not self._refusal(n.sink, ident.namespace)], busy)
        self._unoffered = False
        if not (refused or sendable):
            return
        self._loop = asyncio.get_running_loop()
        told = set()
        for notice in refused:
            why = self._refusal(notice.sink, ident.namespace)
            event = notify.cloud_event(notice, ident.name, ident.namespace, ident.uid, status)
            self._report(_record(notice, event, "Failed", 0, why))
            if notice.sink not in told:
                told.add(notice.sink)
                record_event(ident, "Warning", "NotifySinksInvalid" if self.notifier.sinks_error
                             else "NotifySinkUnknown", why[:1024])
        for notice in sendable:
            event = notify.cloud_event(notice, ident.name, ident.namespace, ident.uid, status)
            with self._lock:
                self._in_flight.add(notice.key)
            if not self.notifier.offer(notice, event, self._report):
                with self._lock:
                    self._in_flight.discard(notice.key)
                self._unoffered = True
                log.warning("%s/%s: the notice queue is full (%d); notice %s waits for the next step",
                            ident.namespace, ident.name, self.notifier.limit, event["id"])

    def _refusal(self, sink: str, namespace: str) -> str:
        """Why a run in `namespace` may not send to `sink` ('' if it may). The same words
        whether the sink does not exist or is another namespace's: a tenant learns no
        other sink's name."""
        if self.notifier.sinks_error:
            return ("the operator's sinks file (TPUFT_NOTIFY_SINKS_FILE) is not valid, so no notice "
                    "can be sent; the cluster admin finds why in the operator's log")
        configured = self.notifier.sinks.get(sink)
        if configured is not None and configured.allows(namespace):
            return ""
        return (f"sink {sink!r} is not configured for namespace {namespace!r} in the operator's "
                "TPUFT_NOTIFY_SINKS_FILE; ask the cluster admin to add it, or to list this "
                "namespace in its namespaces, or remove it from spec.notify")

    def _report(self, record: dict) -> None:
        key = (record["sink"], record["event"], record["attempt"])
        with self._lock:
            self._outcomes[key] = record
            if record["state"] in notify.FINAL_STATES:
                self._in_flight.discard(key)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.wake.set)
            except RuntimeError:  # closed in between
                pass
