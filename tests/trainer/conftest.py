"""Fixtures of the in-process trainer tests (tests/trainer)."""

from __future__ import annotations

import pytest

from trainer_helpers import BLOCK_LENGTH, prepared_data, single_process_group


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group, for the module's tests (FSDP needs one)."""
    with single_process_group():
        yield


@pytest.fixture(scope="module")
def prepared(trainer_assets):
    return prepared_data(trainer_assets, BLOCK_LENGTH)


@pytest.fixture(scope="module")
def tokenizer(trainer_assets):
    """The tiny test model's tokenizer."""
    from tpufinetune_trainer.model import load_tokenizer

    return load_tokenizer(str(trainer_assets.model))


@pytest.fixture
def no_ray_report(monkeypatch):
    """Training outside a Ray Train worker: ray.train.report does nothing."""
    import ray.train

    monkeypatch.setattr(ray.train, "report", lambda *args, **kwargs: None)
