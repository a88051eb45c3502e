"""Notices of a run's end (spec.notify): which are due, the CloudEvent each one is, its HTTP
message, the retry delays, and their record in status.notifications. Pure: delivery is
adapters/notify.py's.

Only sinks the cluster admin configured (TPUFT_NOTIFY_SINKS_FILE) are ever called: a run
names a sink, never a URL, so its spec cannot make the operator request an address of the
user's choice.

Each sink says which namespaces may use it (`namespaces`); a run in any other namespace
is told the sink is not configured for it, never which sinks are.

A notice is (sink, event, attempt). Its CloudEvent id is derived from the run's uid, the
event and the attempt, so a receiver can drop a repeat. A sink is sent its notices one at a
time, in order (each attempt's end, then the run's end), so what it has been sent is a
high-water mark: per sink and event, the highest attempt whose notice is Delivered or
Failed. status.notifications always keeps each mark's record (and fills the rest of its 50
with the newest others), so an operator restart or a new leader sends nothing again, and
the record stays bounded whatever the number of attempts and sinks.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from .apimodels import _list_map, _Model
from .names import GROUP, PLURAL, VERSION

NoticeEvent = Literal["Succeeded", "Failed", "AttemptEnded"]
NOTICE_EVENTS: tuple[str, ...] = NoticeEvent.__args__  # type: ignore[attr-defined]
# What a subscription without `events` is sent: the run's end, either way.
DEFAULT_NOTICE_EVENTS: tuple[str, ...] = ("Succeeded", "Failed")
EVENT_TYPES = {"Succeeded": f"{GROUP}.run.succeeded", "Failed": f"{GROUP}.run.failed",
               "AttemptEnded": f"{GROUP}.attempt.ended"}
# Delivery: the first retry after RETRY_BASE_S, each next one twice as late, at most
# RETRY_CAP_S apart; after MAX_DELIVERY_TRIES tries the notice is Failed (about 4 minutes).
RETRY_BASE_S = 1.0
RETRY_CAP_S = 60.0
MAX_DELIVERY_TRIES = 8
# status.notifications keeps at most this many records: every (sink, event)'s high-water
# mark (at most 8 sinks x 3 events from one spec), then the newest others.
NOTIFICATIONS_LIMIT = 50
SINK_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ALL_NAMESPACES = "*"  # a sink's `namespaces` entry that opens it to every namespace
NAMESPACE_GLOB = r"^[a-z0-9*?]([-a-z0-9*?]{0,61}[a-z0-9*?])?$"  # a namespace name, or one with * and ?
# A status record's final states: such a notice is never sent again.
FINAL_STATES = ("Delivered", "Failed")


class NotifySubscription(_Model):
    """One entry of spec.notify: a sink the cluster admin configured, by name, and the
    events it is sent."""

    sink: str = Field(min_length=1, max_length=63, pattern=SINK_NAME,
                      description="Name of a sink configured in the operator's settings "
                                  "(TPUFT_NOTIFY_SINKS_FILE, Helm value notify.sinks) for this "
                                  "namespace; never a URL. A name not configured for the namespace "
                                  "is shown in status.notifications and a Warning Event.")
    # No schema default: the default (DEFAULT_NOTICE_EVENTS) is applied where it is read.
    events: list[NoticeEvent] | None = Field(  # type: ignore[valid-type]
        None, min_length=1, max_length=len(NOTICE_EVENTS),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="What is sent: Succeeded, Failed (the run's end), AttemptEnded (each "
                    "attempt's end, a retried one included). Unset: Succeeded and Failed.")

    @field_validator("events")
    @classmethod
    def _once_each(cls, events):
        if events is not None and len(set(events)) != len(events):
            raise ValueError("names an event twice; list each once")
        return events


# spec.notify's schema: at most 8 sinks, each named once.
NOTIFY_FIELD = dict(max_length=8, json_schema_extra=_list_map("sink"))


class SinksError(ValueError):
    """The sinks file is not valid; the message names the field and what to write."""


class Sink(BaseModel):
    """One admin-configured destination. `webhook`: an HTTP POST of the CloudEvent as JSON
    (structured mode, Content-Type application/json). `cloudevents`: the CloudEvents HTTP
    binding, `binary` (ce-* headers, the summary as the body) or `structured`
    (application/cloudevents+json)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel,
                              populate_by_name=True)

    name: str = Field(min_length=1, max_length=63, pattern=SINK_NAME)
    type: Literal["webhook", "cloudevents"]
    url: str = Field(min_length=1, max_length=2048)
    mode: Literal["binary", "structured"] = "binary"
    # A file holding a bearer token (a Secret of the operator's namespace, mounted): read
    # at each delivery, so a rotated Secret is used without a restart.
    token_file: str = ""
    # The namespaces whose runs may name it: names or globs (`team-*`; "*": every
    # namespace). Required: the sink's token and the text a run puts in its notices reach
    # only the teams the admin chose.
    namespaces: tuple[str, ...] = Field(min_length=1, max_length=256)

    @field_validator("namespaces")
    @classmethod
    def _namespace_names(cls, namespaces: tuple[str, ...]) -> tuple[str, ...]:
        for name in namespaces:
            if not re.match(NAMESPACE_GLOB, name):
                raise ValueError(f"{name!r} is not a namespace name or glob; list namespaces by name "
                                 f"(team-a), by glob (team-*), or {ALL_NAMESPACES!r} for every namespace")
        return namespaces

    def allows(self, namespace: str) -> bool:
        """Whether a run in `namespace` may name this sink."""
        return any(fnmatchcase(namespace, pattern) for pattern in self.namespaces)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError("must be an http:// or https:// URL")
        return url


