"""Thin adapter over Ray's Job API (our own HTTP client, jobapi.py: the operator never
imports `ray`); the incremental log follower is logfollow.py.

The client is synchronous (requests); callers run it in RayJobs' own pool of threads
(`await jobs.call(jobs.job, ...)`), never in the one Kubernetes calls use. The log follower uses
the Job API's websocket tail, so each byte of a multi-megabyte log is parsed once, not on
every poll; resuming at a cursor it reads a bounded tail and the state API's log stream
instead (adapters/logresume.py), never the log from its start again.
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from tpufinetune.adapters import lease, metrics
from tpufinetune.adapters.jobapi import JobApiClient
from tpufinetune.adapters.logresume import as_logged, stream_decoder
from tpufinetune.adapters.pools import Pool
from tpufinetune.core.phases import JobView
from tpufinetune.settings import DEFAULT_RAY_THREADS
from tpufinetune_trainer.events import parse_text


log = logging.getLogger(__name__)
LOG_TAIL_CHARS = 2000
LOG_EVENTS_CHARS = 1 << 20  # a preflight's whole log is a few KiB; never hold more than this
LOG_TAIL_LINES = 8
LOG_HEARTBEAT_S = 30.0  # a ping on the log stream this often; no pong in half of it ends the stream
# Reconnecting a log stream waits this long, doubling up to the most, again after each
# failed or closed stream; a stream that delivered lines starts from the least again.
RECONNECT_BACKOFF_S = (1.0, 30.0)
NO_DRIVER_LOG = "(no driver log: the job failed before its driver started)"
# Resuming at a saved cursor asks the head for the last lines of the log: this many more
# than the anchor covers, doubling up to the most while the anchor is not among them;
# then, once, for the whole log.
RESUME_LINES = (1000, 16000)
STREAM_INTERVAL_S = 1.0  # how often the head looks for new lines of a followed log file
# A log stream with no line for this many heartbeats (the head answering, the job running)
# is opened again from a bounded tail: it has no ping, and a connection that went
# half-open would otherwise look like a quiet job for ever.
STREAM_QUIET_HEARTBEATS = 10


# Ray's JobSubmissionClient replaces the address it is given with either of these when
# they are set; a stray one would send every run to one cluster. JobApiClient reads
# neither, but anything in this process that still used Ray's client would.
ADDRESS_OVERRIDES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def drop_address_overrides(environ=os.environ) -> list[str]:
    """Remove Ray's address variables from this process: each run talks to its own
    cluster's head, always. Returns the names removed (logged once)."""
    removed = [name for name in ADDRESS_OVERRIDES if environ.pop(name, None) is not None]
    if removed:
        log.warning("ignoring %s: each run uses its own RayCluster's head address", ", ".join(removed))
    return removed


