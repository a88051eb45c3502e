"""The trainer -> operator event protocol: format, parse, incremental stream. Pure."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from harness.rayhead import REPO, VENV_BIN

from tpufinetune_trainer.events import PREFIX, EventStream, emit, format_event, parse_line, parse_text


def test_round_trip_and_kind():
    line = format_event("epoch", epoch=1, epochs=3, loss=3.1402, eval_loss=3.2, epoch_time_s=28.17,
                        tokens_per_s=18613.5, padded_tokens_per_s=20000.0)
    assert line.startswith(PREFIX) and "\n" not in line
    event = parse_line(line)
    assert event.kind == "epoch" and event["v"] == 1
    assert event["loss"] == 3.1402 and event["epochs"] == 3


def test_prefix_found_inside_a_ray_worker_line_with_colours():
    line = format_event("checkpoint", epoch=2, uri="gs://bucket/run/epoch_0002")
    ray_line = f"\x1b[36m(RayTrainWorker pid=19733, ip=10.72.3.20)\x1b[0m {line}\x1b[0m"
    assert parse_line(ray_line) == {"event": "checkpoint", "v": 1, "epoch": 2, "uri": "gs://bucket/run/epoch_0002"}
    assert parse_line(ray_line.encode()) == parse_line(ray_line)


@pytest.mark.parametrize("line", [
    "", "Epoch 1/3 | loss=3.1 | epoch_time=2.0s | tokens/s=1.0", PREFIX, PREFIX + "{", PREFIX + "not json",
    PREFIX + "[1, 2]", PREFIX + '{"no_event": 1}', PREFIX + '{"event": 7}', PREFIX + "{" * 100000,
    None, 12,
])
def test_malformed_lines_give_none_and_never_raise(line):
    assert parse_line(line) is None


def test_trailing_text_after_the_object_is_ignored():
    assert parse_line(PREFIX + '{"event":"start","v":1} trailing words')["event"] == "start"


def test_non_finite_numbers_become_null_not_invalid_json():
    line = format_event("epoch", epoch=1, loss=float("nan"), eval_loss=float("inf"))
    json.loads(line[len(PREFIX):])  # strict JSON
    assert parse_line(line)["loss"] is None


def test_unknown_kinds_cannot_be_emitted():
    with pytest.raises(ValueError, match="unknown event kind 'heartbeat'; expected one of"):
        format_event("heartbeat", x=1)


def test_emit_writes_one_flushed_line():
    out = io.StringIO()
    line = emit("failure", stream=out, type="DataError", message="line one\nline two")
    assert out.getvalue() == line + "\n" and out.getvalue().count("\n") == 1
    assert parse_line(out.getvalue())["message"] == "line one\nline two"


def _log() -> tuple[str, list[dict]]:
    events = [("start", dict(mode="finetune", world_size=2, backend="gloo", device="cpu", devices=["a", "b"])),
              ("epoch", dict(epoch=1, epochs=2, loss=2.5, message="naïve ünïcode ✓")),
              ("checkpoint", dict(epoch=1, uri="/ckpt/epoch_0001")),
              ("result", dict(best_checkpoint_uri="/ckpt/epoch_0001", exported_model_uri="/x", metrics={"loss": 2.5}))]
    lines = []
    for i, (kind, fields) in enumerate(events):
        lines.append(f"(RayTrainWorker pid={i}) some human text {i}")
        lines.append(f"(RayTrainWorker pid={i}) " + format_event(kind, **fields))
    return "\n".join(lines) + "\n", [dict(event=k, v=1, **f) for k, f in events]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 10_000])
def test_stream_over_arbitrary_byte_chunks(chunk):
    text, expected = _log()
    data = text.encode()  # chunks split multi-byte UTF-8 characters too
    stream, got = EventStream(), []
    for i in range(0, len(data), chunk):
        got += stream.feed(data[i:i + chunk])
    got += stream.close()
    assert got == expected


def test_stream_yields_each_event_as_soon_as_its_line_ends():
    stream = EventStream()
    line = format_event("epoch", epoch=1, loss=1.0)
    assert stream.feed(line[:10]) == []
    assert stream.feed(line[10:]) == []  # no newline yet: the line may continue
    assert [e["epoch"] for e in stream.feed("\n")] == [1]
    assert stream.feed("partial " + line) == []
    assert [e.kind for e in stream.close()] == ["epoch"]  # a final line without a newline


def test_stream_drops_a_runaway_line_and_recovers():
    stream = EventStream()
    assert stream.feed("x" * (2 << 20)) == []  # 2 MiB without a newline
    assert stream.feed(format_event("start", mode="m") + "\n") == []  # tail of the runaway line
    assert [e.kind for e in stream.feed(format_event("result", metrics={}) + "\n")] == ["result"]


def test_parse_text_equals_line_by_line():
    text, expected = _log()
    assert parse_text(text) == expected


def test_event_module_imports_without_torch_or_ray():
    python = VENV_BIN / "python" if (VENV_BIN / "python").exists() else sys.executable
    code = ("import sys, tpufinetune_trainer, tpufinetune_trainer.events; "
            "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([str(python), "-c", code], check=True, cwd=str(REPO))


def test_startup_stages_count_from_the_drivers_mark_and_never_go_back(monkeypatch):
    from tpufinetune_trainer import startup

    clock = iter([1000.0 + 5, 1000.0 + 3, 1000.0 + 9])  # a worker's wall clock, a little behind at first
    monkeypatch.setattr(startup.time, "time", lambda: next(clock))
    driver = startup.Startup(origin=1000.0, stages={"data_ready": 4.0})
    worker = startup.Startup.of(driver.handover())  # as Ray hands it to each worker
    assert worker.mark("workers_ready") == 5.0
    assert worker.mark("model_loaded") == 5.0  # 3 s by its clock: never before an earlier stage
    assert worker.mark("first_step") == 9.0
    assert worker.fields() == {"started_at": 1000.0, "data_ready_s": 4.0, "workers_ready_s": 5.0,
                               "model_loaded_s": 5.0, "first_step_s": 9.0}
    assert format_event("startup", step=1, **worker.fields()).startswith(PREFIX)
    with pytest.raises(ValueError, match="unknown start-up stage 'compiled'"):
        worker.mark("compiled")


def test_the_entrypoint_takes_the_drivers_mark_before_its_heavy_imports():
    python = VENV_BIN / "python" if (VENV_BIN / "python").exists() else sys.executable
    code = ("import sys, tpufinetune_trainer.cli; order = list(sys.modules); "  # in import order
            "first = order.index('tpufinetune_trainer.startup'); "
            "late = [m for m in order[:first] if m.split('.')[0] in ('torch', 'numpy', 'tpufinetune_trainer')]; "
            "assert late == ['tpufinetune_trainer'], late")
    subprocess.run([str(python), "-c", code], check=True, cwd=str(REPO))
