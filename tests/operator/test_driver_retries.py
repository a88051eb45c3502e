"""The driver (Run.step, not the pure transition) when Submitting passes its bound with a
preflight still running and a retry left (spec.maxRetries: 1): the preflight is stopped on
the head the step observed, the attempt's AttemptFailed and Retrying Events are posted,
and the next attempt is Pending on a new RayCluster. The step must not trip over its own
status, which no longer names the old head once the retry is decided.

Kubernetes is the in-memory stand-in of run_helpers (the fault is in the order of the
driver's own actions). The head is a small aiohttp stand-in for a Ray head's Job API (its
version, a preflight job that never ends, a stop): no real head can be made to hold a
preflight RUNNING for ever on demand.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from aiohttp import web

from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run

from run_helpers import JobApiStandIn, MemoryCluster, body, in_loop, settings


class HungPreflightHead(JobApiStandIn):
    """A head's Job API whose preflight runs for ever (the fine-tune job is not submitted
    yet: 404); records each stop it is asked."""

    def __init__(self):
        self.stopped: list[str] = []

    def routes(self):
        async def job(request):
            if not request.match_info["id"].endswith("-preflight"):
                return web.json_response({"message": "no such job"}, status=404)
            return web.json_response({"status": "RUNNING", "message": "", "submission_id": request.match_info["id"],
                                      "driver_node_id": "0" * 56})

        async def stop(request):
            self.stopped.append(request.match_info["id"])
            return web.json_response({"stopped": True})

        return [("GET", "/api/jobs/{id}", job), ("POST", "/api/jobs/{id}/stop", stop)]


def submitting_with_a_running_preflight(address: str, since: datetime) -> dict:
    return {"phase": phases.SUBMITTING, "rayClusterName": "tft-demo", "jobId": "tft-uid-1-1", "attempt": 1,
            "dashboardURL": address, "epochs": 1, "phaseTransitionTime": cond.timestamp(since),
            "startTime": cond.timestamp(since),
            "preflight": {"phase": "Running", "attempt": 1, "jobId": "tft-uid-1-1-preflight"}}


@in_loop
async def test_a_submit_timeout_with_a_retry_left_stops_the_preflight_posts_its_events_and_retries():
    async with HungPreflightHead() as head:
        cluster = MemoryCluster(head.address)
        cluster.exists = True
        since = datetime.now(timezone.utc) - timedelta(seconds=30)
        live = body(submitting_with_a_running_preflight(head.address, since))
        live["spec"]["maxRetries"] = 1
        run = Run(live, cluster, RayJobs(timeout=2), settings(submit_timeout=5))
        decision = await run.step()
        assert decision.phase == phases.PENDING, decision.status.get("message")
        assert decision.status["attempt"] == 2 and decision.status["retries"] == 1
        assert "SubmitTimeout" in decision.status["message"]
        # The step went through its actions: the Events, the stop, the old cluster's delete.
        assert "AttemptFailed" in cluster.events and "Retrying" in cluster.events, cluster.events
        assert head.stopped == ["tft-uid-1-1-preflight"]
        assert "delete" in cluster.calls and not cluster.exists
        assert cluster.status["phase"] == phases.PENDING
        assert cluster.status["preflight"]["phase"] == "Failed"
        # And the run goes on: the next step creates attempt 2's RayCluster.
        await run.step()
        assert cluster.calls.count("create") == 1 and cluster.status["phase"] == phases.PROVISIONING
