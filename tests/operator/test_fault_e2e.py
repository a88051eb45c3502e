"""The operator on the test ground under Ray faults: a dead head, a refused token, a head
killed mid-run. Deletion never waits on Ray; an unreachable Ray ends the run with its
reason and releases the slice; a retry after a lost head resumes from the last checkpoint.

That a retry never runs beside its previous attempt is shown where that attempt is still
alive on the head (a killed head comes back with an empty job table, so it cannot be seen
here): test_ray_faults.py, test_a_retry_stops_the_previous_attempt_before_it_submits and
test_a_retry_never_overlaps_its_previous_attempt_and_leaves_no_task_behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.raytoken import SIGNING_KEY_SECRET
from ground_runs import jobs_of, operator_with, released, resource, running, start_run
from harness.timing import within

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


def delete_within_30s(kube, name: str) -> None:
    started = time.monotonic()
    kube.kubectl("delete", "tpufinetune", name, "--wait=false")
    kube.wait_for(lambda: kube.get("tpufinetune", name) is None, f"{name}'s finalizer removed", timeout=within(30))
    assert time.monotonic() - started < within(30)


def test_a_refused_token_fails_the_run_after_the_bound_and_never_blocks_a_delete(
        operator, ground, kube, ground_assets, storage):
    _, refused_cluster = start_run(kube, resource("token-refused", ground_assets, f"{storage}/a", epochs=50))
    _, deleted_cluster = start_run(kube, resource("token-delete", ground_assets, f"{storage}/b", epochs=50))
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
        failed = cond.find(status, cond.FAILED)
        assert failed["reason"] == "RayUnreachable"
        assert "has not answered for" in failed["message"] and "uthentication" in failed["message"]
        released(kube, ground, refused_cluster, [p["metadata"]["uid"] for p in pods])
        kube.wait_for(lambda: kube.get("raycluster", deleted_cluster) is None, "the deleted run's RayCluster gone")


def test_a_head_killed_mid_run_is_retried_once_from_the_last_checkpoint(
        operator, ground, kube, ground_assets, storage):
    manifest = resource("head-killed", ground_assets, storage, epochs=4, rows=400, maxRetries=1)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("head-killed").get("checkpointURI"), "a first checkpoint", timeout=400)
    assert kube.status("head-killed")["epoch"] < 4
    kill_head(ground, kube, cluster)
    kube.wait_for(lambda: kube.status("head-killed").get("attempt") == 2, "the retry", timeout=300)
    checkpoint = kube.status("head-killed")["checkpointURI"]  # attempt 1's last one

    def retry_on_the_new_head():
        """The new head's jobs of this run, once it holds attempt 2 (the operator saw it
        running there); None while that head's dashboard does not answer yet."""
        if kube.status("head-killed").get("phase") != "Running" or kube.head_dashboard(cluster) is None:
            return None
        try:
            jobs = jobs_of(kube, cluster, uid)
        except ConnectionError:  # Ray's client: "Failed to connect to Ray at address ..."
            return None
        return jobs if any(j.submission_id == f"tft-{uid}-2" for j in jobs) else None

    jobs = kube.wait_for(retry_on_the_new_head, "attempt 2 on the new head", timeout=300, interval=1)
    assert [j.submission_id for j in jobs] == [f"tft-{uid}-2"]  # nothing else was submitted there
    assert checkpoint in jobs[0].entrypoint  # resumed from the checkpoint attempt 1 reported
    status = kube.wait_for(lambda: (s := kube.status("head-killed")).get("phase") in ("Succeeded", "Failed") and s,
                           "the run to end", timeout=600, interval=2)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 2 and status["jobId"] == f"tft-{uid}-2"
    assert [entry["epoch"] for entry in status["history"]] == [1, 2, 3, 4]


