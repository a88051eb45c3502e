"""Incremental log parsing: complete lines only, each byte parsed once, restart skips
what status already holds; resuming at a cursor finds its anchor in a bounded tail (pure
tests, then on a real Ray head: what a resume transfers)."""

import asyncio
from types import SimpleNamespace

import pytest

from harness.waiting import wait_for
from run_helpers import long_log, submit_printing
from tpufinetune.core.skew import status_patch
from tpufinetune.driver import Run
from tpufinetune.adapters.logresume import ANCHOR_LINES, AnchorSearch, as_logged, stream_decoder
from tpufinetune.adapters.logfollow import LogFollower
from tpufinetune.adapters.rayjobs import RESUME_LINES, RayJobs, event_dict
from tpufinetune_trainer.events import format_event, parse_text

EPOCH1 = format_event("epoch", epoch=1, epochs=2, loss=3.0)
EPOCH2 = format_event("epoch", epoch=2, epochs=2, loss=2.0)
LOG = f"starting\n(RayTrainWorker pid=7) {EPOCH1}\nEpoch 1/2 | loss=3.0\n(RayTrainWorker pid=7) {EPOCH2}\n"


def follower(skip: int = 0) -> LogFollower:
    return LogFollower(jobs=None, address="http://unused", submission_id="tft-u-1", skip=skip)


def test_events_split_across_chunks_are_parsed_once_complete():
    f = follower()
    cut = LOG.index("\"loss\"")  # inside the first event's JSON
    f._feed(LOG[:cut])
    assert f.drain() == []
    f._feed(LOG[cut:])
    assert [e["epoch"] for e in f.drain()] == [1, 2]
    assert f.cursor == len(LOG.encode())
    assert f.drain() == []


def test_cursor_stays_on_a_line_boundary_and_restart_skips_parsed_lines():
    first = follower()
    first._feed(LOG[: LOG.index("(RayTrainWorker pid=7) " + EPOCH2) + 10])
    assert [e["epoch"] for e in first.drain()] == [1]
    saved = first.cursor
    assert LOG.encode()[:saved].endswith(b"\n")
    # after a restart the websocket replays the log from the start
    second = follower(skip=saved)
    second._feed(LOG)
    assert [e["epoch"] for e in second.drain()] == [2]


def test_the_cursor_saved_is_where_the_handed_out_events_end():
    """Events parsed after the last drain are not in the status being written: the cursor
    and anchor saved with it stop before them, so a restart reads them again."""
    f = follower()
    first = LOG[: LOG.index("Epoch 1/2")]
    f._feed(first)
    assert [e["epoch"] for e in f.drain()] == [1]
    f._feed(LOG[len(first):])  # epoch 2 parsed while the step was deciding
    status = {}
    Run._log_cursor(SimpleNamespace(follower=f), status)
    assert status == {"logCursor": len(first.encode()), "logAnchor": position_after(first)[1], "logJobId": "tft-u-1"}


def test_status_patch_holds_only_changes_and_removals():
    old = {"phase": "Running", "loss": 3.0, "trainerFailure": {"type": "X"}, "kopf": {"progress": {}}}
    new = {"phase": "Running", "loss": 2.0}
    assert status_patch(old, new) == {"loss": 2.0, "trainerFailure": None}


def test_the_last_line_without_a_newline_is_parsed_when_the_log_ends():
    f = follower()
    f._feed(LOG + format_event("result", best_checkpoint_uri="gs://b/best"))
    assert [e["event"] for e in f.drain()] == ["epoch", "epoch"]
    f._feed(b"", final=True)
    assert [e["event"] for e in f.drain()] == ["result"]


def test_stray_ray_address_variables_never_redirect_a_run():
    from tpufinetune.adapters.rayjobs import drop_address_overrides

    environ = {"RAY_ADDRESS": "http://elsewhere:8265", "RAY_API_SERVER_ADDRESS": "http://elsewhere:8265", "HOME": "/"}
    assert drop_address_overrides(environ) == ["RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"]
    assert environ == {"HOME": "/"}


# ---- resuming at a cursor from a bounded tail ----------------------------------------


def position_after(text: str) -> tuple[int, str]:
    """(cursor, anchor) of a follower that parsed `text` and handed out its events."""
    f = follower()
    f._feed(text)
    f.drain()
    return f.drained


