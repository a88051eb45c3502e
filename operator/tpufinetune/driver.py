"""Drives one TPUFineTune: gather observations, run the pure transition, perform its
actions, write status in one place. Shared by the kopf operator and `run --local`; the
difference is only the ClusterBackend (Kubernetes RayCluster, or a local Ray head).
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timedelta, timezone
from typing import Protocol

from tpufinetune.adapters import metrics
from tpufinetune.core import applied, attempts, conditions, notify, phaselmeval, phases
from tpufinetune.core.api import SpecError, parse_stored_spec
from tpufinetune.adapters.lease import LeaseLost
from tpufinetune.core.errors import CreateRefused, StatusConflict
from tpufinetune.core.jobspec import job_submission, preflight_submission
from tpufinetune.core.initsource import source_view
from tpufinetune.core.skew import report_ignored_fields
from tpufinetune.core.phases import ClusterView, Decision, Identity, Observations
from tpufinetune.core.phasemodel import SubmitEvaluation, recorded_cluster_uid
from tpufinetune.core.podstatus import SliceHealth
from tpufinetune.core.progress import ProgressTracker
from tpufinetune.adapters.logfollow import LogFollower
from tpufinetune.adapters.notify import RunNotices, notifier_for
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.runray import RayNotAnswering, RunRay, _one_line
from tpufinetune.runstatus import RunStatus, conflict_backoff
from tpufinetune.settings import Settings
from tpufinetune.core.podtemplate import raycluster_with_pod_settings
from tpufinetune.core.generations import generation

log = logging.getLogger(__name__)
# A waiting run whose backend watches its cluster, pods and Workload looks again this often
# with nothing changed (a resync, as an informer's): a change wakes it at once, and its own
# timers (phases.next_timer) are kept to the second.
IDLE_RESYNC_S = 60.0


class ClusterBackend(Protocol):
    async def observe(self, ident: Identity, name: str) -> ClusterView: ...
    async def create(self, ident: Identity, manifest: dict) -> None: ...
    async def delete(self, ident: Identity, name: str, uid: str = "") -> None: ...
    async def ray_token(self, ident: Identity) -> str | None: ...
    async def write_status(self, ident: Identity, patch: dict, new: dict, resource_version: str) -> str: ...
    async def read_status(self, ident: Identity) -> tuple[dict, str] | None: ...
    async def slice_health(self, ident: Identity, name: str, since, hosts: int) -> SliceHealth: ...
    def record(self, ident: Identity, type_: str, reason: str, message: str) -> None: ...
    async def maintenance(self, ident: Identity, cluster: str) -> tuple[tuple[str, str], ...]: ...


class Run(RunRay, RunStatus):
    """One resource's run. Holds the last status it wrote and the resourceVersion that write
    produced: every status write is conditional on it, so a stale copy cannot win."""

    def __init__(self, body, backend: ClusterBackend, jobs: RayJobs, settings: Settings,
                 progress: ProgressTracker | None = None):
        """`body` may be kopf's live view of the object: spec edits (suspend) are seen
        on the next step without restarting the run. `progress` (shared by the operator's
        runs, read by its liveness probe) hears of each status write and failed status
        read or write."""
        self.body = body
        self.progress = progress if progress is not None else ProgressTracker()
        self.backend = backend
        self.jobs = jobs
        self.settings = settings
        self.status = dict(body.get("status") or {})
        # The status above was read at this version; each write must find it unchanged.
        self.resource_version = str(body["metadata"].get("resourceVersion") or "")
        self.generation = None
        self.planned_init: dict | None = None  # status.initFrom the plan was made with (a chained run's source)
        # (generation, spec source, plan) of the last valid generation a step applied: its
        # plan stays in force while a later edit is refused, and scales the attempt's usage
        # until the edit is applied (the next attempt). None: not known (an operator that
        # restarted after an edit it has not applied yet goes by the latest generation).
        self.applied: tuple[int, str, phases.Plan] | None = None
        self._refresh_spec()
        self.follower: LogFollower | None = None
        self.wake = asyncio.Event()
        # Its namespace is being deleted (handlers.namespace_deleted): the namespace controller
        # deletes what it holds, the operator may no longer act there, and the loop returns.
        self.namespace_ending = False
        self.settling = False  # waiting for kopf's first writes (settle); every change wakes it
        # The status is this run's own from its first step on: the live body's is not read
        # again (handlers.drop_taken_status then keeps only kopf's part of it).
        self.status_taken = False
        # Events drained from the follower but not yet in a written status: applied
        # again on the next step, so a failed write loses none.
        self.unwritten: list[dict] = []
        self.status_stale = False  # a write failed: re-read the object before deciding
        self.object_gone = False  # a write or read found no object: the loop ends
        # Since when the head has not answered (any Ray call, its token included), for one
        # (phase, attempt): a new phase or attempt (a suspend, an eviction, a rebuild, a
        # retry) starts the clock again.
        self.ray_down_since: tuple[tuple, datetime] | None = None
        self.ray_answered = False  # a Ray call of this step got an answer
        self.retry_waiting_since: tuple[int, datetime] | None = None  # (attempt, since)
        self.log_unreadable_since: tuple[str, datetime] | None = None  # (job id, since): runray._finish_log
        self.create_refused = ""  # the API server's words when it last refused the RayCluster
        self._last_write = float("-inf")  # time.monotonic() of the last status write
        # The kopf daemon and on.delete share this Run; one step at a time.
        self.lock = asyncio.Lock()
        self.authorized_address = ""  # the head address that has been given this run's token
        self._notices: RunNotices | None = None  # spec.notify's side, made when first needed

    @property
    def notices(self) -> RunNotices:
        """spec.notify's deliveries. Made for a run that has a notice to offer: most runs
        never do, and a thousand waiting ones would each hold its lock, queue and records."""
        if self._notices is None:
            self._notices = RunNotices(notifier_for(self.settings.notify_sinks_file), self.wake)
        return self._notices

    def _refresh_spec(self) -> None:
        meta = self.body["metadata"]
        generation = int(meta.get("generation") or 1)
        if generation == self.generation and self.status.get("initFrom") == self.planned_init:
            return  # a chained run plans again once its source is recorded: its model is the source's
        self.generation, self.planned_init = generation, self.status.get("initFrom")
        self.ident = Identity(meta["name"], meta.get("namespace", "default"), meta["uid"], generation)
        # This generation's spec, as stored, kept as JSON: the body's dicts are replaced at
        # every event, and a copy of the old ones held here costs a few KB a waiting run.
        self._spec_source = json.dumps(self.body.get("spec") or {}, separators=(",", ":"))
        self.spec_error, self.ignored_fields = "", ()
        try:
            # Fields a newer CRD has and this version lacks are ignored, and reported.
            spec, self.ignored_fields = self._parse_spec(self._spec_source)
        except SpecError as error:
            spec, self.spec_error = None, str(error)
        self.latest_plan = phases.plan_for(self.ident, spec, *self._bounds(), init_from=self.planned_init)
        if self.applied is None and spec is not None and self.status.get("observedGeneration") in (None, generation):
            self.applied = (generation, self._spec_source, self.latest_plan)
        elif self.applied is None:  # a restart: status.appliedSpec says what is in force
            self.applied = applied.recorded(self.status, self.ident, self._parse_spec, *self._bounds())
        self._plan_in_force()

    def _plan_in_force(self) -> None:
        """The plan a step goes by (core/phases.py, plan_in_force): the latest generation's,
        except what the applied generation's must keep until the next attempt."""
        held = self.applied[2] if self.applied is not None and self.applied[0] != self.generation else None
        self.plan = phases.plan_in_force(self.latest_plan, held, refused=bool(self.spec_error))

    def _note_applied(self, status: dict) -> None:
        """A step applied the latest generation (status.observedGeneration): its plan is the
        one in force from now on, and the one kept if a later edit is refused."""
        if not self.spec_error and status.get("observedGeneration") == self.generation and (
                self.applied is None or self.applied[0] != self.generation):
            self.applied = (self.generation, self._spec_source, self.latest_plan)
            self._plan_in_force()

    def _bounds(self) -> tuple[timedelta, timedelta]:
        return timedelta(seconds=self.settings.provision_timeout), timedelta(seconds=self.settings.submit_timeout)

    def _parse_spec(self, source: str):
        return parse_stored_spec(json.loads(source), one_machine=getattr(self.backend, "one_machine", False))

    @property
    def spec(self):
        """The planned generation's spec, parsed again when an action needs it; while an
        edit is refused, the applied generation's (None: none is known). Not kept: most
        runs only wait, and their plan is all a step reads; a parsed spec costs about 5 KB,
        a thousand waiting runs 5 MB for nothing."""
        if self.spec_error:
            return self._parse_spec(self.applied[1])[0] if self.applied is not None else None
        return self._parse_spec(self._spec_source)[0]

    # ---- observations ----------------------------------------------------------------

    async def observe(self, deleting: bool) -> Observations:
        now = datetime.now(timezone.utc)
        phase = self.status.get("phase", "")
        cluster = job = None
        if self.status.get("rayClusterName"):
            cluster = await self.backend.observe(self.ident, self.status["rayClusterName"])
        address = self.status.get("dashboardURL") or (cluster.dashboard_url if cluster else "")
        if deleting:  # never waits on Ray, nor on the signing key: best effort, bounded
            job = await self._job_while_deleting(address, cluster)
            return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job, deleting=True)
        if phases.waits_for_source(self.plan, self.status):  # nothing of its own yet: only its source to read
            read = getattr(self.backend, "read_run", None)
            source = source_view(await read(self.ident.namespace, self.plan.init_from.run)) if read else None
            return Observations(now=now, spec_error=self.spec_error, cluster=cluster, init_source=source)
        kueue_holds = bool(self.plan.queue) and cluster is not None and cluster.suspended  # head gone or going
        if kueue_holds or (phase == phases.QUEUED and self.follower is not None):
            return await self._observe_evicted(now, address, cluster, phase)
        lost = phases.cluster_lost(cluster)  # its head went with it: Ray is not asked
        preflight_job, preflight_events, maintenance = None, (), ()
        self.ray_answered = False
        down = unreachable = ""
        try:
            if address and phase in (phases.SUBMITTING, phases.RUNNING) and self.status.get("jobId") and not lost:
                job = await self._ray(address, self.jobs.job, phaselmeval.followed_job(self.status))
                if self.plan.queue and (job is None or job.status not in phases.JOB_ACTIVE):
                    # An eviction ends the job: Kueue suspends the RayCluster before KubeRay
                    # deletes its pods, so a cluster read after the job shows why it ended.
                    cluster = await self.backend.observe(self.ident, self.status["rayClusterName"])
            events = await self._new_events(address, job)
            self.keep_unwritten(events)
            preflight_job, preflight_events = await self._preflight(address, phase, lost)
        except RayNotAnswering as error:
            job = None
            down, unreachable = self._ray_verdict(now, error)
        if phase == phases.RUNNING and job is not None and job.status in phases.JOB_ACTIVE and cluster is not None:
            maintenance = await self.backend.maintenance(self.ident, self.status["rayClusterName"])
        return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job,
                            events=tuple(self.unwritten), ray_unreachable=unreachable, ray_down=down,
                            ray_answered=self.ray_answered,
                            create_refused=self.create_refused, maintenance=maintenance,
                            preflight_job=preflight_job, preflight_events=preflight_events)

    async def _observe_evicted(self, now, address: str, cluster: ClusterView, phase: str) -> Observations:
        """Kueue suspended the cluster (an eviction): its head may answer for a moment, so
        the job is read only to stop it, and the events already streamed are kept. Once
        Queued, the evicted attempt's last events (a checkpoint it reported before it
        stopped) are taken and its log stream closed."""
        job = None
        if phase in (phases.SUBMITTING, phases.RUNNING) and address and self.status.get("jobId"):
            job = await self._ray_while_deleting("reading the evicted job", address, self.jobs.job,
                                                 phaselmeval.followed_job(self.status))
        if self.follower is not None:
            self.keep_unwritten(self.follower.drain())
            if phase == phases.QUEUED:
                await self._close_follower()
        return Observations(now=now, spec_error=self.spec_error, cluster=cluster, job=job,
                            events=tuple(self.unwritten))

    # ---- one step ---------------------------------------------------------------------

    @property
    def waits_on(self) -> str:
        """The TPUFineTune of its namespace whose changes wake it (spec.model.initFrom), '' for none."""
        return self.plan.init_from.run if phases.waits_for_source(self.plan, self.status) else ""

    def end_with_namespace(self) -> None:
        self.namespace_ending = True
        self.wake.set()

    def being_deleted(self) -> bool:
        return bool(self.body["metadata"].get("deletionTimestamp"))

    async def step(self, deleting: bool = False) -> Decision:
        """One step. Once the object is being deleted every step is a deleting one,
        whoever takes it: Deleting never goes back to Pending, and nothing is created
        after a delete."""
        async with self.lock:
            deleting = deleting or self.being_deleted() or self.status.get("phase") == phases.DELETING
            before = self.status.get("phase", "")
            queued = {k: self.status.get(k) for k in ("phase", "phaseTransitionTime")}
            try:
                decision = await self._step(deleting)
            except StatusConflict:
                raise  # not a failure: the next step re-reads and retries at once
            except Exception:
                metrics.step_failed(before)
                raise
        recorded = [(a.type, a.reason) for a in decision.actions if isinstance(a, phases.RecordEvent)]
        metrics.stepped(before, decision.phase, recorded)
        metrics.left_queue(queued, decision.status)
        return decision

    async def _step(self, deleting: bool) -> Decision:
        self._refresh_spec()
        if self.status_stale:
            try:
                await self._reread_status()
            except Exception as error:
                if not deleting:
                    raise
                log.warning("%s/%s: deleting from the status last known (%s)", self.ident.namespace,
                            self.ident.name, _one_line(error))
        obs = await self.observe(deleting)
        obs = self._without_malformed_events(obs)
        decision = phases.transition(self.ident, self.plan, self.status, obs)
        # A job that ended without success: read its log tail and its slice's pods and
        # nodes once, then decide.
        reads = {}
        for action in decision.actions:
            if isinstance(action, phases.ReadLogTail):
                reads["log_tail"] = await self._log_tail(action.submission_id) or "(empty log)"
            elif isinstance(action, phases.ReadSliceHealth):
                reads["slice_health"] = await self._slice_health(action.since)
        if reads:
            obs = Observations(**{**obs.__dict__, **reads})
            decision = phases.transition(self.ident, self.plan, self.status, obs)
        report_ignored_fields(decision, self.ignored_fields, obs.now, self.ident.generation)
        self._log_cursor(decision.status)
        # Status first: identities are persisted before the actions that depend on them.
        # The head the actions address is the one this step observed: a retry's status no
        # longer names it, and stopping its job comes before the cluster goes.
        before = self.status
        address = before.get("dashboardURL") or (obs.cluster.dashboard_url if obs.cluster is not None else "")
        applied.record(decision.status, self.generation, self._spec_source, bool(self.spec_error),
                       self.applied[:2] if self.applied is not None else None)
        # spec.notify's deliveries, recorded with this write.
        outcomes = self._notices.records() if self._notices is not None else []
        if outcomes:
            decision.status["notifications"] = notify.with_records(decision.status, outcomes)
        try:
            await self._write(decision.status)
        except Exception as error:
            if outcomes:
                self.notices.put_back(outcomes)
            if not deleting:
                raise
            # Releasing the slice (and so the finalizer) never waits on a status write: an
            # admission policy refusing the status, a conflict, an API server that does
            # not answer the write. Deleting's actions need no identity written first.
            log.warning("%s/%s: deleting without writing the status (%s)", self.ident.namespace,
                        self.ident.name, _one_line(error))
            await self._perform(decision, obs, address)
            return decision
        except BaseException:
            if outcomes:
                self.notices.put_back(outcomes)
            raise
        self.unwritten.clear()
        self._offer_notices()
        self._note_applied(decision.status)
        ended = attempts.newly_frozen(before, decision.status)
        metrics.first_steps(before, decision.status)
        spec = self.spec if ended else None
        for entry in ended:
            metrics.attempt_ended(self.ident.namespace, generation(spec.tpu.generation).name if spec else "",
                                  entry.get("reason") or "", float((entry.get("usage") or {}).get("chipHours") or 0) * 3600)
        await self._perform(decision, obs, address)
        return decision

    def _offer_notices(self) -> None:
        """Queue spec.notify's notices the written status calls for (adapters/notify.py);
        the spec is parsed only when the run asked for notices and something ended."""
        if not (self.body.get("spec") or {}).get("notify") or not notify.happened(self.status):
            return
        spec = self.spec
        subscriptions = [(s.sink, s.events) for s in (spec.notify or ())] if spec is not None else []
        self.notices.offer_due(self.ident, subscriptions, self.status, self.backend.record)

    async def _slice_health(self, since: str):
        """The slice's pods and nodes, judged (podstatus.slice_health). Pods that cannot be
        read make a slice that is not known to be well: the retry rebuilds it."""
        try:
            return await self.backend.slice_health(self.ident, self.status["rayClusterName"],
                                                   conditions.parse_time(since), self.plan.hosts)
        except Exception as error:
            detail = _one_line(error)
            log.warning("%s/%s: the slice's pods could not be read: %s", self.ident.namespace, self.ident.name, detail)
            return SliceHealth(False, "", f"the slice's pods could not be read: {detail}")

    async def _perform(self, decision: Decision, obs: Observations | None = None, address: str = "") -> None:
        address = address or self.status.get("dashboardURL") or ""
        for action in decision.actions:
            if isinstance(action, phases.RecordEvent):
                self.backend.record(self.ident, action.type, action.reason, action.message)
            elif isinstance(action, phases.CreateCluster):
                try:
                    await self.backend.create(self.ident, await self._keyed(raycluster_with_pod_settings(
                        self.ident.name, self.ident.namespace, self.ident.uid, self.spec)))
                except LeaseLost:
                    raise  # not this run's trouble: this operator may no longer act
                except Exception as error:  # any failure to create is shown, and timed, by the next step
                    self.create_refused = (str(error) if isinstance(error, CreateRefused) else _one_line(error)) \
                        or type(error).__name__
                    log.warning("%s/%s: creating the RayCluster failed: %s", self.ident.namespace,
                                self.ident.name, self.create_refused)
                    continue
                self.create_refused = ""
                metrics.cluster_created(self.ident.uid, self.body["metadata"].get("creationTimestamp"))
            elif isinstance(action, phases.DeleteCluster):
                cluster = obs.cluster if obs is not None else None
                if cluster is not None and cluster.exists and cluster.deleting:
                    continue  # already going: asking again changes nothing and costs a write
                uid = recorded_cluster_uid(self.status, cluster)
                await self.backend.delete(self.ident, action.name, **({"uid": uid} if uid else {}))
            elif isinstance(action, phases.SubmitJob):
                await self._previous_attempt_ended(action.attempt)
                # A retry resumes from the last checkpoint the previous attempt reported.
                resume = self.status.get("checkpointURI") if action.attempt > 1 else None
                submission = job_submission(
                    self.ident.name, self.ident.namespace, self.ident.uid, self.spec, action.attempt, resume_from=resume,
                    init_from=self.status.get("initFrom"))
                await self._ray(address, self.jobs.submit, action.submission_id,
                                submission.entrypoint, submission.runtime_env, submission.metadata)
                if action.attempt == 1:
                    metrics.job_submitted(self.ident.uid, self.body["metadata"].get("creationTimestamp"))
            elif isinstance(action, phases.SubmitPreflight):
                request = preflight_submission(self.ident.name, self.ident.namespace, self.ident.uid, self.spec,
                                               action.attempt)
                await self._ray(address, self.jobs.submit, request.submission_id,
                                request.entrypoint, request.runtime_env, request.metadata)
            elif isinstance(action, phases.RequestCheckpoint):
                await self._request_checkpoint(action)
            elif isinstance(action, SubmitEvaluation):
                await self._submit_evaluation(address, action)
            elif isinstance(action, phases.StopJob) and decision.phase in (phases.DELETING, phases.QUEUED,
                                                                           phases.PENDING):
                # The slice is going (a delete, an eviction, a retry on a new RayCluster):
                # stopping its job first is a courtesy, best effort and bounded.
                await self._ray_while_deleting(f"stopping job {action.submission_id}", address,
                                               self.jobs.stop, action.submission_id)
                if decision.phase == phases.QUEUED and self.follower is not None:
                    await self._last_lines_of_evicted_job()
            elif isinstance(action, phases.StopJob):
                await self._ray(address, self.jobs.stop, action.submission_id)
        if decision.phase != phases.RUNNING:
            # An evicted attempt's last lines (its newest checkpoint) are applied on the
            # next step; any other stream's are not this run's any more.
            await self._close_follower(keep_events=decision.phase == phases.QUEUED)

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, stopped) -> None:
        """Step until terminal and released; wait on new log events or the poll interval.
        Returns when the object is being deleted: on.delete takes it from there.

        `stopped` is anything with `is_set()` (kopf's DaemonStopped, an asyncio.Event).
        Never ends on an error: kopf does not restart a daemon that returned or raised."""
        conflicts = 0
        while (not stopped.is_set() and not self.being_deleted() and not self.namespace_ending
               and not self.object_gone):
            before = self.status.get("phase")
            # Cleared before the step looks, never after: a change that arrives while the
            # step runs wakes the next one instead of being lost until the next poll.
            self.wake.clear()
            try:
                decision = await self.step()
            except StatusConflict as error:
                # Someone wrote the object since we read it (kopf's status.kopf, a spec
                # edit, another replica): the next step re-reads it and decides again.
                conflicts += 1
                log.info("%s/%s: %s; re-reading the status", self.ident.namespace, self.ident.name, error)
                await self._sleep(stopped, conflict_backoff(conflicts, self.settings.poll_interval))
                continue
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # we are being stopped
                # A cancellation that was not aimed at this loop (a stream task's) is
                # just a failed step.
                log.warning("%s/%s: step cancelled from within, retrying", self.ident.namespace, self.ident.name)
                await self._sleep(stopped, self.settings.poll_interval)
                continue
            except Exception as error:  # transient: API or Ray briefly unreachable
                log.warning("%s/%s: step failed, retrying: %s", self.ident.namespace, self.ident.name, error)
                await self._sleep(stopped, self.settings.poll_interval)
                continue
            conflicts = 0
            if (decision.phase in phases.TERMINAL and not decision.actions and decision.wake_at is None
                    and not (self._notices is not None and self._notices.waiting())):
                return
            if decision.phase != before:
                continue  # a transition: take the next step at once
            await self._sleep(stopped, self._pause(decision))

    def _pause(self, decision: Decision) -> float:
        """Until the next poll, or the wake-up the decision asks for. A finished run that
        keeps its cluster (spec.ttlSecondsAfterFinished) has nothing to poll: it sleeps
        until the release (a change to the RayCluster still wakes it). A waiting run
        (pending, queued, provisioning) that is watched sleeps until a change wakes it,
        its next timer, or the idle resync: a thousand of them take no steps at rest."""
        now = datetime.now(timezone.utc)
        if decision.wake_at is None and self._only_waits(decision):
            timer = phases.next_timer(self.plan, decision.status)
            if timer is None:
                return IDLE_RESYNC_S
            # Just past the timer: the step that looks then finds it expired.
            return min(IDLE_RESYNC_S, max(0.0, (timer - now).total_seconds()) + 0.05)
        if decision.wake_at is None:
            return self.settings.poll_interval
        until = max(0.0, (decision.wake_at - now).total_seconds())
        return until if decision.phase in phases.TERMINAL else min(until, self.settings.poll_interval)

    def _only_waits(self, decision: Decision) -> bool:
        """Nothing to do but wait for a watched change or a timer: no action was taken (a
        create or a delete is confirmed by polling), no refused create is being asked
        again, and the backend's watches wake the run."""
        return (decision.phase in phases.WAITING and not decision.actions and not self.create_refused
                and getattr(self.backend, "watched", False))

    async def _sleep(self, stopped, seconds: float) -> None:
        """Until woken, stopped or `seconds` passed. A waiting run sleeps up to a minute:
        being stopped (kopf's DaemonStopped, an asyncio.Event) ends the sleep at once, so
        an operator that loses its lease or shuts down is not held by it."""
        waits = [asyncio.ensure_future(self.wake.wait())]
        if seconds > self.settings.poll_interval and hasattr(stopped, "wait"):
            waits.append(asyncio.ensure_future(stopped.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    async def close(self) -> None:
        await self._close_follower()