def test_a_raycluster_deleted_mid_run_is_a_lost_job_retried_on_a_new_cluster(
        operator, ground, kube, ground_assets, storage):
    manifest = resource("cluster-deleted", ground_assets, storage, epochs=3, rows=400, maxRetries=1)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("cluster-deleted").get("checkpointURI"), "a first checkpoint", timeout=400)
    old_pods = [p["metadata"]["uid"] for p in kube.pods_of(cluster)]
    kube.kubectl("delete", "raycluster", cluster, "--wait=false")  # someone else's delete
    # Used to fail step after step until RayUnreachable (ten minutes by default).
    kube.wait_for(lambda: kube.status("cluster-deleted").get("attempt") == 2, "the retry", timeout=120)
    status = kube.status("cluster-deleted")
    assert status["retries"] == 1
    kube.wait_for(lambda: kube.status("cluster-deleted").get("phase") in ("Succeeded", "Failed"), "the end",
                  timeout=600)
    status = kube.status("cluster-deleted")
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["attempt"] == 2 and status["jobId"] == f"tft-{uid}-2"
    events = json.loads(kube.kubectl("get", "events", "--field-selector", "involvedObject.name=cluster-deleted",
                                     "-o", "json").stdout)["items"]
    lost = [e for e in events if e["reason"] == "ClusterLost"]
    assert lost and lost[0]["type"] == "Warning" and "deleted outside the operator" in lost[0]["message"]
    assert not any(ground.ray_processes(pod) for pod in old_pods)


def watch_workers(kube, cluster: str, seen: dict) -> None:
    """Each worker pod's Ready time and, once seen, its deletion time (for its lifetime)."""
    for p in kube.pods_of(cluster):
        if p["metadata"]["labels"].get("ray.io/node-type") != "worker":
            continue
        entry = seen.setdefault(p["metadata"]["uid"], {})
        ready = next((c for c in (p.get("status") or {}).get("conditions") or []
                      if c["type"] == "Ready" and c["status"] == "True"), None)
        if ready:
            entry.setdefault("ready", cond.parse_time(ready["lastTransitionTime"]))
        if p["metadata"].get("deletionTimestamp"):
            # deletionTimestamp is the deadline (the request + the grace period), not the request.
            grace = timedelta(seconds=p["metadata"].get("deletionGracePeriodSeconds") or 0)
            entry.setdefault("deleted", cond.parse_time(p["metadata"]["deletionTimestamp"]) - grace)


def retry_to_running(kube, name: str, watch=lambda: None) -> float:
    """Seconds from attempt 1's end to attempt 2 Running (both from the status)."""
    status = kube.wait_for(lambda: (watch(), s := kube.status(name))[1].get("phase") == "Running"
                           and s.get("attempt") == 2 and s, f"{name}: attempt 2 Running", timeout=400, interval=1)
    ended = cond.parse_time(status["attempts"][0]["endTime"])
    return (cond.parse_time(status["phaseTransitionTime"]) - ended).total_seconds()


