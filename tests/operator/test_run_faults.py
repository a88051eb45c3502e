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
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tpufinetune.adapters.kube import cluster_view
from tpufinetune.adapters.logfollow import LogFollower
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import conditions as cond
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.settings import Settings
from tpufinetune_trainer.events import format_event

from run_helpers import JobApiStandIn, MemoryCluster, body, closed_address, in_loop, running, settings


class WatchedLock(asyncio.Lock):
    """The Run's lock, telling when a step had to wait for it (an event, not a sleep)."""

    def __init__(self):
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self):
        if self.locked():
            self.contended.set()
        return await super().acquire()


@in_loop
async def test_deleting_waits_for_the_daemons_step_and_nothing_is_created_after_it():
    cluster = MemoryCluster()
    live = body()
    run = Run(live, cluster, RayJobs(), settings())
    await run.step()  # Pending: identities reserved
    run.lock = WatchedLock()
    cluster.create_gate = asyncio.Event()
    daemon_step = asyncio.create_task(run.step())  # Pending -> Provisioning: creates, slowly
    while "create" not in cluster.calls:
        await asyncio.sleep(0.01)

    live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    delete_step = asyncio.create_task(run.step(deleting=True))  # kopf's on.delete, same Run
    # Until the delete step either waits for the daemon's step or ends without waiting.
    contended = asyncio.create_task(run.lock.contended.wait())
    await asyncio.wait({delete_step, contended}, return_when=asyncio.FIRST_COMPLETED)
    contended.cancel()
    assert not delete_step.done(), "the delete step ran beside the daemon's step"
    assert run.lock.contended.is_set()
    assert cluster.calls == ["status:Pending", "status:Provisioning", "create"]  # nothing of the delete yet
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
    assert not (await run.observe(deleting=True)).cluster.exists  # the finalizer may go


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
    run = Run(body(running(address)), cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=1))
    decision = await run.step()  # within the bound: said in the status and an Event, nothing decided
    assert decision.phase == phases.RUNNING and not cond.find(decision.status, cond.FAILED)
    assert re.search(f"Ray unreachable: the Ray head at {re.escape(address)} does not answer: "
                     f"Failed to connect to Ray at address: {re.escape(address)}", cluster.status["message"])
    assert cluster.events == ["RayUnreachable"] and cluster.exists
    await run.step()
    assert cluster.events == ["RayUnreachable"]  # the same reason: no second Event
    await asyncio.sleep(1.1)
    decision = await run.step()
    closed.close()
    assert decision.phase == phases.FAILED
    failed = cond.find(decision.status, cond.FAILED)
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
    run = Run(body(running(address)), cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=600))
    try:
        started = time.monotonic()
        # The call's own timeout ends it (a ReadTimeout, not the 30 s hang detector's
        # asyncio TimeoutError): without one it would never return.
        decision = await asyncio.wait_for(run.step(), 30)
        assert time.monotonic() - started < 30
        assert re.search(r"does not answer: .*[Rr]ead timed out. \(read timeout=0\.5\)", decision.status["message"])
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
    with pytest.raises(TimeoutError, match="the API server did not answer in time"):
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


@in_loop
async def test_a_raycluster_deleted_mid_run_is_a_lost_job_retried_without_asking_its_dead_head():
    closed, address = closed_address()
    cluster = MemoryCluster(address)  # someone deleted the RayCluster: it does not exist
    live = body(running(address))
    live["spec"]["maxRetries"] = 1
    run = Run(live, cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=600))
    decision = await run.step()  # used to fail every step until RayUnreachable
    assert decision.phase == phases.PENDING and decision.status["attempt"] == 2
    assert decision.status["retries"] == 1
    assert cluster.events == ["ClusterLost"]
    assert "deleted outside the operator" in cluster.status["message"]
    decision = await run.step()
    closed.close()
    assert decision.phase == phases.PROVISIONING and cluster.calls[-1] == "create"


@in_loop
async def test_the_ray_unreachable_clock_starts_again_after_a_suspend():
    closed, address = closed_address()
    cluster = MemoryCluster(address)
    cluster.exists = True
    live = body(running(address))
    run = Run(live, cluster, RayJobs(timeout=0.5), settings(ray_unreachable_timeout=1))
    assert "Ray unreachable" in (await run.step()).status["message"]  # the head does not answer: the clock starts
    await asyncio.sleep(1.1)
    live["spec"]["suspend"], live["metadata"]["generation"] = True, 2
    assert (await run.step()).phase == phases.PENDING  # suspended: the slice is released
    live["spec"]["suspend"], live["metadata"]["generation"] = False, 3
    assert (await run.step()).phase == phases.PROVISIONING
    assert (await run.step()).phase == phases.SUBMITTING  # on a new cluster
    decision = await run.step()  # used to end the run at once: the clock had run since attempt 1
    closed.close()
    assert "Ray unreachable" in decision.status["message"]
    assert run.status["phase"] == phases.SUBMITTING


