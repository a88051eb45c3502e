"""Each attempt's logs in the run's storage (tpufinetune_trainer/logship.py): numbered chunk
objects written while the process runs, the bound, and a process's whole output (Python,
C-level writes, a child process, stderr) captured without changing what its own stdout
and stderr receive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tpufinetune_trainer import logship


def read_all(uri: str, stream: str) -> bytes:
    return b"".join(logship.StreamReader(uri, stream).read())


def test_chunks_are_numbered_objects_read_in_order_and_each_once(tmp_path):
    uri = str(tmp_path / "run" / "logs" / "attempt-1")
    writer = logship.ChunkWriter(uri, logship.DRIVER, budget=1 << 20, started_ms=1_700_000_000_000)
    reader = logship.StreamReader(uri, logship.DRIVER)
    writer.append(b"one\n")
    writer.flush()
    writer.flush()  # nothing new: no empty chunk
    assert logship.chunks(uri, logship.DRIVER) == ["1700000000000-000001.log"]
    assert b"".join(reader.read()) == b"one\n"
    writer.append(b"two\n")
    writer.append(b"three\n")
    writer.flush()
    assert b"".join(reader.read()) == b"two\nthree\n"  # only what is new
    assert b"".join(reader.read()) == b""
    # A restarted writer of the same stream (a worker group restarted in the job) never
    # overwrites: its chunks sort after the first one's.
    later = logship.ChunkWriter(uri, logship.DRIVER, budget=1 << 20, started_ms=1_700_000_000_500)
    later.append(b"again\n")
    later.flush()
    assert read_all(uri, logship.DRIVER) == b"one\ntwo\nthree\nagain\n"
    assert logship.streams(uri) == [logship.DRIVER]


def test_a_stream_over_its_bound_keeps_its_start_and_its_newest_chunks(tmp_path):
    uri = str(tmp_path / "attempt-2")
    writer = logship.ChunkWriter(uri, logship.worker_stream(3), budget=400, started_ms=1)
    assert writer.chunk_limit == 100
    for i in range(20):
        writer.append(f"line {i:02d} ".encode() * 10 + b"\n")  # 91 bytes: one chunk each
        writer.flush()
    names = logship.chunks(uri, "worker-3")
    sizes = [os.path.getsize(tmp_path / "attempt-2" / "worker-3" / n) for n in names]
    assert sum(sizes) <= 400, sizes
    assert names[0].endswith("-000001.log") and names[-1].endswith("-000020.log")
    text = read_all(uri, "worker-3").decode()
    assert text.startswith("line 00 ") and text.rstrip().endswith("line 19")
    assert "[tpufinetune: chunks 2-17 dropped to keep the attempt's logs under their bound]" in text
    assert logship.streams(uri) == ["worker-3"]


def test_bytes_held_while_storage_fails_are_bounded_and_said_dropped(tmp_path):
    uri = str(tmp_path / "attempt-1")
    writer = logship.ChunkWriter(uri, logship.DRIVER, budget=4000, started_ms=1)
    (tmp_path / "attempt-1" / "driver").rmdir()
    (tmp_path / "attempt-1" / "driver").write_text("not a directory")  # every write fails
    for i in range(50):
        writer.append(f"{i:04d}".encode() * 25)  # 100 bytes
    writer.flush()
    assert writer.errors == 1 and len(writer.buffer) <= writer.chunk_limit * logship.BUFFER_CHUNKS
    (tmp_path / "attempt-1" / "driver").unlink()
    (tmp_path / "attempt-1" / "driver").mkdir()
    writer.flush()
    text = read_all(uri, logship.DRIVER).decode()
    assert text.startswith("[tpufinetune: 1000 bytes dropped: storage was too slow]\n0010"), text[:80]
    assert text.endswith("0049" * 25)


def test_the_split_of_the_attempts_bound():
    assert logship.stream_budget(1000, logship.DRIVER, 4) == 500
    assert logship.stream_budget(1000, logship.worker_stream(0), 4) == 125


def test_where_an_attempts_logs_go_and_their_bound(monkeypatch):
    for name in ("TPUFINETUNE_ATTEMPT", "TPUFT_LOGS_URI", "TPUFT_LOGS_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert logship.attempt_logs_uri("gs://b/runs", "tft-x-1") == ""  # a run by hand: no attempt, none kept
    monkeypatch.setenv("TPUFINETUNE_ATTEMPT", "3")
    assert logship.attempt_logs_uri("gs://b/runs/", "tft-x-1") == "gs://b/runs/tft-x-1/logs/attempt-3"
    monkeypatch.setenv("TPUFT_LOGS_URI", "/mnt/logs/here")
    assert logship.attempt_logs_uri("gs://b/runs", "tft-x-1") == "/mnt/logs/here"
    assert logship.max_bytes() == logship.DEFAULT_MAX_BYTES == 64 << 20
    monkeypatch.setenv("TPUFT_LOGS_MAX_BYTES", "1000")
    assert logship.max_bytes() == 1000
    monkeypatch.setenv("TPUFT_LOGS_MAX_BYTES", "lots")
    assert logship.max_bytes() == logship.DEFAULT_MAX_BYTES


def test_a_bound_of_zero_keeps_nothing(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TPUFT_LOGS_MAX_BYTES", "0")
    with logship.shipping(logship.DRIVER, str(tmp_path / "a")) as shipper:
        print("plain", flush=True)
    assert shipper is None and not (tmp_path / "a").exists()
    assert capfd.readouterr().out == "plain\n"


CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    from tpufinetune_trainer import logship
    logship.FLUSH_S = float(os.environ["FLUSH_S"])
    with logship.shipping(logship.DRIVER, os.environ["LOGS"], on_sigterm=True):
        print("python stdout", flush=True)
        print("python stderr", file=sys.stderr, flush=True)
        os.write(1, b"fd write\\n")
        subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
        for i in range(200):  # print writes a line's text and its newline apart
            print(f"out {i}", flush=True)
            print(f"err {i}", file=sys.stderr, flush=True)
        print("ready", flush=True)
        time.sleep(float(os.environ["SLEEP_S"]))
        print("after the sleep", flush=True)
""")