class _SinksFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sinks: list[Sink] = Field(default_factory=list, max_length=64)


def parse_sinks(text: str, source: str = "the sinks file") -> dict[str, Sink]:
    """The sinks of a YAML or JSON document
    `{sinks: [{name, type, url, mode, tokenFile, namespaces}]}`, by name; SinksError naming
    the field if it is not valid."""
    try:
        document = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as error:
        raise SinksError(f"{source}: not YAML or JSON: {error}") from None
    try:
        sinks = _SinksFile.model_validate(document or {}).sinks
    except ValidationError as error:
        first = error.errors()[0]
        path = ".".join(str(part) for part in first["loc"])
        raise SinksError(f"{source}: {path}: {first['msg']} (write e.g. sinks: [{{name: team, "
                         f"type: webhook, url: https://hooks.example.com/x, namespaces: [team-a]}}])") from None
    by_name: dict[str, Sink] = {}
    for sink in sinks:
        if sink.name in by_name:
            raise SinksError(f"{source}: sink {sink.name!r} is named twice; give each a name of its own")
        by_name[sink.name] = sink
    return by_name


@dataclass(frozen=True)
class Notice:
    sink: str
    event: str  # one of NOTICE_EVENTS
    attempt: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.sink, self.event, self.attempt)


def event_id(uid: str, event: str, attempt: int) -> str:
    """The same for every send of one notice (a receiver's dedupe key), and for every sink."""
    return f"{uid}.{event}.{attempt}"


def due_notices(subscriptions, status: dict) -> list[Notice]:
    """The notices the run's status calls for and its sink has not settled: above the sink's
    high-water mark for the event (`marks`). `subscriptions`: (sink, events or None) pairs
    from spec.notify. Each sink's in the order it is sent: by attempt, an attempt's end
    before the run's."""
    wanted = sorted(happened(status), key=lambda found: (found[1], found[0] != "AttemptEnded"))
    settled = marks(status.get("notifications") or ())
    return [Notice(sink, event, attempt) for sink, events in subscriptions for event, attempt in wanted
            if event in (events or DEFAULT_NOTICE_EVENTS) and attempt > settled.get((sink, event), -1)]


def next_per_sink(due: list[Notice], busy) -> list[Notice]:
    """What may be sent now: each sink's first due notice, unless a notice of that sink is
    being sent or its outcome is not yet written (`busy`: notice keys). One at a time per
    sink, so a notice settled is always its sink's high-water mark for its event."""
    blocked = {key[0] for key in busy}
    sendable = []
    for notice in due:
        if notice.sink not in blocked:
            sendable.append(notice)
            blocked.add(notice.sink)
    return sendable


def marks(records) -> dict[tuple[str, str], int]:
    """Per (sink, event): the highest attempt whose notice is Delivered or Failed."""
    found: dict[tuple[str, str], int] = {}
    for record in records:
        if record.get("state") in FINAL_STATES:
            sink, event, attempt = _record_key(record)
            found[(sink, event)] = max(found.get((sink, event), -1), attempt)
    return found


