"""The operator's end-to-end tests run on the test ground (tests/harness/ground.py): the real
KubeRay turns each RayCluster into pods, the scheduler binds them to GKE-shaped nodes, the
node agent runs them as Ray processes, and the operator (as deploy/'s ServiceAccount)
reaches each head by its Service name. Fixtures: `ground`, `operator`, `kube`
(tests/harness/ground_fixtures.py)."""

import pytest


@pytest.fixture(autouse=True)
def no_leader_left_registered():
    """An elector a test starts stays this process's registered leader after it stops (in
    the operator the process then exits: nothing after the hand-back may act). Tests share
    a process, so each leaves the registration as it found it."""
    from tpufinetune.adapters import lease

    before = lease._leader
    yield
    lease._leader = before
