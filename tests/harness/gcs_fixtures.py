"""`gcs` (session): a Cloud Storage emulator of its own (harness/gcs.py), for tests that need
gs:// without the whole ground; the ground starts its own (`ground.gcs`). Tests that use
it are marked `cluster` (it is a binary built from a Go module, like the control plane)."""

from __future__ import annotations

import pytest

from harness.gcs import GcsEmulator


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gcs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gcs")
    emulator = GcsEmulator(workdir / "root", workdir / "gcs.log").start()
    try:
        yield emulator
    finally:
        emulator.stop()
