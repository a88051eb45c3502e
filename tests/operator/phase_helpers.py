"""Shared inputs of the pure state-machine tests (test_phases*.py, test_capabilities*.py):
one identity, plan, ready cluster and clock, and `step`, one transition from them."""

from datetime import datetime, timedelta, timezone

from tpufinetune.core import phases
from tpufinetune.core.phases import ClusterView, Identity, Observations, Plan
from tpufinetune.core.podstatus import HEALTHY

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
IDENT = Identity("demo", "ns", "uid-1", generation=3)
PLAN = Plan(cluster_name="demo-rc", epochs=2, max_retries=0, provision_timeout=timedelta(minutes=30))
READY = ClusterView(exists=True, owned=True, ready=True, dashboard_url="http://head:8265", uid="rc-uid-1")
# What the driver reads once a job ended without success: the log's last lines, the slice's pods.
ENDED = {"log_tail": "worker 0: RuntimeError: boom", "slice_health": HEALTHY}


def step(status, plan=PLAN, **obs):
    obs.setdefault("now", T0)
    return phases.transition(IDENT, plan, status, Observations(**obs))


def kinds(decision):
    return [type(a).__name__ for a in decision.actions]
