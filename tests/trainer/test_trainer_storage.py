"""The trainer's one way to storage (tpufinetune_trainer.storage): which client a location
gets, and, on the GCS emulator, the host-local copy of a model or dataset in a bucket."""

from __future__ import annotations

import multiprocessing

import pyarrow.fs as pafs
import pytest

from tpufinetune_trainer import storage
from tpufinetune_trainer.data import load_rows
from tpufinetune_trainer.errors import DataError, ModelError
from tpufinetune_trainer.model import check_model, load_tokenizer


def options(fs) -> dict:
    return fs.__reduce__()[1][0]  # the options pyarrow rebuilds it from (what Ray ships to workers)


def test_gs_uses_the_emulator_anonymously_when_storage_emulator_host_is_set(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    fs, path = storage.filesystem("gs://bucket/runs/a/")
    assert isinstance(fs, pafs.GcsFileSystem) and path == "bucket/runs/a"
    assert options(fs)["anonymous"] and options(fs)["scheme"] == "http"
    assert options(fs)["endpoint_override"] == "127.0.0.1:4443"
    assert storage.uri_of(fs, path) == "gs://bucket/runs/a"
    ray = storage.ray_storage("gs://bucket/runs")
    assert ray["storage_path"] == "bucket/runs" and isinstance(ray["storage_filesystem"], pafs.GcsFileSystem)


def test_gs_uses_default_credentials_without_an_emulator(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    fs, path = storage.filesystem("gs://bucket")
    assert path == "bucket"
    assert not options(fs)["anonymous"] and options(fs)["scheme"] == "https" and not options(fs)["endpoint_override"]


def test_a_path_is_the_local_file_system(tmp_path):
    fs, path = storage.filesystem(str(tmp_path / "x"))
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "x")
    assert storage.uri_of(fs, path) == path
    assert storage.ray_storage(str(tmp_path)) == {"storage_path": str(tmp_path)}


def _copy(uri: str, endpoint: str, cache: str, out) -> None:
    import os

    os.environ.update(STORAGE_EMULATOR_HOST=endpoint, XDG_CACHE_HOME=cache)
    out.put(str(storage.local_copy(uri)))


def test_a_model_and_a_dataset_in_a_bucket_are_copied_once_per_host_and_loaded(
        gcs, trainer_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = gcs.unique_uri("assets", "storage-test")
    model = gcs.upload(trainer_assets.model, f"{base}/model")
    data = gcs.upload(trainer_assets.data, f"{base}/train.jsonl")

    # Several processes of one host at once: every one gets the same finished copy.
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_copy, args=(model, gcs.endpoint, str(tmp_path / "cache"), out))
             for _ in range(3)]
    for p in procs:
        p.start()
    paths = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(30)
    assert len(paths) == 1, paths
    entries = list((tmp_path / "cache" / "tpufinetune" / "storage").iterdir())
    assert len(entries) == 1 and (entries[0] / "done").exists() and not (entries[0] / "partial").exists()
    assert sorted(p.name for p in (entries[0] / "model").iterdir()) == sorted(
        p.name for p in trainer_assets.model.iterdir())

    check_model(model)
    assert load_tokenizer(model).vocab_size > 0
    rows = load_rows(data, "train")
    assert len(rows) == sum(1 for _ in trainer_assets.data.open())

    # A changed object is fetched again (the listing names the cache entry).
    gcs.upload(trainer_assets.data, f"{base}/model/extra.jsonl")
    fresh = storage.local_copy(model)
    assert str(fresh) != paths.pop() and (fresh / "extra.jsonl").is_file()


def test_missing_objects_are_named(gcs, monkeypatch, tmp_path):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="no model directory there"):
        check_model(gcs.uri("nowhere", "model"))
    with pytest.raises(DataError, match="no such object"):
        load_rows(gcs.uri("nowhere", "train.jsonl"), "train")


