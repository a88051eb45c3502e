"""The checkpoints' writer and the startup probe (checkpoint.py): every rank writes its
shards into WRITE_THREADS files in parallel, straight to the path or URI, and before training a tiny sharded state is
saved and loaded the way every checkpoint will be, through the same writer, reader, gloo
group and storage, then removed; a storage it cannot use stops the run with a StorageError
naming it and the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tpufinetune_trainer import checkpoint as ckpt
from tpufinetune_trainer.errors import StorageError
from tpufinetune_trainer.parallelize import build_mesh
from trainer_helpers import run_rank_processes

WORKER = Path(__file__).with_name("trainer_probe_worker.py")


def shard_files(world: int) -> list[str]:
    return [f"__{rank}_{i}.distcp" for rank in range(world) for i in range(ckpt.WRITE_THREADS)]


def probe(location) -> dict:
    return ckpt.startup_probe(str(location), build_mesh("cpu", 1), torch.device("cpu"), dist.group.WORLD)


def test_the_probe_saves_and_loads_a_sharded_state_and_removes_its_directory(tmp_path, process_group):
    run_dir = tmp_path / "storage" / "run"
    result = probe(run_dir / ckpt.PROBE_DIR)
    assert result["files"] == sorted([".metadata", *shard_files(1)])  # what a checkpoint's writer writes
    assert result["removed"] and result["remove_error"] is None
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # nothing of the probe is left
    assert probe(run_dir / ckpt.PROBE_DIR)["removed"]  # a rerun (the next attempt) probes again


def test_a_probe_in_a_bucket_is_written_and_read_in_place_and_removed(gcs, monkeypatch, process_group):
    from tpufinetune_trainer import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    location = ckpt.join_uri(gcs.unique_uri("runs", "probe"), "run", ckpt.PROBE_DIR)
    result = probe(location)
    assert result["files"] == sorted([".metadata", *shard_files(1)]) and result["removed"], result
    assert not storage.exists(location)


def test_a_storage_the_probe_cannot_write_fails_with_a_storage_error_naming_it_and_the_cause(
        tmp_path, process_group):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    location = blocker / "run" / ckpt.PROBE_DIR
    with pytest.raises(StorageError) as failed:
        probe(location)
    message = str(failed.value)
    assert f"Checkpoint storage {location}" in message and "could not create its directory" in message
    assert "rank 0: NotADirectoryError" in message, message


def probe_ranks(location: str, out_prefix: Path, world: int = 2) -> list[dict]:
    run_rank_processes(WORKER, world, lambda rank, port: [location, str(out_prefix), str(port), str(rank), str(world)])
    return [json.loads(Path(f"{out_prefix}.{rank}.json").read_text()) for rank in range(world)]


def test_two_ranks_probe_a_shared_storage_and_agree_when_it_is_not_shared(tmp_path):
    common = tmp_path / "common-storage" / "run" / ckpt.PROBE_DIR
    first, second = probe_ranks(str(common), tmp_path / "common-result")
    assert first["files"] == sorted([".metadata", *shard_files(2)]) and first["removed"], first
    assert second["files"] == [] and not common.exists()  # rank 0 lists and removes
    # A path meant to be common that is each host's own disk: rank 1's files are not where rank 0's
    # metadata is, so rank 1 cannot load; every rank stops, naming rank 1's cause.
    apart = list(probe_ranks(str(tmp_path / "host{rank}" / "run" / ckpt.PROBE_DIR),
                                  tmp_path / "apart-result"))
    for result in apart:
        assert "could not load the state back: ranks 0, 1: DCP on rank 1: AssertionError: metadata is None" \
            in result["error"] and "No such file or directory" in result["error"], result
    assert f"Checkpoint storage {tmp_path / 'host0' / 'run' / ckpt.PROBE_DIR}" in apart[0]["error"]


def test_a_probe_whose_state_cannot_be_read_back_fails(tmp_path, process_group, monkeypatch):
    """A storage that accepts the files but returns something else (here: DCP's load
    writes nothing back) fails the check of every rank's values."""
    monkeypatch.setattr(ckpt.dcp, "load", lambda *args, **kwargs: None)
    with pytest.raises(StorageError, match="could not read back what it wrote: rank 0: the loaded values differ"):
        probe(tmp_path / "storage" / "run" / ckpt.PROBE_DIR)
    assert not (tmp_path / "storage" / "run" / ckpt.PROBE_DIR).exists()  # removed on failure too