class TimedJobClient(JobApiClient):
    """The Job API client with a timeout on every HTTP request, connect and read: a head
    that accepts connections and never answers holds one thread for `timeout` seconds, not
    for ever (the client is synchronous; each call runs in a worker thread). Its log
    stream is bounded too: `timeout` to open it, and a heartbeat while it is open."""

    def __init__(self, address: str, headers: dict, timeout: float, heartbeat: float = LOG_HEARTBEAT_S):
        self._heartbeat = heartbeat
        self.log_bytes = 0  # bytes of job logs received, every endpoint together
        super().__init__(address, headers=headers, timeout=timeout)  # its version check times out too

    def received(self, size: int) -> None:
        """Bytes of a job's log that came from the head (tpufinetune_log_bytes_total)."""
        self.log_bytes += size
        metrics.log_read(size)

    async def tail_job_logs(self, job_id: str):
        """Ray's log stream (the Job API websocket), with a ping every `heartbeat` seconds:
        a stream whose head went silent (a half-open connection, a partition) ends with an
        error once a pong is missed, instead of waiting for ever. A quiet job still
        answers pings."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout, sock_connect=self._timeout)
        async with aiohttp.ClientSession(headers=self._headers, timeout=timeout) as session:
            ws = await asyncio.wait_for(session.ws_connect(
                f"{self._address}/api/jobs/{job_id}/logs/tail", headers=self._headers,
                heartbeat=self._heartbeat), self._timeout)
            async with ws:
                while True:
                    message = await ws.receive()
                    if message.type == aiohttp.WSMsgType.TEXT:
                        self.received(len(message.data.encode()))
                        yield message.data
                    elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                          aiohttp.WSMsgType.CLOSED):
                        if ws.close_code not in (None, aiohttp.WSCloseCode.OK):
                            raise RuntimeError(f"log stream of {job_id} closed with code {ws.close_code}"
                                               f" ({ws.exception() or 'no pong to a heartbeat, or a cut'})")
                        return
                    elif message.type == aiohttp.WSMsgType.ERROR:
                        raise RuntimeError(f"log stream of {job_id} failed: {ws.exception()}")

    def driver_node(self, submission_id: str) -> str | None:
        """The node the job's driver runs on (the state API's log endpoints need it)."""
        return (self.job_or_none(submission_id) or {}).get("driver_node_id") or None

    def log_lines(self, submission_id: str, node_id: str, lines: int) -> tuple[str, bool]:
        """The driver log's last `lines` lines (-1: all), cut on the head (the state API),
        as the websocket shows them; and whether that was the whole log."""
        params = {"submission_id": submission_id, "node_id": node_id, "lines": lines}
        response = self._do_request("GET", "/api/v0/logs/file", params=params)
        if response.status_code != 200:
            self._raise_error(response)
        raw = response.content
        self.received(len(raw))
        # Ray counts a last line without a newline as one of the `lines`.
        return as_logged(raw), lines < 0 or raw.count(b"\n") + 1 < lines

    async def stream_log(self, submission_id: str, node_id: str, lines: int):
        """The driver log's last `lines` lines, then each line appended, as the websocket
        shows them (the state API's log stream). Ray never ends this stream, not even
        when the job ends, and sends nothing while the log is quiet: after each
        `heartbeat` seconds without data it yields "", so the caller can ask whether the
        head and the job are still there. `timeout` bounds the wait for its first bytes."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout, sock_connect=self._timeout)
        params = {"submission_id": submission_id, "node_id": node_id, "lines": str(lines),
                  "interval": str(STREAM_INTERVAL_S)}
        decoder = stream_decoder()
        async with aiohttp.ClientSession(headers=self._headers, timeout=timeout) as session:
            # The head answers (headers and all) only with the tail's first bytes.
            response = await asyncio.wait_for(session.get(
                f"{self._address}/api/v0/logs/stream", params=params), self._timeout)
            async with response:
                if response.status != 200:
                    raise RuntimeError(f"log stream of {submission_id} refused: {response.status} "
                                       f"{(await response.text())[:300]}")
                while True:
                    try:
                        chunk = await asyncio.wait_for(response.content.readany(), self._heartbeat)
                    except asyncio.TimeoutError:
                        yield ""
                        continue
                    if not chunk:
                        raise RuntimeError(f"log stream of {submission_id} closed by the head")
                    self.received(len(chunk))
                    text = decoder.decode(chunk)
                    if text:
                        yield text

    def last_lines(self, submission_id: str, lines: int) -> str | None:
        """The last lines of the job's driver log, cut on the head (the state API's log
        endpoint): a multi-megabyte log is never downloaded to keep its tail. None when
        the job has no driver log: it failed before its driver started (a runtime_env
        that could not be set up), and the endpoint would only answer an error."""
        info = self.job_or_none(submission_id) or {}
        if not info.get("driver_node_id"):  # the endpoint needs the node the driver ran on
            return None
        params = {"submission_id": submission_id, "lines": lines, "node_id": info["driver_node_id"]}
        response = self._do_request("GET", "/api/v0/logs/file", params=params)
        if response.status_code != 200:
            self._raise_error(response)
        return response.text

    def alive_resources(self) -> dict[str, float]:
        """Ray resources of the cluster's alive nodes (the state API's node list)."""
        response = self._do_request("GET", "/api/v0/nodes", params={"limit": 10000, "detail": "true"})
        if response.status_code != 200:
            self._raise_error(response)
        total: dict[str, float] = {}
        for node in response.json()["data"]["result"]["result"]:
            if node.get("state") == "ALIVE":
                for key, value in (node.get("resources_total") or {}).items():
                    total[key] = total.get(key, 0.0) + float(value)
        return total

    def leftovers(self, submission_id: str) -> str:
        """What of the job is still in Ray: its actors that are not dead and its placement
        groups that are not removed (the state API, filtered by the job's Ray job id); ""
        when nothing is, or the head does not know the job. Ray Train's workers are actors
        of the driver's job inside its placement group, so once both lists are empty every
        CPU and TPU they held is back with the raylets. Detached actors outlive their job
        by design (Ray Train's state actor, created once per cluster, and its placement
        group cleaner, which holds no CPU and ends once it removed the group) and are not
        counted; a placement group is, detached or not, until it is removed."""
        info = self.job_or_none(submission_id) or {}
        job_id = info.get("job_id")
        if not job_id:
            return ""
        found = []
        for path, what, key, gone, detached_count in (
                ("/api/v0/actors", "actors", "job_id", "DEAD", False),
                ("/api/v0/placement_groups", "placement groups", "creator_job_id", "REMOVED", True)):
            params = [("filter_keys", key), ("filter_predicates", "="), ("filter_values", job_id),
                      ("filter_keys", "state"), ("filter_predicates", "!="), ("filter_values", gone),
                      ("limit", 1000), ("detail", "true")]
            response = self._do_request("GET", path, params=params)
            if response.status_code != 200:
                self._raise_error(response)
            left = [item for item in response.json()["data"]["result"]["result"]
                    if detached_count or not item.get("is_detached")]
            if left:
                names = sorted({str(item.get("class_name") or item.get("name") or "") for item in left} - {""})
                found.append(f"{len(left)} {what}" + (f" ({', '.join(names[:3])})" if names else ""))
        return ", ".join(found)


class RayJobs:
    """One Job API client per dashboard address, created on first use. Each address may
    have its own token (`authorize`: each run's head has its own); `headers` are for the
    addresses that have none (a fixed dashboard: a port-forward, a local head).

    Its methods block; `call` runs one in the Ray pool (`threads`, TPUFT_RAY_THREADS):
    heads that never answer hold these threads only, never a Kubernetes call's."""

    def __init__(self, headers: dict | None = None, timeout: float = 10.0, heartbeat: float = LOG_HEARTBEAT_S,
                 threads: int = DEFAULT_RAY_THREADS):
        drop_address_overrides()
        self.pool = Pool("ray", threads)
        self._headers = headers or {}
        self._address_headers: dict[str, dict] = {}
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._clients: dict[str, TimedJobClient] = {}

    async def call(self, fn, *args):
        """`fn(*args)` (one of these blocking methods, or a client's) in the Ray pool."""
        return await self.pool.call(fn, *args)

    def authorize(self, address: str, token: str) -> None:
        """Send `token` to this address, and only to it (a new token replaces the client)."""
        headers = {"Authorization": f"Bearer {token}"}
        if self._address_headers.get(address) != headers:
            self._address_headers[address] = headers
            self._clients.pop(address, None)

    def client(self, address: str) -> TimedJobClient:
        if address not in self._clients:
            headers = self._address_headers.get(address, self._headers)
            self._clients[address] = TimedJobClient(address, headers, self.timeout, self.heartbeat)
        return self._clients[address]

    def job(self, address: str, submission_id: str) -> JobView | None:
        info = self.client(address).job_or_none(submission_id)
        if info is None:
            return None
        return JobView(status=str(info.get("status")), message=info.get("message") or "")

    def submit(self, address: str, submission_id: str, entrypoint: str, runtime_env: dict, metadata: dict) -> None:
        """Submit once. Ray refuses a second job with the same submission id; that refusal
        means an earlier submit (before a crash) went through, which is what we want.
        Fenced by the Lease here, in the Ray thread, just before the request: not before
        the token was derived or the call waited for a thread."""
        lease.check_held(f"submit on the Ray head at {address} ({submission_id})")
        try:
            self.client(address).submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                runtime_env=runtime_env or None,
                metadata=metadata or None,
            )
        except RuntimeError as error:
            if "already exists" not in str(error):
                raise
            log.info("job %s already submitted; attaching", submission_id)

    def alive_resources(self, address: str) -> dict[str, float]:
        return self.client(address).alive_resources()

    def leftovers(self, address: str, submission_id: str) -> str:
        return self.client(address).leftovers(submission_id)

    def stop(self, address: str, submission_id: str) -> None:
        """Ask the job to stop; a job the head does not know (404) is already stopped.
        Fenced by the Lease here, just before the request (as `submit`)."""
        lease.check_held(f"stop on the Ray head at {address} ({submission_id})")
        self.client(address).stop_if_exists(submission_id)

    def events(self, address: str, submission_id: str) -> list[dict]:
        """Every trainer event of a short job's whole log (a preflight's)."""
        client = self.client(address)
        text = client.get_job_logs(submission_id)
        client.received(len(text.encode()))
        return [event_dict(event) for event in parse_text(text[-LOG_EVENTS_CHARS:])]

    def log_tail(self, address: str, submission_id: str) -> str:
        """Last lines of the log, read once when a job failed without a failure event."""
        text = self.client(address).last_lines(submission_id, LOG_TAIL_LINES)
        if text is None:
            return NO_DRIVER_LOG
        tail = text[-LOG_TAIL_CHARS:]
        return " | ".join(line.strip() for line in tail.splitlines()[-LOG_TAIL_LINES:] if line.strip())


def event_dict(event) -> dict:
    """The parser's event as a plain dict (the pure core works on dicts)."""
    if isinstance(event, dict):
        return event
    for attr in ("as_dict", "to_dict"):
        if hasattr(event, attr):
            return getattr(event, attr)()
    return dict(event.fields, event=event.kind)
