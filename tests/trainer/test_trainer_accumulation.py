"""Gradient accumulation over several slices (HSDP) all-reduces across the slices once a
step, not once a micro-batch: the micro-batches before the last are reduce-scattered within
their slice and summed there, and the last one's backward all-reduces the sum over the
data-centre network. Two slices, accumulation 4, two real gloo processes: the all-reduces on
the replicate group are counted (one per FSDP unit per step, where every micro-batch's
used to be four), and the gradients are plain FSDP's over the same two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_helpers import prepared_data_file, run_rank_processes

WORKER = Path(__file__).with_name("trainer_accum_worker.py")
LENGTH = 256  # trainer_accum_worker.LENGTH
WORLD = 2


def run(model: Path, data_file: Path, out: Path, slices: int) -> dict:
    run_rank_processes(WORKER, WORLD, lambda rank, port: [str(model), str(data_file), str(out), str(port),
                                                          str(rank), str(WORLD), str(slices)], timeout=420)
    return torch.load(out)


@pytest.mark.timeout(900)
def test_accumulation_all_reduces_across_slices_once_a_step(trainer_assets, tmp_path):
    data_file = prepared_data_file(trainer_assets, tmp_path / "data.pkl", LENGTH)
    hsdp = run(trainer_assets.model, data_file, tmp_path / "hsdp.pt", slices=2)
    fsdp = run(trainer_assets.model, data_file, tmp_path / "fsdp.pt", slices=1)
    assert hsdp["units"] > 1
    assert hsdp["all_reduces"] == hsdp["units"], (hsdp["all_reduces"], hsdp["units"])  # not 4 x units
    assert fsdp["all_reduces"] == 0
    for a, b in zip(hsdp["grads"], fsdp["grads"]):  # the same sum, regrouped: fp32 rounding only
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert any(bool(g.abs().sum() > 0) for g in hsdp["grads"])
