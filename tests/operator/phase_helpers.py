"""Shared inputs of the pure state-machine tests (test_phases*.py, test_capabilities*.py):
one identity, plan, ready cluster and clock, a spec, `step`, one transition from them, and
`running_status`, a run stepped into Running; `running_with_slice`, one whose slice became ready
minutes after it was created (the attempts' and start-up figures' tests)."""

from datetime import datetime, timedelta, timezone

from tpufinetune.core import phases
from tpufinetune.core.phases import ClusterView, Identity, JobView, Observations, Plan
from tpufinetune.core.podstatus import HEALTHY

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
IDENT = Identity("demo", "ns", "uid-1", generation=3)
PLAN = Plan(cluster_name="demo-rc", epochs=2, max_retries=0, provision_timeout=timedelta(minutes=30))
READY = ClusterView(exists=True, owned=True, ready=True, dashboard_url="http://head:8265", uid="rc-uid-1")
# What the driver reads once a job ended without success: the log's last lines, the slice's pods.
ENDED = {"log_tail": "worker 0: RuntimeError: boom", "slice_health": HEALTHY}


# A v6e 4x4 spec as a user writes it (parse it with tpufinetune.core.api.parse_spec).
SPEC = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "example.com/trainer:1",
        "checkpoint": {"storagePath": "gs://bucket/ckpt"}}


def spec_with(**changes) -> dict:
    """SPEC with its top-level fields replaced by `changes`."""
    return {**SPEC, **changes}


def step(status, plan=PLAN, **obs):
    obs.setdefault("now", T0)
    return phases.transition(IDENT, plan, status, Observations(**obs))


def running_status(plan=PLAN, now=T0, job: str = "PENDING") -> dict:
    """The status of a run stepped from nothing into Running, its job `job` on Ray."""
    d = step({}, plan=plan, now=now)
    d = step(d.status, plan=plan, now=now)
    d = step(d.status, plan=plan, now=now, cluster=READY)
    d = step(d.status, plan=plan, now=now, cluster=READY, job=JobView(job))
    assert d.phase == phases.RUNNING
    return d.status


# A four-host v6e run with one retry, for the attempts' and start-up figures' tests.
V6E = Plan(cluster_name="demo-rc", epochs=2, max_retries=1, cluster_hash="h", hosts=4, chips=16)


def at(minutes: float):
    return T0 + timedelta(minutes=minutes)


def running_with_slice(plan=V6E, ready_at=10, cluster=READY) -> dict:
    """Created at T0, the slice ready at `ready_at` minutes, the job running just after."""
    d = step({}, plan=plan)
    d = step(d.status, plan=plan, now=at(0))
    d = step(d.status, plan=plan, now=at(ready_at), cluster=cluster)
    d = step(d.status, plan=plan, now=at(ready_at), cluster=cluster, job=None)
    d = step(d.status, plan=plan, now=at(ready_at), cluster=cluster, job=JobView("RUNNING"))
    assert d.phase == phases.RUNNING
    return d.status


def kinds(decision):
    return [type(a).__name__ for a in decision.actions]