def tiny_sharded_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=build_mesh("cpu", 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_checkpoint_is_written_in_write_threads_files_per_rank_and_loads_back(tmp_path, process_group):
    model, optimizer = tiny_sharded_model(0)
    directory = tmp_path / "epoch_0001"
    ckpt.save_sharded(model, optimizer, str(directory), {"epoch": 1, "step": 3}, dist.group.WORLD)
    assert ckpt.WRITE_THREADS > 1
    assert sorted(p.name for p in directory.iterdir()) == sorted([".metadata", *shard_files(1), ckpt.STATE_FILE])
    assert ckpt.is_complete(str(directory))  # every file the metadata names is there

    other, other_optimizer = tiny_sharded_model(1)
    state = ckpt.load_sharded(other, other_optimizer, str(directory), dist.group.WORLD)
    assert state == {"epoch": 1, "step": 3}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    moments = [s["exp_avg"].full_tensor() for s in optimizer.state.values()]
    loaded = [s["exp_avg"].full_tensor() for s in other_optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, loaded))


def test_a_checkpoint_to_a_uri_is_written_straight_through_pyarrow(tmp_path, process_group, monkeypatch):
    """No local staging directory: the writer for a URI is the pyarrow one, and nothing
    makes a temporary directory while saving."""
    import tempfile

    model, optimizer = tiny_sharded_model(0)
    location = f"file://{tmp_path / 'bucket' / 'epoch_0001'}"
    assert isinstance(ckpt.checkpoint_writer(location), ckpt.ArrowWriter)
    assert type(ckpt.checkpoint_writer(str(tmp_path / "x"))) is ckpt.dcp.FileSystemWriter

    def no_staging(*args, **kwargs):
        raise AssertionError("a checkpoint was staged in a local temporary directory")

    monkeypatch.setattr(tempfile, "mkdtemp", no_staging)
    ckpt.save_sharded(model, optimizer, location, {"epoch": 1, "step": 3}, dist.group.WORLD)
    monkeypatch.undo()
    directory = tmp_path / "bucket" / "epoch_0001"
    assert sorted(p.name for p in directory.iterdir()) == sorted([".metadata", *shard_files(1), ckpt.STATE_FILE])
    assert ckpt.is_complete(location) and ckpt.read_trainer_state(location) == {"epoch": 1, "step": 3}
    other, other_optimizer = tiny_sharded_model(1)
    ckpt.load_sharded(other, other_optimizer, location, dist.group.WORLD)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_the_host_stager_copies_into_the_same_buffers_and_never_while_they_are_written(process_group):
    from concurrent.futures import Future

    model, optimizer = tiny_sharded_model(0)
    stager = ckpt.HostStager()
    first = stager.stage(ckpt._state_dicts(model, optimizer))
    weight = model[0].weight
    kept = first["model"]["0.weight"].to_local().clone()
    with torch.no_grad():
        weight.add_(1.0)  # training goes on: the staged copy does not move
    assert torch.equal(first["model"]["0.weight"].to_local(), kept)
    assert first["model"]["0.weight"].placements == weight.placements and first["model"]["0.weight"].shape == weight.shape
    second = stager.stage(ckpt._state_dicts(model, optimizer))
    assert second["model"]["0.weight"].to_local().data_ptr() == first["model"]["0.weight"].to_local().data_ptr()
    assert torch.equal(second["model"]["0.weight"].to_local(), weight.to_local())
    stager.in_flight = Future()  # a save still writing from the buffers
    with pytest.raises(RuntimeError, match="still being written"):
        stager.stage(ckpt._state_dicts(model, optimizer))