BAD_EVENTS = [
    {"event": "epoch", "epoch": "two", "epochs": 2, "loss": 1.0},  # a wrong type
    {"event": "epoch", "epoch": -1, "epochs": 2},  # a value the status model refuses
    {"event": "epoch", "epoch": 1, "epochs": 2, "loss": float("nan")},  # JSON cannot carry it
]


@in_loop
async def test_a_malformed_trainer_event_is_dropped_counted_and_never_blocks_the_next_ones():
    from prometheus_client import REGISTRY
    dropped_before = REGISTRY.get_sample_value("tpufinetune_trainer_events_dropped_total") or 0
    cluster = MemoryCluster()
    run = Run(body(), cluster, RayJobs(), settings())
    await run.step()  # Pending
    good = {"event": "epoch", "epoch": 1, "epochs": 2, "loss": 2.5}
    run.unwritten = [*BAD_EVENTS, good]  # as drained from the log follower
    decision = await run.step()  # used to raise on every step from here on
    assert decision.phase == phases.PROVISIONING
    assert cluster.status["epoch"] == 1 and cluster.status["loss"] == 2.5
    assert run.unwritten == []
    assert cluster.events.count("MalformedTrainerEvent") == 1
    assert REGISTRY.get_sample_value("tpufinetune_trainer_events_dropped_total") == dropped_before + 3
    later = {"event": "epoch", "epoch": 2, "epochs": 2, "loss": 2.0}
    run.unwritten = [later]
    await run.step()
    assert cluster.status["epoch"] == 2



@in_loop
async def test_status_writes_of_one_run_are_spaced_by_the_setting():
    cluster = MemoryCluster()
    cluster.ready = False  # it stays Provisioning: no Ray here
    run = Run(body(), cluster, RayJobs(), settings(status_write_interval=0.3))
    await run.step()  # Pending
    await run.step()  # Provisioning
    transitions = [b - a for a, b in zip(cluster.write_times, cluster.write_times[1:])]
    assert cluster.status["phase"] == "Provisioning" and transitions[0] < 0.2, transitions  # at once
    first = len(cluster.write_times) - 1
    for step in range(1, 5):  # a chatty trainer: a new event at every step
        run.unwritten = [{"event": "progress", "step": step, "total_steps": 100}]
        await run.step()
    assert cluster.status["progress"]["step"] == 4
    gaps = [b - a for a, b in zip(cluster.write_times[first:], cluster.write_times[first + 1:])]
    assert len(gaps) == 4 and min(gaps) >= 0.29, gaps


