"""Notices delivered to a real HTTP receiver in this process (adapters/notify.py): retries
with backoff, the queue's bound, a sink not configured, and nothing sent twice."""
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cloudevents.v1.http import from_http
from prometheus_client import REGISTRY

from tpufinetune.adapters.notify import Notifier, RunNotices, http_message
from tpufinetune.core import notify
from tpufinetune.core.phases import Identity

IDENT = Identity("tiny", "ml", "0b7c5c1e-1111-2222-3333-444455556666", 1)
SUCCEEDED = {"phase": "Succeeded", "attempt": 1, "loss": 1.1, "evalLoss": 1.3, "usage": {"chipHours": 0.5},
             "completionTime": "2026-12-05T01:00:00Z", "checkpointURI": "gs://b/tiny/ckpt",
             "attempts": [{"attempt": 1, "startTime": "2026-12-05T00:00:00Z", "endTime": "2026-12-05T01:00:00Z",
                           "reason": "Succeeded", "logsURI": "gs://b/tiny/logs/attempt-1/"}]}


class Receiver:
    """Answers `codes` in turn (then 200) and keeps every request it got."""

    def __init__(self, codes=()):
        self.codes = list(codes)
        self.got: list[tuple[dict, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.codes.pop(0) if receiver.codes else 200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(codes=()):
        made.append(Receiver(codes))
        return made[-1]
    yield make
    for one in made:
        one.close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


def sink_for_ml(**fields) -> notify.Sink:
    """A sink the admin opened to namespace ml (IDENT's)."""
    return notify.Sink(namespaces=["ml"], **fields)


def fast_notifier(sinks, **kwargs) -> Notifier:
    return Notifier({s.name: s for s in sinks}, retry_base=0.05, retry_cap=0.2, **kwargs)


async def settle(notices: RunNotices, status: dict, timeout: float = 10.0) -> dict:
    """Write outcomes into `status` as the driver does until nothing is in flight."""
    async def loop():
        while True:
            notices.wake.clear()
            records = notices.records()
            if records:
                status["notifications"] = notify.with_records(status, records)
            if not notices.waiting():
                return status
            await notices.wake.wait()
    return await asyncio.wait_for(loop(), timeout)


def delivered(notifier: Notifier, subscriptions, record=lambda *a: None) -> dict:
    """A finished run's due notices offered once and settled into its status; the
    notifier closed after."""
    async def scenario():
        notices = RunNotices(notifier, asyncio.Event())
        return await settle(notices, notices_offered(notices, subscriptions, record))
    try:
        return asyncio.run(scenario())
    finally:
        notifier.close()


def notices_offered(notices: RunNotices, subscriptions, record) -> dict:
    status = dict(SUCCEEDED)
    notices.offer_due(IDENT, subscriptions, status, record)
    return status


@pytest.mark.timeout(30)
def test_a_receiver_that_refuses_twice_gets_the_event_on_the_third_try(receiver):
    hook = receiver([503, 503])
    sink = sink_for_ml(name="bus", type="cloudevents", url=hook.url, mode="binary")
    notifier = fast_notifier([sink])
    events = []
    tries = {outcome: tried("bus", outcome) for outcome in ("Pending", "Delivered", "Failed")}

    async def scenario():
        notices = RunNotices(notifier, asyncio.Event())
        status = await settle(notices, notices_offered(notices, [("bus", None)], lambda *a: events.append(a)))
        # A second pass over the written status (a restart, another replica) sends nothing.
        notices.offer_due(IDENT, [("bus", None)], status, lambda *a: events.append(a))
        assert not notices.waiting()
        return status
    try:
        status = asyncio.run(scenario())
    finally:
        notifier.close()
    (record,) = status["notifications"]
    assert (record["state"], record["tries"], record["sink"], record["event"]) == ("Delivered", 3, "bus", "Succeeded")
    assert "lastError" not in record
    assert len(hook.got) == 3 and events == []
    ids = {from_http(headers, body)["id"] for headers, body in hook.got}
    assert ids == {f"{IDENT.uid}.Succeeded.1"}  # one id at every try: a receiver can dedupe
    read = from_http(*hook.got[-1])
    assert read.data["logsURI"] == "gs://b/tiny/logs/attempt-1/" and read.data["evalLoss"] == 1.3
    # tpufinetune_notice_tries_total: two tries to be tried again, then one delivered.
    assert {outcome: tried("bus", outcome) - before for outcome, before in tries.items()} == {
        "Pending": 2, "Delivered": 1, "Failed": 0}


def tried(sink: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("tpufinetune_notice_tries_total", {"sink": sink, "outcome": outcome}) or 0.0


@pytest.mark.timeout(30)
def test_a_refusal_that_will_not_change_fails_at_once_and_the_token_is_sent(receiver, tmp_path):
    hook = receiver([401])
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    sink = sink_for_ml(name="team", type="webhook", url=hook.url, token_file=str(token))
    status = delivered(fast_notifier([sink]), [("team", None)])
    (record,) = status["notifications"]
    assert (record["state"], record["tries"], record["lastError"]) == ("Failed", 1, "HTTP 401 Unauthorized")
    headers, body = hook.got[0]
    assert headers["authorization"] == "Bearer s3cret"
    assert json.loads(body)["data"]["checkpointURI"] == "gs://b/tiny/ckpt"


@pytest.mark.timeout(30)
def test_out_of_tries_the_notice_fails_with_the_last_error(receiver):
    hook = receiver([503] * 10)
    notifier = fast_notifier([sink_for_ml(name="bus", type="cloudevents", url=hook.url)], max_tries=3)
    status = delivered(notifier, [("bus", None)])
    (record,) = status["notifications"]
    assert (record["state"], record["tries"]) == ("Failed", 3) and "503" in record["lastError"]
    assert len(hook.got) == 3


def test_a_sink_not_configured_is_failed_in_status_with_an_event_and_never_called():
    events = []
    status = delivered(fast_notifier([]), [("nosuch", ["Succeeded"])], lambda *a: events.append(a))
    (record,) = status["notifications"]
    assert (record["state"], record["tries"]) == ("Failed", 0)
    assert "'nosuch' is not configured" in record["lastError"]
    assert [(e[1], e[2]) for e in events] == [("Warning", "NotifySinkUnknown")]


@pytest.mark.timeout(30)
def test_the_queue_is_bounded_and_a_refused_notice_stays_due():
    # A port nothing listens on, retried only after a minute: each notice stays held.
    sinks = {name: sink_for_ml(name=name, type="webhook", url="http://127.0.0.1:9/x") for name in ("a", "b", "c")}
    notifier = Notifier(sinks, limit=2, senders=1, retry_base=60.0)

    async def scenario():
        notices = RunNotices(notifier, asyncio.Event())
        subscriptions = [(name, ["Succeeded"]) for name in sinks]
        notices.offer_due(IDENT, subscriptions, SUCCEEDED, lambda *a: None)  # 3 due, room for 2
        assert notifier.held == 2
        assert notices.waiting()  # the third is still owed: the run keeps stepping
        notices.offer_due(IDENT, subscriptions, SUCCEEDED, lambda *a: None)  # queued ones are not offered twice
        assert notifier.held == 2
    try:
        asyncio.run(scenario())
    finally:
        notifier.close()


@pytest.mark.timeout(30)
def test_a_sink_is_sent_its_next_notice_only_once_the_last_is_settled_and_written(receiver):
    hook = receiver([503])
    notifier = fast_notifier([sink_for_ml(name="team", type="webhook", url=hook.url)])
    status = {**SUCCEEDED, "attempts": [{"attempt": 1, "endTime": "2026-12-05T00:30:00Z"},
                                        {"attempt": 2, "endTime": "2026-12-05T01:00:00Z"}], "attempt": 2}
    subscriptions = [("team", ["AttemptEnded", "Succeeded"])]

    async def scenario():
        notices = RunNotices(notifier, asyncio.Event())
        for _ in range(3):  # as the driver does: offer after each write
            notices.offer_due(IDENT, subscriptions, status, lambda *a: None)
            assert notifier.held == 1  # one at a time, however many are due
            await settle(notices, status)
        notices.offer_due(IDENT, subscriptions, status, lambda *a: None)
        assert not notices.waiting()
    try:
        asyncio.run(scenario())
    finally:
        notifier.close()
    assert [json.loads(body)["id"] for _, body in hook.got] == [
        f"{IDENT.uid}.AttemptEnded.1", f"{IDENT.uid}.AttemptEnded.1", f"{IDENT.uid}.AttemptEnded.2",
        f"{IDENT.uid}.Succeeded.2"]  # in order; the first refused once


@pytest.mark.timeout(30)
def test_a_sink_not_open_to_the_runs_namespace_is_refused_and_no_event_names_another_sink(receiver):
    """A sink of another namespace is never called, and what the run is told about it is
    what it is told about a name that does not exist: no sink's name but its own."""
    theirs, ours = receiver(), receiver()
    notifier = fast_notifier([notify.Sink(name="team-a", type="webhook", url=theirs.url, namespaces=["other"]),
                              sink_for_ml(name="team-b", type="webhook", url=ours.url)])
    events = []
    status = delivered(notifier, [("team-a", ["AttemptEnded", "Succeeded"]), ("nosuch", None), ("team-b", None)],
                       lambda *a: events.append(a))
    states = {r["sink"]: (r["state"], r["tries"], r.get("lastError", "")) for r in status["notifications"]}
    assert [(r["event"], r["state"]) for r in status["notifications"] if r["sink"] == "team-a"] == [
        ("AttemptEnded", "Failed"), ("Succeeded", "Failed")]  # both refused; one Event says so
    assert states["team-b"][:2] == ("Delivered", 1) and len(ours.got) == 1
    assert theirs.got == []
    assert states["team-a"][:2] == states["nosuch"][:2] == ("Failed", 0)
    assert states["team-a"][2] == states["nosuch"][2].replace("'nosuch'", "'team-a'")
    assert "namespace 'ml'" in states["team-a"][2]
    assert [(e[1], e[2]) for e in events] == [("Warning", "NotifySinkUnknown")] * 2
    for (_, _, _, message), named in zip(events, ("team-a", "nosuch")):
        others = {"team-a", "team-b", "nosuch", "other"} - {named}
        assert f"'{named}'" in message and not any(other in message for other in others), message


@pytest.mark.timeout(60)
def test_the_driver_sends_a_finished_runs_notice_once_and_records_it_before_it_rests(receiver, tmp_path):
    """A run found finished (an operator that restarted after its end): its loop does not
    rest until the notice is delivered and written; the next operator sends nothing."""
    from run_helpers import MemoryCluster, body, settings

    from tpufinetune.adapters.rayjobs import RayJobs
    from tpufinetune.driver import Run

    hook = receiver([503, 503])
    sinks = tmp_path / "sinks.yaml"
    sinks.write_text(f"sinks: [{{name: team, type: cloudevents, url: '{hook.url}', namespaces: [ns]}}]\n")
    finished = {**SUCCEEDED, "conditions": [{"type": "Succeeded", "status": "True", "reason": "JobSucceeded",
                                             "lastTransitionTime": "2026-12-05T01:00:00Z"}]}
    cluster = MemoryCluster()

    async def operator_pass(status):
        live = body(status)
        live["spec"]["notify"] = [{"sink": "team"}]
        run = Run(live, cluster, RayJobs(), settings(notify_sinks_file=str(sinks)))
        await asyncio.wait_for(run.run(asyncio.Event()), 30)
        return run
    asyncio.run(operator_pass(finished))
    (record,) = cluster.status["notifications"]
    assert (record["state"], record["tries"], record["event"]) == ("Delivered", 3, "Succeeded")
    assert len(hook.got) == 3
    read = from_http(*hook.got[-1])
    assert (read["id"], read["type"]) == ("uid-1.Succeeded.1", "tpufinetune.dev.run.succeeded")
    assert read.data["reason"] == "JobSucceeded" and read.data["name"] == "demo"
    asyncio.run(operator_pass(dict(cluster.status)))  # a restart, or the next leader
    assert len(hook.got) == 3


def test_a_sinks_file_that_is_not_valid_fails_each_notice_with_its_error(tmp_path):
    from tpufinetune.adapters.notify import notifier_for

    bad = tmp_path / "sinks.yaml"
    bad.write_text("sinks: [{name: team, type: webhook, url: 'ftp://x', namespaces: [ml]}]\n")
    assert notifier_for(str(tmp_path / "absent.yaml")).sinks == {}  # nothing mounted: no sinks
    notifier = notifier_for(str(bad))
    assert "sinks.0.url" in notifier.sinks_error
    events = []

    async def scenario():
        notices = RunNotices(notifier, asyncio.Event())
        status = dict(SUCCEEDED)
        notices.offer_due(IDENT, [("team", None)], status, lambda *a: events.append(a))
        return await settle(notices, status)
    status = asyncio.run(scenario())
    (record,) = status["notifications"]
    assert record["state"] == "Failed" and "TPUFT_NOTIFY_SINKS_FILE" in record["lastError"]
    assert [e[2] for e in events] == ["NotifySinksInvalid"]


# ---- the POST that carries a notice (the CloudEvents SDK's HTTP binding) ----------------

ENDED = {"phase": "Succeeded", "attempt": 2, "loss": 1.25, "completionTime": "2026-12-05T01:00:00Z",
         "attempts": [{"attempt": 2, "endTime": "2026-12-05T01:00:00Z", "reason": "Succeeded"}]}


@pytest.mark.parametrize("sink", [
    sink_for_ml(name="b", type="cloudevents", url="http://x", mode="binary"),
    sink_for_ml(name="s", type="cloudevents", url="http://x", mode="structured"),
])
def test_both_cloudevents_modes_read_back_with_the_sdk(sink):
    event = notify.cloud_event(notify.Notice("b", "Succeeded", 2), "tiny", "ml", "0b7c5c1e", ENDED)
    headers, body = http_message(event, sink)
    read = from_http(headers, body)
    assert (read["id"], read["type"], read["source"], read["subject"]) == (
        event["id"], event["type"], event["source"], "tiny")
    assert read.data == event["data"]
    assert ("ce-id" in headers) == (sink.mode == "binary")


def test_a_webhook_gets_the_whole_event_as_plain_json():
    event = notify.cloud_event(notify.Notice("team", "Failed", 1), "tiny", "ml", "0b7c5c1e",
                               {**ENDED, "phase": "Failed", "attempt": 1})
    headers, body = http_message(event, sink_for_ml(name="team", type="webhook", url="http://hooks.example/x"))
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body)["type"] == "tpufinetune.dev.run.failed"


# ---- many attempts and sinks: each notice once, a bounded record, a loop that ends --------

def ended_attempts(count: int) -> dict:
    """A run that failed after `count` attempts, each ended (status.attempts keeps 20)."""
    attempts = [{"attempt": n, "startTime": f"2026-12-05T{n:02d}:00:00Z", "endTime": f"2026-12-05T{n:02d}:30:00Z",
                 "reason": "Preempted"} for n in range(1, count + 1)]
    return {"phase": "Failed", "attempt": count, "attempts": attempts, "completionTime": attempts[-1]["endTime"],
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                            "lastTransitionTime": attempts[-1]["endTime"]}]}


