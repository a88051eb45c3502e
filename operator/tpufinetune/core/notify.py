"""Notices of a run's end (spec.notify): which are due, the CloudEvent each one is, its HTTP
message, the retry delays, and their record in status.notifications. Pure: delivery is
adapters/notify.py's.

Only sinks the cluster admin configured (TPUFT_NOTIFY_SINKS_FILE) are ever called: a run
names a sink, never a URL, so its spec cannot make the operator request an address of the
user's choice.

A notice is (sink, event, attempt). Its CloudEvent id is derived from the run's uid, the
event and the attempt, so a receiver can drop a repeat; status.notifications is the record
of what was delivered, so an operator restart or a new leader does not send it again.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
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
# status.notifications keeps the newest this many records.
NOTIFICATIONS_LIMIT = 50
SINK_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A status record's final states: such a notice is never sent again.
FINAL_STATES = ("Delivered", "Failed")


class NotifySubscription(_Model):
    """One entry of spec.notify: a sink the cluster admin configured, by name, and the
    events it is sent."""

    sink: str = Field(min_length=1, max_length=63, pattern=SINK_NAME,
                      description="Name of a sink configured in the operator's settings "
                                  "(TPUFT_NOTIFY_SINKS_FILE, Helm value notify.sinks); never a URL. "
                                  "A name not configured is shown in status.notifications and a "
                                  "Warning Event.")
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
    """The sinks of a YAML or JSON document `{sinks: [{name, type, url, mode, tokenFile}]}`,
    by name; SinksError naming the field if it is not valid."""
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
                         f"type: webhook, url: https://hooks.example.com/x}}])") from None
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
    """The notices the run's status calls for and status.notifications does not hold as
    Delivered or Failed. `subscriptions`: (sink, events or None) pairs from spec.notify."""
    wanted = happened(status)
    done = {_record_key(r) for r in status.get("notifications") or () if r.get("state") in FINAL_STATES}
    due = []
    for sink, events in subscriptions:
        for event, attempt in wanted:
            notice = Notice(sink, event, attempt)
            if event in (events or DEFAULT_NOTICE_EVENTS) and notice.key not in done:
                due.append(notice)
    return due


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
    the same notice's, newest last, bounded to NOTIFICATIONS_LIMIT. A final record is never
    replaced by a later non-final one (a stale try's report)."""
    kept = {_record_key(r): r for r in status.get("notifications") or ()}
    for record in records:
        old = kept.get(_record_key(record))
        if old is not None and old.get("state") in FINAL_STATES:
            continue
        kept.pop(_record_key(record), None)
        kept[_record_key(record)] = record
    return list(kept.values())[-NOTIFICATIONS_LIMIT:]
