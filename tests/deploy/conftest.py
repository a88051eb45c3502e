"""Fixtures for the deployment tests (helpers in manifests.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from manifests import ROOT, helm_version


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm built from Go modules (`make helm`, tests/helmbuild/build.sh)."""
    path = ROOT / ".cache" / "helm" / helm_version() / "bin" / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail("helm is not built: run `make helm` (builds it from Go modules, "
                    "tests/helmbuild/build.sh)", pytrace=False)
    return path
