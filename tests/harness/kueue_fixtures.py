"""Fixtures for Kueue on the test ground (harness/kueue.py), opt-in: only the tests that use
them start Kueue, so every other test runs on the ground as before.

- `kueue` (session): Kueue running on the `ground`, with its ResourceFlavors, ClusterQueues
  and WorkloadPriorityClasses (harness/kueue.py `QUEUE_OBJECTS`).
- `queued_namespace` (function): `ground_namespace` with its LocalQueues `tpu-queue` and
  `cpu-queue`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kueue(ground):
    return ground.start_kueue()


@pytest.fixture
def queued_namespace(kueue, ground_namespace):
    kueue.add_local_queues(ground_namespace)
    return ground_namespace