@pytest.mark.timeout(120)
def test_eight_sinks_and_twenty_attempts_get_each_notice_once_and_the_run_rests(receiver, tmp_path):
    """8 sinks x (20 AttemptEnded + Failed) = 168 notices, more than status.notifications
    holds: each sink is sent each of its 21 once, in order, the record stays within its
    bound, the run's loop returns once they are settled, and the next operator sends none."""
    from run_helpers import MemoryCluster, body, settings

    from tpufinetune.adapters.rayjobs import RayJobs
    from tpufinetune.core.status import checked_status
    from tpufinetune.driver import Run

    hooks = {f"s{i}": receiver([503] if i == 0 else ()) for i in range(8)}  # one refuses once
    sinks = tmp_path / "sinks.yaml"
    sinks.write_text(json.dumps({"sinks": [{"name": name, "type": "webhook", "url": hook.url, "namespaces": ["ns"]}
                                           for name, hook in hooks.items()]}))
    cluster = MemoryCluster()

    async def operator_pass(status):
        live = body(status)
        live["spec"]["notify"] = [{"sink": name, "events": ["AttemptEnded", "Failed"]} for name in hooks]
        run = Run(live, cluster, RayJobs(), settings(notify_sinks_file=str(sinks), status_write_interval=0))
        await asyncio.wait_for(run.run(asyncio.Event()), 40)  # returns: nothing left to send
    asyncio.run(operator_pass(ended_attempts(20)))
    wanted = [f"uid-1.AttemptEnded.{n}" for n in range(1, 21)] + ["uid-1.Failed.20"]
    for name, hook in hooks.items():
        ids = [json.loads(got)["id"] for _, got in hook.got]
        assert ids == (wanted[:1] if name == "s0" else []) + wanted, name  # each once (s0: a retry), in order
    records = cluster.status["notifications"]
    assert len(records) <= notify.NOTIFICATIONS_LIMIT and all(r["state"] == "Delivered" for r in records)
    checked_status({"notifications": records})
    assert notify.due_notices([(name, ["AttemptEnded", "Failed"]) for name in hooks], cluster.status) == []
    asyncio.run(operator_pass(dict(cluster.status)))  # a restart, or the next leader
    assert sum(len(hook.got) for hook in hooks.values()) == 8 * 21 + 1