def _child(tmp_path, uri: str, flush_s: float, sleep_s: float) -> subprocess.Popen:
    env = {**os.environ, "LOGS": uri, "TPUFT_LOGS_MAX_BYTES": str(1 << 20), "FLUSH_S": str(flush_s),
           "SLEEP_S": str(sleep_s), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _wait_for(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_process_output_is_streamed_while_it_runs_and_kept_when_it_is_terminated(tmp_path):
    uri = str(tmp_path / "logs" / "attempt-1")
    proc = _child(tmp_path, uri, flush_s=logship.FLUSH_S, sleep_s=60)
    try:
        # Streamed: the lines are in storage one flush period after they were printed,
        # while the process still runs.
        streamed_s = _wait_for(lambda: b"ready" in read_all(uri, logship.DRIVER), timeout=logship.FLUSH_S + 10)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # as `ray job stop` does
        proc.wait(20)
    finally:
        proc.kill()
    kept = read_all(uri, logship.DRIVER).decode()
    for line in ("python stdout", "python stderr", "fd write", "child process", "ready"):
        assert line + "\n" in kept, (line, kept)
    assert "after the sleep" not in kept
    lines = kept.splitlines()
    assert [x for x in lines if x.startswith("out ")] == [f"out {i}" for i in range(200)]  # whole lines, in order
    assert [x for x in lines if x.startswith("err ")] == [f"err {i}" for i in range(200)]
    assert proc.returncode == -signal.SIGTERM  # the previous handling (the default: terminate) still applies
    # What the process's own stdout and stderr got is unchanged.
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    expected_out = "python stdout\nfd write\nchild process\n" + "".join(f"out {i}\n" for i in range(200)) + "ready\n"
    assert out == expected_out and err == "python stderr\n" + "".join(f"err {i}\n" for i in range(200)), (out, err)
    print(f"\nstreamed {streamed_s:.1f} s after start (flush every {logship.FLUSH_S:g} s)")


@pytest.mark.timeout(60)
def test_a_killed_process_loses_at_most_its_last_flush_period(tmp_path):
    uri = str(tmp_path / "logs" / "attempt-1")
    proc = _child(tmp_path, uri, flush_s=0.5, sleep_s=60)
    try:
        _wait_for(lambda: b"ready" in read_all(uri, logship.DRIVER), timeout=10)
        proc.kill()  # no handler runs: what the last flush wrote is what is kept
        proc.wait(10)
    finally:
        proc.kill()
    assert "python stdout\n" in read_all(uri, logship.DRIVER).decode()


@pytest.mark.timeout(60)
def test_a_process_that_ends_flushes_everything(tmp_path):
    uri = str(tmp_path / "logs" / "attempt-1")
    proc = _child(tmp_path, uri, flush_s=30, sleep_s=0)  # no periodic flush happens before the end
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    kept = read_all(uri, logship.DRIVER).decode()
    # Each stream's lines in order; stdout's and stderr's interleave as their pipes were read.
    assert [x for x in kept.splitlines() if not x.startswith("err ")][-2:] == ["ready", "after the sleep"]
    assert "child process\n" in kept and "err 199\n" in kept
    assert out.decode().endswith("after the sleep\n")


def test_without_a_logs_uri_nothing_is_captured(capfd):
    with logship.shipping(logship.DRIVER, "") as shipper:
        print("plain", flush=True)
    assert shipper is None
    assert capfd.readouterr().out == "plain\n"


@pytest.mark.timeout(120)
def test_chunks_in_a_bucket_are_written_and_read_the_same_way(gcs, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    uri = gcs.unique_uri("logs-test", "run") + "/logs/attempt-1"
    for rank in (0, 1):
        writer = logship.ChunkWriter(uri, logship.worker_stream(rank), budget=1 << 20, started_ms=5)
        writer.append(f"worker {rank} line\n".encode())
        writer.flush()
    driver = logship.ChunkWriter(uri, logship.DRIVER, budget=1 << 20, started_ms=5)
    reader = logship.StreamReader(uri, logship.DRIVER)
    for i in range(3):
        driver.append(f"driver {i}\n".encode())
        driver.flush()
        assert b"".join(reader.read()) == f"driver {i}\n".encode()
    assert logship.streams(uri) == ["driver", "worker-0", "worker-1"]
    assert read_all(uri, "worker-1") == b"worker 1 line\n"
    assert gcs.list(uri) == ["driver/0000000000005-000001.log", "driver/0000000000005-000002.log",
                             "driver/0000000000005-000003.log", "worker-0/0000000000005-000001.log",
                             "worker-1/0000000000005-000001.log"]


SHARED_FILE_CHILD = textwrap.dedent("""
    import os, sys, threading
    from tpufinetune_trainer import logship
    with logship.shipping(logship.DRIVER, os.environ["LOGS"]):
        def err_lines():
            for i in range(300):
                print(f"err {i} " + "e" * 300, file=sys.stderr, flush=True)
        thread = threading.Thread(target=err_lines)
        thread.start()
        for i in range(300):  # longer than a pipe hands over at once
            print(f"out {i} " + "o" * 20000, flush=True)
        thread.join()
""")


@pytest.mark.timeout(60)
def test_stdout_and_stderr_into_one_file_keep_their_lines_whole(tmp_path):
    """A Ray job's log is one file behind both descriptors; a long event line on stdout
    must not be cut by a stderr line (the operator would lose the event)."""
    log = tmp_path / "job.log"
    env = {**os.environ, "LOGS": str(tmp_path / "logs" / "attempt-1"), "TPUFT_LOGS_MAX_BYTES": str(1 << 30),
           "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as sink:
        subprocess.run([sys.executable, "-c", SHARED_FILE_CHILD], env=env, stdout=sink, stderr=sink,
                       check=True, timeout=50)
    lines = log.read_text().splitlines()
    cut = [line[:80] for line in lines if not (line.startswith("out ") and line.endswith("o" * 20000))
           and not (line.startswith("err ") and line.endswith("e" * 300))]
    assert not cut, f"{len(cut)} cut lines, e.g. {cut[:3]}"
    assert sum(line.startswith("out ") for line in lines) == 300
    assert sum(line.startswith("err ") for line in lines) == 300
