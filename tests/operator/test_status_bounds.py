"""What a run keeps and how fast it retries while its status cannot be written: the trainer
events drained but not written are bounded (the newest progress and every other kind
kept), and conflicting writes are retried with a growing pause, not at once for a minute.
The driver with run_helpers' in-memory stand-in for Kubernetes."""

from __future__ import annotations

import asyncio
import time

from tpufinetune.adapters import handlers
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import phases
from tpufinetune.core.errors import StatusConflict
from tpufinetune.driver import Run
from tpufinetune.runstatus import UNWRITTEN_LIMIT, conflict_backoff

from run_helpers import MemoryCluster, being_deleted, body, delete_memo, in_loop, settings


def test_events_waiting_for_a_status_write_are_bounded_and_the_newest_and_rarest_kept():
    run = Run(body(), MemoryCluster(), RayJobs(), settings())
    checkpoint = {"event": "checkpoint", "step": 5, "uri": "gs://b/c/5"}
    for batch in range(30):  # each step drains a batch and its write is refused
        run.keep_unwritten([{"event": "progress", "step": batch * 100 + i} for i in range(100)])
        if batch == 3:
            run.keep_unwritten([checkpoint])
    assert len(run.unwritten) == UNWRITTEN_LIMIT
    assert checkpoint in run.unwritten
    assert run.unwritten[-1] == {"event": "progress", "step": 2999}


def test_conflicts_back_off_up_to_the_poll_interval():
    assert conflict_backoff(1, 5.0) == 0.0  # the first: a re-read usually settles it
    waits = [conflict_backoff(n, 5.0) for n in range(2, 12)]
    assert 0 < waits[0] <= 0.1 and max(waits) <= 5.0 and waits[-1] >= 2.5


class Conflicting(MemoryCluster):
    """Every status write loses to another writer."""

    async def write_status(self, ident, patch, new, resource_version):
        self.calls.append("conflict")
        raise StatusConflict("ns/demo changed since resourceVersion 1")


@in_loop
async def test_a_delete_whose_status_writes_always_conflict_releases_the_cluster_at_once():
    cluster = Conflicting()
    cluster.exists = True
    live = being_deleted(phases.SUCCEEDED)
    memo = delete_memo(cluster)
    began = time.monotonic()
    await asyncio.wait_for(handlers.release(body=live, memo=memo), 20)  # was: a minute of conflicts, then raised
    assert time.monotonic() - began < 10
    assert "delete" in cluster.calls and not cluster.exists
