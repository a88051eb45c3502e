"""The gradient of a 2-rank FSDP2 step (gloo, two real processes on the CPU) is the
1-rank gradient of the same global batch, and the step's gradient norm (the `progress`
event's `grad_norm`) is the global norm of that gradient."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch

from harness.ports import free_port
from tpufinetune_trainer.data import pad_id_of, prepare
from tpufinetune_trainer.model import load_tokenizer

WORKER = Path(__file__).with_name("trainer_grad_worker.py")
LENGTH = 256  # trainer_grad_worker.LENGTH


def run_ranks(model: Path, data_file: Path, out: Path, world: int) -> dict:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(model), str(data_file), str(out), str(port),
                               str(rank), str(world)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return torch.load(out)


def test_two_ranks_give_the_one_rank_gradient_of_the_same_global_batch(trainer_assets, tmp_path):
    tokenizer = load_tokenizer(str(trainer_assets.model))
    data = prepare(str(trainer_assets.data), "train[:160]", tokenizer, LENGTH, 0.1, 42)
    data_file = tmp_path / "data.pkl"
    data_file.write_bytes(pickle.dumps({"train": data.train, "eval": data.eval, "pad_id": pad_id_of(tokenizer)}))
    one = run_ranks(trainer_assets.model, data_file, tmp_path / "one.pt", world=1)
    two = run_ranks(trainer_assets.model, data_file, tmp_path / "two.pt", world=2)
    assert one["names"] == two["names"] and len(one["grads"]) > 10
    nonzero = 0
    for name, a, b in zip(one["names"], one["grads"], two["grads"]):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        # fp32; only the order of the sums differs (FSDP's reduce-scatter over two ranks)
        assert torch.linalg.vector_norm(a - b) <= 1e-5 * torch.linalg.vector_norm(a) + 1e-9, name
        nonzero += bool(torch.any(a != 0))
    assert nonzero > len(one["grads"]) // 2  # the gradients are real, not all zero
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in one["grads"]]))
    assert abs(one["grad_norm"] - float(expected)) <= 1e-5 * float(expected)
    assert abs(two["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"]
