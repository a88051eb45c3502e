"""trainer_state.json, the file that makes a checkpoint complete, is never torn: on a path
it is written under another name and renamed into place, so a writer killed mid-write (a
real process, SIGKILL) leaves the checkpoint incomplete and a resume takes the previous
one; and a state file that does not parse (torn by an older trainer, or a file system that
lost its tail) is passed over the same way instead of failing the resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tpufinetune_trainer import checkpoint as ckpt


def write(run: Path, name: str, step: int | None) -> Path:
    directory = run / name
    dcp.save({"model": {"w": torch.full((4,), float(step or 0))}},
             storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    if step is not None:
        ckpt.write_trainer_state(str(directory), json.dumps({"epoch": 1, "step": step}))
    return directory


WRITER = """
import json, sys
from tpufinetune_trainer import checkpoint as ckpt
ckpt.write_trainer_state(sys.argv[1], json.dumps({"epoch": 1, "step": 30, "history": ["x" * int(sys.argv[2])]}))
"""


def kill_mid_write(directory: Path, size: int) -> bool:
    """Start a writer of a `size`-byte state and SIGKILL it once a file of the state is
    partly written; True when it was caught mid-write."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(size)],
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    caught = False
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        partial = [e for e in os.scandir(directory) if ckpt.STATE_FILE in e.name and 0 < e.stat().st_size < size]
        if partial:
            os.kill(proc.pid, signal.SIGKILL)
            caught = True
            break
    proc.wait()
    return caught


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_the_one_resumed(tmp_path):
    run = tmp_path / "run"
    write(run, "step_0000020-a", 20)
    torn = write(run, "step_0000030-a", None)  # shards and metadata written; the state is next
    caught = False
    for size in (64 << 20, 256 << 20, 512 << 20):
        caught = kill_mid_write(torn, size)
        if caught:
            break
    assert caught, "the writer finished before it could be killed mid-write"
    state = torn / ckpt.STATE_FILE
    assert not state.exists() or json.loads(state.read_text())["step"] == 30  # never torn
    assert ckpt.latest_complete(str(run)) == str(run / "step_0000020-a")
    assert not ckpt.is_complete(str(torn))


def test_a_state_file_that_does_not_parse_is_passed_over(tmp_path):
    run = tmp_path / "run"
    write(run, "step_0000020-a", 20)
    torn = write(run, "step_0000030-a", 30)
    text = (torn / ckpt.STATE_FILE).read_text()
    (torn / ckpt.STATE_FILE).write_text(text[: len(text) // 2])  # what a torn write left
    assert ckpt.latest_complete(str(run)) == str(run / "step_0000020-a")
    assert not ckpt.is_complete(str(torn))
    (torn / ckpt.STATE_FILE).write_text(text)
    assert ckpt.latest_complete(str(run)) == str(torn)
    assert ckpt.is_complete(str(torn))
    assert [p.name for p in torn.iterdir() if ckpt.STATE_FILE in p.name] == [ckpt.STATE_FILE]  # no partial left
