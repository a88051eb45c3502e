"""The driver's tests without Kubernetes: an in-memory stand-in for the one RayCluster a
run sees (the faults these tests show are in the order of the driver's own steps, not in
Kubernetes), a resource body, settings with short bounds, and a fresh event loop; and a
real job on a Ray head that prints given text."""

from __future__ import annotations

import asyncio
import functools
import shlex
import socket
import time
from pathlib import Path

from harness.waiting import wait_for
from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.core import phases
from tpufinetune.core.api import GROUP, VERSION
from tpufinetune.core.phases import ClusterView
from tpufinetune_trainer.events import format_event
from tpufinetune.core.podstatus import HEALTHY
from tpufinetune.settings import Settings


def in_loop(test):
    """Run an async test in a fresh event loop (the driver's own asyncio, no plugin)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


SPEC = {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
        "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}


# A v6e 4x4 run, for the tests of the operator process on the bare control plane.
V6E_SPEC = {"tpu": {"generation": "v6e", "topology": "4x4"}, "image": "registry.example/t:1",
            "checkpoint": {"storagePath": "gs://bench/ckpt"}}


def tpufinetune(name: str, spec: dict = V6E_SPEC) -> dict:
    """A TPUFineTune manifest named `name`."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFineTune", "metadata": {"name": name}, "spec": spec}


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
        self.write_times: list[float] = []
        self.ready = True  # once it exists
        self.health = HEALTHY  # what the slice's pods say once a job ended

    async def observe(self, ident, name):
        if self.cancel_next_observe:  # a cancelled inner future, not a cancellation of the run
            self.cancel_next_observe = False
            raise asyncio.CancelledError()
        return ClusterView(exists=self.exists, owned=True, ready=self.exists and self.ready,
                           dashboard_url=self.dashboard_url)

    async def create(self, ident, manifest):
        self.calls.append("create")
        if self.create_gate is not None:
            await self.create_gate.wait()
        self.exists = True

    async def delete(self, ident, name):
        self.calls.append("delete")
        self.exists = False

    async def ray_token(self, ident):
        return None  # the head takes RayJobs' own headers

    async def slice_health(self, ident, name, since, hosts):
        self.calls.append("slice_health")
        return self.health

    async def write_status(self, ident, patch, new, resource_version):
        self.calls.append(f"status:{new.get('phase')}")
        self.write_times.append(time.monotonic())
        self.status = new
        if self.lose_next_answer:  # the write landed, but its answer was lost (a timeout)
            self.lose_next_answer = False
            raise TimeoutError("the API server did not answer in time")

    async def read_status(self, ident):
        return dict(self.status), ""

    def record(self, ident, type_, reason, message):
        self.events.append(reason)

    async def maintenance(self, ident, cluster):
        return ()  # no node of this cluster has maintenance scheduled


def closed_address() -> tuple[socket.socket, str]:
    """A Ray head's address that refuses connections (bound, never listening)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    return closed, f"http://127.0.0.1:{closed.getsockname()[1]}"


def running(address: str) -> dict:
    """The status of a run whose attempt 1 runs on the head at `address`."""
    return {"phase": phases.RUNNING, "rayClusterName": "tft-demo", "jobId": "tft-uid-1-1", "attempt": 1,
            "dashboardURL": address, "epochs": 1}


def body(status: dict | None = None, **meta) -> dict:
    return {"metadata": {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": 1, **meta},
            "spec": dict(SPEC), "status": dict(status or {})}


def settings(**values) -> Settings:
    return Settings(poll_interval=0.05, ray_timeout=0.5, **values)


def being_deleted(phase: str) -> dict:
    """A run in `phase` whose delete has begun: its RayCluster tft-demo, attempt 1's job."""
    return body({"phase": phase, "rayClusterName": "tft-demo", "attempt": 1, "jobId": "tft-uid-1-1"},
                deletionTimestamp="2026-01-01T00:00:00Z")


def delete_memo(backend):
    """What kopf's on.delete handler (handlers.release) reads of its memo, around `backend`."""
    from types import SimpleNamespace

    from tpufinetune.adapters.rayjobs import RayJobs
    from tpufinetune.core.progress import ProgressTracker

    return SimpleNamespace(backend=backend, jobs=RayJobs(timeout=0.5), settings=settings(), progress=ProgressTracker())


def long_log(lines: int, every: int = 100) -> str:
    """A chatty job's log: filler lines, a progress event every `every` lines, a result."""
    out = []
    for i in range(lines):
        if i % every == every - 1:
            out.append(format_event("progress", epoch=1, epochs=1, step=i, loss=1.0 / (i + 1)))
        else:
            out.append(f"step {i}: nothing to report " + "." * 40)
    out.append(format_event("result", best_checkpoint_uri="gs://b/best"))
    return "".join(line + "\n" for line in out)


# Ray's job supervisor writes this line into the job's log through a file buffer that it
# flushes only after the job's process has started: a job that prints at once can have
# the line land after its output, or inside it (Ray 2.60, job_supervisor._exec_entrypoint).
RAY_ENTRYPOINT_LINE = "Running entrypoint for job "


def submit_printing(ray_head, tmp_path: Path, *parts: str, gate: Path | None = None, then: str = "") -> str:
    """A real job on `ray_head` printing `parts` (from files, so the log holds exactly them
    after Ray's own lines), then running the shell command `then`. It starts printing only
    once Ray's entrypoint line is in its log (a start file this waits for, then creates), so
    its output is the log's end. With `gate`, it waits for that file after its first part
    (the test creates it when it wants the rest)."""
    start = tmp_path / "start"
    commands = [f"until [ -e {shlex.quote(str(start))} ]; do sleep 0.1; done"]
    for i, part in enumerate(parts):
        path = tmp_path / f"part{i}.txt"
        path.write_text(part)
        commands.append(shlex.join(["cat", str(path)]))
        if i == 0 and gate is not None:
            commands.append(f"until [ -e {shlex.quote(str(gate))} ]; do sleep 0.1; done")
    client = ray_head.job_client()
    job_id = client.submit_job(entrypoint=" && ".join(commands + ([then] if then else [])))
    wait_for(lambda: RAY_ENTRYPOINT_LINE in client.get_job_logs(job_id), 120, f"Ray's entrypoint line in {job_id}'s log")
    start.touch()
    return job_id


class JobApiStandIn:
    """A small aiohttp server answering a head's Job API on a free loopback port, for the
    faults no real head can be made to show on demand (each subclass's docstring says
    which). A subclass gives `routes()`, (method, path, handler) beyond `/api/version`."""

    address = ""

    def routes(self) -> list[tuple[str, str, object]]:
        raise NotImplementedError

    async def __aenter__(self):
        import ray
        from aiohttp import web

        async def version(request):
            return web.json_response({"version": "4", "ray_version": ray.__version__, "ray_commit": ""})

        app = web.Application()
        app.router.add_get("/api/version", version)
        for method, path, handler in self.routes():
            app.router.add_route(method, path, handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.address = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()



class RecordingBackend(KubeBackend):
    """The operator's KubeBackend; its Events go to a list (kopf posts them only from
    inside a running operator)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, str]] = []

    def record(self, ident, type_, reason, message):
        self.events.append((reason, message))
