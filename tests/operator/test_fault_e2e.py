"""The operator on the test ground under Ray faults: a dead head, a refused token, a head
killed mid-run. Deletion never waits on Ray; an unreachable Ray ends the run with its
reason and releases the slice; a retry after a lost head never runs two jobs and
resumes from the last checkpoint."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from contextlib import contextmanager, nullcontext

import pytest

from harness.operator_process import OperatorProcess
from tpufinetune.core.raytoken import SIGNING_KEY_SECRET
from test_operator_e2e import jobs_of, released, resource, start_run

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def head_pod(kube, cluster: str) -> dict:
    return next(p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "head")


def kill_head(ground, kube, cluster: str) -> None:
    """SIGKILL every Ray process of the head pod, as a crash would (the node agent then
    reports the container terminated and restarts it, as a kubelet would)."""
    uid = head_pod(kube, cluster)["metadata"]["uid"]
    pids = ground.ray_processes(uid)
    assert pids, "the head pod has no Ray process"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def operator_with(operator, setup=None, **env):
    """The operator restarted with other settings (a short bound), and `setup` (a context
    manager) in force only while the session's operator is down; the session's operator
    comes back afterwards."""
    operator.kill()
    try:
        with setup or nullcontext():
            other = OperatorProcess({**operator.env, **env}, operator.log_path, hosts_file=operator.hosts_file)
            other.start()
            try:
                yield other
            finally:
                other.kill()
    finally:
        operator.start()


@contextmanager
def other_signing_key(ground):
    """The operator's Ray token signing key replaced by another (a rotation), restored
    afterwards; the operator reads it once, so only an operator started inside sees it."""
    secret = ["-n", "tpufinetune-system", "secret", SIGNING_KEY_SECRET]
    saved = json.loads(ground.kubectl("get", *secret, "-o", "json").stdout)["data"]
    other = base64.b64encode(b"another key, not the one the heads' tokens come from").decode()
    ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": {"key": other}}))
    try:
        yield
    finally:
        ground.kubectl("patch", *secret, "--type=merge", "-p", json.dumps({"data": saved}))


def running(kube, name: str, timeout: float = 300) -> None:
    kube.wait_for(lambda: kube.status(name).get("phase") == "Running", f"{name} Running", timeout=timeout)


def delete_within_30s(kube, name: str) -> None:
    started = time.monotonic()
    kube.kubectl("delete", "tpufinetune", name, "--wait=false")
    kube.wait_for(lambda: kube.get("tpufinetune", name) is None, f"{name}'s finalizer removed", timeout=30)
    assert time.monotonic() - started < 30


def test_deleting_after_the_head_died_releases_the_slice_within_30s(operator, ground, kube, trainer_assets, tmp_path):
    _, cluster = start_run(kube, resource("dead-head", trainer_assets, tmp_path / "ckpt", epochs=50))
    running(kube, "dead-head")
    pods = kube.pods_of(cluster)
    kill_head(ground, kube, cluster)
    delete_within_30s(kube, "dead-head")
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])


def test_a_refused_token_fails_the_run_after_the_bound_and_never_blocks_a_delete(
        operator, ground, kube, trainer_assets, tmp_path):
    _, refused_cluster = start_run(kube, resource("token-refused", trainer_assets, tmp_path / "a", epochs=50))
    _, deleted_cluster = start_run(kube, resource("token-delete", trainer_assets, tmp_path / "b", epochs=50))
    running(kube, "token-refused")
    running(kube, "token-delete")
    pods = kube.pods_of(refused_cluster) + kube.pods_of(deleted_cluster)
    # The signing key replaced (a rotation): the operator now derives tokens the running
    # heads refuse.
    with operator_with(operator, other_signing_key(ground), TPUFT_RAY_UNREACHABLE_TIMEOUT="20"):
        delete_within_30s(kube, "token-delete")
        kube.wait_for(lambda: kube.status("token-refused").get("phase") == "Failed", "token-refused Failed",
                      timeout=120)
        status = kube.status("token-refused")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "RayUnreachable"
        assert "has not answered for" in failed["message"] and "uthentication" in failed["message"]
        released(kube, ground, refused_cluster, [p["metadata"]["uid"] for p in pods])
        kube.wait_for(lambda: kube.get("raycluster", deleted_cluster) is None, "the deleted run's RayCluster gone")


def test_a_head_killed_mid_run_is_retried_once_from_the_last_checkpoint_never_two_jobs(
        operator, ground, kube, trainer_assets, tmp_path):
    manifest = resource("head-killed", trainer_assets, tmp_path / "ckpt", epochs=4, maxRetries=1)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("head-killed").get("checkpointURI"), "a first checkpoint", timeout=400)
    assert kube.status("head-killed")["epoch"] < 4
    kill_head(ground, kube, cluster)
    kube.wait_for(lambda: kube.status("head-killed").get("attempt") == 2, "the retry", timeout=300)
    checkpoint = kube.status("head-killed")["checkpointURI"]  # attempt 1's last one

    most_active, retry_entrypoint = 0, ""
    deadline = time.monotonic() + 600
    while kube.status("head-killed").get("phase") not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, kube.status("head-killed")
        try:
            jobs = jobs_of(kube, cluster, uid)
        except Exception:  # the head is restarting, or gone with its cluster at the end
            jobs = []
        most_active = max(most_active, len([j for j in jobs if str(j.status.value) in ("PENDING", "RUNNING")]))
        retry_entrypoint = next((j.entrypoint for j in jobs if j.submission_id == f"tft-{uid}-2"), retry_entrypoint)
        time.sleep(1)
    status = kube.status("head-killed")
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 2 and status["jobId"] == f"tft-{uid}-2"
    assert most_active <= 1
    assert checkpoint in retry_entrypoint  # resumed from the checkpoint attempt 1 reported
    assert [entry["epoch"] for entry in status["history"]] == [1, 2, 3, 4]