def test_the_anchor_is_found_in_a_tail_and_only_what_follows_is_parsed():
    log = long_log(5000)
    cut = log.index("\n", len(log) * 9 // 10) + 1
    cursor, anchor = position_after(log[:cut])
    assert cursor == len(log[:cut].encode()) and AnchorSearch.usable(anchor)
    tail = "".join(log.splitlines(keepends=True)[-1200:])
    search = AnchorSearch(anchor)
    rest = search.feed(tail[:777]) or search.feed(tail[777:])  # in chunks, cut anywhere
    assert rest == log[cut:]
    # The window reaches back to the last event line: it is unique in the log.
    assert int(anchor.split(".")[0]) <= 100 and log[:cut].count("step") > 100


def test_a_tail_without_the_anchor_finds_nothing():
    log = long_log(5000)
    cursor, anchor = position_after(log[: log.index("\n", len(log) // 2) + 1])
    tail = "".join(log.splitlines(keepends=True)[-1000:])
    assert AnchorSearch(anchor).feed(tail) is None


def test_the_state_apis_raw_bytes_read_as_the_websockets_lines():
    """The websocket reads the file in text mode ("\\r\\n" and "\\r" end lines); the state
    API sends raw bytes: both views give the same cursor and anchor."""
    log = long_log(300, every=7)
    raw = log.replace("\n", "\r\n").encode()
    decoder = stream_decoder()
    streamed = "".join(decoder.decode(raw[i:i + 5]) for i in range(0, len(raw), 5)) + decoder.decode(b"", final=True)
    assert as_logged(raw) == streamed == log
    assert position_after(streamed) == position_after(log)


def test_an_anchor_from_an_older_status_or_a_typo_is_not_used():
    for anchor in ("", "x", "3.zz.00", "0.0123456789abcdef.0123456789abcdef", "8.0123456789abcdef"):
        assert not AnchorSearch.usable(anchor)
    assert AnchorSearch.usable("8.0123456789abcdef.0123456789abcdef")


# ---- on a real Ray head: what a resume transfers --------------------------------------


def whole_log(ray_head, job_id: str, ends_with: str) -> str:
    client = ray_head.job_client()
    # The head writes the driver's log file asynchronously: wait for its last line.
    return wait_for(lambda: (text := client.get_job_logs(job_id)).endswith(ends_with) and text, 120,
                    f"the log of {job_id} to end with its last line")


def follow(ray_head, job_id: str, cursor: int, anchor: str, until,
           on_resumed=lambda: None) -> tuple[list[dict], LogFollower, int]:
    """A follower resuming at (cursor, anchor), as after a restart: its events once
    `until(events)`, and the log bytes its client received. `on_resumed()` is called once,
    when the follower has resumed from the log's tail."""
    jobs = RayJobs(headers=ray_head.headers(), timeout=10, heartbeat=2)

    async def scenario():
        f = LogFollower(jobs, ray_head.dashboard_url, job_id, skip=cursor, anchor=anchor)
        f.start()
        events: list[dict] = []
        resumed = False
        try:
            for _ in range(600):
                if not resumed and f.tail_resumes:
                    resumed = True
                    on_resumed()
                events += f.drain()
                if until(events) or not f.running:
                    break
                await asyncio.sleep(0.1)
            job = await asyncio.to_thread(jobs.job, ray_head.dashboard_url, job_id)
            if job.status not in ("PENDING", "RUNNING"):
                await f.finish()
            return events + f.drain(), f
        finally:
            await f.close()

    events, f = asyncio.run(scenario())
    return events, f, jobs.client(ray_head.dashboard_url).log_bytes


@pytest.fixture(scope="module")
def long_job(ray_head, tmp_path_factory):
    """A finished job that printed 60 000 lines (about 4 MB)."""
    log = long_log(60000)
    job_id = submit_printing(ray_head, tmp_path_factory.mktemp("long"), log)
    return job_id, whole_log(ray_head, job_id, log[-200:])


@pytest.mark.ray
def test_a_restart_deep_in_a_long_log_reads_only_a_bounded_tail(ray_head, long_job):
    job_id, log = long_job
    cut = log.index("\n", len(log) - 300 * 70) + 1  # about 300 lines before the end
    cursor, anchor = position_after(log[:cut])
    expected = [event_dict(e) for e in parse_text(log[cut:])]
    events, f, received = follow(ray_head, job_id, cursor, anchor, lambda got: got[-1:] == expected[-1:])
    assert events == expected  # exactly the events after the cursor: none twice, none missing
    assert f.tail_resumes >= 1 and f.full_replays == 0
    # Each read is the anchor's lines and RESUME_LINES more (a probe, the stream's start,
    # the last read after the job ended), never the log from its start.
    line = max(len(x) for x in log[-100_000:].splitlines()) + 1
    assert received <= 4 * (ANCHOR_LINES[1] + RESUME_LINES[0]) * line < len(log.encode()) / 4, received
    print(f"\nlog {len(log.encode())} bytes; resumed 300 lines before its end: {received} bytes received")


@pytest.mark.ray
def test_a_cursor_whose_lines_are_not_in_the_tail_replays_the_log_from_its_start(ray_head, long_job):
    job_id, log = long_job
    cut = log.index("\n", len(log) // 2) + 1  # 30 000 lines before the end: past the probes' most
    cursor, _ = position_after(log[:cut])
    wrong = position_after("some other log\n")[1]  # lines that are nowhere in this log
    expected = [event_dict(e) for e in parse_text(log[cut:])]
    events, f, received = follow(ray_head, job_id, cursor, wrong, lambda got: got[-1:] == expected[-1:])
    assert events == expected
    assert f.full_replays == 1 and received >= len(log.encode())
    print(f"\nlog {len(log.encode())} bytes; anchor not found: {received} bytes received")


@pytest.mark.ray
def test_a_restart_while_the_job_prints_follows_from_the_cursor(ray_head, tmp_path):
    before, after = long_log(20000), long_log(300, every=10)
    gate = tmp_path / "go"
    job_id = submit_printing(ray_head, tmp_path, before, after, gate=gate)
    log = whole_log(ray_head, job_id, before[-200:])  # the job now waits for the gate
    assert log.endswith(before)  # after Ray's own first lines
    cursor, anchor = position_after(log)
    expected = [event_dict(e) for e in parse_text(after)]
    # The job prints its last lines once the follower resumed from the tail: it follows them.
    try:
        events, f, received = follow(ray_head, job_id, cursor, anchor, lambda got: got[-1:] == expected[-1:],
                                     on_resumed=gate.touch)
    finally:
        gate.touch()  # never leave the job waiting on the shared head
    assert events == expected
    assert f.tail_resumes >= 1 and f.full_replays == 0
    assert received < len(before.encode()) / 4, received
    print(f"\nlog {len((before + after).encode())} bytes; resumed while running: {received} bytes received")
