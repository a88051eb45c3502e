"""Several slices on the CPU: HSDP over gloo with a 2x2 mesh (two slices of two ranks, four
real processes) against plain FSDP over four ranks, same seed and global batch.

- Same loss curve: HSDP only regroups the gradient's sum (reduce-scatter within a slice,
  all-reduce across), so every step's global loss agrees within fp32 rounding.
- The mesh comes from each rank's slice as its pod gives it (TPUFT_SLICE_INDEX), not from
  the rank order: the slices here interleave the ranks (0 and 2 are slice 0).
- The checkpoint holds each shard once: DCP writes a shard replicated across slices from one
  rank only, so HSDP's checkpoint is no bigger than plain FSDP's of the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpufinetune_trainer.errors import ConfigError
from tpufinetune_trainer.slices import Place, layout
from trainer_helpers import prepared_data_file, run_rank_processes

WORKER = Path(__file__).with_name("trainer_hsdp_worker.py")
LENGTH = 256  # trainer_hsdp_worker.LENGTH
WORLD = 4
# fp32 on the CPU: the two runs differ only in the order of the gradient sums.
LOSS_TOLERANCE = 1e-4


def run_ranks(model: Path, data_file: Path, out: Path, slices: int) -> dict:
    def argv(rank: int, port: int) -> list[str]:
        return [str(model), str(data_file), str(out), str(port), str(rank), str(WORLD), str(slices),
                str(rank % slices)]

    run_rank_processes(WORKER, WORLD, argv, timeout=420)
    return torch.load(out)


def data_bytes(checkpoint: str) -> tuple[int, int]:
    """(bytes, files) of a checkpoint's DCP data files (its metadata and state left out)."""
    files = [f for f in Path(checkpoint).iterdir() if f.suffix == ".distcp"]
    return sum(f.stat().st_size for f in files), len(files)


@pytest.mark.timeout(900)
def test_hsdp_two_by_two_has_the_loss_curve_of_fsdp_over_four_and_writes_each_shard_once(trainer_assets, tmp_path):
    data_file = prepared_data_file(trainer_assets, tmp_path / "data.pkl", LENGTH)
    fsdp = run_ranks(trainer_assets.model, data_file, tmp_path / "fsdp.pt", slices=1)
    hsdp = run_ranks(trainer_assets.model, data_file, tmp_path / "hsdp.pt", slices=2)

    assert hsdp["dims"] == ("replicate", "shard")
    assert hsdp["mesh"] == [[0, 2], [1, 3]]  # by each rank's slice, not its rank
    assert fsdp["mesh"] == [0, 1, 2, 3]
    assert len(fsdp["losses"]) == len(hsdp["losses"]) == 5
    assert fsdp["losses"][-1] < fsdp["losses"][0]  # it trains: a curve, not a constant
    for step, (a, b) in enumerate(zip(fsdp["losses"], hsdp["losses"])):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(a), (step, fsdp["losses"], hsdp["losses"])

    fsdp_bytes, _ = data_bytes(fsdp["checkpoint"])
    hsdp_bytes, hsdp_files = data_bytes(hsdp["checkpoint"])
    # Written twice (once per slice), HSDP's would be about 2x FSDP's.
    assert fsdp_bytes > 0 and hsdp_bytes <= 1.05 * fsdp_bytes, (hsdp_bytes, fsdp_bytes)
    assert hsdp_files >= 2


def test_a_ranks_slice_comes_from_its_pod_the_replica_label_first():
    from tpufinetune_trainer.slices import place

    assert place(5, {"TPUFT_SLICE_INDEX": "1", "TPU_NAME": "v6e-16-0", "TPU_WORKER_ID": "3"}) == Place(1, 3, 5)
    assert place(2, {"TPU_NAME": "v6e-16-1", "TPU_WORKER_ID": "2"}) == Place(1, 2, 2)
    assert place(0, {}) == Place(None, 0, 0)
    with pytest.raises(ConfigError, match="TPUFT_SLICE_INDEX='x'"):
        place(0, {"TPUFT_SLICE_INDEX": "x"})


def test_the_mesh_rows_are_slices_ordered_by_host_then_rank():
    places = [Place(1, 1, 0), Place(0, 0, 1), Place(1, 0, 2), Place(0, 1, 3)]
    assert layout(places, 2) == [[1, 3], [2, 0]]


@pytest.mark.parametrize("places, words", [
    ([Place(0, 0, 0), Place(None, 0, 1)], "ranks \\[1\\] cannot tell which slice"),
    ([Place(0, 0, 0), Place(0, 1, 1), Place(0, 2, 2), Place(1, 0, 3)], "slice 0: 3, slice 1: 1"),
    ([Place(0, 0, 0), Place(2, 0, 1)], "slice 0: 1, slice 2: 1"),
])
def test_ranks_that_do_not_form_whole_slices_are_refused(places, words):
    with pytest.raises(ConfigError, match=words):
        layout(places, 2)


def test_a_resume_on_another_slice_count_is_refused_and_one_slice_matches_older_checkpoints():
    from tpufinetune_trainer import resume
    from tpufinetune_trainer.config import FinetuneConfig
    from tpufinetune_trainer.data import Examples
    from tpufinetune_trainer.errors import ResumeMismatch

    examples = Examples([[1, 2, 3]] * 64, [[-100, 2, 3]] * 64)
    one = resume.fingerprint(FinetuneConfig(num_workers=4, storage_path="/x"), 4, examples)
    two = resume.fingerprint(FinetuneConfig(num_workers=4, num_slices=2, storage_path="/x"), 4, examples)
    assert "num_slices" not in one and two["num_slices"] == 2
    with pytest.raises(ResumeMismatch, match=r"slices \(--num-slices, spec.tpu.slices\) 2 -> null"):
        resume.check({"fingerprint": two}, one, "gs://b/run/step_1")
    assert resume.check({"fingerprint": one}, dict(one), "gs://b/run/step_1")
