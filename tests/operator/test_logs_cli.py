"""Each attempt's logs: where they are (one function, jobspec.logs_uri, for the status, the
trainer's environment and the reader), status.attempts[].logsURI, and `tpufinetune logs`
reading what the trainer's writer wrote, all at once or following it."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tpufinetune import cli
from tpufinetune.adapters import runlogs
from tpufinetune.core import attempts, jobspec
from tpufinetune.core.api import parse_spec
from tpufinetune_trainer import cli as trainer_cli
from tpufinetune_trainer import logship

from phase_helpers import spec_with

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)


def test_the_trainer_writes_an_attempts_logs_where_the_operator_says_they_are(monkeypatch):
    """The trainer finds the place from what the job gives it (its argv, TPUFINETUNE_ATTEMPT
    in the job's env); the operator computes it for the status: the same URI."""
    spec = parse_spec(spec_with(checkpoint={"storagePath": "gs://bucket/runs/"}))
    job = jobspec.job_submission("demo", "ns", "6f1c2d3e-aaaa", spec, attempt=3)
    expected = f"gs://bucket/runs/{jobspec.run_name('demo', '6f1c2d3e-aaaa')}/logs/attempt-3"
    assert jobspec.logs_uri(jobspec.run_logs_root("demo", "6f1c2d3e-aaaa", spec), 3) == expected
    monkeypatch.delenv(logship.LOGS_URI_ENV, raising=False)
    for key, value in job.runtime_env["env_vars"].items():
        monkeypatch.setenv(key, value)
    assert trainer_cli._logs_uri(job.entrypoint_argv[1:]) == expected  # the driver's
    config = trainer_cli._config(trainer_cli.build_parser().parse_args(job.entrypoint_argv[1:])).validate()
    assert logship.attempt_logs_uri(config.storage_path, config.run_name) == expected  # each worker's
    with pytest.raises(ValueError, match="attempt"):
        jobspec.logs_uri("gs://b/r/logs", 0)


def test_a_collectives_run_and_its_preflight_keep_no_logs(monkeypatch):
    spec = parse_spec(spec_with(mode="collectives"))
    assert jobspec.run_logs_root("demo", "u", spec) == ""
    monkeypatch.setenv(logship.ATTEMPT_ENV, "1")
    monkeypatch.delenv(logship.LOGS_URI_ENV, raising=False)
    assert trainer_cli._logs_uri(jobspec.job_submission("demo", "ns", "u", spec, 1).entrypoint_argv[1:]) == ""
    finetune = parse_spec(spec_with())
    assert trainer_cli._logs_uri(jobspec.preflight_submission("d", "ns", "u", finetune, 1).entrypoint_argv[1:]) == ""


def test_each_attempt_entry_links_its_own_logs_once():
    root = "gs://b/tft-demo-6f1c/logs"
    s = {"attempt": 1}
    first = attempts.begin(s, T0, logs_root=root)
    assert first["logsURI"] == f"{root}/attempt-1"
    attempts.begin(s, T0, logs_root="gs://elsewhere/logs")  # a spec edit mid-attempt: the logs stay where written
    assert s["attempts"][0]["logsURI"] == f"{root}/attempt-1"
    attempts.end(s, T0, "AppFailed", "boom", keep_slice=True)
    s["attempt"] = 2
    attempts.begin(s, T0, took_over=s["attempts"][0], logs_root=root)
    assert [e["logsURI"] for e in s["attempts"]] == [f"{root}/attempt-1", f"{root}/attempt-2"]
    assert "logsURI" not in attempts.begin({"attempt": 1}, T0)  # a run that keeps none


def run_object(status: dict, storage_path: str = "gs://b/ckpt") -> dict:
    spec = spec_with(checkpoint={"storagePath": storage_path})
    return {"metadata": {"name": "demo", "namespace": "ns", "uid": "6f1c2d3e-aaaa"}, "spec": spec, "status": status}


def test_which_attempt_and_where_its_logs_are():
    status = {"attempt": 2, "attempts": [{"attempt": 1, "startTime": "t", "endTime": "t", "logsURI": "gs://x/a1"},
                                         {"attempt": 2, "startTime": "t"}]}
    obj = run_object(status)
    assert runlogs.attempt_of(obj, None)[0] == 2  # the current one by default
    number, entry = runlogs.attempt_of(obj, 1)
    assert runlogs.logs_uri_of(obj, number, entry) == "gs://x/a1"
    # An entry without the field (folded out of the list, or an older operator's): the
    # same place, from the spec.
    number, entry = runlogs.attempt_of(obj, 2)
    assert runlogs.logs_uri_of(obj, number, entry) == f"gs://b/ckpt/{jobspec.run_name('demo', '6f1c2d3e-aaaa')}/logs/attempt-2"
    with pytest.raises(LookupError, match="no attempt 3"):
        runlogs.attempt_of(obj, 3)
    with pytest.raises(LookupError, match="no attempt yet"):
        runlogs.attempt_of(run_object({}), None)
    assert runlogs.ended(obj, 1) and not runlogs.ended(obj, 2) and runlogs.ended(None, 2)


def _write(uri: str, stream: str, lines: list[str], started_ms: int = 1) -> logship.ChunkWriter:
    writer = logship.ChunkWriter(uri, stream, budget=1 << 20, started_ms=started_ms)
    for line in lines:
        writer.append(f"{line}\n".encode())
        writer.flush()
    return writer


def test_show_prints_a_streams_chunks_in_order(tmp_path):
    uri = str(tmp_path / "logs" / "attempt-1")
    _write(uri, logship.DRIVER, ["driver 1", "driver 2"])
    _write(uri, logship.worker_stream(1), ["worker one"])
    out: list[bytes] = []
    assert runlogs.show(uri, runlogs.stream_name(None), out.append)
    assert b"".join(out) == b"driver 1\ndriver 2\n"
    out.clear()
    assert runlogs.show(uri, runlogs.stream_name(1), out.append) and out == [b"worker one\n"]
    assert not runlogs.show(uri, runlogs.stream_name(5), out.append)
    assert runlogs.available(uri) == "driver, worker-1"


@pytest.mark.timeout(30)
def test_follow_prints_what_is_written_while_the_attempt_runs_and_stops_once_it_ended(tmp_path):
    uri = str(tmp_path / "logs" / "attempt-1")
    writer = _write(uri, logship.DRIVER, ["before"])
    state = {"status": {"attempt": 1, "attempts": [{"attempt": 1, "startTime": "t"}]}}
    seen: list[tuple[float, bytes]] = []
    started = time.monotonic()

    written: list[float] = []

    def later():
        for i in range(3):
            time.sleep(0.5)
            writer.append(f"live {i}\n".encode())
            writer.flush()
            written.append(time.monotonic() - started)
        state["status"]["attempts"][0]["endTime"] = "t"
        time.sleep(0.1)
        writer.append(b"last words\n")  # the final flush of a process that just ended
        writer.flush()

    thread = threading.Thread(target=later)
    thread.start()
    assert runlogs.show(uri, logship.DRIVER, lambda b: seen.append((time.monotonic() - started, b)), follow=True,
                        read_obj=lambda: state, number=1, poll_s=0.1, settle_s=0.5)
    thread.join()
    assert b"".join(b for _, b in seen) == b"before\nlive 0\nlive 1\nlive 2\nlast words\n"
    # Followed, not read at the end: the first live line came before the last was written.
    first_live = next(t for t, b in seen if b.startswith(b"live 0"))
    assert first_live < written[2], (seen, written)


def test_the_command_refuses_bad_numbers_before_reaching_anything(capsys):
    assert cli.main(["logs", "demo", "--attempt", "0"]) == cli.EXIT_INVALID
    assert "--attempt must be 1 or more" in capsys.readouterr().err
    assert cli.main(["logs", "demo", "--worker", "-1"]) == cli.EXIT_INVALID


@pytest.mark.parametrize("argv", [["logs", "demo"], ["eval", "demo", "--samples"]], ids=["logs", "eval-samples"])
def test_without_pyarrow_the_command_names_the_extra(argv):
    """Both readers of a run's storage (tpufinetune logs, tpufinetune eval --samples)."""
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            f"from tpufinetune import cli; sys.exit(cli.main({argv!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == cli.EXIT_INVALID, proc.stderr
    assert "pip install 'tpufinetune[logs]'" in proc.stderr


def test_the_logs_extra_pins_pyarrow_as_the_trainer_lock_and_kubernetes_as_the_operator():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {extra: dict(p.split("==") for p in extras[extra]) for extra in ("logs", "operator")}
    assert pins["logs"]["kubernetes"] == pins["operator"]["kubernetes"]
    lock = (REPO / "requirements" / "trainer-py311.lock.txt").read_text()
    assert f"\npyarrow=={pins['logs']['pyarrow']} " in lock


def test_logs_reads_the_run_from_the_api_server_and_prints_an_attempts_lines(control_plane, namespace, tmp_path,
                                                                            capsys):
    uri = str(tmp_path / "logs" / "attempt-1")
    _write(uri, logship.DRIVER, ["driver says hello"])
    _write(uri, logship.worker_stream(0), ["worker 0 says hello"])
    manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                "metadata": {"name": "demo", "namespace": namespace},
                "spec": {"tpu": {"generation": "v6e", "topology": "2x2"}, "image": "registry.example/t:1",
                         "checkpoint": {"storagePath": "gs://b/ckpt"}}}
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    status = {"phase": "Failed", "attempt": 1,
              "attempts": [{"attempt": 1, "startTime": "2026-12-05T10:00:00Z", "endTime": "2026-12-05T10:05:00Z",
                            "reason": "AppFailed", "logsURI": uri}]}
    control_plane.kubectl("-n", namespace, "patch", "tpufinetune", "demo", "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": status}))
    kubeconfig = ["--kubeconfig", str(control_plane.kubeconfig)]
    assert cli.main(["logs", "demo", "-n", namespace, "--attempt", "1", *kubeconfig]) == 0
    assert capsys.readouterr().out == "driver says hello\n"
    assert cli.main(["logs", "demo", "-n", namespace, "--worker", "0", "--follow", *kubeconfig]) == 0
    assert capsys.readouterr().out == "worker 0 says hello\n"
    assert cli.main(["logs", "demo", "-n", namespace, "--worker", "3", *kubeconfig]) == 1
    assert "streams kept: driver, worker-0" in capsys.readouterr().err
    assert cli.main(["logs", "missing", "-n", namespace, *kubeconfig]) == 1
    assert f"tpufinetune {namespace}/missing not found" in capsys.readouterr().err
