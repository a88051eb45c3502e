"""spec.notify, the sinks file, and the notices' CloudEvents (core/notify.py): pure."""
import pytest

from tpufinetune.core import notify
from tpufinetune.core.api import SpecError, parse_spec
from tpufinetune.core.status import checked_status

SPEC = {"tpu": {"generation": "cpu", "topology": "2"}, "image": "trainer:1",
        "checkpoint": {"storagePath": "gs://b/runs"}}
UID = "0b7c5c1e-1111-2222-3333-444455556666"
ENDED = {
    "phase": "Succeeded", "attempt": 2, "loss": 1.25, "evalLoss": 1.5,
    "checkpointURI": "gs://b/run/ckpt-3", "exportedModelURI": "gs://b/run/export",
    "completionTime": "2026-12-05T01:00:00Z", "usage": {"chipHours": 3.5},
    "conditions": [{"type": "Succeeded", "status": "True", "reason": "JobSucceeded", "message": "",
                    "lastTransitionTime": "2026-12-05T01:00:00Z"}],
    "attempts": [
        {"attempt": 1, "startTime": "2026-12-05T00:00:00Z", "endTime": "2026-12-05T00:30:00Z",
         "reason": "Preempted", "usage": {"chipHours": 1.0}},
        {"attempt": 2, "startTime": "2026-12-05T00:31:00Z", "endTime": "2026-12-05T01:00:00Z",
         "reason": "Succeeded", "usage": {"chipHours": 2.5}, "logsURI": "gs://b/run/logs/attempt-2/"},
    ],
}
WEBHOOK = notify.Sink(name="team", type="webhook", url="http://hooks.example/x")


def test_notify_names_sinks_and_events_with_no_default_written():
    spec = parse_spec({**SPEC, "notify": [{"sink": "team"}, {"sink": "ops", "events": ["AttemptEnded"]}]})
    assert [(s.sink, s.events) for s in spec.notify] == [("team", None), ("ops", ["AttemptEnded"])]
    assert parse_spec(SPEC).notify is None


@pytest.mark.parametrize("notify_field, words", [
    ([{"sink": "https://evil.example/x"}], "spec.notify[0].sink"),
    ([{"sink": "team", "events": ["Running"]}], "spec.notify[0].events[0]"),
    ([{"sink": "team", "events": ["Failed", "Failed"]}], "names an event twice"),
    ([{"sink": "team", "url": "http://x"}], "spec.notify[0].url: unknown field"),
])
def test_a_bad_notify_entry_is_refused_naming_the_field(notify_field, words):
    with pytest.raises(SpecError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_spec({**SPEC, "notify": notify_field})


def test_the_sinks_file_is_parsed_and_its_mistakes_named():
    sinks = notify.parse_sinks("sinks:\n- {name: team, type: webhook, url: 'https://h.example/x', "
                               "tokenFile: /var/run/t}\n- {name: bus, type: cloudevents, "
                               "url: 'http://broker.ns.svc', mode: structured}\n")
    assert sinks["team"].token_file == "/var/run/t" and sinks["bus"].mode == "structured"
    assert notify.parse_sinks("") == {}
    with pytest.raises(notify.SinksError, match=r"sinks.0.url: .*http:// or https://"):
        notify.parse_sinks('{"sinks": [{"name": "a", "type": "webhook", "url": "file:///etc/passwd"}]}')
    with pytest.raises(notify.SinksError, match="named twice"):
        notify.parse_sinks("sinks: [{name: a, type: webhook, url: 'http://x'}, "
                           "{name: a, type: webhook, url: 'http://y'}]")
    with pytest.raises(notify.SinksError, match="sinks.0.type"):
        notify.parse_sinks("sinks: [{name: a, type: slack, url: 'http://x'}]")


def test_due_notices_follow_the_status_and_skip_what_was_delivered():
    subscriptions = [("team", None), ("ops", ["AttemptEnded", "Failed"])]
    due = notify.due_notices(subscriptions, ENDED)
    assert [n.key for n in due] == [("team", "Succeeded", 2), ("ops", "AttemptEnded", 1),
                                    ("ops", "AttemptEnded", 2)]
    recorded = {**ENDED, "notifications": [
        {"sink": "team", "event": "Succeeded", "attempt": 2, "state": "Delivered"},
        {"sink": "ops", "event": "AttemptEnded", "attempt": 1, "state": "Pending"}]}
    # Delivered is never sent again; Pending (a restart mid-retry) is.
    assert [n.key for n in notify.due_notices(subscriptions, recorded)] == [
        ("ops", "AttemptEnded", 1), ("ops", "AttemptEnded", 2)]
    assert notify.due_notices(subscriptions, {"phase": "Running", "attempt": 1}) == []


def test_the_succeeded_event_carries_the_summary_and_a_deterministic_id():
    event = notify.cloud_event(notify.Notice("team", "Succeeded", 2), "tiny", "ml", UID, ENDED)
    assert event == notify.cloud_event(notify.Notice("other", "Succeeded", 2), "tiny", "ml", UID, ENDED)
    assert event["id"] == f"{UID}.Succeeded.2"
    assert event["type"] == "tpufinetune.dev.run.succeeded"
    assert event["source"] == "/apis/tpufinetune.dev/v1alpha1/namespaces/ml/tpufinetunes/tiny"
    assert event["time"] == "2026-12-05T01:00:00Z"
    assert event["data"] == {
        "name": "tiny", "namespace": "ml", "uid": UID, "phase": "Succeeded", "attempt": 2,
        "reason": "JobSucceeded", "message": "", "loss": 1.25, "evalLoss": 1.5, "chipHours": 3.5,
        "checkpointURI": "gs://b/run/ckpt-3", "exportedModelURI": "gs://b/run/export",
        "logsURI": "gs://b/run/logs/attempt-2/"}
    ended = notify.cloud_event(notify.Notice("team", "AttemptEnded", 1), "tiny", "ml", UID, ENDED)
    assert (ended["data"]["reason"], ended["data"]["chipHours"], ended["time"]) == (
        "Preempted", 1.0, "2026-12-05T00:30:00Z")
    assert "logsURI" not in ended["data"]  # attempt 1 has none yet: left out, not null


def test_backoff_doubles_to_its_cap_and_only_transient_refusals_retry():
    assert [notify.retry_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert [notify.retryable(c) for c in (None, 500, 503, 429, 408, 400, 401, 404)] == [
        True, True, True, True, True, False, False, False]


def test_records_replace_their_notice_keep_final_states_and_stay_bounded():
    pending = {"sink": "a", "event": "Succeeded", "attempt": 1, "id": "x", "state": "Pending", "tries": 1,
               "time": "2026-12-05T01:00:00Z", "lastError": "HTTP 503 Service Unavailable"}
    delivered = {**pending, "state": "Delivered", "tries": 3}
    delivered.pop("lastError")
    after = notify.with_records({"notifications": [pending]}, [delivered])
    assert after == [delivered]
    assert notify.with_records({"notifications": after}, [pending]) == [delivered]  # a stale report
    checked_status({"notifications": after})  # every key declared
    many = [{**pending, "attempt": n} for n in range(1, 80)]
    kept = notify.with_records({}, many)
    assert len(kept) == notify.NOTIFICATIONS_LIMIT and kept[-1]["attempt"] == 79
