"""The export's weights reach the host on rank 0 only, in the export's dtype: every rank
takes part in each tensor's all-gather (a collective), cast to bf16 on its shard first, so
the gather moves half of fp32's bytes, and only rank 0 copies the gathered tensor to its
host. Two real gloo processes; the bytes are counted per rank (trainer_export_worker.py).
Every rank used to copy every tensor to its host in fp32: E4B's 2.7 GB embedding on all 16
workers of a v6e-16. The files are what the fp32 model gives cast to bf16, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trainer_helpers import run_rank_processes

WORKER = Path(__file__).with_name("trainer_export_worker.py")
WORLD = 2


@pytest.mark.timeout(600)
def test_only_rank_zero_copies_the_export_to_its_host_and_the_gather_is_in_the_exports_dtype(trainer_assets, tmp_path):
    destination, out = tmp_path / "export", tmp_path / "counts"
    run_rank_processes(WORKER, WORLD, lambda rank, port: [str(trainer_assets.model), str(out), str(destination),
                                                          str(port), str(rank), str(WORLD)], timeout=420)
    ranks = [torch.load(f"{out}.{rank}.pt") for rank in range(WORLD)]
    reference = ranks[0]["reference"]
    export_bytes = ranks[0]["written"]["bytes"]
    assert export_bytes > 0 and ranks[1]["written"] == {}
    assert ranks[1]["counts"]["host"] == 0, ranks[1]["counts"]  # nothing on another rank's host
    assert ranks[0]["counts"]["host"] == export_bytes, (ranks[0]["counts"], export_bytes)  # bf16, once
    fp32_bytes = sum(t.numel() * 4 for t in reference.values() if t.is_floating_point())
    for rank in ranks:  # every rank gathers the sharded tensors, in bf16
        assert 0 < rank["counts"]["gathered"] <= fp32_bytes // 2, (rank["counts"], fp32_bytes)
    files = sorted(destination.glob("*.safetensors"))
    seen = 0
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                full = next(v for k, v in reference.items() if k.replace("_orig_mod.", "") == key)
                assert torch.equal(f.get_tensor(key), full.to(torch.bfloat16) if full.is_floating_point() else full), key
                seen += 1
    assert seen > 0
