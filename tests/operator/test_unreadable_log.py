"""A job that ended with a log its head does not give: the run is not frozen in Running.
Reading the log's last lines is a Ray call like any other (runray._finish_log): shown as
the head not answering, on the clock of TPUFT_RAY_UNREACHABLE_TIMEOUT, then the outcome is
decided from the lines read.

Kubernetes is run_helpers' in-memory stand-in. The head is a small aiohttp stand-in for a
Ray head's Job API (its version, a job that SUCCEEDED, a log stream that closes at once
without the trainer's last event, a log endpoint that answers 500): no real head can be
made to refuse its log on demand.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run

from run_helpers import JobApiStandIn, MemoryCluster, body, in_loop, running, settings


class LoglessHead(JobApiStandIn):
    def __init__(self):
        self.log_reads = 0

    def routes(self):
        async def job(request):
            return web.json_response({"status": "SUCCEEDED", "message": "", "driver_node_id": "0" * 56,
                                      "submission_id": request.match_info["id"]})

        async def tail(request):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.close()
            return ws

        async def logs(request):
            self.log_reads += 1
            return web.Response(status=500, text="the log file is gone")

        return [("GET", "/api/jobs/{id}", job), ("GET", "/api/jobs/{id}/logs/tail", tail),
                ("GET", "/api/jobs/{id}/logs", logs)]


@in_loop
async def test_an_ended_job_whose_log_cannot_be_read_is_decided_after_the_unreachable_bound():
    async with LoglessHead() as head:
        cluster = MemoryCluster(head.address)
        cluster.exists = True
        run = Run(body(running(head.address)), cluster, RayJobs(timeout=2), settings(ray_unreachable_timeout=1))
        first = await run.step()  # raised the log's failure, every step, for ever
        assert first.phase == phases.RUNNING
        shown = cond.find(cluster.status, cond.RAY_REACHABLE)
        assert shown["status"] == "False" and "could not be read to its end" in shown["message"], shown
        await asyncio.sleep(1.1)
        decided = await run.step()
        await run.close()
    assert decided.phase == phases.SUCCEEDED, decided.status.get("message")
    assert head.log_reads >= 2
