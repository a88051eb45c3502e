"""The Ray side of a run (a part of driver.Run): every Ray call goes through `_ray`, one
policy: the run's own token derived first, and any failure, a token that cannot be derived
included, counted by the unreachable clock (TPUFT_RAY_UNREACHABLE_TIMEOUT); deletion and an
eviction ask Ray only best effort and bounded, and need neither an answer nor the signing
key. A head that refuses the token (401, 403) is tried with each key of the keyring; one
that refuses them all ends the attempt at once (RayAuthRefused): its key was removed, and
the next attempt runs on a new RayCluster with a token of the current key
(core/phaseattempts.py says what that costs). Also the run's log follower, the trainer
events it drains (malformed ones dropped), its log tail and the checks before a retry is
submitted.

A mixin: Run provides `status`, `ident`, `settings`, `backend`, `jobs`, `follower`, `wake`,
`unwritten`, `ray_down_since`, `ray_answered`, `retry_waiting_since`, `log_unreadable_since`
and `authorized_address`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import datetime, timezone

from tpufinetune.adapters.jobapi import AuthenticationError
from tpufinetune.adapters.kube import server_message
from tpufinetune.adapters.lease import LeaseLost
from tpufinetune.adapters.logfollow import LogFollower
from tpufinetune.adapters.raytokens import SigningKeyError
from tpufinetune.adapters import metrics
from tpufinetune.core import conditions, phaselmeval, phases, raytoken, runevents
from tpufinetune.core.errors import CreateRefused
from tpufinetune.core.phaseattempts import token_refused
from tpufinetune.core.generations import generation
from tpufinetune.core.jobspec import checkpoint_request, lmeval_submission, submission_id
from tpufinetune.core.phases import ClusterView, Observations
from tpufinetune.core.sizing import total_devices

log = logging.getLogger(__name__)
# While deleting, Ray gets this long to answer (the job's state, a stop request).
DELETE_RAY_TIMEOUT = 5.0


class RunRay:
    """Ray calls, log following and retry readiness of one run (see the module)."""

    async def _preflight(self, address: str, phase: str, lost: bool):
        """The attempt's preflight job while it is the one to watch, and its events once it
        ended (its log is short: read whole, once)."""
        result = self.status.get("preflight") or {}
        if phase != phases.SUBMITTING or lost or not address or result.get("phase") != "Running" \
                or result.get("attempt") != self.status.get("attempt"):
            return None, ()
        job = await self._ray(address, self.jobs.job, result["jobId"])
        if job is None or job.status in phases.JOB_ACTIVE:
            return job, ()
        return job, tuple(await self._ray(address, self.jobs.events, result["jobId"]))

    async def _ray(self, address: str, call, *args):
        """Every Ray call of a run goes through here (`call(address, *args)`, one of
        RayJobs' methods): with the run's own token, derived first, and under the
        unreachable clock. A head that does not answer, or a token that cannot be derived
        (the signing key unreadable), raises RayNotAnswering and starts the clock; any
        answer stops it (a 404 is an answer: a job lost). A refused token is tried again
        with the keyring's other keys, then raises RayAuthRefused."""
        while True:
            # A side effect (submit, stop) is fenced by the Lease in its Ray thread, just
            # before its request (RayJobs): LeaseLost is no unanswered head.
            try:
                await self._authorize(address)
            except Exception as error:
                raise RayNotAnswering(f"the Ray token for {address} could not be derived: {_one_line(error)}") \
                    from error
            try:
                result = await self.jobs.call(call, address, *args)
            except LeaseLost:
                raise
            except AuthenticationError as error:
                if await self._another_key(address, error):
                    continue
                raise RayNotAnswering(f"the Ray head at {address} does not answer: {_one_line(error)}") from error
            except Exception as error:
                raise RayNotAnswering(f"the Ray head at {address} does not answer: {_one_line(error)}") from error
            self.ray_down_since = None
            self.ray_answered = True
            return result

    def _keyring(self):
        """The backend's RayTokens (KubeBackend's), or None: a fixed dashboard, a local head."""
        return None if self.settings.fixed_dashboard else getattr(self.backend, "tokens", None)

    async def _another_key(self, address: str, error: AuthenticationError) -> bool:
        """The head refused the token: True when another key of the keyring is to be
        tried; raises RayAuthRefused when none is left (without a keyring: False)."""
        tokens = self._keyring()
        if tokens is None:
            return False
        try:
            next_key = await self._in_kube_pool(tokens.refused, self.ident)
        except SigningKeyError as unreadable:
            raise RayNotAnswering(f"the Ray token for {address} could not be derived: {unreadable}") from error
        self.authorized_address = ""  # the next call derives the token again, of that key
        if next_key:
            return True
        current = tokens.keyring().current
        raise RayAuthRefused(token_refused(current, f"the head at {address} took no key of Secret {tokens.where} "
                                                    f"({_one_line(error)}); the next attempt runs on a new "
                                                    f"RayCluster with a token of key {current}")) from error

    async def _in_kube_pool(self, fn, *args):
        """A blocking keyring call in the backend's Kubernetes pool (its Secret read is a
        Kubernetes call), never the default executor that serves the event loop's lookups."""
        pool = getattr(self.backend, "pool", None)
        return await (pool.call(fn, *args) if pool is not None else asyncio.to_thread(fn, *args))

    async def _keyed(self, manifest: dict) -> dict:
        """The new RayCluster, made with the keyring's current key: its token Secret and
        label name the key's id. An unreadable keyring refuses the create (shown, timed)."""
        tokens = getattr(self.backend, "tokens", None)
        if tokens is None:
            return manifest
        try:
            key_id = await self._in_kube_pool(tokens.key_for_new_cluster, self.ident)
        except SigningKeyError as error:
            raise CreateRefused(f"the run's Ray token could not be derived: {error}") from None
        self.authorized_address = ""  # the new head (same address) takes the new token
        return raytoken.with_key_id(manifest, self.ident.name, self.ident.uid, key_id)

    def _ray_verdict(self, now: datetime, error: RayNotAnswering) -> tuple[str, str]:
        """(down, "") while the head has not answered for less than
        TPUFT_RAY_UNREACHABLE_TIMEOUT in this phase and attempt; then ("", unreachable)."""
        if isinstance(error, RayAuthRefused):
            return "", str(error)  # waiting would not help: the head never takes this token
        key = (self.status.get("phase"), self.status.get("attempt"))
        # The clock is in the status (condition RayReachable, False since the head stopped
        # answering): a restarted or standby operator goes on from there instead of
        # starting it again. Kept here too, for a run whose status cannot be written. An
        # answer earlier in this step stops it.
        known = [self.ray_down_since[1]] if self.ray_down_since is not None and self.ray_down_since[0] == key else []
        recorded = None if self.ray_answered else phases.ray_down_since(self.status)
        self.ray_down_since = (key, min(known + ([recorded] if recorded is not None else []) + [now]))
        down = (now - self.ray_down_since[1]).total_seconds()
        bound = self.settings.ray_unreachable_timeout
        log.warning("%s/%s: %s (for %d s of %g)", self.ident.namespace, self.ident.name, error, down, bound)
        if down < bound:
            # One Event per reason: an object's address in an error's words is not a new one.
            why = re.sub(r" at 0x[0-9a-fA-F]+", "", str(error))
            return f"Ray unreachable: {why}; the attempt ends if this lasts {bound:g} s", ""
        return "", f"{error}; it has not answered for {int(down)} s"

    async def _authorize(self, address: str) -> None:
        """Every Ray call to this run's head carries the run's own token, and no other
        head ever gets it (None: the backend's head takes the operator's default token)."""
        if not address or address == self.authorized_address:
            return
        token = await self.backend.ray_token(self.ident)
        if token is not None:
            self.jobs.authorize(address, token)
        self.authorized_address = address

    async def _job_while_deleting(self, address: str, cluster: ClusterView | None):
        """The job, only to stop it politely; unknown (None) when the head is gone or does
        not answer in time."""
        if not (address and self.status.get("jobId") and cluster is not None and cluster.exists and cluster.ready):
            return None
        return await self._ray_while_deleting("reading the job", address, self.jobs.job,
                                              phaselmeval.followed_job(self.status))

    async def _ray_while_deleting(self, what: str, address: str, call, *args):
        """Best effort and bounded: deletion (and an eviction) never waits on Ray, nor on
        the signing key. A dead head, a token that cannot be derived, a refused one or a
        timeout gives None, and losing the cluster ends the job anyway."""
        try:
            return await asyncio.wait_for(self._ray(address, call, *args), DELETE_RAY_TIMEOUT)
        except Exception as error:
            log.info("%s/%s: %s failed (%s); the cluster is going, and the job with it",
                     self.ident.namespace, self.ident.name, what, error or type(error).__name__)
            return None

    async def _new_events(self, address: str, job) -> tuple[dict, ...]:
        if job is None or self.status.get("phase") != phases.RUNNING:
            return ()
        job_id = phaselmeval.followed_job(self.status)  # the lm-eval job's once the export is evaluated
        if self.follower is None or self.follower.submission_id != job_id:
            await self._close_follower()  # the previous attempt's stream
            same_job = self.status.get("logJobId") == job_id
            skip = int(self.status.get("logCursor") or 0) if same_job else 0
            anchor = str(self.status.get("logAnchor") or "") if same_job else ""
            self.follower = LogFollower(self.jobs, address, job_id, skip=skip, anchor=anchor, wake=self.wake)
            self.follower.start()
        if job.status not in phases.JOB_ACTIVE:
            # Decide the outcome only once the whole log is parsed: the last lines
            # (result, failure) may still be in flight when Ray reports the job ended.
            await self._finish_log(address, job_id)
        return tuple(self.follower.drain())

    async def _finish_log(self, address: str, job_id: str) -> None:
        """The ended job's last lines, under the one Ray-call policy: a log the head does
        not give is a head not answering (RayNotAnswering: shown, on the clock) for up to
        TPUFT_RAY_UNREACHABLE_TIMEOUT, counted from the first failure for this job; then
        the outcome is decided from what was read, never left open with no clock."""
        try:
            await self.follower.finish()
            self.log_unreadable_since = None
            return
        except Exception as error:
            now = datetime.now(timezone.utc)
            if self.log_unreadable_since is None or self.log_unreadable_since[0] != job_id:
                self.log_unreadable_since = (job_id, now)
            waited = (now - self.log_unreadable_since[1]).total_seconds()
            detail = f"the log of job {job_id} could not be read to its end: {_one_line(error)}"
            if waited < self.settings.ray_unreachable_timeout:
                # Shown as the head not answering; this clock, not the head's (which its
                # answer about the job stopped), says when to go on without the rest.
                raise RayNotAnswering(f"the Ray head at {address} does not answer: {detail}") from error
        log.warning("%s/%s: %s for %d s; deciding from the lines read", self.ident.namespace, self.ident.name,
                    detail, waited)
        self.follower.give_up()

    def _log_cursor(self, status: dict) -> None:
        """Where the drained events end in the log (bytes, and the anchor naming the lines
        before); saved with the status they produced, so a restart resumes exactly there."""
        if self.follower is None:
            return
        cursor, anchor = self.follower.drained
        same_job = status.get("logJobId") == self.follower.submission_id
        if not same_job or cursor > int(status.get("logCursor") or 0):
            status["logCursor"] = cursor
            status["logAnchor"] = anchor
            status["logJobId"] = self.follower.submission_id

    def _without_malformed_events(self, obs: Observations) -> Observations:
        """A trainer line the status cannot hold (a wrong type, a refused value) is dropped
        with a warning, a Warning Event and the tpufinetune_trainer_events_dropped_total
        metric; kept, it would fail every step and hold back every later event."""
        if not obs.events:
            return obs
        kept, dropped = runevents.split_malformed(self.status, list(obs.events))
        if not dropped:
            return obs
        for event, why in dropped:
            log.warning("%s/%s: dropped trainer event %.300s: %s", self.ident.namespace, self.ident.name,
                        json.dumps(event, default=str), why)
        metrics.events_dropped(len(dropped))
        event, why = dropped[0]
        more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
        self.backend.record(self.ident, "Warning", "MalformedTrainerEvent",
                            f"dropped the trainer's {str(event.get('event'))[:40]!r} event{more}: {why}"[:1024])
        self.unwritten = kept
        return Observations(**{**obs.__dict__, "events": tuple(kept)})

    async def _log_tail(self, job_id: str) -> str:
        """The failed job's last lines; never a reason to leave the failure undecided: a
        tail that cannot be read is said so, and the job's own message is what remains."""
        try:
            return await self._ray(self.status["dashboardURL"], self.jobs.log_tail, job_id)
        except Exception as error:
            detail = _one_line(error)
            log.warning("%s/%s: the log tail of %s could not be read: %s", self.ident.namespace,
                        self.ident.name, job_id, detail)
            return f"(the log tail could not be read: {detail})"

    async def _request_checkpoint(self, action: phases.RequestCheckpoint) -> None:
        """Best effort: the request is recorded in status already; a head that does not take
        it is said so in an Event (the run goes on, as it would without the notice)."""
        request = checkpoint_request(self.ident.name, self.ident.namespace, self.ident.uid, action.attempt,
                                     action.request, action.reason, action.detail)
        try:
            await self._ray(self.status["dashboardURL"], self.jobs.submit, request.submission_id,
                            request.entrypoint, request.runtime_env, request.metadata)
        except Exception as error:
            log.warning("%s/%s: asking for a checkpoint failed: %s", self.ident.namespace, self.ident.name, error)
            self.backend.record(self.ident, "Warning", "CheckpointRequestFailed",
                                f"could not ask the trainer for a checkpoint: {_one_line(error)}")

    async def _submit_evaluation(self, address: str, action) -> None:
        """The attempt's lm-eval job (core/phaselmeval.py) on its export, on the same head with
        the run's token; a duplicate submit after a crash is Ray's to refuse (its id is fixed)."""
        spec = self.spec
        if spec is None or spec.evaluation is None or spec.evaluation.lm_eval is None:
            return  # an edit removed it: the next step finds no job and its watchdog ends the wait
        request = lmeval_submission(self.ident.name, self.ident.namespace, self.ident.uid, spec, action.attempt,
                                    action.model_uri)
        await self._ray(address, self.jobs.submit, request.submission_id, request.entrypoint,
                        request.runtime_env, request.metadata)

    async def _previous_attempt_ended(self, attempt: int) -> None:
        """Never two trainers on one slice: before attempt N is submitted, attempt N-1 must
        be unknown to the head (404: a new head) or ended; an active one is asked to stop
        and the submit waits for a later step."""
        if attempt <= 1:
            return
        address, previous = self.status["dashboardURL"], submission_id(self.ident.uid, attempt - 1)
        job = await self._ray(address, self.jobs.job, previous)
        if job is not None and job.status in phases.JOB_ACTIVE:
            await self._ray(address, self.jobs.stop, previous)
            raise RetryNotReady(f"attempt {attempt - 1} ({previous}) is still {job.status}; "
                                f"stopping it before attempt {attempt} is submitted")
        if job is not None and self._within_retry_bound(attempt):
            # The same RayCluster: the ended driver's workers must have left Ray first.
            left = await self._ray(address, self.jobs.leftovers, previous)
            if left:
                raise RetryNotReady(f"attempt {attempt} waits for attempt {attempt - 1}'s {left} to leave Ray")
        await self._workers_back(address, attempt)

    async def _workers_back(self, address: str, attempt: int) -> None:
        """A retry after a lost head goes in once the workers have rejoined the new head
        (their raylets outlive the old one for a while): submitted earlier, the trainer
        would find no room and fail at once. Bounded: after TPUFT_RAY_UNREACHABLE_TIMEOUT
        the retry is submitted anyway and the trainer says what is missing."""
        if not self._within_retry_bound(attempt):
            return
        spec = self.spec
        need = {("TPU" if generation(spec.tpu.generation).is_tpu else "CPU"): float(total_devices(spec))}
        have = await self._ray(address, self.jobs.alive_resources)
        short = {k: have.get(k, 0.0) for k, v in need.items() if have.get(k, 0.0) < v}
        if short:
            detail = ", ".join(f"{k} {have_:g}/{need[k]:g}" for k, have_ in short.items())
            raise RetryNotReady(f"attempt {attempt} waits for the cluster's workers to rejoin Ray ({detail})")

    def _within_retry_bound(self, attempt: int) -> bool:
        """A retry waits (for the last attempt's leftovers to leave, for workers to rejoin)
        at most TPUFT_RAY_UNREACHABLE_TIMEOUT; then it is submitted anyway and the trainer
        says what is missing."""
        now = datetime.now(timezone.utc)
        if self.retry_waiting_since is None or self.retry_waiting_since[0] != attempt:
            # Counted from entering Submitting for this attempt, as the status records it:
            # a restart does not start the wait again.
            entered = conditions.parse_time(self.status.get("phaseTransitionTime")) \
                if self.status.get("phase") == phases.SUBMITTING else None
            self.retry_waiting_since = (attempt, min(entered or now, now))
        return (now - self.retry_waiting_since[1]).total_seconds() <= self.settings.ray_unreachable_timeout

    async def _close_follower(self, keep_events: bool = False) -> None:
        if self.follower is not None:
            await self.follower.close()
            if keep_events:
                self.unwritten.extend(self.follower.drain())
            self.follower = None

    async def _last_lines_of_evicted_job(self) -> None:
        """The stopped job's last lines (a checkpoint it reported) are read before the next
        step takes them; bounded, and a head already gone only ends the stream."""
        try:
            await asyncio.wait_for(self.follower.finish(timeout=DELETE_RAY_TIMEOUT), 2 * DELETE_RAY_TIMEOUT)
        except Exception as error:
            log.info("%s/%s: the evicted job's log could not be read to its end (%s)",
                     self.ident.namespace, self.ident.name, error or type(error).__name__)


def _one_line(error: Exception) -> str:
    """An error in one line: the API server's own message when it sent one (a Kubernetes
    ApiException carries it in a JSON body), else the error's first line."""
    message = server_message(error)
    if message:
        return f"{getattr(error, 'status', '')} {message}".strip()[:300]
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


class RayNotAnswering(RuntimeError):
    """A Ray call of a run failed: its head did not answer (any error but a 404), or the
    run's token could not be derived. The message says which, and why."""


class RayAuthRefused(RayNotAnswering):
    """The run's head refused the token of every key in the keyring: its cluster was made
    with a key removed since. The message is phaseattempts.token_refused's."""


class RetryNotReady(RuntimeError):
    """The next attempt is not submitted yet: the previous one is still active, or the
    cluster's workers have not rejoined Ray."""