def happened(status: dict) -> list[tuple[str, int]]:
    """(event, attempt) of each notice-worthy thing the status shows: every ended attempt
    it still lists, and the run's end."""
    found = [("AttemptEnded", int(a["attempt"])) for a in status.get("attempts") or ()
             if a.get("endTime") and a.get("attempt")]
    if status.get("phase") in ("Succeeded", "Failed"):
        found.append((status["phase"], int(status.get("attempt") or 0)))
    return found


def cloud_event(notice: Notice, name: str, namespace: str, uid: str, status: dict) -> dict:
    """The CloudEvent (v1.0, as a JSON-ready dict) of one notice. Built from status alone,
    so a resend after a restart carries the same attributes and summary."""
    attempt = _attempt(status, notice.attempt)
    ended = notice.event == "AttemptEnded"
    condition = next((c for c in status.get("conditions") or () if c.get("type") == notice.event), {})
    usage = (attempt if ended else status).get("usage") or {}
    data = {
        "name": name, "namespace": namespace, "uid": uid,
        "phase": status.get("phase"),
        "attempt": notice.attempt,
        "reason": attempt.get("reason") if ended else condition.get("reason") or attempt.get("reason"),
        "message": ((attempt if ended else status).get("message") or "")[:1024],
        "loss": status.get("loss"),
        "evalLoss": status.get("evalLoss"),
        "chipHours": usage.get("chipHours"),
        "checkpointURI": status.get("checkpointURI"),
        "exportedModelURI": status.get("exportedModelURI"),
        "exportedAdapterURI": status.get("exportedAdapterURI"),
        "logsURI": attempt.get("logsURI"),
    }
    time = attempt.get("endTime") if ended else status.get("completionTime") or attempt.get("endTime")
    event = {
        "specversion": "1.0",
        "id": event_id(uid, notice.event, notice.attempt),
        "source": f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}",
        "type": EVENT_TYPES[notice.event],
        "subject": name,
        "datacontenttype": "application/json",
        "data": {k: v for k, v in data.items() if v is not None},
    }
    if time:
        event["time"] = time
    return event


def _attempt(status: dict, number: int) -> dict:
    return next((a for a in status.get("attempts") or () if a.get("attempt") == number), {})


def webhook_message(event: dict) -> tuple[dict[str, str], bytes]:
    """(headers, body) of the POST that carries `event` to a `webhook` sink: the whole
    event as plain JSON. A `cloudevents` sink gets the CloudEvents SDK's HTTP binding
    (adapters/notify.py)."""
    return {"Content-Type": "application/json"}, json.dumps(event, separators=(",", ":")).encode()


def retry_delay(failed_tries: int, base: float = RETRY_BASE_S, cap: float = RETRY_CAP_S) -> float:
    """Seconds before the next try after `failed_tries` (>= 1) failed ones: exponential."""
    return min(cap, base * 2 ** (max(1, failed_tries) - 1))


def retryable(code: int | None) -> bool:
    """A failed try worth another: no answer, a server error, a timeout or throttling. Any
    other refusal (a wrong URL, a refused token) will be refused again."""
    return code is None or code >= 500 or code in (408, 429)


def _record_key(record: dict) -> tuple[str, str, int]:
    return (record.get("sink", ""), record.get("event", ""), int(record.get("attempt") or 0))


def with_records(status: dict, records) -> list[dict]:
    """status.notifications with `records` (each one notice's latest state) put in place of
    the same notice's, newest last. A final record is never replaced by a later non-final
    one (a stale try's report), nor is a non-final one added at or below its mark. Bounded
    to NOTIFICATIONS_LIMIT: the oldest records go first, each (sink, event)'s mark last."""
    kept = {_record_key(r): r for r in status.get("notifications") or ()}
    for record in records:
        key = _record_key(record)
        old = kept.get(key)
        if record.get("state") not in FINAL_STATES and (
                (old is not None and old.get("state") in FINAL_STATES)
                or key[2] <= marks(kept.values()).get(key[:2], -1)):
            continue
        kept.pop(key, None)
        kept[key] = record
    ordered = list(kept.values())
    excess = len(ordered) - NOTIFICATIONS_LIMIT
    if excess <= 0:
        return ordered
    settled = marks(ordered)
    is_mark = [r.get("state") in FINAL_STATES and _record_key(r)[2] == settled[_record_key(r)[:2]]
               for r in ordered]
    dropped = set()
    for keep_marks in (True, False):
        for index, record in enumerate(ordered):
            if excess and index not in dropped and not (keep_marks and is_mark[index]):
                dropped.add(index)
                excess -= 1
    return [r for index, r in enumerate(ordered) if index not in dropped]
