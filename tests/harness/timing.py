"""One factor for every product time bound a test asserts on a loaded machine.

The product promises bounds in wall-clock seconds (a deleted run's finalizer goes within
30 s, a waiting run explains itself within 60 s, a standby takes the Lease within a lease
duration and a retry period). The tests measure them on the test ground, where two cores run
the control plane, KubeRay, the operator and a training Ray cluster at once: a bound is
asserted as `within(bound)`, the product's figure times LOAD_FACTOR, so a slow machine
does not fail a correct operator and a broken one (a bound missed by more than half again)
still fails. Lower bounds (not before the lease ran out) are never scaled.

TPUFT_TEST_LOAD_FACTOR overrides it (1 asserts the product's own figures).
"""

from __future__ import annotations

import os

LOAD_FACTOR = float(os.environ.get("TPUFT_TEST_LOAD_FACTOR", "1.5"))


def within(product_seconds: float) -> float:
    """The bound a test asserts for a product bound of `product_seconds`."""
    return product_seconds * LOAD_FACTOR
