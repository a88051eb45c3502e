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
WEBHOOK = notify.Sink(name="team", type="webhook", url="http://hooks.example/x", namespaces=["ml"])


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
                               "tokenFile: /var/run/t, namespaces: [team-a, team-a-*]}\n"
                               "- {name: bus, type: cloudevents, url: 'http://broker.ns.svc', "
                               "mode: structured, namespaces: ['*']}\n")
    assert sinks["team"].token_file == "/var/run/t" and sinks["bus"].mode == "structured"
    assert [sinks["team"].allows(ns) for ns in ("team-a", "team-a-dev", "team-b", "team-ab")] == [
        True, True, False, False]
    assert sinks["bus"].allows("anyone")
    assert notify.parse_sinks("") == {}
    with pytest.raises(notify.SinksError, match=r"sinks.0.url: .*http:// or https://"):
        notify.parse_sinks('{"sinks": [{"name": "a", "type": "webhook", "url": "file:///etc/passwd", '
                           '"namespaces": ["*"]}]}')
    with pytest.raises(notify.SinksError, match="named twice"):
        notify.parse_sinks("sinks: [{name: a, type: webhook, url: 'http://x', namespaces: [ml]}, "
                           "{name: a, type: webhook, url: 'http://y', namespaces: [ml]}]")
    with pytest.raises(notify.SinksError, match="sinks.0.type"):
        notify.parse_sinks("sinks: [{name: a, type: slack, url: 'http://x', namespaces: [ml]}]")
    # Every sink says which namespaces may use it.
    with pytest.raises(notify.SinksError, match=r"sinks.0.namespaces: Field required .*namespaces: \[team-a\]"):
        notify.parse_sinks("sinks: [{name: a, type: webhook, url: 'http://x'}]")
    with pytest.raises(notify.SinksError, match=r"sinks.0.namespaces: .*at least 1"):
        notify.parse_sinks("sinks: [{name: a, type: webhook, url: 'http://x', namespaces: []}]")
    with pytest.raises(notify.SinksError, match=r"sinks.0.namespaces: .*'Team A' is not a namespace name or glob"):
        notify.parse_sinks("sinks: [{name: a, type: webhook, url: 'http://x', namespaces: [Team A]}]")


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


def test_each_sink_is_sent_one_notice_at_a_time_in_order():
    subscriptions = [("team", ["AttemptEnded", "Succeeded"]), ("ops", ["AttemptEnded"])]
    due = notify.due_notices(subscriptions, ENDED)
    assert [n.key for n in due] == [("team", "AttemptEnded", 1), ("team", "AttemptEnded", 2),
                                    ("team", "Succeeded", 2), ("ops", "AttemptEnded", 1), ("ops", "AttemptEnded", 2)]
    assert [n.key for n in notify.next_per_sink(due, set())] == [("team", "AttemptEnded", 1), ("ops", "AttemptEnded", 1)]
    # A sink whose notice is being sent (or whose outcome waits for its write) gets nothing more.
    assert [n.key for n in notify.next_per_sink(due, {("team", "AttemptEnded", 1)})] == [("ops", "AttemptEnded", 1)]


def test_many_sinks_and_attempts_keep_a_bounded_record_that_sends_nothing_twice():
    """8 sinks x (20 AttemptEnded + Failed) = 168 notices, delivered as the operator sends
    them: each round, each sink's next one. status.notifications stays within its bound and,
    once all are settled, nothing is due, round after round."""
    status = {"phase": "Failed", "attempt": 20, "attempts": [
        {"attempt": n, "endTime": "2026-12-05T01:00:00Z"} for n in range(1, 21)]}
    subscriptions = [(f"s{i}", ["AttemptEnded", "Failed"]) for i in range(8)]
    sent = []
    for _ in range(40):
        due = notify.next_per_sink(notify.due_notices(subscriptions, status), set())
        sent += [n.key for n in due]
        status["notifications"] = notify.with_records(status, [
            {"sink": n.sink, "event": n.event, "attempt": n.attempt, "id": "x", "state": "Delivered",
             "tries": 1, "time": "2026-12-05T01:00:00Z"} for n in due])
        assert len(status["notifications"]) <= notify.NOTIFICATIONS_LIMIT
    assert len(sent) == len(set(sent)) == 8 * 21
    assert notify.due_notices(subscriptions, status) == []
    checked_status({"notifications": status["notifications"]})
    # Each (sink, event)'s high-water mark is kept, however old.
    assert {(r["sink"], r["event"], r["attempt"]) for r in status["notifications"]} >= {
        (sink, event, 20) for sink, _ in subscriptions for event in ("AttemptEnded", "Failed")}


def test_a_sinks_mark_outlives_newer_records_of_other_sinks():
    mark = {"sink": "quiet", "event": "Succeeded", "attempt": 1, "id": "x", "state": "Delivered", "tries": 1,
            "time": "2026-12-05T01:00:00Z"}
    noisy = [{**mark, "sink": "noisy", "event": "AttemptEnded", "attempt": n} for n in range(1, 80)]
    kept = notify.with_records({"notifications": [mark]}, noisy)
    assert len(kept) == notify.NOTIFICATIONS_LIMIT and kept[0] == mark and kept[-1]["attempt"] == 79
    assert notify.due_notices([("quiet", None)], {"phase": "Succeeded", "attempt": 1, "notifications": kept}) == []
    # A stale report of a notice below its sink's mark is not recorded.
    stale = {**mark, "sink": "noisy", "event": "AttemptEnded", "attempt": 3, "state": "Pending"}
    assert notify.with_records({"notifications": kept}, [stale]) == kept


def test_the_charts_sinks_schema_asks_what_the_operator_asks():
    """values.schema.json refuses at `helm install` what parse_sinks would refuse at the
    operator's start: every sink names its namespaces, each a name or glob."""
    import json
    from pathlib import Path

    chart = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tpufinetune" / "values.schema.json"
    sink = json.loads(chart.read_text())["properties"]["notify"]["properties"]["sinks"]["items"]
    assert "namespaces" in sink["required"]
    assert sink["properties"]["namespaces"]["items"]["pattern"] == notify.NAMESPACE_GLOB
    assert sink["properties"]["namespaces"]["minItems"] == 1
    assert sink["properties"]["name"]["pattern"] == notify.SINK_NAME
