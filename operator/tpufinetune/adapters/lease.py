"""Leader election on a coordination.k8s.io/v1 Lease in the operator's namespace (the rules
are in core/lease.py). Only the leader runs kopf's handlers; `serve.py` blocks in
`acquire()` before it starts kopf, and a background thread renews the Lease every retry
period. A leader that cannot renew within the renew deadline calls `on_lost`, which exits
the process at once: Kubernetes restarts the container, which comes back as a standby.

The kubernetes client's own leaderelection package has a LeaseLock, but it keeps no
leaseTransitions, gives its API calls no timeout (a hung request outlives the renew
deadline) and logs every retry; this module is the small part of it we need.

Every write carries the resourceVersion that was read (`replace`, and `create` fails if
the Lease exists), so two candidates that decide at the same moment cannot both win.

Fencing: the leader that renews registers itself (`start_renewing`), and every create,
delete and submit of the operator calls `check_held` just before it is made: refused
(LeaseLost) once the Lease is lost, given back, or not renewed within the renew deadline,
whether or not the renewer has noticed yet. Without election nothing is fenced.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.rest import ApiException

from tpufinetune.core import lease as rules
from tpufinetune.core.lease import LeaseRecord

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """A side effect refused: this process may no longer act as the leader."""


_leader: "LeaseElector | None" = None  # this process's renewing elector (None: no election)


def check_held(what: str) -> None:
    """Raise LeaseLost unless this process still leads (core/lease.py, `fenced`); called
    just before each create, delete and submit. Without election: always allowed."""
    leader = _leader
    if leader is None:
        return
    problem = rules.fenced(leader.last_renewed, time.monotonic(), leader.renew_deadline, leader.lost)
    if problem:
        raise LeaseLost(f"{what} refused: this operator no longer holds Lease "
                        f"{leader.namespace}/{leader.name}: {problem}")


def identity(env: dict | None = None) -> str:
    """The holderIdentity: the pod's name (downward API, POD_NAME), else host name and pid.
    A container restarted in the same pod keeps its name and takes its own Lease back at
    once: the process that held it is gone."""
    env = os.environ if env is None else env
    return env.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}"


def record_of(lease: client.V1Lease) -> LeaseRecord:
    spec = lease.spec or client.V1LeaseSpec()
    return LeaseRecord(spec.holder_identity or "", int(spec.lease_duration_seconds or 0),
                       spec.acquire_time, spec.renew_time, int(spec.lease_transitions or 0))


def micro_time(when: datetime | None) -> str | None:
    """A MicroTime as the API server parses it: always six fraction digits (isoformat, which
    the client's models use, drops them when they are all zero, and the server refuses that)."""
    return None if when is None else when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(name: str, namespace: str, record: LeaseRecord, resource_version: str = "") -> dict:
    """The Lease to write, as JSON; with `resource_version`, a precondition: the write is
    refused (409) if anyone wrote the Lease since it was read."""
    metadata = {"name": name, "namespace": namespace}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": {"holderIdentity": record.holder, "leaseDurationSeconds": record.duration_s,
                     "acquireTime": micro_time(record.acquire_time), "renewTime": micro_time(record.renew_time),
                     "leaseTransitions": record.transitions}}


