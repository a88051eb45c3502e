"""Two replicas without harm: leader election on a Lease, and status writes fenced by
resourceVersion.

- The rules (core/lease.py) in milliseconds.
- The elector (adapters/lease.py) against the real kube-apiserver: one leader among
  candidates that race, a standby that takes over only once the lease ran out (or at once
  after a release), a leader that stops when it cannot renew.
- Fencing against the real kube-apiserver: a writer holding a stale copy (a replica that
  lost its Lease) is refused, and the newer Succeeded status stays.
The whole operator, two replicas and a leader killed mid-run, is in
tests/operator/test_operator_e2e.py (its finetune run).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from tpufinetune.core import lease as rules
from tpufinetune.core.errors import StatusConflict
from tpufinetune.core.lease import LeaseRecord
from tpufinetune.core.phases import ClusterView
from tpufinetune.settings import Settings, SettingsError

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
LATER = T0 + timedelta(seconds=30)


# ---- the rules --------------------------------------------------------------------------

def test_nobody_holds_it_yet_so_the_first_candidate_creates_it():
    assert rules.claim(None, "a", 15, T0, 0.0) == LeaseRecord("a", 15, T0, T0, 0)


def test_the_holder_renews_keeping_its_acquire_time_and_transitions():
    held = LeaseRecord("a", 15, T0, T0, 4)
    assert rules.claim(held, "a", 15, LATER, 99.0) == LeaseRecord("a", 15, T0, LATER, 4)


def test_another_holders_lease_is_respected_until_this_candidate_saw_it_unchanged_that_long():
    held = LeaseRecord("a", 15, T0, T0, 4)
    assert rules.claim(held, "b", 15, LATER, 14.9) is None
    # renewTime is 30 s old on this clock, but what counts is how long *we* watched it.
    assert rules.claim(held, "b", 15, LATER, 0.0) is None
    assert rules.claim(held, "b", 15, LATER, 15.0) == LeaseRecord("b", 15, LATER, LATER, 5)


def test_the_holders_own_duration_counts_not_the_candidates():
    held = LeaseRecord("a", 40, T0, T0, 0)
    assert rules.claim(held, "b", 15, LATER, 20.0) is None
    assert rules.claim(held, "b", 15, LATER, 40.0).holder == "b"


def test_a_released_lease_is_taken_at_once():
    gone = rules.released(LeaseRecord("a", 15, T0, T0, 4), LATER)
    assert gone.holder == "" and gone.transitions == 4
    assert rules.claim(gone, "b", 15, LATER, 0.0) == LeaseRecord("b", 15, LATER, LATER, 5)


def test_the_expiry_clock_restarts_whenever_the_lease_changes():
    first = rules.seen(None, "10", 100.0)
    assert rules.seen(first, "10", 105.0) == ("10", 100.0)
    assert rules.seen(first, "11", 105.0) == ("11", 105.0)


def test_the_leader_stops_at_the_renew_deadline():
    assert not rules.must_stop(100.0, 109.9, 10)
    assert rules.must_stop(100.0, 110.0, 10)


def test_timings_that_cannot_work_are_refused_naming_the_settings():
    assert rules.timing_problem(15, 10, 2) == ""
    assert "TPUFT_LEASE_DURATION (10) must be greater than TPUFT_RENEW_DEADLINE (10)" in rules.timing_problem(10, 10, 2)
    assert "TPUFT_RENEW_DEADLINE (2) must be greater than 1.2 x TPUFT_RETRY_PERIOD (2)" in rules.timing_problem(15, 2, 2)


def test_settings_default_to_election_on_and_refuse_bad_values():
    settings = Settings.from_env({})
    assert (settings.leader_election, settings.lease_name, settings.lease_duration,
            settings.renew_deadline, settings.retry_period) == (True, "tpufinetune-operator", 15, 10, 2)
    with pytest.raises(SettingsError, match="TPUFT_LEASE_DURATION .* must be greater than TPUFT_RENEW_DEADLINE"):
        Settings.from_env({"TPUFT_RENEW_DEADLINE": "20"})
    with pytest.raises(SettingsError, match="TPUFT_LEADER_ELECTION='sometimes': write true or false"):
        Settings.from_env({"TPUFT_LEADER_ELECTION": "sometimes"})
    with pytest.raises(SettingsError, match="TPUFT_RETRY_PERIOD='2s' is not a number of seconds"):
        Settings.from_env({"TPUFT_RETRY_PERIOD": "2s"})
    # Off, the timings are not used and not checked.
    assert not Settings.from_env({"TPUFT_LEADER_ELECTION": "false", "TPUFT_RENEW_DEADLINE": "20"}).leader_election


def test_identity_comes_from_the_downward_api():
    from tpufinetune.adapters.lease import identity

    assert identity({"POD_NAME": "tpufinetune-operator-5d9c-x2x"}) == "tpufinetune-operator-5d9c-x2x"
    assert identity({}).endswith(f"_{__import__('os').getpid()}")


# ---- a refused status write costs one re-read, not a poll interval -----------------------

class ConflictOnce:
    """A backend whose first status write is refused as stale (what the API server answers
    after kopf's own status.kopf write or a spec edit); in memory: the order of the
    driver's calls is what is tested."""

    def __init__(self):
        self.calls: list[str] = []
        self.status: dict = {}
        self.written = asyncio.Event()

    async def observe(self, ident, name):
        return ClusterView(exists=False, owned=True, ready=False, dashboard_url="")

    async def create(self, ident, manifest):
        self.calls.append("create")

    async def delete(self, ident, name):
        self.calls.append("delete")

    async def write_status(self, ident, patch, new, resource_version):
        if not self.calls:
            self.calls.append(f"refused@{resource_version}")
            raise StatusConflict("changed since it was read")
        self.calls.append(f"write@{resource_version}")
        self.status = new
        self.written.set()
        return str(int(resource_version) + 1)

    async def read_status(self, ident):
        self.calls.append("read")
        return dict(self.status), "7"

    def record(self, ident, type_, reason, message):
        pass


def test_a_refused_write_is_retried_at_once_after_a_re_read():
    from tpufinetune.driver import Run

    async def scenario():
        backend = ConflictOnce()
        body = {"metadata": {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": 1,
                             "resourceVersion": "5"},
                "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                         "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}
        run = Run(body, backend, None, Settings(poll_interval=60, leader_election=False))
        stopped = asyncio.Event()
        loop = asyncio.create_task(run.run(stopped))
        started = time.monotonic()
        await asyncio.wait_for(backend.written.wait(), 10)
        stopped.set()
        run.wake.set()
        await asyncio.wait_for(loop, 10)
        return backend.calls, time.monotonic() - started

    calls, took = asyncio.run(scenario())
    assert calls[:3] == ["refused@5", "read", "write@7"], calls
    assert took < 5  # not the 60 s poll interval


# ---- the elector on the real API server ----------------------------------------------------

FAST = dict(lease_duration=2, renew_deadline=1.5, retry_period=0.25)


def elector(k8s_api, namespace: str, me: str, lost: list | None = None, name: str = "leader", **timing):
    from tpufinetune.adapters.lease import LeaseElector

    return LeaseElector(k8s_api, namespace, name, me, on_lost=(lost if lost is not None else []).append,
                        **{**FAST, **timing})


def read_lease(k8s_api, namespace: str, name: str = "leader"):
    from kubernetes import client

    return client.CoordinationV1Api(k8s_api).read_namespaced_lease(name, namespace)


def test_candidates_racing_for_a_new_lease_elect_exactly_one(k8s_api, namespace):
    candidates = [elector(k8s_api, namespace, f"c{i}") for i in range(4)]
    barrier, won = threading.Barrier(len(candidates)), {}

    def race(candidate):
        barrier.wait()
        won[candidate.me] = candidate.try_acquire_or_renew(timeout=5)

    threads = [threading.Thread(target=race, args=(c,)) for c in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    winners = [me for me, ok in won.items() if ok]
    assert len(winners) == 1, won
    spec = read_lease(k8s_api, namespace).spec
    assert spec.holder_identity == winners[0] and spec.lease_transitions == 0
    assert spec.lease_duration_seconds == 2


def test_a_standby_takes_over_only_after_the_lease_ran_out_and_counts_the_transition(k8s_api, namespace):
    leader, standby = elector(k8s_api, namespace, "a"), elector(k8s_api, namespace, "b")
    leader.acquire()
    leader.start_renewing()
    deadline = time.monotonic() + 3 * FAST["lease_duration"]
    while time.monotonic() < deadline:  # renewed: never free, however long the standby looks
        assert not standby.try_acquire_or_renew(timeout=5)
        time.sleep(0.1)
    assert standby.holder == "a"
    leader.stop(release=False)  # a leader that died: the Lease is left as it was
    stopped = time.monotonic()
    standby.acquire()
    waited = time.monotonic() - stopped
    # It waited out the lease on its own clock (the last change it saw was up to one
    # retry period before the stop), and took it at its first try after that.
    assert FAST["lease_duration"] - FAST["retry_period"] <= waited <= FAST["lease_duration"] + 2 * FAST["retry_period"] + 1
    spec = read_lease(k8s_api, namespace).spec
    assert spec.holder_identity == "b" and spec.lease_transitions == 1
    assert spec.acquire_time > spec.renew_time - timedelta(seconds=1)


def test_a_released_lease_is_taken_at_the_standbys_next_try(k8s_api, namespace):
    leader, standby = elector(k8s_api, namespace, "a"), elector(k8s_api, namespace, "b")
    leader.acquire()
    assert not standby.try_acquire_or_renew(timeout=5)
    leader.stop(release=True)
    assert read_lease(k8s_api, namespace).spec.holder_identity == ""
    assert standby.try_acquire_or_renew(timeout=5)
    assert read_lease(k8s_api, namespace).spec.holder_identity == "b"


def test_a_leader_that_sees_another_holder_stops_at_once(k8s_api, namespace):
    from kubernetes import client

    lost: list[str] = []
    leader = elector(k8s_api, namespace, "a", lost)
    leader.acquire()
    leader.start_renewing()
    lease = read_lease(k8s_api, namespace)
    lease.spec.holder_identity = "someone-else"  # e.g. a leader with a longer lease
    client.CoordinationV1Api(k8s_api).replace_namespaced_lease("leader", namespace, lease)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "now held by 'someone-else'" in lost[0]
    leader.stop(release=True)  # stopping after a loss hands back nothing
    assert read_lease(k8s_api, namespace).spec.holder_identity == "someone-else"


def test_a_leader_that_cannot_reach_the_api_server_stops_within_the_renew_deadline(k8s_api, namespace):
    """The API server is "gone" for this leader: once it holds the Lease, its client is
    swapped for one that reaches a closed port (connection refused, a real fault of the
    transport; the shared control plane itself cannot be stopped here)."""
    from kubernetes import client

    lost: list[str] = []
    leader = elector(k8s_api, namespace, "a", lost)
    leader.acquire()
    leader.start_renewing()
    time.sleep(1)
    assert not lost
    closed = client.Configuration()
    closed.host = "https://127.0.0.1:9"
    leader.leases = client.CoordinationV1Api(client.ApiClient(closed))
    cut = time.monotonic()
    deadline = cut + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    took = time.monotonic() - cut
    assert lost and "not renewed for 1.5 s" in lost[0]
    # Stopped before the lease (2 s, as others measure it) could run out.
    assert took < FAST["lease_duration"], took
    leader.stop(release=False)


# ---- fencing on the real API server --------------------------------------------------------

def test_a_stale_writer_is_refused_and_the_newer_succeeded_status_stays(control_plane, k8s_api, namespace):
    from kubernetes import client

    from tpufinetune.adapters.kube import KubeBackend
    from tpufinetune.core.api import GROUP, PLURAL, VERSION
    from tpufinetune.driver import Run

    control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TPUFineTune", "metadata": {"name": "fenced"},
        "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "example/trainer:1",
                 "checkpoint": {"storagePath": "gs://tpufinetune-ground/never"}}}))
    objects = client.CustomObjectsApi(k8s_api)
    body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced")
    settings = Settings(leader_election=False)
    backend = KubeBackend(k8s_api, settings)
    old_leader = Run(copy.deepcopy(body), backend, None, settings)  # its copy, read before the hand-over
    new_leader = Run(copy.deepcopy(body), backend, None, settings)

    async def scenario():
        await new_leader._write({"phase": "Running", "message": "training"})
        await new_leader._write({"phase": "Succeeded", "message": "done"})
        with pytest.raises(StatusConflict):
            await old_leader._write({"phase": "Running", "message": "still training (stale)"})
        assert old_leader.status_stale
        await old_leader._reread_status()  # what the next step does first
        return dict(old_leader.status)

    reread = asyncio.run(scenario())
    live = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced")["status"]
    assert (live["phase"], live["message"]) == ("Succeeded", "done")
    assert reread["phase"] == "Succeeded"
    assert old_leader.resource_version == new_leader.resource_version

    # kopf's own bookkeeping (status.kopf, written without a precondition) moves the
    # resourceVersion: the next write is refused once, and after a re-read it lands.
    objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "fenced",
                                                  {"status": {"kopf": {"progress": {}}}})

    async def after_kopf():
        with pytest.raises(StatusConflict):
            await new_leader._write({**new_leader.status, "message": "done, checked"})
        await new_leader._reread_status()
        await new_leader._write({**new_leader.status, "message": "done, checked"})

    asyncio.run(after_kopf())
    live = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fenced")["status"]
    assert (live["phase"], live["message"]) == ("Succeeded", "done, checked")
