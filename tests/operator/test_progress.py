"""The progress tracker behind the operator's liveness probe (core/progress.py), and the
driver feeding it: a run whose status cannot be written (or read back after a failed
write) for longer than the bound is stalled; a successful write clears it. The ground
test in test_status_write_faults.py checks the real /healthz answer."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from tpufinetune.core import phases
from tpufinetune.core.progress import ProgressTracker
from tpufinetune.driver import Run
from tpufinetune.adapters.rayjobs import RayJobs
from run_helpers import MemoryCluster, body, in_loop, settings

RUN = ("ns", "demo", "uid-1")
OTHER = ("ns", "other", "uid-2")


def test_failing_writes_stall_a_run_only_past_the_bound_counted_from_the_first_failure():
    progress = ProgressTracker()
    progress.failed(RUN, now=100.0, error="403 refused")
    progress.failed(RUN, now=150.0, error="403 refused again")
    assert progress.stalled(now=159.0, bound=60) == []
    [line] = progress.stalled(now=161.0, bound=60)
    assert line.startswith("ns/demo: no status write for 61 s") and "refused again" in line


def test_a_successful_write_clears_the_run_and_restarts_its_clock():
    progress = ProgressTracker()
    progress.failed(RUN, now=0.0, error="refused")
    progress.written(RUN)
    progress.failed(RUN, now=100.0, error="refused")
    assert progress.stalled(now=150.0, bound=60) == []


def test_one_stalled_run_is_named_whatever_the_others_do_and_forgetting_it_clears_it():
    progress = ProgressTracker()
    progress.failed(RUN, now=0.0, error="refused")
    progress.failed(OTHER, now=0.0, error="refused")
    progress.written(OTHER)
    assert [line.split(":")[0] for line in progress.stalled(now=100.0, bound=60)] == ["ns/demo"]
    progress.forget(RUN)
    assert progress.stalled(now=100.0, bound=60) == []


def test_a_run_the_api_server_refuses_is_its_own_trouble_and_never_stalls_the_operator():
    progress = ProgressTracker()
    assert progress.failed(RUN, now=0.0, error="422 refused by policy", own=True) is True
    assert progress.failed(RUN, now=50.0, error="422 refused by policy", own=True) is False  # one episode
    assert progress.stalled(now=1000.0, bound=60) == []  # however long: a restart changes nothing
    assert progress.failing[RUN].since == 0.0


def test_the_operator_stalls_only_while_no_run_reaches_the_api_server():
    progress = ProgressTracker()
    progress.failed(RUN, now=0.0, error="connection refused")
    progress.reached(now=90.0)  # another run's status written: the API server serves the operator
    assert progress.stalled(now=100.0, bound=60) == []
    [line] = progress.stalled(now=151.0, bound=60)  # nothing reached it for longer than the bound
    assert line.startswith("ns/demo:") and "connection refused" in line


class RefusingCluster(MemoryCluster):
    """Status writes (and, when `refuse_reads`, reads) refused, as an admission policy or
    a missing RBAC verb would refuse them."""

    def __init__(self):
        super().__init__()
        self.refuse_writes = self.refuse_reads = False

    async def write_status(self, ident, patch, new, resource_version):
        if self.refuse_writes:
            raise PermissionError("status writes are refused")
        return await super().write_status(ident, patch, new, resource_version)

    async def read_status(self, ident):
        if self.refuse_reads:
            raise PermissionError("cannot get resource tpufinetunes")
        return await super().read_status(ident)


@in_loop
async def test_the_driver_reports_refused_writes_and_refused_read_backs_until_a_write_lands():
    cluster, progress = RefusingCluster(), ProgressTracker()
    run = Run(body(), cluster, RayJobs(), settings(), progress)
    await run.step()  # Pending written
    assert progress.failing == {}
    cluster.refuse_writes = True
    with pytest.raises(PermissionError, match="writes are refused"):
        await run.step()
    since = progress.failing[RUN].since
    cluster.refuse_writes, cluster.refuse_reads = False, True  # the read-back is what fails now
    with pytest.raises(PermissionError, match="cannot get"):
        await run.step()
    assert progress.failing[RUN].since == since and "cannot get" in progress.failing[RUN].error
    assert progress.stalled(now=since + 2, bound=1)
    cluster.refuse_reads = False
    decision = await run.step()
    assert decision.phase == phases.PROVISIONING and progress.failing == {}


@in_loop
async def test_a_write_refused_for_the_object_is_the_runs_trouble_said_once_by_an_event():
    cluster, progress = RefusingCluster(), ProgressTracker()
    run = Run(body(), cluster, RayJobs(), settings(), progress)
    await run.step()
    # What the kubernetes client raises for the API server's answer (its own class).
    refusal = ApiException(status=422, reason="refused by the test's admission policy")

    async def refuse(*_):
        raise refusal
    cluster.write_status = refuse
    for _ in range(2):
        with pytest.raises(ApiException):
            await run.step()
    assert progress.failing[RUN].own and cluster.events.count("StatusWriteFailing") == 1
    assert progress.stalled(now=progress.failing[RUN].since + 10_000, bound=1) == []
    refusal.status = 503  # the API server itself failing: the operator's trouble
    with pytest.raises(ApiException):
        await run.step()
    assert not progress.failing[RUN].own


class DeletedCluster(MemoryCluster):
    """The run's object deleted under it, its finalizer already gone (a delete that another
    replica, or a namespace's deletion, finished): the API server answers 404 to its
    status writes and reads."""

    async def write_status(self, ident, patch, new, resource_version):
        raise ApiException(status=404, reason='tpufinetunes.tpufinetune.dev "demo" not found')

    async def read_status(self, ident):
        return None


@in_loop
async def test_an_object_gone_ends_the_run_without_an_event_or_a_failing_write():
    """No StatusWriteFailing ('the run goes on') for an object that no longer exists: no Event
    can be attached to it (its namespace may be going too, its RoleBinding first), and the
    run's loop ends instead of writing for ever."""
    import asyncio

    cluster, progress = DeletedCluster(), ProgressTracker()
    run = Run(body(), cluster, RayJobs(), settings(), progress)
    await asyncio.wait_for(run.run(asyncio.Event()), timeout=10)
    assert run.object_gone and progress.failing == {} and "StatusWriteFailing" not in cluster.events
