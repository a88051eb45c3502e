"""The gradient of a 2-rank FSDP2 step (gloo, two real processes on the CPU) is the
1-rank gradient of the same global batch, and the step's gradient norm (the `progress`
event's `grad_norm`) is the global norm of that gradient."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer_helpers import prepared_data_file, run_rank_processes

WORKER = Path(__file__).with_name("trainer_grad_worker.py")
LENGTH = 256  # trainer_grad_worker.LENGTH


def run_ranks(model: Path, data_file: Path, out: Path, world: int) -> dict:
    run_rank_processes(WORKER, world, lambda rank, port: [str(model), str(data_file), str(out), str(port),
                                                          str(rank), str(world)])
    return torch.load(out)


def test_two_ranks_give_the_one_rank_gradient_of_the_same_global_batch(trainer_assets, tmp_path):
    data_file = prepared_data_file(trainer_assets, tmp_path / "data.pkl", LENGTH)
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
