"""Fencing that covers side effects: a leader that has not renewed its Lease within the renew
deadline (or lost it, or gave it back) makes no create, delete or submit, each refused by a
check made just before it; the renewal itself, read and write together, ends within the
renew deadline, so the leader stops before the lease runs out; a delete removes the
RayCluster the run decided on (its uid as a precondition), never one a fresh read finds.

- The rules (core/lease.py) in microseconds.
- The elector against a real HTTP server that answers slowly (the fault: an API server
  that takes most of the renew deadline to answer the read and never answers the write).
- The checks in KubeBackend and the run's Ray calls, with nothing listening behind them:
  without the fence they would fail differently (a refused connection).
- The real kube-apiserver: a lost leader creates nothing; a delete with the recorded uid
  spares a newer RayCluster of the same name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from unittest import mock
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from kubernetes import client

from tpufinetune.adapters import lease
from tpufinetune.adapters.kube import KubeBackend
from tpufinetune.adapters.rayjobs import RayJobs
from tpufinetune.core import lease as rules
from tpufinetune.core import phases
from tpufinetune.core.phasemodel import recorded_cluster_uid
from tpufinetune.core.phases import ClusterView, Identity
from tpufinetune.driver import Run
from tpufinetune.runray import RayNotAnswering
from tpufinetune.settings import Settings

from harness.waiting import wait_for
from run_helpers import body, closed_address, in_loop, MemoryCluster, running, settings

TIMING = dict(lease_duration=2, renew_deadline=1.5, retry_period=0.25)
IDENT = Identity("demo", "ns", "uid-1")


def api_at(host: str) -> client.ApiClient:
    config = client.Configuration()
    config.host = host
    return client.ApiClient(config)


@contextlib.contextmanager
def leading(api: client.ApiClient, renewed_ago: float = 0.0, lost: list | None = None):
    """This process leads (as serve.py makes it: acquired, then renewing), its last renewal
    `renewed_ago` seconds back."""
    elector = lease.LeaseElector(api, "ns", "leader", "me", on_lost=(lost if lost is not None else []).append,
                                 **TIMING)
    elector.holder = "me"
    elector.last_renewed = time.monotonic() - renewed_ago
    # The process's registered leader is this one's for the test only: a stopped elector
    # stays registered (and fenced), as it must in the process that stopped it.
    with mock.patch.object(lease, "_leader", None):
        elector.start_renewing()
        try:
            yield elector
        finally:
            elector.stop(release=False)


# ---- the rules -------------------------------------------------------------------------


def test_a_leader_may_act_only_within_the_renew_deadline_of_its_last_renewal():
    assert rules.fenced(100.0, 101.4, 1.5, "") == ""
    assert "renew deadline 1.5 s" in rules.fenced(100.0, 101.5, 1.5, "")
    assert rules.fenced(100.0, 100.1, 1.5, "Lease ns/leader is now held by 'b'") == "Lease ns/leader is now held by 'b'"


# ---- the renewal ends within the lease -----------------------------------------------------


class SlowLeaseServer(BaseHTTPRequestHandler):
    """Answers the Lease read after `read_s`, and the write never in time."""

    read_s = 1.0

    def do_GET(self):
        time.sleep(self.read_s)
        body = json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": "leader", "namespace": "ns", "resourceVersion": "7"},
                           "spec": {"holderIdentity": "me", "leaseDurationSeconds": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        time.sleep(5)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(30)
def test_a_renewal_that_the_api_server_answers_slowly_ends_before_the_lease_does():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowLeaseServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lost: list[str] = []
    try:
        with leading(api_at(f"http://127.0.0.1:{server.server_address[1]}"), lost=lost) as leader:
            began = leader.last_renewed
            lease.check_held("a create")  # within the renew deadline: allowed
            wait_for(lambda: lost, 10, "the leader to step down", interval=0.02)
            took = time.monotonic() - began
            # Read (1 s) and write together end by the renew deadline: the leader has
            # stopped before the lease (2 s, as a standby measures it) runs out.
            assert lost and "not renewed for 1.5 s" in lost[0]
            assert took < TIMING["lease_duration"], took
            with pytest.raises(lease.LeaseLost, match="no longer holds Lease ns/leader"):
                lease.check_held("a create")
    finally:
        server.shutdown()
        server.server_close()


# ---- every side effect is checked just before it is made -----------------------------------


@in_loop
async def test_a_leader_past_its_renew_deadline_neither_creates_nor_deletes():
    closed, address = closed_address()
    backend = KubeBackend(api_at(address), Settings(leader_election=False))
    manifest = {"metadata": {"name": "tft-demo"}, "spec": {}}
    with leading(api_at(address), renewed_ago=10):
        with pytest.raises(lease.LeaseLost, match="creating ns/demo's token Secret"):
            await backend.create(IDENT, manifest)
        with pytest.raises(lease.LeaseLost, match="deleting RayCluster ns/tft-demo"):
            await backend.delete(IDENT, "tft-demo", uid="rc-uid-1")
        with pytest.raises(lease.LeaseLost, match="creating RayCluster ns/tft-demo"):
            backend._create_cluster(IDENT, manifest)
    closed.close()


@in_loop
async def test_a_leader_that_lost_its_lease_submits_and_stops_nothing():
    closed, address = closed_address()
    run = Run(body(running(address)), MemoryCluster(address), RayJobs(timeout=0.3), settings())
    with leading(api_at(address)) as leader:
        leader.lost = "Lease ns/leader is now held by 'b'"
        with pytest.raises(lease.LeaseLost, match="submit on the Ray head"):
            await run._ray(address, run.jobs.submit, "tft-uid-1-2", "python -c pass", {}, {})
        with pytest.raises(lease.LeaseLost, match="stop on the Ray head"):
            await run._ray(address, run.jobs.stop, "tft-uid-1-1")
        # Reading is no side effect: it goes on, and finds the head down.
        with pytest.raises(RayNotAnswering, match=f"the Ray head at {address} does not answer"):
            await run._ray(address, run.jobs.job, "tft-uid-1-1")
    closed.close()


@in_loop
async def test_after_the_lease_is_handed_back_nothing_is_allowed():
    closed, address = closed_address()
    with leading(api_at(address)) as leader:
        lease.check_held("a create")
        leader.stop(release=False)  # as serve.py hands the Lease back at shutdown
        with pytest.raises(lease.LeaseLost, match="the operator is stopping"):
            lease.check_held("a create")
    closed.close()


@in_loop
async def test_a_submit_queued_for_a_ray_thread_is_fenced_when_it_gets_one():
    """The check is made in the Ray thread just before the request: a submit that waited
    for a thread (or for its token) while the Lease was lost is refused, not sent."""
    closed, address = closed_address()
    jobs = RayJobs(timeout=0.3, threads=1)
    run = Run(body(running(address)), MemoryCluster(address), jobs, settings())
    busy, free = threading.Event(), threading.Event()

    def hold_the_thread():
        busy.set()
        free.wait(10)

    with leading(api_at(address)) as leader:
        holding = asyncio.ensure_future(jobs.call(hold_the_thread))
        await asyncio.to_thread(busy.wait, 5)
        submit = asyncio.ensure_future(run._ray(address, jobs.submit, "tft-uid-1-2", "python -c pass", {}, {}))
        await asyncio.sleep(0.2)  # the submit is queued behind the held thread
        leader.lost = "Lease ns/leader is now held by 'b'"
        free.set()
        await holding
        with pytest.raises(lease.LeaseLost, match="submit on the Ray head"):
            await submit
    closed.close()


def test_without_election_nothing_is_fenced():
    lease.check_held("a create")


# ---- deletes take the uid the run decided on ------------------------------------------------


def test_the_delete_precondition_is_the_decided_cluster_else_the_recorded_one():
    status = {"attempts": [{"attempt": 1, "rayClusterUID": "rc-old"}, {"attempt": 2, "rayClusterUID": "rc-2"}]}
    seen = ClusterView(exists=True, owned=True, uid="rc-seen")
    assert recorded_cluster_uid(status, seen) == "rc-seen"
    assert recorded_cluster_uid(status, None) == "rc-2"  # the latest attempt's
    assert recorded_cluster_uid(status, ClusterView(exists=True, owned=False, uid="theirs")) == "rc-2"
    assert recorded_cluster_uid({}, None) == ""


# ---- on the real kube-apiserver ------------------------------------------------------------


def raycluster(name: str) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name},
            "spec": {"headGroupSpec": {"rayStartParams": {},
                                       "template": {"spec": {"containers": [{"name": "ray-head", "image": "x"}]}}}}}


@pytest.mark.timeout(120)
def test_a_delete_with_the_recorded_uid_spares_a_newer_cluster_of_the_same_name(kuberay_crd, k8s_api, namespace):
    objects = client.CustomObjectsApi(k8s_api)
    args = ("ray.io", "v1", namespace, "rayclusters")
    old = objects.create_namespaced_custom_object(*args, raycluster("tft-demo"))["metadata"]["uid"]
    objects.delete_namespaced_custom_object(*args, "tft-demo")
    newer = objects.create_namespaced_custom_object(*args, raycluster("tft-demo"))["metadata"]["uid"]
    backend = KubeBackend(k8s_api, Settings(leader_election=False))
    ident = Identity("demo", namespace, "uid-1")
    asyncio.run(backend.delete(ident, "tft-demo", uid=old))  # a step decided on the old one
    assert objects.get_namespaced_custom_object(*args, "tft-demo")["metadata"]["uid"] == newer
    asyncio.run(backend.delete(ident, "tft-demo", uid=newer))
    with pytest.raises(client.ApiException) as gone:
        objects.get_namespaced_custom_object(*args, "tft-demo")
    assert gone.value.status == 404


class Backend(KubeBackend):
    def record(self, ident, type_, reason, message):
        pass  # kopf posts Events only from inside a running operator


@pytest.mark.timeout(120)
def test_a_leader_that_lost_its_lease_creates_nothing(control_plane, kuberay_crd, k8s_api, namespace):
    from tpufinetune.core import raytoken
    import base64
    import secrets

    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": raytoken.SIGNING_KEY_SECRET, "namespace": namespace},
        "data": {"key": base64.b64encode(secrets.token_bytes(32)).decode()}}))
    control_plane.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": "fenced"},
        "spec": {"tpu": {"generation": "cpu", "topology": "1"}, "image": "registry.example/t:1",
                 "checkpoint": {"storagePath": "gs://tpufinetune-ground/unused"}}}))
    found = client.CustomObjectsApi(k8s_api).get_namespaced_custom_object(
        "tpufinetune.dev", "v1alpha1", namespace, "tpufinetunes", "fenced")
    settings_ = Settings(poll_interval=1, operator_namespace=namespace, leader_election=False)
    run = Run(found, Backend(k8s_api, settings_), RayJobs(), settings_)

    async def until_refused():
        for _ in range(6):  # New -> Pending -> Provisioning asks for the create
            try:
                await run.step()
            except lease.LeaseLost as refused:
                return str(refused)
        return ""

    with leading(api_at("http://127.0.0.1:9"), renewed_ago=10):
        refused = asyncio.run(until_refused())
    assert "creating" in refused and "no longer holds Lease" in refused
    listed = client.CustomObjectsApi(k8s_api).list_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters")
    assert listed["items"] == []
    secrets_ = client.CoreV1Api(k8s_api).list_namespaced_secret(namespace).items
    assert [s.metadata.name for s in secrets_ if s.metadata.name != raytoken.SIGNING_KEY_SECRET] == []
    assert run.status.get("phase") in (phases.PENDING, phases.PROVISIONING)
