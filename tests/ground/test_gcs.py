"""The ground's Cloud Storage (harness/gcs.py): objects written through the GCS API are
files under `<gcs_root>/<bucket>/` (what a volume of the bucket mounts), names ending in
`.metadata` (torch's checkpoint index) included, and the trainer's own client reaches the
same objects through STORAGE_EMULATOR_HOST, as every pod does."""

from __future__ import annotations

import pytest

from tpufinetune_trainer import storage

pytestmark = [pytest.mark.cluster, pytest.mark.ground]


def test_objects_are_files_under_the_root_and_the_trainer_reaches_them(ground, tmp_path, monkeypatch):
    gcs = ground.gcs
    local = tmp_path / "checkpoint"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "a.txt").write_text("alpha")
    (local / ".metadata").write_bytes(b"index")
    uri = gcs.upload(local, gcs.unique_uri("parts", "files"))

    assert gcs.list(uri) == [".metadata", "sub/a.txt"]
    assert gcs.read(f"{uri}/sub/a.txt") == b"alpha"
    on_disk = ground.gcs_root / gcs.bucket / uri.removeprefix(f"gs://{gcs.bucket}/")
    assert (on_disk / "sub" / "a.txt").read_text() == "alpha" and (on_disk / ".metadata").read_bytes() == b"index"

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert storage.exists(f"{uri}/.metadata", "file") and storage.exists(f"{uri}/sub", "dir")
    assert not storage.exists(f"{uri}/missing")
    assert (storage.local_copy(f"{uri}/sub/a.txt")).read_text() == "alpha"
