"""The driver (Run) under faults that need no Kubernetes and no Ray head: concurrent
daemon and deletion steps, a head that refuses connections, a head that accepts them and
never answers, and a RayCluster going away.

The backend here is an in-memory stand-in for Kubernetes: these faults are about the
order of the driver's own steps and its Ray calls, and Kubernetes plays no part in them.
The Ray side is real: Ray's own Job API client, against a closed port (connection
refused) and against a socket that accepts and never answers (a black-holed head).
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tpufinetune.adapters.kube import cluster_view
from tpufinetune.adapters.rayjobs import LogFollower, RayJobs
from tpufinetune.core import phases
from tpufinetune.core.phases import ClusterView
from tpufinetune.driver import Run
from tpufinetune.settings import Settings



def in_loop(test):
    """Run an async test in a fresh event loop (the driver's own asyncio, no plugin)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


SPEC = {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
        "checkpoint": {"storagePath": "/tmp/unused"}}


class MemoryCluster:
    """Kubernetes as far as one run sees it: one RayCluster that exists or not, the
    status the run wrote, and every call in order. `create_gate`, when set, holds a
    create until the test opens it (a slow API call)."""

    def __init__(self, dashboard_url: str = "http://127.0.0.1:9"):
        self.exists = False
        self.dashboard_url = dashboard_url
        self.calls: list[str] = []
        self.status: dict = {}
        self.create_gate: asyncio.Event | None = None
        self.lose_next_answer = False
        self.events: list[str] = []
        self.cancel_next_observe = False

    async def observe(self, ident, name):
        if self.cancel_next_observe:  # a cancelled inner future, not a cancellation of the run
            self.cancel_next_observe = False
            raise asyncio.CancelledError()
        return ClusterView(exists=self.exists, owned=True, ready=self.exists, dashboard_url=self.dashboard_url)

    async def create(self, ident, manifest):
        self.calls.append("create")
        if self.create_gate is not None:
            await self.create_gate.wait()
        self.exists = True

    async def delete(self, ident, name):
        self.calls.append("delete")
        self.exists = False

    async def write_status(self, ident, patch, new, resource_version):
        self.calls.append(f"status:{new.get('phase')}")
        self.status = new
        if self.lose_next_answer:  # the write landed, but its answer was lost (a timeout)
            self.lose_next_answer = False
            raise TimeoutError("the API server did not answer in time")

    async def read_status(self, ident):
        return dict(self.status), ""

    def record(self, ident, type_, reason, message):
        self.events.append(reason)


def body(status: dict | None = None, **meta) -> dict:
    return {"metadata": {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": 1, **meta},
            "spec": dict(SPEC), "status": dict(status or {})}


def running_status(address: str) -> dict:
    return {"phase": phases.RUNNING, "rayClusterName": "tft-demo", "jobId": "tft-uid-1-1", "attempt": 1,
            "dashboardURL": address, "epochs": 1}


def settings(**values) -> Settings:
    return Settings(poll_interval=0.05, ray_timeout=0.5, **values)


@in_loop
async def test_deleting_waits_for_the_daemons_step_and_nothing_is_created_after_it():
    cluster = MemoryCluster()
    live = body()
    run = Run(live, cluster, RayJobs(), settings())
    await run.step()  # Pending: identities reserved
    cluster.create_gate = asyncio.Event()
    daemon_step = asyncio.create_task(run.step())  # Pending -> Provisioning: creates, slowly
    while "create" not in cluster.calls:
        await asyncio.sleep(0.01)

    live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    delete_step = asyncio.create_task(run.step(deleting=True))  # kopf's on.delete, same Run
    await asyncio.sleep(0.05)
    assert not delete_step.done()  # it waits for the daemon's step instead of racing it
    cluster.create_gate.set()
    await daemon_step
    decision = await delete_step
    assert decision.phase == phases.DELETING
    assert cluster.calls[-1] == "delete" and not cluster.exists

    # A late daemon step (kopf stops the daemon a little later) is a deleting step too.
    for _ in range(3):
        again = await run.step()
        assert again.phase == phases.DELETING
    assert cluster.calls.count("create") == 1
    assert all(call == "delete" or call == "status:Deleting" for call in cluster.calls[cluster.calls.index("delete"):])
    assert not cluster.exists
    assert phases.deletion_complete(await run.observe(deleting=True))


@in_loop
async def test_the_daemon_loop_hands_over_once_the_object_is_being_deleted():
    live = body()
    run = Run(live, MemoryCluster(), RayJobs(), settings())
    live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await asyncio.wait_for(run.run(asyncio.Event()), 5)  # returns at once: on.delete owns it
    assert run.status == {}


@in_loop
async def test_a_head_that_refuses_connections_fails_the_run_after_the_setting_and_releases_the_slice():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
    cluster = MemoryCluster(address)
    cluster.exists = True
    run = Run(body(running_status(address)), cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=1))
    with pytest.raises(Exception):
        await run.step()  # transient at first: the step is retried
    assert run.status["phase"] == phases.RUNNING
    await asyncio.sleep(1.1)
    decision = await run.step()
    closed.close()
    assert decision.phase == phases.FAILED
    failed = next(c for c in decision.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RayUnreachable"
    assert address in failed["message"] and "has not answered for" in failed["message"]
    assert cluster.calls[-1] == "delete" and not cluster.exists


@in_loop
async def test_a_black_holed_head_costs_one_bounded_call_not_a_stalled_run():
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # the kernel accepts connections; nothing ever answers
    address = f"http://127.0.0.1:{hole.getsockname()[1]}"
    cluster = MemoryCluster(address)
    cluster.exists = True
    run = Run(body(running_status(address)), cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=600))
    try:
        started = time.monotonic()
        with pytest.raises(Exception):
            # A hang detector, not a timing target: without a timeout this never returns.
            await asyncio.wait_for(run.step(), 30)
        assert time.monotonic() - started < 30
    finally:
        hole.close()
    assert run.status["phase"] == phases.RUNNING


class TroubledHead(BaseHTTPRequestHandler):
    """A dashboard in trouble: it answers its version, then 500 to everything, with "does
    not exist" in the body (as a head whose GCS is restarting may). No real head can be
    made to answer exactly this on demand, hence this small stand-in."""

    def do_GET(self):
        if self.path == "/api/version":
            self._answer(200, json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": ""}))
        else:
            self._answer(500, "job tft-uid-1-1 does not exist in the GCS yet")

    do_POST = do_GET

    def _answer(self, code: int, text: str) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


def test_only_a_404_means_the_job_is_gone_an_error_body_never_does():
    server = ThreadingHTTPServer(("127.0.0.1", 0), TroubledHead)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RuntimeError, match="500"):
            RayJobs(timeout=5).job(address, "tft-uid-1-1")
        with pytest.raises(RuntimeError, match="500"):
            RayJobs(timeout=5).stop(address, "tft-uid-1-1")
    finally:
        server.shutdown()


@in_loop
async def test_after_a_write_whose_answer_was_lost_the_next_decision_starts_from_the_servers_status():
    cluster = MemoryCluster()
    run = Run(body(), cluster, RayJobs(), settings())
    await run.step()  # Pending
    cluster.lose_next_answer = True
    with pytest.raises(TimeoutError):
        await run.step()  # Provisioning written, but the run could not know
    assert cluster.status["phase"] == phases.PROVISIONING
    decision = await run.step()
    assert decision.phase == phases.PROVISIONING
    assert cluster.events.count("CreatingCluster") == 0  # not announced again from a stale Pending
    assert cluster.calls.count("create") == 1


@in_loop
async def test_a_stray_cancellation_inside_a_step_does_not_end_the_daemon():
    cluster = MemoryCluster()
    cluster.exists = True
    run = Run(body({"phase": phases.FAILED, "rayClusterName": "tft-demo"}), cluster, RayJobs(), settings())
    cluster.cancel_next_observe = True
    await asyncio.wait_for(run.run(asyncio.Event()), 10)  # used to end with CancelledError
    assert cluster.calls[-1] == "delete" and not cluster.exists


@in_loop
async def test_no_log_follower_is_left_running_once_the_phase_leaves_running():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{closed.getsockname()[1]}"  # the old head is gone: its stream retries
    run = Run(body(), MemoryCluster(address), RayJobs(timeout=0.5), settings())
    await run.step()  # Pending
    run.follower = LogFollower(run.jobs, address, "tft-uid-1-1")  # a previous attempt's stream
    run.follower.start()
    stream = run.follower
    await asyncio.sleep(0.1)
    assert stream.running
    decision = await run.step()  # Pending -> Provisioning (e.g. after a suspend)
    closed.close()
    assert decision.phase == phases.PROVISIONING
    assert not stream.running and run.follower is None
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


def test_a_raycluster_being_deleted_is_never_ready():
    going = {"metadata": {"name": "tft-demo", "namespace": "ns", "ownerReferences": [{"uid": "uid-1"}],
                          "deletionTimestamp": "2026-01-01T00:00:00Z"},
             "status": {"state": "ready"}}
    view = cluster_view(going, "uid-1", Settings())
    assert view.exists and view.owned and not view.ready
    assert "being deleted" in view.problem