def test_an_app_failure_retries_on_the_same_raycluster_faster_than_a_lost_pod_and_each_attempt_is_counted(
        operator, ground, kube, ground_assets, storage):
    """Attempt 1's driver killed (an application crash on a healthy slice): attempt 2 runs on
    the same RayCluster, from the checkpoint. A worker pod deleted instead (the cloud taking
    a host): attempt 1 is Preempted and attempt 2 runs on a new RayCluster, later. Both
    attempts are in status.attempts with their reasons, and usage.hostHours is what the
    worker pods lived. Last, the rebuilt slice's head is killed and the run deleted: the
    delete never waits on the dead head."""
    manifest = resource("app-crash", ground_assets, f"{storage}/a", epochs=2, rows=480, maxRetries=1,
                        training={"checkpointEverySteps": 2})
    uid, cluster = start_run(kube, manifest)
    cluster_uid = kube.wait_for(lambda: (kube.get("raycluster", cluster) or {}).get("metadata", {}).get("uid"),
                                "the RayCluster")
    workers: dict = {}
    kube.wait_for(lambda: (watch_workers(kube, cluster, workers), kube.status("app-crash").get("checkpointURI"))[1],
                  "a first checkpoint", timeout=400, interval=1)
    checkpoint = kube.status("app-crash")["checkpointURI"]
    driver = kube.head_job_client(cluster).get_job_info(f"tft-{uid}-1").driver_info
    os.kill(int(driver.pid), signal.SIGKILL)  # the trainer's driver dies; every pod stays Ready
    reuse = retry_to_running(kube, "app-crash", lambda: watch_workers(kube, cluster, workers))

    def ended():
        watch_workers(kube, cluster, workers)
        status = kube.status("app-crash")
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    status = kube.wait_for(ended, "app-crash to end", timeout=600, interval=1)
    assert status["phase"] == "Succeeded", status.get("message")
    kube.wait_for(lambda: (watch_workers(kube, cluster, workers), not kube.pods_of(cluster))[1], "pods gone",
                  timeout=120, interval=1)
    status = kube.status("app-crash")
    first, second = status["attempts"]
    assert first["reason"] == "AppFailed" and "log tail:" in first["message"], first
    assert second["reason"] == "Succeeded"
    # From the last checkpoint attempt 1 reported: the one seen before the kill, or a later one.
    resumed, seen = second["resumedFrom"].rsplit("/", 1), checkpoint.rsplit("/", 1)
    assert resumed[0] == seen[0] and resumed[1] >= seen[1], (resumed, seen)
    assert first["rayClusterUID"] == second["rayClusterUID"] == cluster_uid
    assert first["lostSteps"] >= 0
    wide = kube.kubectl("get", "tpufinetunes", "app-crash", "-o", "wide").stdout.splitlines()
    assert wide[1][wide[0].index("ATTEMPTS"):].split()[0] == "2", wide  # kubectl aligns columns
    events = kube.items("events", "--field-selector", "involvedObject.name=app-crash")
    assert any(e["reason"] == "AttemptFailed" and "AppFailed" in e["message"] for e in events)
    # Host-hours: the two worker pods, from Ready to deleted (the slice was never rebuilt).
    assert len(workers) == 2 and all({"ready", "deleted"} <= set(w) for w in workers.values()), workers
    lived = sum((w["deleted"] - w["ready"]).total_seconds() for w in workers.values()) / 3600
    usage = status["usage"]
    assert usage["chipHours"] == 0 and usage["provisioningSeconds"] > 0
    assert abs(usage["hostHours"] - lived) <= 0.1 * lived, (usage, lived)

    # The same fault as the cloud's: a worker pod taken away. The slice is rebuilt.
    uid, cluster = start_run(kube, resource("pod-lost", ground_assets, f"{storage}/b", epochs=50, maxRetries=1))
    running(kube, "pod-lost")
    kube.wait_for(lambda: kube.status("pod-lost").get("lastEventTime"), "the trainer's first event", timeout=300)
    old_uid = kube.get("raycluster", cluster)["metadata"]["uid"]
    worker = next(p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "worker")
    kube.kubectl("delete", "pod", worker["metadata"]["name"], "--wait=false")
    rebuild = retry_to_running(kube, "pod-lost")
    first, second = kube.status("pod-lost")["attempts"]
    # The pod is gone when the operator looks (its preStop hook had the trainer save and
    # stop at once): the message names it, or its replacement.
    assert first["reason"] == "Preempted", first
    assert worker["metadata"]["name"] in first["message"] or "was replaced" in first["message"], first
    assert first["rayClusterUID"] == old_uid != second["rayClusterUID"]
    print(f"\nretry to Running: same RayCluster {reuse:.0f} s, rebuilt {rebuild:.0f} s")
    assert reuse < rebuild, (reuse, rebuild)

    # Its new head dies; deleting the run then never waits on Ray: the finalizer goes within
    # 30 s and every pod and Ray process of the slice is released.
    cluster = kube.status("pod-lost")["rayClusterName"]
    pods = kube.pods_of(cluster)
    kill_head(ground, kube, cluster)
    delete_within_30s(kube, "pod-lost")
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