class LeaseElector:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, me: str, *,
                 lease_duration: float, renew_deadline: float, retry_period: float,
                 on_lost: Callable[[str], None]):
        # Its own client, without urllib3's retries: each retry gets the whole timeout again,
        # and a renewal must end within the renew deadline (a read and a write together).
        config = copy.deepcopy(api.configuration)
        config.retries = False
        self.leases = client.CoordinationV1Api(client.ApiClient(config))
        self.namespace, self.name, self.me = namespace, name, me
        self.duration_s = math.ceil(lease_duration)
        self.renew_deadline, self.retry_period = renew_deadline, retry_period
        self.on_lost = on_lost
        self.lease: client.V1Lease | None = None  # the last one read or written
        self.holder = ""  # who holds it, as last read
        self._seen: tuple[str, float] | None = None
        self._stopping = threading.Event()
        self._renewer: threading.Thread | None = None
        self.last_renewed = 0.0  # when the last successful try began (time.monotonic())
        self._tried_at = 0.0  # when the current (or last) try began
        self.lost = ""  # why this leader stopped acting ('' while it leads)

    # ---- one try ---------------------------------------------------------------------

    def try_acquire_or_renew(self, timeout: float) -> bool:
        """One read and at most one write, both within `timeout` seconds together; False on
        any refusal or error (the caller retries)."""
        now = datetime.now(timezone.utc)
        self._tried_at = time.monotonic()
        ends = self._tried_at + timeout
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as error:
            if error.status != 404:
                log.warning("reading Lease %s/%s failed: %s %s", self.namespace, self.name, error.status, error.reason)
                return False
            return self._create(now, timeout)
        except Exception as error:  # connection refused, timeout: the API server is away
            log.warning("reading Lease %s/%s failed: %s", self.namespace, self.name, error)
            return False
        self._seen = rules.seen(self._seen, lease.metadata.resource_version, time.monotonic())
        record = record_of(lease)
        self.holder = record.holder
        new = rules.claim(record, self.me, self.duration_s, now, time.monotonic() - self._seen[1])
        if new is None:
            return False
        body = lease_body(self.name, self.namespace, new, lease.metadata.resource_version)
        left = ends - time.monotonic()
        if left <= 0:  # the read took the whole budget: a write now could land too late
            log.warning("renewing Lease %s/%s: the read took %.1f s, no time left to write it",
                        self.namespace, self.name, timeout)
            return False
        try:
            self.lease = self.leases.replace_namespaced_lease(self.name, self.namespace, body,
                                                              _request_timeout=left)
        except ApiException as error:
            if error.status != 409:  # 409: someone wrote it since we read it
                log.warning("updating Lease %s/%s failed: %s %s", self.namespace, self.name, error.status, error.reason)
            return False
        except Exception as error:
            log.warning("updating Lease %s/%s failed: %s", self.namespace, self.name, error)
            return False
        if record.holder != self.me:
            log.info("took Lease %s/%s from %r (transition %d)", self.namespace, self.name,
                     record.holder, new.transitions)
        self.holder = self.me
        self._seen = (self.lease.metadata.resource_version, time.monotonic())
        return True

    def _create(self, now: datetime, timeout: float) -> bool:
        body = lease_body(self.name, self.namespace, rules.claim(None, self.me, self.duration_s, now, 0.0))
        try:
            self.lease = self.leases.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
        except ApiException as error:
            if error.status != 409:  # 409: another candidate created it first
                log.warning("creating Lease %s/%s failed: %s %s", self.namespace, self.name, error.status, error.reason)
            return False
        except Exception as error:
            log.warning("creating Lease %s/%s failed: %s", self.namespace, self.name, error)
            return False
        log.info("created Lease %s/%s", self.namespace, self.name)
        self.holder = self.me
        self._seen = (self.lease.metadata.resource_version, time.monotonic())
        return True

    # ---- standby, leader, stop -------------------------------------------------------

    def acquire(self) -> None:
        """Block until this candidate holds the Lease (a standby waits here)."""
        announced = None
        while not self.try_acquire_or_renew(timeout=self.renew_deadline):
            if self.holder != announced:
                log.info("standing by: Lease %s/%s is held by %r", self.namespace, self.name, self.holder)
                announced = self.holder
            time.sleep(self.retry_period * random.uniform(1.0, rules.JITTER))
        self.last_renewed, self.lost = self._tried_at, ""
        log.info("leading as %r (Lease %s/%s)", self.me, self.namespace, self.name)

    def start_renewing(self) -> None:
        global _leader
        _leader = self  # from now on every side effect is fenced by this Lease
        self._renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stopping.wait(self.retry_period):
            left = self.renew_deadline - (time.monotonic() - self.last_renewed)
            if left > 0 and self.try_acquire_or_renew(timeout=left):
                # Counted from when the try began: the Lease others watch changed no earlier.
                self.last_renewed = self._tried_at
                continue
            if self._stopping.is_set():
                return
            if self.holder and self.holder != self.me:
                return self._lose(f"Lease {self.namespace}/{self.name} is now held by {self.holder!r}")
            if rules.must_stop(self.last_renewed, time.monotonic(), self.renew_deadline):
                return self._lose(f"Lease {self.namespace}/{self.name} not renewed for "
                                  f"{self.renew_deadline:g} s (the renew deadline)")

    def _lose(self, why: str) -> None:
        self.lost = why  # fenced from now on, before on_lost (the exit) has run
        self.on_lost(why)

    def stop(self, release: bool = True) -> None:
        """Stop renewing; with `release`, hand the Lease back so a standby takes over on
        its next try (best effort: if this fails, the standby waits out the lease)."""
        self._stopping.set()
        self.lost = self.lost or "the operator is stopping"  # no side effect after the hand-back
        if self._renewer is not None:
            self._renewer.join(self.renew_deadline + 1)
        # It stays the registered leader, lost: work already queued (a create in a pool
        # thread) is refused by check_held after the hand-back, never let through.
        if not release or self.lease is None or self.holder != self.me:
            return
        body = lease_body(self.name, self.namespace, rules.released(record_of(self.lease), datetime.now(timezone.utc)),
                          self.lease.metadata.resource_version)
        try:
            self.leases.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self.retry_period)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except Exception as error:
            log.warning("releasing Lease %s/%s failed (a standby takes over when it expires): %s",
                        self.namespace, self.name, error)
