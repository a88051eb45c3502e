"""The new capabilities on the test ground, on real parts: a deadline that stops a real job
and releases a real slice (the TTL's wake-up with no event is in test_ray_auth_e2e.py),
pod-level reasons (an image that cannot be pulled, a crash loop) read from the pods the real
KubeRay made, and a retry after an edit on a rebuilt cluster, which is then deleted mid-run
(the finalizer gone within 30 s, everything released)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest

from tpufinetune.core import conditions as cond
from tpufinetune.core.conditions import parse_time

from ground_runs import reconciles, released, resource, start_run
from harness.timing import within

REBUILT = "example.com/rebuilt"  # the workers' annotation the rebuild test's edit adds

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.ground]


def test_the_deadline_stops_the_job_and_the_ttl_keeps_then_releases_the_slice(operator, ground, kube, ground_assets, storage):
    manifest = resource("tiny-deadline", ground_assets, storage, epochs=200, ttlSecondsAfterFinished=3600)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("tiny-deadline").get("phase") == "Running", "phase Running", timeout=300)
    job_id = kube.status("tiny-deadline")["jobId"]
    # A deadline a few seconds from now, set on the running job: it applies at once.
    started = parse_time(kube.status("tiny-deadline")["startTime"])
    deadline = int((datetime.now(timezone.utc) - started).total_seconds()) + 5
    kube.kubectl("patch", "tpufinetune", "tiny-deadline", "--type=merge", "-p",
                 f'{{"spec": {{"activeDeadlineSeconds": {deadline}}}}}')

    status = kube.wait_for(lambda: (s := kube.status("tiny-deadline")).get("phase") == "Failed" and s,
                           "phase Failed", timeout=60)
    assert cond.find(status, cond.FAILED)["reason"] == "DeadlineExceeded", status["message"]
    assert f"spec.activeDeadlineSeconds ({deadline} s)" in status["message"]
    # The TTL keeps the cluster for debugging: its head still answers, and the job on it
    # was stopped by the operator.
    assert kube.get("raycluster", cluster) is not None
    assert status["rayClusterReleaseTime"] > status["completionTime"]
    client = kube.head_job_client(cluster)
    kube.wait_for(lambda: client.get_job_status(job_id).value == "STOPPED", "the job STOPPED", timeout=30)
    pods = kube.pods_of(cluster)
    assert len(pods) == 3

    # A TTL of 0 releases it at once: the edit wakes the finished run.
    kube.kubectl("patch", "tpufinetune", "tiny-deadline", "--type=merge", "-p",
                 '{"spec": {"ttlSecondsAfterFinished": 0}}')
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    assert kube.status("tiny-deadline")["phase"] == "Failed"


@pytest.mark.parametrize("fault,reasons,detail", [
    ({"image": "registry.tpufinetune.invalid/trainer:1"}, ("ErrImagePull", "ImagePullBackOff"),
     "registry.tpufinetune.invalid"),
    ({"head": {"annotations": {"ground.tpufinetune.dev/exit-code": "3"}}}, ("CrashLoopBackOff",), "exited 3"),
], ids=["image-pull", "crash-loop"])
def test_provisioning_names_the_worst_pod_state_and_the_hosts_ready(operator, kube, ground_assets, storage,
                                                                   fault, reasons, detail):
    manifest = resource("tiny-stuck", ground_assets, storage, mode="collectives", **fault)
    _, cluster = start_run(kube, manifest)

    def named():
        status = kube.status("tiny-stuck")
        return (cond.find(status, cond.CLUSTER_READY) or {}).get("reason") in reasons and status

    status = kube.wait_for(named, f"ClusterReady reason in {reasons}", timeout=120)
    assert status["phase"] == "Provisioning"
    condition = cond.find(status, cond.CLUSTER_READY)
    assert condition["status"] == "False"
    assert status["message"] == condition["message"]
    assert status["message"].startswith("hosts ready 0/2; pod "), status["message"]
    assert detail in status["message"]
    events = kube.items("events", "--field-selector", "involvedObject.name=tiny-stuck")
    assert any(e["reason"] in reasons and e["type"] == "Warning" for e in events)
    kube.kubectl("delete", "tpufinetune", "tiny-stuck", "--wait=true", "--timeout=60s", timeout=70)
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster released", timeout=60)


def test_a_retry_after_an_edit_runs_on_a_rebuilt_cluster_and_a_delete_mid_run_releases_it_within_30s(
        operator, ground, kube, ground_assets, storage):
    """Fault 11 on real parts: the edit waits for the next attempt, which runs on a
    RayCluster built from the edited spec, never on the old one."""
    manifest = resource("tiny-rebuild", ground_assets, storage, epochs=200, maxRetries=1)
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("tiny-rebuild").get("phase") == "Running", "phase Running", timeout=300)
    old = kube.get("raycluster", cluster)
    # An edit of the workers' pod settings: it changes the RayCluster, not what the
    # checkpoints were trained on (a topology of another world size would make the retry's
    # resume a ResumeMismatch: docs/api.md), so the retry resumes on the rebuilt cluster.
    kube.kubectl("patch", "tpufinetune", "tiny-rebuild", "--type=merge", "-p",
                 json.dumps({"spec": {"workers": {"annotations": {REBUILT: "yes"}}}}))
    # The edit wakes the run (kopf's watch of the TPUFineTunes); three more steps of the
    # running run, each reading the live object, have the edit in hand: it is not applied
    # yet, and the status says so.
    steps = reconciles(operator, "Running")
    kube.wait_for(lambda: reconciles(operator, "Running") >= steps + 3, "three steps after the edit", timeout=60)
    status = kube.status("tiny-rebuild")
    assert status["phase"] == "Running" and status["observedGeneration"] == 1  # not applied yet
    live = kube.get("raycluster", cluster)  # the running cluster, neither rebuilt nor edited in place
    assert live["metadata"]["uid"] == old["metadata"]["uid"]
    assert REBUILT not in (live["spec"]["workerGroupSpecs"][0]["template"]["metadata"].get("annotations") or {})
    # The attempt ends (stopped outside the operator): the retry rebuilds the cluster first.
    kube.head_job_client(cluster).stop_job(status["jobId"])

    def rebuilt():
        body = kube.get("raycluster", cluster)
        return body if body and body["metadata"]["uid"] != old["metadata"]["uid"] else None

    new = kube.wait_for(rebuilt, "a new RayCluster", timeout=120)
    template = new["spec"]["workerGroupSpecs"][0]["template"]
    assert template["metadata"]["annotations"][REBUILT] == "yes"
    status = kube.wait_for(lambda: (s := kube.status("tiny-rebuild")).get("phase") == "Running"
                           and s["attempt"] == 2 and s, "attempt 2 Running", timeout=300)
    assert status["retries"] == 1 and status["observedGeneration"] == 2
    assert status["jobId"] == f"tft-{uid}-2"
    # The job runs on the rebuilt cluster (its head knows it), and it alone.
    jobs = [j.submission_id for j in kube.head_job_client(cluster).list_jobs()]
    assert jobs == [f"tft-{uid}-2"]

    # Deleted mid-run: the job is stopped, the slice released and the finalizer gone within
    # 30 s; the head dies with its cluster, as in production.
    pods = kube.pods_of(cluster)
    assert len(pods) == 3 and all(ground.ray_processes(p["metadata"]["uid"]) for p in pods)
    started = time.monotonic()
    kube.kubectl("delete", "tpufinetune", "tiny-rebuild", "--wait=false")
    kube.wait_for(lambda: kube.get("tpufinetune", "tiny-rebuild") is None, "finalizer removed", timeout=within(30))
    assert time.monotonic() - started < within(30)
    released(kube, ground, cluster, [p["metadata"]["uid"] for p in pods])
    # A normal delete is not an error: every Event posted for the run is Normal or Warning.
    events = kube.items("events", "--field-selector", "involvedObject.name=tiny-rebuild")
    assert events and not [e for e in events if e["type"] not in ("Normal", "Warning")], events
