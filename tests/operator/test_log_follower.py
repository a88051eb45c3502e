"""Incremental log parsing: complete lines only, each byte parsed once, restart skips
what status already holds."""

from tpufinetune.driver import status_patch
from tpufinetune.adapters.rayjobs import LogFollower
from tpufinetune_trainer.events import format_event

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
    assert f.parsed_bytes == len(LOG.encode())
    assert f.drain() == []


def test_cursor_stays_on_a_line_boundary_and_restart_skips_parsed_lines():
    first = follower()
    first._feed(LOG[: LOG.index("(RayTrainWorker pid=7) " + EPOCH2) + 10])
    assert [e["epoch"] for e in first.drain()] == [1]
    saved = first.parsed_bytes
    assert LOG.encode()[:saved].endswith(b"\n")
    # after a restart the websocket replays the log from the start
    second = follower(skip=saved)
    second._feed(LOG)
    assert [e["epoch"] for e in second.drain()] == [2]


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