@pytest.mark.parametrize("read_ahead", [1 << 10, 8 << 20], ids=["small-blocks", "default"])
def test_a_sharded_checkpoint_in_a_bucket_loads_in_place(gcs, tmp_path, monkeypatch, read_ahead):
    """DCP reads every item of a shard straight from the bucket, by byte ranges (torch.load
    seeks to each item's end, where a plain GCS read is refused)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tpufinetune_trainer import checkpoint as ckpt

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setattr(ckpt.RangeReader, "READ_AHEAD", read_ahead)
    torch.manual_seed(0)
    saved = {"model": {"w": torch.randn(300, 200), "b": torch.arange(10.0)}, "optim": {"step": torch.ones(3)}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")), no_dist=True)
    uri = gcs.upload(tmp_path / "ckpt", gcs.unique_uri("checkpoints", "in-place"))
    assert storage.exists(f"{uri}/.metadata", "file")

    loaded = {"model": {"w": torch.zeros(300, 200), "b": torch.zeros(10)}, "optim": {"step": torch.zeros(3)}}
    dcp.load(loaded, storage_reader=ckpt.storage_reader(uri), no_dist=True)
    for part in saved:
        for key in saved[part]:
            assert torch.equal(loaded[part][key], saved[part][key]), (part, key)


def test_a_restart_finds_the_newest_complete_checkpoint_of_its_run(tmp_path, gcs, monkeypatch):
    """What a restarted worker group resumes from when Ray Train registered nothing: the
    checkpoint with the most steps whose state and every shard its metadata names exist."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from tpufinetune_trainer import checkpoint as ckpt

    run = tmp_path / "storage" / "tft-run"

    def write(name: str, step: int | None) -> Path:
        directory = run / name
        dcp.save({"model": {"w": torch.full((4,), float(step or 0))}},
                 storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
        if step is not None:
            (directory / ckpt.STATE_FILE).write_text(json.dumps({"epoch": 1, "step": step}))
        return directory

    assert ckpt.latest_complete(str(run)) is None  # a first start: nothing there yet
    write("epoch_0001", 10)
    torn = write("step_0000020", 20)
    write("step_0000030", None)  # no trainer state: rank 0 died before writing it
    (run / "export").mkdir()
    (run / "checkpoint_manager_snapshot.json").write_text("{}")
    shard = next(torn.glob("*.distcp"))
    kept = shard.read_bytes()
    shard.unlink()  # a rank's shard never arrived
    assert not ckpt.is_complete(str(torn))
    assert ckpt.latest_complete(str(run)) == str(run / "epoch_0001")
    shard.write_bytes(kept)
    assert ckpt.is_complete(str(torn))
    assert ckpt.latest_complete(str(run)) == str(run / "step_0000020")

    # In a bucket, where there are objects and no directories to list.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    uri = gcs.upload(run, gcs.unique_uri("runs", "restart"))
    assert ckpt.latest_complete(uri) == f"{uri}/step_0000020"
    assert ckpt.latest_complete(f"{uri}-never-written") is None


def test_every_hosts_copy_of_a_dataset_has_the_same_fingerprint(gcs, trainer_assets, tmp_path, monkeypatch):
    """A retry's new head pod downloads the dataset again; its copy keeps the object's
    modification time, so the data fingerprint (and `datasets`' own) is the first
    attempt's and the prepared data it published is found, not tokenized again."""
    import shutil
    import time

    from tpufinetune_trainer import data_stream

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    data = gcs.upload(trainer_assets.data, f"{gcs.unique_uri('assets', 'fingerprint')}/train.jsonl")
    tokenizer = load_tokenizer(str(trainer_assets.model))
    prints = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the image's one cache path
    for _host in ("first", "second"):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)  # a new pod's empty disk
        rows = load_rows(data, "train")
        prints.append(data_stream.fingerprint(rows, data, "train", tokenizer, {"max_seq_len": 64}))
        time.sleep(0.05)  # the second host's download is later
    assert prints[0] == prints[1]
