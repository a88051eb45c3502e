"""Helpers for the trainer tests: run `tpufinetune-train` for real and read its events.

A plain module with a unique name (not conftest.py), so `from trainer_helpers import …`
can never pick up another directory's conftest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.rayhead import REPO, VENV_BIN

from tpufinetune_trainer.events import PREFIX, Event, parse_text

TRAINER = VENV_BIN / "tpufinetune-train"


@dataclass
class Run:
    rc: int
    output: str
    events: list[Event]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def one(self, kind: str) -> Event:
        found = self.of(kind)
        assert len(found) == 1, f"expected one {kind} event, got {found}\n{self.tail()}"
        return found[0]

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]


def events_of(output: str) -> list[Event]:
    """Every event in a log; also asserts that every line carrying the prefix parsed."""
    events = parse_text(output)
    marked = sum(line.count(PREFIX) for line in output.splitlines())
    assert marked == len(events), f"{marked} prefixed lines but {len(events)} parsed events"
    return events


def run_trainer(args: list[str], env: dict, timeout: float = 300) -> Run:
    """Run the CLI as a process (as the Ray job entrypoint would); a hang fails the test."""
    proc = subprocess.Popen([str(TRAINER), *args], env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"tpufinetune-train {' '.join(args)} hung for {timeout}s:\n{output[-4000:]}")
    return Run(proc.returncode, output, events_of(output))


def offline_env(env: dict) -> dict:
    return dict(env, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@contextlib.contextmanager
def single_process_group():
    """A real one-rank gloo process group on a free loopback port (FSDP2 and DCP need one)."""
    import torch.distributed as dist

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# The block length of the step and loss tests.
BLOCK_LENGTH = 256


def make_trainer(model, data: dict, storage, **overrides):
    """A one-process cpu Trainer (rank 0 of 1) of the model at `model` on `data` (the
    `prepared` fixture), saving under `storage`: one epoch of micro-batches of 2 blocks of
    BLOCK_LENGTH at a learning rate of 3e-3, `overrides` (FinetuneConfig's fields) on top."""
    from tpufinetune_trainer.backends import BACKENDS
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.train import Trainer

    settings = dict(model_id=str(model), storage_path=str(storage), num_workers=1, device="cpu",
                    max_seq_len=BLOCK_LENGTH, learning_rate=3e-3, batch_size_per_device=2, num_epochs=1)
    cfg = FinetuneConfig(**{**settings, **overrides}).validate()
    return Trainer(cfg, BACKENDS["cpu"], data, rank=0, world=1, local_rank=0)


def prepared_data(assets, length: int) -> dict:
    """160 rows of the tiny assets tokenized and packed in `length`-token blocks (10% held
    out), as the step and loss tests train on them."""
    from tpufinetune_trainer.data import pad_id_of, prepare
    from tpufinetune_trainer.model import load_tokenizer

    tokenizer = load_tokenizer(str(assets.model))
    data = prepare(str(assets.data), "train[:160]", tokenizer, length, 0.1, 42)
    return {"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)}


def load_differences(old, new) -> list[str]:
    """Every way two FSDP2-sharded models differ: parameter names, full tensors (gathered:
    collective, every rank calls it), dtypes, trainability, sharding, ties, buffers, mode,
    config. Empty when the two loads made the same model."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    found = []
    old_params, new_params = dict(old.named_parameters()), dict(new.named_parameters())
    if list(old_params) != list(new_params):
        return [f"parameters differ: {sorted(set(old_params) ^ set(new_params))}"]
    for name, a in old_params.items():
        b = new_params[name]
        if isinstance(a, DTensor) != isinstance(b, DTensor) or a.requires_grad != b.requires_grad:
            found.append(f"{name}: sharding or trainability")
        full_a, full_b = full(a), full(b)
        if full_a.dtype != full_b.dtype or not torch.equal(full_a, full_b):
            found.append(f"{name}: values or dtype")
    old_buffers, new_buffers = dict(old.named_buffers()), dict(new.named_buffers())
    if list(old_buffers) != list(new_buffers):
        found.append(f"buffers differ: {sorted(set(old_buffers) ^ set(new_buffers))}")
    for name, a in old_buffers.items():
        b = new_buffers.get(name)
        if b is None or a.dtype != b.dtype or not torch.equal(a, b):
            found.append(f"buffer {name}: values or dtype")
    old_ties = {name for name, _ in old.named_parameters(remove_duplicate=False)} - set(old_params)
    new_ties = {name for name, _ in new.named_parameters(remove_duplicate=False)} - set(new_params)
    if old_ties != new_ties:
        found.append(f"tied weights differ: {old_ties} vs {new_ties}")
    if old.training != new.training:
        found.append("train/eval mode")
    if old.config.to_dict() != new.config.to_dict():
        found.append("config")
    if old.generation_config.to_dict() != new.generation_config.to_dict():
        found.append("generation config")
    return found



def run_rank_processes(worker: Path, world: int, argv_of, timeout: float = 240) -> None:
    """`worker` once per rank, as separate processes meeting over gloo on a free loopback
    port; `argv_of(rank, port)` gives each its arguments. A rank that fails fails the test
    with its output; a hang kills every rank."""
    port = free_port()
    # The workers import the test helpers as pytest's configured path does (`make test`
    # sets no PYTHONPATH): they get this process's path.
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    procs = [subprocess.Popen([sys.executable, str(worker), *argv_of(rank, port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]


def prepared_data_file(assets, out: Path, length: int) -> Path:
    """The test data's first 160 rows prepared as `finetune` prepares them (blocks of
    `length`), pickled for rank processes to load with `load_data_file`."""
    import pickle

    from tpufinetune_trainer.data import pad_id_of, prepare
    from tpufinetune_trainer.model import load_tokenizer

    tokenizer = load_tokenizer(str(assets.model))
    data = prepare(str(assets.data), "train[:160]", tokenizer, length, 0.1, 42)
    out.write_bytes(pickle.dumps({"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)}))
    return out


def load_data_file(path: str) -> dict:
    """What `prepared_data_file` wrote, in a rank process."""
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)
