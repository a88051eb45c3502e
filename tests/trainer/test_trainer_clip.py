"""The trainer's gradient clip (`parallelize.clip_grad_norm`, on the local shards) gives
torch's `clip_grad_norm_` over FSDP2's DTensors: the same global norm and the same clipped
gradients, on one slice's 1-D mesh and on HSDP's 2-D one, where the replicated dimension
holds copies that must not be summed (four real gloo processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpufinetune_trainer.parallelize import clip_grad_norm
from trainer_helpers import run_rank_processes

WORKER = Path(__file__).with_name("trainer_clip_worker.py")


def test_the_sharded_clip_matches_torchs_on_fsdp_and_hsdp_meshes(tmp_path):
    out = tmp_path / "clip.pt"
    run_rank_processes(WORKER, 4, lambda rank, port: [str(out), str(port), str(rank), "4"], timeout=180)
    results = torch.load(out)
    assert len(results) == 4
    clipped = 0
    for (shape, max_norm), result in results.items():
        ours, theirs = result["norms"]
        assert ours == pytest.approx(theirs, rel=1e-5), (shape, max_norm)
        assert ours > 0.05  # the small threshold really clips
        for a, b in zip(*result["grads"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (shape, max_norm)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in result["grads"][0]]))
        if max_norm < ours:
            clipped += 1
            assert float(total) == pytest.approx(max_norm, rel=1e-4)
        else:
            assert float(total) == pytest.approx(ours, rel=1e-5)
    assert clipped == 2


def test_plain_tensors_are_clipped_as_torch_clips_them():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(2))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params[:2], twins[:2]):  # the last has no gradient
        p.grad = torch.randn_like(p)
        t.grad = p.grad.clone()
    norm = clip_grad_norm(params, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.5, foreach=True)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6) and float(norm) > 0.5
    for p, t in zip(params[:2], twins[:2]):
        assert torch.allclose(p.grad, t.grad)
    assert params[2].grad is None


def test_with_no_gradients_the_norm_is_a_zero_on_the_parameters_device():
    """A step whose trained parameters got no gradient (all frozen in this micro-batch's
    path) returns a zero norm on their device: progress stacks it with the device's loss sum,
    and a CPU zero beside a TPU tensor fails there. The meta device stands in for the
    accelerator: a real device other than the host's, with no storage."""
    params = [torch.nn.Parameter(torch.empty(4, 3, device="meta")), torch.nn.Parameter(torch.empty(2, device="meta"))]
    norm = clip_grad_norm(params, 1.0)
    assert norm.device == params[0].device and norm.shape == () and norm.dtype == torch.float32
    loss_sum = torch.zeros((), device="meta")
    assert torch.stack([loss_sum, norm]).device.type == "meta"  # what emit_progress does
