"""The Ray pods' preStop hook (sizing.PRE_STOP_SCRIPT) run by /bin/sh against workers that
announce themselves with the trainer's own notice code: it signals each worker and waits
for it to save, and never signals a process that was given the pid of a worker that died
without removing its file (pids wrap: pid_max is often 32768)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tpufinetune.core.sizing import PRE_STOP_SCRIPT
from tpufinetune_trainer import notice

# A worker as the trainer announces it: SIGTERM makes it "save" (remove its file) and exit.
WORKER = """
import os, signal, sys, time
from tpufinetune_trainer import notice
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), notice.done(), os._exit(0)))
notice._announce(True)
print("announced", flush=True)
time.sleep(120)
"""


def _worker(notice_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env={**os.environ, notice.NOTICE_DIR_ENV: str(notice_dir)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "announced"
    return proc


def _hook(notice_dir, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", PRE_STOP_SCRIPT], env={"TPUFT_NOTICE_DIR": str(notice_dir),
                                                                  "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def bystander():
    """A live process that is not a worker of the pod (another pod's, or a later one's)."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_hook_signals_each_announced_worker_and_waits_until_it_has_saved(tmp_path):
    workers = [_worker(tmp_path) for _ in range(2)]
    assert sorted(int(f.name) for f in tmp_path.iterdir()) == sorted(w.pid for w in workers)
    assert all((tmp_path / str(w.pid)).read_text() == notice.start_time(w.pid) for w in workers)
    started = time.monotonic()
    assert _hook(tmp_path).returncode == 0
    assert time.monotonic() - started >= 0.3  # it waited for the saves
    assert [w.wait(10) for w in workers] == [0, 0]
    assert not any(tmp_path.iterdir())


def test_a_stale_file_whose_pid_now_names_another_process_neither_signals_it_nor_holds_the_hook(tmp_path, bystander):
    # A worker that died without removing its file, its pid since given to `bystander`.
    (tmp_path / str(bystander.pid)).write_text(str(int(notice.start_time(bystander.pid)) - 1))
    worker = _worker(tmp_path)
    assert _hook(tmp_path, timeout=10).returncode == 0
    assert worker.wait(10) == 0
    assert bystander.poll() is None, "the hook signalled a process that is not the pod's worker"


def test_a_file_without_a_start_time_from_an_earlier_trainer_is_signalled_by_its_pid(tmp_path):
    worker = _worker(tmp_path)
    (tmp_path / str(worker.pid)).write_text("")  # as trainers before the start time wrote it
    assert _hook(tmp_path, timeout=10).returncode == 0
    assert worker.wait(10) == 0
    assert not any(tmp_path.iterdir())
