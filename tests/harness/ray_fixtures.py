"""Fixtures for a real local Ray head and the trainer's offline assets.

`ray_head` (session): a real `ray start --head` from this project's .venv on loopback,
with token authentication on, isolated ports and temp dir; stopped (only what it
started) at the end of the session. It exposes:

    gcs_address    "127.0.0.1:PORT"      (RAY_ADDRESS for ray.init / tpufinetune-train)
    dashboard_url  "http://127.0.0.1:PORT" (Ray Job API)
    token          the bearer token
    temp_dir       Ray's temp/session dir (logs are under it)
    env()          os.environ + RAY_ADDRESS, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN, .venv/bin on PATH
    headers()      {"Authorization": "Bearer <token>"} for JobSubmissionClient(headers=…)
    job_client()   a JobSubmissionClient that authenticates

`trainer_assets` (session): the tiny random Gemma 4 + tokenizer + dolly-format dataset
built offline by `python -m tpufinetune_trainer.assets` into pytest's tmp dir:
`.model` and `.data` (paths), `.root`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import session_order
from harness.rayhead import RayHead

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_head():
    head = RayHead.start(num_cpus=int(os.environ.get("TPUFT_TEST_RAY_CPUS", "4")))
    session_order.hold(session_order.RAY_HEAD, head.stop)
    try:
        yield head
    finally:
        head.stop()


@dataclass(frozen=True)
class TrainerAssets:
    root: Path
    model: Path
    data: Path  # the JSONL file


def build_assets(out: Path, size: str = "tiny") -> TrainerAssets:
    """In-process (the test process has the training stack loaded already); the same
    code path as `python -m tpufinetune_trainer.assets --out DIR`."""
    from tpufinetune_trainer.assets import write_assets

    write_assets(out, size)
    return TrainerAssets(root=out, model=out / "model", data=out / "data" / "train.jsonl")


@pytest.fixture(scope="session")
def trainer_assets(tmp_path_factory) -> TrainerAssets:
    return build_assets(tmp_path_factory.mktemp("assets"))
