"""Clocks that decide a run's fate live in its status, so a restarted (or standby) operator
goes on counting instead of starting again; and a run whose status could not be written
says so in the status with the first write that lands.

The driver's tests use the in-memory stand-in for Kubernetes of run_helpers; the Ray side
is a real closed port (a head that never answers)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from kubernetes.client.exceptions import ApiException

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run

from phase_helpers import READY, T0, step
from run_helpers import body, closed_address, in_loop, MemoryCluster, running, settings


@in_loop
async def test_the_unreachable_clock_goes_on_after_a_restart():
    closed, address = closed_address()
    cluster = MemoryCluster(address)
    cluster.exists = True
    bound = 3
    first = Run(body(running(address)), cluster, RayJobs(timeout=0.3), settings(ray_unreachable_timeout=bound))
    assert (await first.step()).phase == phases.RUNNING
    down = cond.find(cluster.status, cond.RAY_REACHABLE)
    assert down["status"] == "False" and down["reason"] == "NotAnswering"
    await asyncio.sleep(1.0)
    # The operator restarts: a new Run from the object as stored, no memory of the first.
    restarted = Run(body(cluster.status), cluster, RayJobs(timeout=0.3), settings(ray_unreachable_timeout=bound))
    assert (await restarted.step()).phase == phases.RUNNING
    await asyncio.sleep(2.1)  # more than the bound since the head stopped answering; less since the restart
    decision = await restarted.step()
    closed.close()
    assert decision.phase == phases.FAILED, decision.status.get("message")
    assert cond.find(decision.status, cond.FAILED)["reason"] == "RayUnreachable"


def test_an_answer_stops_the_clock_and_a_new_phase_drops_it():
    down = step(running("http://head:8265"), cluster=READY, ray_down="the head does not answer").status
    assert phases.ray_down_since(down) == T0
    later = T0 + timedelta(seconds=30)
    still = step(down, cluster=READY, ray_down="the head does not answer", now=later).status
    assert phases.ray_down_since(still) == T0  # the clock keeps its start
    answered = step(down, cluster=READY, ray_answered=True,
                    job=phases.JobView("RUNNING"), now=later).status
    assert cond.find(answered, cond.RAY_REACHABLE)["status"] == "True"
    assert phases.ray_down_since(answered) is None
    gone = step(down, cluster=phases.ClusterView(exists=False), now=later).status
    assert gone["phase"] != phases.RUNNING and cond.find(gone, cond.RAY_REACHABLE) is None


@in_loop
async def test_the_retry_wait_counts_from_entering_submitting_as_recorded():
    entered = datetime.now(timezone.utc) - timedelta(seconds=700)
    status = {**running("http://127.0.0.1:9"), "phase": phases.SUBMITTING, "attempt": 2,
              "phaseTransitionTime": cond.timestamp(entered)}
    run = Run(body(status), MemoryCluster(), RayJobs(timeout=0.3), settings(ray_unreachable_timeout=600))
    assert not run._within_retry_bound(2)  # a restart does not give the wait another 600 s


class RefusingCluster(MemoryCluster):
    """An API server that refuses this object's status writes a few times (admission)."""

    def __init__(self, address: str, refusals: int):
        super().__init__(address)
        self.refusals = refusals

    async def write_status(self, ident, patch, new, resource_version):
        if self.refusals:
            self.refusals -= 1
            raise ApiException(status=422, reason="refused by an admission policy")
        return await super().write_status(ident, patch, new, resource_version)


@in_loop
async def test_the_first_write_that_lands_says_how_long_writes_failed():
    cluster = RefusingCluster("http://127.0.0.1:9", refusals=2)
    run = Run(body(), cluster, RayJobs(timeout=0.3), settings())
    for _ in range(2):
        try:
            await run.step()
        except ApiException:
            pass
    assert cluster.events == ["StatusWriteFailing"]  # said once while it lasts
    assert cond.find(cluster.status, cond.STATUS_WRITABLE) is None  # nothing could be written
    await run.step()
    shown = cond.find(cluster.status, cond.STATUS_WRITABLE)
    assert shown["status"] == "True" and shown["reason"] == "WritesFailed"
    assert "status writes failed for" in shown["message"] and "422" in shown["message"]
    before = cluster.status
    await run.step()  # writes land again: the condition stays as it was, not rewritten
    assert cond.find(cluster.status, cond.STATUS_WRITABLE) == cond.find(before, cond.STATUS_WRITABLE)
