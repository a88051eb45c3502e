"""Drives one TPUFineTune: gather observations, run the pure transition, perform its
actions, write status in one place. Shared by the kopf operator and `run --local`; the
difference is only the ClusterBackend (Kubernetes RayCluster, or a local Ray head).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Protocol

from tpufinetune.adapters import metrics
from tpufinetune.core import phases
from tpufinetune.core.api import SpecError, parse_spec
from tpufinetune.core.jobspec import job_submission
from tpufinetune.core.phases import ClusterView, Decision, Identity, Observations, Plan
from tpufinetune.adapters.rayjobs import LogFollower, RayJobs
from tpufinetune.settings import Settings
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.sizing import raycluster_name

log = logging.getLogger(__name__)
# While deleting, Ray gets this long to answer (the job's state, a stop request).
DELETE_RAY_TIMEOUT = 5.0


class ClusterBackend(Protocol):
    async def observe(self, ident: Identity, name: str) -> ClusterView: ...
    async def create(self, ident: Identity, manifest: dict) -> None: ...
    async def delete(self, ident: Identity, name: str) -> None: ...
    async def write_status(self, ident: Identity, patch: dict, new: dict) -> None: ...
    def record(self, ident: Identity, type_: str, reason: str, message: str) -> None: ...


def status_patch(old: dict, new: dict) -> dict:
    """JSON merge patch from old to new status: changed keys, and None for removed ones."""
    patch = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new and k != "kopf"})
    return patch


class Run:
    """One resource's run. Holds the last status it wrote: the operator is its only writer."""

    def __init__(self, body, backend: ClusterBackend, jobs: RayJobs, settings: Settings):
        """`body` may be kopf's live view of the object: spec edits (suspend) are seen
        on the next step without restarting the run."""
        self.body = body
        self.backend = backend
        self.jobs = jobs
        self.settings = settings
        self.status = dict(body.get("status") or {})
        self.generation = None
        self._refresh_spec()
        self.follower: LogFollower | None = None
        self.wake = asyncio.Event()

    def _refresh_spec(self) -> None:
        meta = self.body["metadata"]
        generation = int(meta.get("generation") or 1)
        if generation == self.generation:
            return
        self.generation = generation
        self.ident = Identity(meta["name"], meta.get("namespace", "default"), meta["uid"], generation)
        self.spec, self.spec_error = None, ""
        try:
            self.spec = parse_spec(dict(self.body.get("spec") or {}))
        except SpecError as error:
            self.spec_error = str(error)
        self.plan = Plan(
            cluster_name=raycluster_name(self.ident.name),
            epochs=int(self.spec.training.epochs) if self.spec else 0,
            max_retries=self.spec.max_retries if self.spec else 0,
            provision_timeout=timedelta(seconds=self.settings.provision_timeout),
            suspended=bool(self.spec and self.spec.suspend),
            queue=(self.spec.queue_name or "") if self.spec else "",
        )

    # ---- observations ----------------------------------------------------------------

    async def observe(self, deleting: bool) -> Observations:
        now = datetime.now(timezone.utc)
        phase = self.status.get("phase", "")
        cluster = job = None
        if self.status.get("rayClusterName"):
            cluster = await self.backend.observe(self.ident, self.status["rayClusterName"])
        address = self.status.get("dashboardURL") or (cluster.dashboard_url if cluster else "")
        if deleting:
            job = await self._job_while_deleting(address, cluster)
            return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job, deleting=True)
        kueue_holds = bool(self.plan.queue) and cluster is not None and cluster.suspended  # head gone or going
        if kueue_holds or (phase == phases.QUEUED and self.follower is not None):
            return await self._observe_evicted(now, address, cluster, phase)
        if address and phase in (phases.SUBMITTING, phases.RUNNING) and self.status.get("jobId"):
            job = await asyncio.to_thread(self.jobs.job, address, self.status["jobId"])
            if self.plan.queue and (job is None or job.status not in phases.JOB_ACTIVE):
                # An eviction ends the job: Kueue suspends the RayCluster before KubeRay
                # deletes its pods, so a cluster read after the job shows why it ended.
                cluster = await self.backend.observe(self.ident, self.status["rayClusterName"])
        events = await self._new_events(address, job)
        return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job, events=events, deleting=deleting)

    async def _observe_evicted(self, now, address: str, cluster: ClusterView, phase: str) -> Observations:
        """Kueue suspended the cluster (an eviction): its head may answer for a moment, so
        the job is read only to stop it, and the events already streamed are kept. Once
        Queued, the evicted attempt's last events (a checkpoint it reported before it
        stopped) are taken and its log stream closed."""
        job, events = None, ()
        if phase in (phases.SUBMITTING, phases.RUNNING) and address and self.status.get("jobId"):
            job = await self._ray_while_deleting("reading the evicted job", self.jobs.job, address, self.status["jobId"])
        if self.follower is not None:
            events = tuple(self.follower.drain())
            if phase == phases.QUEUED:
                await self.follower.close()
                self.follower = None
        return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job, events=events)

    async def _job_while_deleting(self, address: str, cluster: ClusterView | None):
        """The job, only to stop it politely; unknown (None) when the head is gone or does
        not answer in time."""
        if not (address and self.status.get("jobId") and cluster is not None and cluster.exists and cluster.ready):
            return None
        return await self._ray_while_deleting("reading the job", self.jobs.job, address, self.status["jobId"])

    async def _ray_while_deleting(self, what: str, call, *args):
        """Best effort and bounded: deletion (and an eviction) never waits on Ray. A dead
        head, a refused token or a timeout gives None, and losing the cluster ends the job
        anyway."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(call, *args), DELETE_RAY_TIMEOUT)
        except Exception as error:
            log.info("%s/%s: %s failed (%s); the cluster is going, and the job with it",
                     self.ident.namespace, self.ident.name, what, error or type(error).__name__)
            return None

    async def _new_events(self, address: str, job) -> tuple[dict, ...]:
        if job is None or self.status.get("phase") != phases.RUNNING:
            return ()
        job_id = self.status["jobId"]
        if self.follower is None or self.follower.submission_id != job_id:
            skip = int(self.status.get("logCursor") or 0) if self.status.get("logJobId") == job_id else 0
            self.follower = LogFollower(self.jobs, address, job_id, skip=skip, wake=self.wake)
            self.follower.start()
        if job.status not in phases.JOB_ACTIVE:
            # Decide the outcome only once the whole log is parsed: the last lines
            # (result, failure) may still be in flight when Ray reports the job ended.
            await self.follower.finish()
        return tuple(self.follower.drain())

    def _log_cursor(self, status: dict) -> None:
        """Where the log was parsed up to; saved with the status it produced, so a
        restart skips exactly those bytes."""
        if self.follower is None:
            return
        same_job = status.get("logJobId") == self.follower.submission_id
        if not same_job or self.follower.parsed_bytes > int(status.get("logCursor") or 0):
            status["logCursor"] = self.follower.parsed_bytes
            status["logJobId"] = self.follower.submission_id

    # ---- one step ---------------------------------------------------------------------

    async def step(self, deleting: bool = False) -> Decision:
        before = self.status.get("phase", "")
        try:
            decision = await self._step(deleting)
        except Exception:
            metrics.step_failed(before)
            raise
        recorded = [(a.type, a.reason) for a in decision.actions if isinstance(a, phases.RecordEvent)]
        metrics.stepped(before, decision.phase, recorded)
        return decision

    async def _step(self, deleting: bool) -> Decision:
        self._refresh_spec()
        obs = await self.observe(deleting)
        decision = phases.transition(self.ident, self.plan, self.status, obs)
        # A failed job without a failure event: read the log tail once, then decide.
        tail = [a for a in decision.actions if isinstance(a, phases.ReadLogTail)]
        if tail:
            text = await asyncio.to_thread(self.jobs.log_tail, self.status["dashboardURL"], tail[0].submission_id)
            obs = Observations(**{**obs.__dict__, "log_tail": text or "(empty log)"})
            decision = phases.transition(self.ident, self.plan, self.status, obs)
        self._log_cursor(decision.status)
        # Status first: identities are persisted before the actions that depend on them.
        await self._write(decision.status)
        await self._perform(decision)
        return decision

    async def _write(self, new: dict) -> None:
        patch = status_patch(self.status, new)
        if patch:
            await self.backend.write_status(self.ident, patch, new)
        self.status = new

    async def _perform(self, decision: Decision) -> None:
        for action in decision.actions:
            if isinstance(action, phases.RecordEvent):
                self.backend.record(self.ident, action.type, action.reason, action.message)
            elif isinstance(action, phases.CreateCluster):
                await self.backend.create(self.ident, raycluster_with_pod_settings(
                    self.ident.name, self.ident.namespace, self.ident.uid, self.spec))
                metrics.cluster_created(self.ident.uid, self.body["metadata"].get("creationTimestamp"))
            elif isinstance(action, phases.DeleteCluster):
                await self.backend.delete(self.ident, action.name)
            elif isinstance(action, phases.SubmitJob):
                # A retry resumes from the last checkpoint the previous attempt reported.
                resume = self.status.get("checkpointURI") if action.attempt > 1 else None
                submission = job_submission(
                    self.ident.name, self.ident.namespace, self.ident.uid, self.spec, action.attempt, resume_from=resume
                )
                await asyncio.to_thread(
                    self.jobs.submit, self.status["dashboardURL"], action.submission_id,
                    submission.entrypoint, submission.runtime_env, submission.metadata,
                )
                if action.attempt == 1:
                    metrics.job_submitted(self.ident.uid, self.body["metadata"].get("creationTimestamp"))
            elif isinstance(action, phases.StopJob) and decision.phase in (phases.DELETING, phases.QUEUED):
                await self._ray_while_deleting(f"stopping job {action.submission_id}", self.jobs.stop,
                                               self.status["dashboardURL"], action.submission_id)
                if decision.phase == phases.QUEUED and self.follower is not None:
                    await self._last_lines_of_evicted_job()
            elif isinstance(action, phases.StopJob):
                await asyncio.to_thread(self.jobs.stop, self.status["dashboardURL"], action.submission_id)
        if decision.phase in phases.TERMINAL and self.follower is not None:
            await self.follower.close()
            self.follower = None

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, stopped) -> None:
        """Step until terminal and released; wait on new log events or the poll interval.

        `stopped` is anything with `is_set()` (kopf's DaemonStopped, an asyncio.Event)."""
        while not stopped.is_set():
            before = self.status.get("phase")
            try:
                decision = await self.step()
            except Exception as error:  # transient: API or Ray briefly unreachable
                log.warning("%s/%s: step failed, retrying: %s", self.ident.namespace, self.ident.name, error)
                await self._sleep(stopped, self.settings.poll_interval)
                continue
            if decision.phase in phases.TERMINAL and not decision.actions:
                return
            if decision.phase != before:
                continue  # a transition: take the next step at once
            await self._sleep(stopped, self.settings.poll_interval)

    async def _sleep(self, stopped, seconds: float) -> None:
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def _last_lines_of_evicted_job(self) -> None:
        """The stopped job's last lines (a checkpoint it reported) are read before the next
        step takes them; bounded, and a head already gone only ends the stream."""
        try:
            await asyncio.wait_for(self.follower.finish(timeout=DELETE_RAY_TIMEOUT), 2 * DELETE_RAY_TIMEOUT)
        except Exception as error:
            log.info("%s/%s: the evicted job's log could not be read to its end (%s)",
                     self.ident.namespace, self.ident.name, error or type(error).__name__)

    async def close(self) -> None:
        if self.follower is not None:
            await self.follower.close()
