"""The driver (Run) against a real local Ray head under faults: a 404 versus other
errors, a refused token, a log stream a proxy closes cleanly mid-run, a stream cancelled
under the follower, retries (never two jobs at once, no follower left behind) and one
black-holed head beside a healthy run.

Kubernetes plays no part here: `run --local`'s LocalBackend stands in for the RayCluster
(the local head is the cluster). The Ray side is all real: the head, its Job API, the
trainer's jobs, aiohttp for the proxy.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import shlex
import socket
import threading
import uuid

import aiohttp
import pytest
from aiohttp import web
from tpufinetune.adapters.jobapi import AuthenticationError

from harness.ports import free_port
from harness.waiting import wait_for
from tpufinetune import runray
from tpufinetune.adapters.logfollow import LogFollower
from tpufinetune.adapters.rayjobs import NO_DRIVER_LOG, RESUME_LINES, RayJobs, event_dict
from tpufinetune.core import phases
from tpufinetune.driver import Run
from tpufinetune.local import LocalBackend
from tpufinetune.settings import Settings
from tpufinetune_trainer.events import format_event, parse_text

from run_helpers import long_log, submit_printing

pytestmark = [pytest.mark.ray]


def resource(assets, storage, mode: str = "finetune", **extra) -> dict:
    spec = {
        "tpu": {"generation": "cpu", "topology": "2"}, "mode": mode,
        "image": "registry.example/tpufinetune-trainer:test",
        "model": {"id": str(assets.model)}, "dataset": {"id": str(assets.data), "split": "train"},
        "training": {"epochs": 2, "batchSizePerDevice": 4, "maxSeqLen": 128},
        "checkpoint": {"storagePath": str(storage)},
        **extra,
    }
    name = f"r{uuid.uuid4().hex[:8]}"
    return {"metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4()), "generation": 1},
            "spec": spec}


def settings(ray_head, **values) -> Settings:
    # The deployed Ray call timeout (10 s), not a shorter one: the head here serves a
    # training job on two loaded cores, as a slice's head does.
    return Settings(poll_interval=1, ray_token=ray_head.token or "", **values)


def local_run(ray_head, body: dict, address: str | None = None, jobs: RayJobs | None = None) -> Run:
    s = settings(ray_head)
    backend = LocalBackend(address or ray_head.dashboard_url, out=io.StringIO())
    # A run attached mid-way (its status says Submitting or Running) finds its cluster up.
    backend.cluster_up = (body.get("status") or {}).get("phase") in (phases.SUBMITTING, phases.RUNNING)
    return Run(body, backend, jobs or RayJobs(headers=s.ray_headers(), timeout=s.ray_timeout), s)


def wait_job(client, job_id: str, timeout: float = 120) -> str:
    """The job's final status, once it ended."""
    def ended():
        status = str(client.get_job_status(job_id).value)
        return status if status in ("SUCCEEDED", "FAILED", "STOPPED") else None
    return wait_for(ended, timeout, f"job {job_id} to end")


def printing_job(ray_head, tmp_path, lines: list[str]) -> str:
    """A real job whose log is `lines` (trainer event lines among them) after Ray's own."""
    job_id = submit_printing(ray_head, tmp_path, "".join(line + "\n" for line in lines))
    assert wait_job(ray_head.job_client(), job_id) == "SUCCEEDED"
    return job_id


# ---- the Job API adapter ---------------------------------------------------------------


def test_a_job_is_lost_only_when_the_head_answers_404(ray_head, tmp_path):
    jobs = RayJobs(headers=ray_head.headers(), timeout=10)
    assert jobs.job(ray_head.dashboard_url, "tft-never-submitted-1") is None  # the head's real 404
    job_id = printing_job(ray_head, tmp_path, ["hello"])
    assert jobs.job(ray_head.dashboard_url, job_id).status == "SUCCEEDED"
    jobs.stop(ray_head.dashboard_url, "tft-never-submitted-1")  # stopping an unknown job: done


