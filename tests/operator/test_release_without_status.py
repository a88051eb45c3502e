"""Releasing a slice and removing the finalizer never wait on a status write: with every
status write of a run refused (an admission policy on tpufinetunes/status in its
namespace), kopf's on.delete handler still deletes the RayCluster and returns, so the
finalizer goes. The refusal here is the Kubernetes client's own ApiException (422, as the
API server answers a ValidatingAdmissionPolicy's denial); the ground run that shows it
with the real policy is in test_status_write_faults.py.
"""

from __future__ import annotations


import time

from kubernetes.client.rest import ApiException
from urllib3.exceptions import ReadTimeoutError

from tpufinetune.adapters import handlers
from tpufinetune.core import phases

from run_helpers import MemoryCluster, being_deleted, delete_memo, in_loop

REFUSAL = "status writes are refused by the test's admission policy"


class RefusingStatus(MemoryCluster):
    """Every status write is refused as the API server refuses one that a policy denies."""

    async def write_status(self, ident, patch, new, resource_version):
        self.calls.append(f"refused:{new.get('phase')}")
        error = ApiException(status=422, reason="Unprocessable Entity")
        error.body = '{"kind": "Status", "message": "%s"}' % REFUSAL
        raise error


@in_loop
async def test_a_delete_releases_the_raycluster_and_returns_while_every_status_write_is_refused():
    cluster = RefusingStatus()
    cluster.exists = True
    live = being_deleted(phases.SUCCEEDED)
    memo = delete_memo(cluster)
    await handlers.release(body=live, memo=memo)  # returns: kopf removes the finalizer
    assert "delete" in cluster.calls and not cluster.exists
    assert any(call.startswith("refused:") for call in cluster.calls)  # its writes were tried, and refused
    assert "create" not in cluster.calls


class ReadTimesOutOnce(MemoryCluster):
    """The first read of the RayCluster times out, as a read the API server does not answer
    within the client's timeout does (a mock: a real API server cannot be made to miss one
    chosen read; the ground's delete tests show the whole path)."""

    def __init__(self):
        super().__init__()
        self.timed_out = False

    async def observe(self, ident, name):
        if not self.timed_out:
            self.timed_out = True
            raise ReadTimeoutError(None, "/apis/ray.io/v1/rayclusters", "Read timed out. (read timeout=10)")
        return await super().observe(ident, name)


@in_loop
async def test_a_failed_read_during_a_delete_is_tried_again_within_seconds_not_after_kopfs_minute():
    cluster = ReadTimesOutOnce()
    cluster.exists = True
    live = being_deleted(phases.RUNNING)
    memo = delete_memo(cluster)
    started = time.monotonic()
    await handlers.release(body=live, memo=memo)  # returns: kopf removes the finalizer
    assert cluster.timed_out and "delete" in cluster.calls and not cluster.exists
    assert time.monotonic() - started < handlers.RELEASE_RETRY_S


@in_loop
async def test_a_delete_in_a_namespace_being_deleted_returns_at_once_and_leaves_the_cluster_to_it():
    """The namespace controller deletes the RayCluster with its namespace, and the operator's
    RoleBinding there is gone already: once the namespace watch has seen the deletion, the
    delete handler makes no call and the finalizer goes."""
    cluster = RefusingStatus()
    cluster.exists = True
    live = being_deleted(phases.RUNNING)
    memo = delete_memo(cluster)
    ending = {"metadata": {"name": live["metadata"]["namespace"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    await handlers.namespace_deleted(type="MODIFIED", body=ending, memo=memo)
    try:
        await handlers.release(body=live, memo=memo)
        assert cluster.calls == [] and cluster.exists
    finally:
        await handlers.namespace_deleted(type="DELETED", body=ending, memo=memo)
    assert live["metadata"]["namespace"] not in handlers.ENDING_NAMESPACES

def test_the_finalizer_patch_removes_only_the_operators_and_only_from_the_list_it_read():
    from tpufinetune.adapters.handlers import FINALIZER
    from tpufinetune.adapters.kube import finalizer_removal

    assert finalizer_removal(["backup.example/keep"], FINALIZER) == []
    test, replace = finalizer_removal(["backup.example/keep", FINALIZER], FINALIZER)
    assert test == {"op": "test", "path": "/metadata/finalizers", "value": ["backup.example/keep", FINALIZER]}
    assert replace == {"op": "replace", "path": "/metadata/finalizers", "value": ["backup.example/keep"]}