class BlackHoledAPIServer:
    """A socket that accepts connections and never answers: an API server (or a proxy in
    front of it) that hangs. Closing it resets every connection it accepted."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc):
        self.sock.close()


@in_loop
async def test_every_kubernetes_call_is_bounded_by_the_setting():
    from kubernetes import client
    from urllib3.exceptions import MaxRetryError, ReadTimeoutError

    from tpufinetune.adapters.kube import KubeBackend
    from tpufinetune.core.phases import Identity

    ident = Identity("demo", "ns", "uid-1")
    with BlackHoledAPIServer() as address:
        config = client.Configuration()
        config.host = address
        backend = KubeBackend(client.ApiClient(config), Settings(kube_timeout=0.3))
        calls = {"observe": backend.observe(ident, "tft-demo"), "create": backend.create(ident, {"metadata": {}}),
                 "delete": backend.delete(ident, "tft-demo"), "read_status": backend.read_status(ident),
                 "write_status": backend.write_status(ident, {"phase": "Running"}, {}, "")}
        for name, call in calls.items():
            started = time.monotonic()
            # A hang detector, not a timing target: without a timeout these never return.
            with pytest.raises((ReadTimeoutError, MaxRetryError)):
                await asyncio.wait_for(call, 20)
            assert time.monotonic() - started < 20, name


class StandInHead(JobApiStandIn):
    """A stand-in for a head's Job API (its version, one RUNNING job) whose log stream
    misbehaves on demand: `silent` completes the websocket handshake and then never
    answers again, not even a ping (a half-open connection, a partition); `close` closes
    each stream cleanly at once while the job runs. For a follower resuming at a cursor
    (the state API's log endpoints, serving LOG): `quiet` sends the log on its stream and
    then nothing, while the job endpoint still answers (a half-open stream); `partitioned`
    does the same, and once a stream is open the job endpoint never answers either. No
    real head can be made to do any of these on demand, hence this small aiohttp server."""

    def __init__(self, mode: str):
        self.mode = mode
        self.streams: list[float] = []  # when each log stream was opened

    def routes(self):
        from aiohttp import web

        async def job(request):
            if self.mode == "partitioned" and self.streams:
                await asyncio.sleep(3600)
            return web.json_response({"status": "RUNNING", "message": "", "submission_id": request.match_info["id"],
                                      "driver_node_id": "0" * 56})

        async def log_file(request):
            return web.Response(text=LOG)

        async def log_stream(request):
            self.streams.append(time.monotonic())
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(LOG.encode())
            await asyncio.sleep(3600)
            return response

        async def tail(request):
            self.streams.append(time.monotonic())
            ws = web.WebSocketResponse(autoping=self.mode != "silent")
            await ws.prepare(request)
            if self.mode == "silent":
                await asyncio.sleep(3600)  # never reads: its pings go unanswered
            await ws.close()
            return ws

        return [("GET", "/api/jobs/{id}", job), ("GET", "/api/jobs/{id}/logs/tail", tail),
                ("GET", "/api/v0/logs/file", log_file), ("GET", "/api/v0/logs/stream", log_stream)]


@in_loop
async def test_a_log_stream_gone_silent_is_noticed_by_its_heartbeat_and_reopened():
    async with StandInHead("silent") as head:
        follower = LogFollower(RayJobs(timeout=2, heartbeat=0.4), head.address, "tft-uid-1-1", backoff=(0.1, 0.1))
        follower.start()
        deadline = time.monotonic() + 20  # a hang detector: without a heartbeat one stream waits for ever
        while len(head.streams) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await follower.close()
    assert len(head.streams) >= 2 and follower.reconnects >= 1


@in_loop
async def test_a_log_stream_closed_at_once_again_and_again_is_reopened_with_a_bounded_backoff():
    async with StandInHead("close") as head:
        follower = LogFollower(RayJobs(timeout=2), head.address, "tft-uid-1-1", backoff=(0.2, 0.8))
        follower.start()
        await asyncio.sleep(3)
        await follower.close()
    gaps = [b - a for a, b in zip(head.streams, head.streams[1:])]
    assert 3 <= len(head.streams) <= 7, gaps  # used to reconnect in a tight loop: hundreds
    assert gaps[0] >= 0.19 and max(gaps) >= 0.75 and max(gaps) < 1.5, gaps  # doubling, up to the most


LOG = "".join(f"line {i}\n" + format_event("progress", epoch=1, epochs=1, step=i, loss=1.0) + "\n" for i in range(50))


def resumed_mid_log() -> tuple[int, str, list[int]]:
    """(cursor, anchor) after the first half of LOG, and the steps that follow."""
    first = LogFollower(None, "http://unused", "tft-uid-1-1")
    half = LOG[: LOG.index("line 25\n")]
    first._feed(half)
    first.drain()
    return (*first.drained, list(range(25, 50)))


async def follow_resumed(head, timeout: float, until) -> LogFollower:
    """A follower resumed mid-LOG against `head`, run until `until(follower)` holds, then
    closed. The 20 s bound is a hang detector: a half-open stream looks quiet for ever, and
    without a heartbeat a silent head is waited on for ever."""
    cursor, anchor, _ = resumed_mid_log()
    follower = LogFollower(RayJobs(timeout=timeout, heartbeat=0.2), head.address, "tft-uid-1-1",
                           skip=cursor, anchor=anchor, backoff=(0.1, 0.1))
    follower.start()
    deadline = time.monotonic() + 20
    while not until(follower) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await follower.close()
    return follower


@in_loop
async def test_a_quiet_log_stream_is_opened_again_from_the_cursor_and_delivers_nothing_twice():
    async with StandInHead("quiet") as head:
        follower = await follow_resumed(head, 2, lambda _: len(head.streams) >= 2)
    assert len(head.streams) >= 2
    steps = resumed_mid_log()[2]
    assert [e["step"] for e in follower.drain()] == steps  # once, though the log came on every stream


@in_loop
async def test_a_quiet_log_stream_of_a_head_that_stopped_answering_is_given_up():
    async with StandInHead("partitioned") as head:
        follower = await follow_resumed(head, 1, lambda f: f.reconnects >= 1)
    assert follower.reconnects >= 1 and len(head.streams) == 1
    assert [e["step"] for e in follower.drain()] == resumed_mid_log()[2]
