"""Shard groups within a slice (--shard-group, the operator's spec.training.sharding) on the
CPU: two gloo ranks, the state replicated on both (G = 1) against sharded over both (the
whole slice, plain FSDP; with two ranks G = 2 is that), same seed and global batch.

- Same losses: replicating the state only regroups the gradient's sum (an all-reduce in
  place of a reduce-scatter), so each step's global loss agrees within fp32 rounding.
- A checkpoint written under one choice restores under the other (DCP reshards: the
  parameters' names and shapes are the same), and the steps after it agree.
- The export is the same model: the same tensors, names and shapes, equal to the export
  dtype's rounding.
- The mesh's rows are groups of G ranks of a slice, by host then rank (slices.layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpufinetune_trainer.config import FinetuneConfig
from tpufinetune_trainer.errors import ConfigError
from tpufinetune_trainer.slices import Place, layout
from trainer_helpers import prepared_data_file, run_rank_processes

WORKER = Path(__file__).with_name("trainer_sharding_worker.py")
LENGTH = 256  # trainer_sharding_worker.LENGTH
WORLD = 2
STEPS = 3
LOSS_TOLERANCE = 1e-5
LEARNING_RATE = 1e-3  # trainer_sharding_worker's


def run_ranks(model: Path, data_file: Path, out: Path, shard_group: int, steps: int, restore: str = "") -> dict:
    def argv(rank: int, port: int) -> list[str]:
        return [str(model), str(data_file), str(out), str(port), str(rank), str(WORLD), str(shard_group), str(steps),
                *([restore] if restore else [])]

    run_rank_processes(WORKER, WORLD, argv, timeout=420)
    return torch.load(out)


def assert_same(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= LOSS_TOLERANCE * abs(x), (step, a, b)


def assert_same_export(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    def tensors(export: Path) -> dict:
        return {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}

    first, second = tensors(a), tensors(b)
    assert first and first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.shape == second[name].shape and tensor.dtype == second[name].dtype, name
        x, y = tensor.float(), second[name].float()
        # bf16 (the base's dtype): the fp32 weights' last-bit differences may round one ulp
        # apart. And AdamW normalises each element's gradient: one that is about zero (a sum
        # that cancels) can take a step of either sign when the sum's order changes, so a
        # handful of elements (1 of 111680 of the embedding, measured) differ, by no more
        # than the steps' learning rate.
        apart = (x - y).abs() > 1e-6 + 2 ** -7 * y.abs()
        assert apart.sum().item() <= max(1, x.numel() // 10_000), name
        assert (x - y).abs().max().item() <= 2 * STEPS * LEARNING_RATE, name


@pytest.mark.timeout(900)
def test_replicated_state_has_the_losses_of_full_sharding_and_checkpoints_restore_across_choices(
        trainer_assets, tmp_path):
    data_file = prepared_data_file(trainer_assets, tmp_path / "data.pkl", LENGTH)
    full = run_ranks(trainer_assets.model, data_file, tmp_path / "full.pt", shard_group=0, steps=STEPS)
    replicated = run_ranks(trainer_assets.model, data_file, tmp_path / "replicated.pt", shard_group=1, steps=STEPS)

    assert full["mesh"] == [0, 1]
    assert replicated["dims"] == ("replicate", "shard") and replicated["mesh"] == [[0], [1]]
    # Full sharding: a unit a block and the root. Replicated and kept gathered, the tiny
    # model's blocks share one unit (under 25 MB): one all-reduce of their gradients a step.
    blocks = json.loads((Path(trainer_assets.model) / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert full["units"] == blocks + 1 and replicated["units"] == 2, (full["units"], replicated["units"])
    assert full["losses"][-1] < full["losses"][0]  # it trains
    assert_same(full["losses"], replicated["losses"])
    assert_same_export(Path(full["export"]), Path(replicated["export"]))

    # Each choice restores the other's checkpoint: weights and AdamW's moments, resharded.
    replicated_from_full = run_ranks(trainer_assets.model, data_file, tmp_path / "r_from_f.pt", shard_group=1,
                                     steps=2, restore=full["checkpoint"])
    full_from_replicated = run_ranks(trainer_assets.model, data_file, tmp_path / "f_from_r.pt", shard_group=0,
                                     steps=2, restore=replicated["checkpoint"])
    assert_same(replicated_from_full["losses"], full_from_replicated["losses"])
    # Restored, not fresh: the first batch's loss is the trained model's, below a fresh start's.
    assert replicated_from_full["losses"][0] < full["losses"][0] - 1e-3


def test_a_shard_group_cuts_each_slice_into_rows_by_host_then_rank():
    places = [Place(None, 1, 0), Place(None, 0, 1), Place(None, 1, 2), Place(None, 0, 3)]
    assert layout(places, 1, 2) == [[1, 3], [0, 2]]  # one slice: no slice label needed
    assert layout(places, 1, 1) == [[1], [3], [0], [2]]
    assert layout(places, 1) == [[1, 3, 0, 2]]
    two = [Place(1, 0, 0), Place(0, 0, 1), Place(1, 0, 2), Place(0, 0, 3)]
    assert layout(two, 2, 1) == [[1], [3], [0], [2]]  # replicas span slices x groups
    with pytest.raises(ConfigError, match="--shard-group 3 does not divide the 4 devices"):
        layout(places, 1, 3)


def test_a_shard_group_that_does_not_divide_a_slice_is_refused():
    with pytest.raises(ConfigError, match="--shard-group 3 must be 0"):
        FinetuneConfig(num_workers=4, shard_group=3, storage_path="/x").validate()
    with pytest.raises(ConfigError, match="--shard-group 4 must be 0"):
        FinetuneConfig(num_workers=4, num_slices=2, shard_group=4, storage_path="/x").validate()
    assert FinetuneConfig(num_workers=4, num_slices=2, shard_group=2, storage_path="/x").validate().shard_group == 2


def test_the_mesh_is_one_dimensional_unless_a_group_is_smaller_than_the_slice(monkeypatch):
    from tpufinetune_trainer import parallelize, slices

    built = []
    monkeypatch.setattr(parallelize, "init_device_mesh", lambda device, shape: ("1-D", shape))
    monkeypatch.setattr(slices, "build_slice_mesh", lambda *args: built.append(args) or "2-D")
    assert parallelize.build_mesh("cpu", 4) == ("1-D", (4,))
    assert parallelize.build_mesh("cpu", 4, shard_group=4) == ("1-D", (4,))
    assert parallelize.build_mesh("cpu", 4, 1, "g", shard_group=2) == "2-D" and built[-1] == ("cpu", 1, "g", 2)
    assert parallelize.build_mesh("cpu", 4, 2, "g", shard_group=2) == "2-D" and built[-1] == ("cpu", 2, "g", 0)