def test_the_log_tail_of_a_failed_job_is_cut_on_the_head(ray_head, tmp_path):
    # Its lines come after Ray's entrypoint line (submit_printing): in a full suite run Ray
    # wrote that line after a fast job's output, and the tail ended with it, not line 4999.
    job_id = submit_printing(ray_head, tmp_path, "".join(f"line {i}\n" for i in range(5000)), then="exit 3")
    assert wait_job(ray_head.job_client(), job_id) == "FAILED"
    tail = RayJobs(headers=ray_head.headers(), timeout=10).log_tail(ray_head.dashboard_url, job_id)
    assert tail.split(" | ")[-1] == "line 4999", tail
    assert "line 4990" not in tail and len(tail.split(" | ")) <= 8


def test_a_job_that_failed_before_its_driver_started_is_decided_on_its_own_message(ray_head):
    body = {"metadata": {"name": "no-driver", "namespace": "default", "uid": str(uuid.uuid4()), "generation": 1},
            "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                     "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}
    job_id = f"tft-{body['metadata']['uid']}-1"
    client = ray_head.job_client()
    # The head cannot set this runtime_env up (no such package): no driver ever runs.
    client.submit_job(entrypoint="true", submission_id=job_id,
                      runtime_env={"working_dir": "gcs://_ray_pkg_00000000000000000000000000000000.zip"})
    assert wait_job(client, job_id) == "FAILED"
    assert not client.get_job_info(job_id).driver_node_id
    body["status"] = {"phase": phases.RUNNING, "rayClusterName": "tft-no-driver", "jobId": job_id, "attempt": 1,
                      "dashboardURL": ray_head.dashboard_url, "epochs": 1}
    run = local_run(ray_head, body)

    async def scenario():
        try:
            return await asyncio.wait_for(run.step(), 60)  # used to raise: no node to read a log from
        finally:
            await run.close()

    decision = asyncio.run(scenario())
    assert decision.phase == phases.FAILED
    failed = next(c for c in decision.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "JobFailed"
    assert failed["message"].startswith("runtime_env setup failed") and failed["message"].endswith(NO_DRIVER_LOG)
    assert "Traceback" not in failed["message"]


def test_a_refused_token_is_an_error_never_a_lost_job(ray_head):
    jobs = RayJobs(headers={"Authorization": "Bearer wrong"}, timeout=10)
    with pytest.raises(AuthenticationError, match="^Authentication failed: "):  # 403: a token, not this one
        jobs.job(ray_head.dashboard_url, "tft-never-submitted-1")


# ---- the log follower ------------------------------------------------------------------


EVENTS = [format_event("epoch", epoch=1, epochs=2, loss=3.0), format_event("epoch", epoch=2, epochs=2, loss=2.0),
          format_event("result", best_checkpoint_uri="/ckpt/best", exported_model_uri="/ckpt/model")]


def test_finish_after_the_stream_was_cancelled_reads_the_rest_instead_of_raising(ray_head, tmp_path):
    job_id = printing_job(ray_head, tmp_path, ["starting", *EVENTS])

    async def scenario():
        follower = LogFollower(RayJobs(headers=ray_head.headers(), timeout=10), ray_head.dashboard_url, job_id)
        follower.start()
        await follower.close()  # the stream task is cancelled (a restart of the attempt, a shutdown)
        await follower.finish()  # used to re-raise that CancelledError and end the daemon
        return follower.drain()

    events = asyncio.run(scenario())
    assert [e["event"] for e in events] == ["epoch", "epoch", "result"]


def test_the_follower_of_a_job_the_head_does_not_know_ends_by_itself(ray_head):
    async def scenario():
        follower = LogFollower(RayJobs(headers=ray_head.headers(), timeout=10), ray_head.dashboard_url,
                               "tft-lost-with-its-head-1")
        follower.start()
        for _ in range(100):  # used to reconnect for ever
            if not follower.running:
                break
            await asyncio.sleep(0.1)
        running = follower.running
        await follower.close()
        return running

    assert asyncio.run(scenario()) is False


class ClosingProxy:
    """A reverse proxy in front of the head, as an ingress or an agent restart would be:
    HTTP passes through; the first log stream is closed cleanly (code 1000) after its
    first chunk (or once it passed on `close_after`), while the job runs; later streams
    pass through."""

    def __init__(self, upstream: str, close_after: str = ""):
        self.upstream = upstream
        self.close_after = close_after
        self.closes_left = 1
        self.before_close = ""
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=1)  # a stream still open upstream ends at once
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.address = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.session.close()

    def _headers(self, request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() == "authorization" or k.lower() == "content-type"}

    async def handle(self, request: web.Request):
        if request.path.endswith("/logs/tail"):
            return await self.tail(request)
        async with self.session.request(request.method, self.upstream + request.path_qs,
                                        headers=self._headers(request), data=await request.read()) as upstream:
            # Passed on as it comes: the state API's log stream never ends by itself.
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def tail(self, request: web.Request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        closing = self.closes_left > 0
        self.closes_left -= 1
        async with self.session.ws_connect(self.upstream + request.path_qs, headers=self._headers(request)) as up:
            async for message in up:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                await ws.send_str(message.data)
                if closing:
                    self.before_close += message.data
                    if self.close_after in self.before_close:
                        await ws.close()  # before the upstream's own close, which may take a while
                        break
        await ws.close()  # a clean close, mid-run for the first stream
        return ws


@pytest.mark.slow
def test_a_clean_close_of_the_log_stream_mid_run_loses_no_later_event(ray_head, trainer_assets, tmp_path):
    async def scenario():
        proxy = ClosingProxy(ray_head.dashboard_url)
        await proxy.start()
        try:
            run = local_run(ray_head, resource(trainer_assets, tmp_path / "ckpt"), address=proxy.address)
            await asyncio.wait_for(run.run(asyncio.Event()), 600)
            return run.status, proxy
        finally:
            await proxy.stop()

    status, proxy = asyncio.run(scenario())
    # The first stream was closed mid-run. Whether the job was still running when the
    # follower saw the close (it reconnects) or had just ended (it reads the rest once)
    # depends on the machine's load; either way no later event may be lost.
    assert proxy.closes_left <= 0, "the proxy never closed a stream"
    assert "exported_model_uri" not in proxy.before_close  # the close came before the end
    assert status["phase"] == phases.SUCCEEDED, status.get("message")
    assert [entry["epoch"] for entry in status["history"]] == [1, 2]
    assert status["checkpointURI"] and status["exportedModelURI"]


# How long LogFollower.finish waits for a websocket to end by itself (its default, as the
# driver calls it at a job's end).
FINISH_STREAM_S = inspect.signature(LogFollower.finish).parameters["timeout"].default


def finish_bound(jobs: RayJobs) -> float:
    """The most LogFollower.finish can take: the stream's own end (its `timeout`), then the
    rest read from the cursor, each call to the head within the client's timeout: a client,
    the driver's node, the tail (doubling from RESUME_LINES[0] to RESUME_LINES[1], then the
    whole log) and, failing that, the whole log once more."""
    tails = 2 + (RESUME_LINES[1] // RESUME_LINES[0]).bit_length()
    return FINISH_STREAM_S + (2 + tails + 1) * jobs.timeout


def test_a_reconnect_mid_run_reads_a_bounded_tail_not_the_log_from_its_start(ray_head, tmp_path):
    """The websocket is closed once it passed a long log's first part, while the job
    sleeps before its last lines: the follower resumes at its cursor from a bounded tail
    and the state API's stream (the websocket would send all of it again)."""
    before, after = long_log(20000), long_log(300, every=10).replace("nothing to report", "late line")
    for name, text in (("before", before), ("after", after)):
        (tmp_path / name).write_text(text)
    job_id = ray_head.job_client().submit_job(entrypoint=" && ".join((
        shlex.join(["cat", str(tmp_path / "before")]), "sleep 6", shlex.join(["cat", str(tmp_path / "after")]))))
    jobs = RayJobs(headers=ray_head.headers(), timeout=10)
    expected = [event_dict(e) for e in parse_text(before + after)]

    async def scenario():
        proxy = ClosingProxy(ray_head.dashboard_url, close_after=before[-100:])
        await proxy.start()
        follower = LogFollower(jobs, proxy.address, job_id, backoff=(0.1, 0.1))
        follower.start()
        events = []
        try:
            for _ in range(900):  # a hang detector
                if len(events) >= len(expected):
                    break
                await asyncio.sleep(0.1)
                events += follower.drain()
            # Nothing more may come: once the job has ended, the follower is finished as the
            # driver finishes it (the stream's last lines, or the rest read from the cursor),
            # and every event it would ever hand out has been drained.
            await asyncio.to_thread(wait_job, ray_head.job_client(), job_id)
            await asyncio.wait_for(follower.finish(), finish_bound(jobs))
            return events + follower.drain(), follower, proxy
        finally:
            await follower.close()
            await proxy.stop()

    events, follower, proxy = asyncio.run(scenario())
    assert proxy.closes_left <= 0 and "late line" not in proxy.before_close  # closed mid-run
    assert events == expected  # each event once
    assert follower.reconnects >= 1 and follower.tail_resumes >= 1 and follower.full_replays == 0
    received = jobs.client(proxy.address).log_bytes
    whole = len((before + after).encode())
    assert received < 1.3 * whole, (received, whole)  # a replay would have sent `before` twice
    print(f"\nlog {whole} bytes; websocket closed after {len(proxy.before_close.encode())}: {received} received")


# ---- retries: one job at a time, no follower left ---------------------------------------


def test_a_retry_stops_the_previous_attempt_before_it_submits(ray_head, trainer_assets, tmp_path):
    body = resource(trainer_assets, tmp_path / "ckpt", mode="collectives", maxRetries=1)
    uid = body["metadata"]["uid"]
    client = ray_head.job_client()
    # Attempt 1 is still running on the head (the operator's view said it was lost).
    client.submit_job(entrypoint="sleep 600", submission_id=f"tft-{uid}-1")
    body["status"] = {"phase": phases.SUBMITTING, "rayClusterName": "tft-x", "attempt": 2, "jobId": f"tft-{uid}-2",
                      "dashboardURL": ray_head.dashboard_url, "epochs": 0}

    def ours():
        return {j.submission_id: str(j.status.value) for j in client.list_jobs()
                if (j.submission_id or "").startswith(f"tft-{uid}-")}

    async def scenario():
        run = local_run(ray_head, body)
        with pytest.raises(RuntimeError, match="is still (PENDING|RUNNING); stopping it"):
            await run.step()
        held = ours()
        decision = None
        for _ in range(60):  # the stop takes effect; then attempt 2 goes in
            try:
                decision = await run.step()
            except RuntimeError:
                await asyncio.sleep(1)
                continue
            if decision.phase == phases.RUNNING:
                break
        await run.close()
        return held, decision

    held, decision = asyncio.run(scenario())
    assert f"tft-{uid}-2" not in held  # nothing was submitted while attempt 1 ran
    jobs = ours()
    assert jobs[f"tft-{uid}-1"] == "STOPPED"
    assert decision is not None and decision.phase == phases.RUNNING and f"tft-{uid}-2" in jobs
    client.stop_job(f"tft-{uid}-2")


class SubmitWatch(RayJobs):
    """Ray's Job API as the driver uses it, asking the head at every submission which of
    the run's jobs are active. A job becomes active only by a submission, so a check at
    each one sees any overlap, however short (a sample every few tenths would not)."""

    def __init__(self, client, uid: str, **kwargs):
        super().__init__(**kwargs)
        self.head, self.uid = client, uid
        self.active_at_submit: list[tuple[str, list[str]]] = []

    def submit(self, address, submission_id, *args) -> None:
        active = [j.submission_id for j in self.head.list_jobs()
                  if (j.submission_id or "").startswith(f"tft-{self.uid}-") and str(j.status.value) in phases.JOB_ACTIVE]
        self.active_at_submit.append((submission_id, active))
        super().submit(address, submission_id, *args)


@pytest.mark.slow
def test_a_retry_never_overlaps_its_previous_attempt_and_leaves_no_task_behind(ray_head, trainer_assets, tmp_path,
                                                                                monkeypatch):
    body = resource(trainer_assets, tmp_path / "ckpt", maxRetries=1)
    body["spec"]["dataset"] = {"id": str(tmp_path / "missing.jsonl"), "split": "train"}  # every attempt fails
    uid = body["metadata"]["uid"]
    streams_at_start: list[tuple[str, int]] = []

    class CountedFollower(LogFollower):
        """The driver's log follower, counting the streams still running when it starts."""

        def start(self) -> None:
            live = [t for t in asyncio.all_tasks() if t.get_name().startswith("logs-") and not t.done()]
            streams_at_start.append((self.submission_id, len(live)))
            super().start()

    monkeypatch.setattr(runray, "LogFollower", CountedFollower)  # where the driver's Ray side makes it
    jobs = SubmitWatch(ray_head.job_client(), uid, headers=ray_head.headers(), timeout=5)

    async def scenario():
        run = local_run(ray_head, body, jobs=jobs)
        await asyncio.wait_for(run.run(asyncio.Event()), 600)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return run.status, left

    status, left = asyncio.run(scenario())
    assert status["phase"] == phases.FAILED and status["attempt"] == 2
    assert "missing.jsonl" in status["message"]
    # Each attempt kept its reason and its driver log's last lines.
    assert [a["reason"] for a in status["attempts"]] == ["AppFailed", "AppFailed"]
    assert all("missing.jsonl" in a["message"] and "log tail:" in a["message"] for a in status["attempts"])
    # Nothing of the run was active when either attempt went in.
    assert jobs.active_at_submit == [(f"tft-{uid}-1", []), (f"tft-{uid}-2", [])]
    # Attempt 1's follower was closed before attempt 2's started (each attempt has one).
    assert [n for _, n in streams_at_start] == [0] * len(streams_at_start)
    assert {job for job, _ in streams_at_start} == {f"tft-{uid}-1", f"tft-{uid}-2"}
    assert left == []  # nothing runs on after a terminal phase


# ---- one black-holed head beside a healthy run ------------------------------------------


@pytest.mark.slow
def test_black_holed_heads_stall_no_other_run_and_hold_threads_only_briefly(ray_head, trainer_assets, tmp_path):
    holes = []
    for _ in range(6):
        hole = socket.socket()
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)  # accepts connections, never answers
        holes.append(hole)

    async def scenario():
        # A small Ray pool, so that threads held for ever by black holes would starve the healthy run.
        jobs = RayJobs(headers=ray_head.headers(), timeout=2, threads=4)
        healthy = local_run(ray_head, resource(trainer_assets, tmp_path / "ckpt", mode="collectives"), jobs=jobs)
        stuck = []
        for hole in holes:
            address = f"http://127.0.0.1:{hole.getsockname()[1]}"
            body = resource(trainer_assets, tmp_path / "x")
            body["status"] = {"phase": phases.RUNNING, "rayClusterName": "tft-x", "jobId": "tft-x-1", "attempt": 1,
                              "dashboardURL": address, "epochs": 2}
            stuck.append(local_run(ray_head, body, address=address, jobs=jobs))
        stop = asyncio.Event()
        stuck_loops = [asyncio.create_task(run.run(stop)) for run in stuck]
        await asyncio.wait_for(healthy.run(asyncio.Event()), 400)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*stuck_loops), 60)
        return healthy.status, [run.status["phase"] for run in stuck]

    threads_before = threading.active_count()
    try:
        status, stuck_phases = asyncio.run(scenario())
    finally:
        for hole in holes:
            hole.close()
    assert status["phase"] == phases.SUCCEEDED, status.get("message")
    assert status["collectives"]["passed"] is True
    assert stuck_phases == [phases.RUNNING] * len(holes)  # still waiting, within TPUFT_RAY_UNREACHABLE_TIMEOUT
    assert threading.active_count() <= threads_before + 4
