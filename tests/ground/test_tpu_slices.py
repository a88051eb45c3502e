"""TPU slices on the test ground: the tutorial's v6e 4x4 and v7x 2x2x2 samples go through the
real KubeRay, the real scheduler and Ray's own TPU slice reservation across the simulated
hosts, up to the first call that needs a chip: spec.preflight, which finds every host short
of its devices before any fine-tune is submitted (each is the sample in deploy/samples/ itself,
with only what a user fills in: finetune-v6e-4x4.yaml as it ships, finetune-v7x-2x2x2.yaml
with the preflight and a short ttlSecondsAfterFinished added); and a pool too small for the
slice says why.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kubernetes.utils import parse_quantity

from harness import images
from harness.nodepools import NODEPOOL_LABEL, tpu_pool
from harness.samples import sample_on_the_ground
from tpufinetune.core import conditions as cond
from tpufinetune.core.generations import ACCELERATOR_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE
from harness.timing import within

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow, pytest.mark.ground]


def tpu_resource(name: str, generation: str, topology: str, assets, storage, **extra) -> dict:
    return {
        "apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune", "metadata": {"name": name},
        "spec": {
            "tpu": {"generation": generation, "topology": topology},
            "image": "registry.example/tpufinetune-trainer:test",
            "model": {"id": assets.model},
            "dataset": {"id": assets.data, "split": "train[:64]"},
            "training": {"epochs": 1, "batchSizePerDevice": 1, "maxSeqLen": 64},
            "checkpoint": {"storagePath": storage},
            **extra,
        },
    }


# Programs of the base image itself (Ray's /bin/sh fate-sharing watchdog and its sleep).
SYSTEM_PROGRAMS = ("/bin/", "/usr/bin/")


def _runs_from(pid: int, env: str) -> bool | None:
    """Whether a pod's process runs the image's environment: a program of it (raylet,
    gcs_server), or a Python process naming it in its command line or (once Ray renames
    it, e.g. ray::DashboardAgent) in the libraries it mapped. None for a program of the
    base image, and for a process that exited meanwhile (it tells nothing either way)."""
    proc = Path(f"/proc/{pid}")
    try:
        exe = os.readlink(proc / "exe")
        if exe.startswith(env):
            return True
        if Path(exe).name.startswith("python"):
            return env in (proc / "cmdline").read_bytes().decode(errors="replace") or env in (proc / "maps").read_text()
        return None if exe.startswith(SYSTEM_PROGRAMS) else False
    except OSError:
        return None


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid} (exited)"


def ray_nodes(kube, cluster: str) -> list[dict]:
    """Ray's own view of its nodes (state API on the head), with their resources and labels."""
    try:
        summary = kube.head_get(cluster, "/nodes?view=summary")["data"]["summary"]
    except OSError:  # the head is still starting
        return []
    return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]


def _fits(requests: dict, allocatable: dict) -> bool:
    return all(parse_quantity(value) <= parse_quantity(allocatable.get(name, "0")) for name, value in requests.items())


def check_slice(kube, ground, name: str, generation_label: str, topology: str, pool: str,
                hosts: int, chips_per_host: int, tpu_per_host: int, head_resource: str, head_kept: bool = False):
    """`chips_per_host`: google.com/tpu per pod; `tpu_per_host`: Ray's TPU resource per host
    (devices: two per chip on v7x); `head_kept`: the run has ttlSecondsAfterFinished, so
    the head's own job list can be read after the failure."""
    def named():
        status = kube.status(name)
        if not status.get("rayClusterName") and status.get("phase") == "Failed":
            raise AssertionError(f"the run failed before it had a RayCluster: {kube.run_state(name)}")
        return status.get("rayClusterName")

    cluster = kube.wait_for(named, "rayClusterName", details=lambda: kube.run_state(name))

    def scheduled():
        pods = kube.pods_of(cluster)
        workers = [p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
        return pods if len(workers) == hosts and all(p["spec"].get("nodeName") for p in pods) else None

    pods = kube.wait_for(scheduled, f"head + {hosts} workers scheduled", timeout=120)
    workers = [p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    nodes = {n["metadata"]["name"]: n for n in kube.items("nodes")}
    # Each worker on its own node of the one pool for this slice, and it fits the machine.
    assert len({w["spec"]["nodeName"] for w in workers}) == hosts
    for worker in workers:
        node = nodes[worker["spec"]["nodeName"]]
        assert node["metadata"]["labels"][NODEPOOL_LABEL] == pool
        assert node["metadata"]["labels"][ACCELERATOR_LABEL] == generation_label
        assert node["metadata"]["labels"][TOPOLOGY_LABEL] == topology
        requests = worker["spec"]["containers"][0]["resources"]["requests"]
        assert requests[TPU_RESOURCE] == str(chips_per_host)
        assert _fits(requests, node["status"]["allocatable"]), (requests, node["status"]["allocatable"])
        # GKE's toleration for pods that request google.com/tpu (ExtendedResourceToleration).
        assert any(t.get("key") == TPU_RESOURCE for t in worker["spec"].get("tolerations") or [])

    # Ray sees the slice as a real TPU slice: hosts x TPU, one slice head, one slice name.
    def tpu_hosts():
        found = [n for n in ray_nodes(kube, cluster) if n["raylet"]["resourcesTotal"].get("TPU")]
        return found if len(found) == hosts else None

    found = kube.wait_for(tpu_hosts, f"{hosts} TPU hosts in Ray", timeout=240, interval=2)
    # Pods of the trainer image run its environment (the hashed lock and torch_tpu, as
    # Dockerfile.trainer builds it), not the development venv.
    trainer_env = str(images.trainer_env().resolve())  # as the processes see it
    for pod in pods:
        pids = ground.ray_processes(pod["metadata"]["uid"])
        verdicts = {p: _runs_from(p, trainer_env) for p in pids}
        strays = [p for p, image in verdicts.items() if image is False]
        assert not strays, [_describe(p) for p in strays]
        # Not only the base image's programs: Ray's own, still running, run from the environment.
        assert any(verdicts.values()), [_describe(p) for p in pids]
    assert [n["raylet"]["resourcesTotal"]["TPU"] for n in found] == [tpu_per_host] * hosts
    assert sum(n["raylet"]["resourcesTotal"].get(head_resource, 0) for n in found) == 1
    assert len({n["raylet"]["labels"]["ray.io/tpu-slice-name"] for n in found}) == 1
    assert sorted(n["raylet"]["labels"]["ray.io/tpu-worker-id"] for n in found) == [str(i) for i in range(hosts)]

    kube.kubectl("wait", f"tpufinetune/{name}", "--for=condition=Failed", "--timeout=500s", timeout=520)
    status = kube.status(name)
    (attempt,) = status["attempts"]
    # spec.preflight: the collectives check places one worker per device on every host,
    # finds each host short of its devices (the ground has no chips), and the run fails
    # before any fine-tune job is submitted.
    assert cond.find(status, cond.FAILED)["reason"] == "PreflightFailed", (status.get("message"),
                                                                           status.get("preflight"))
    assert "short of TPU devices" in status["message"], status["message"]
    result = status["preflight"]
    assert result["phase"] == "Failed" and result["jobId"].endswith("-1-preflight")
    assert result["hosts"] == hosts and set(result["shortHosts"].values()) == {0}
    assert len(result["shortHosts"]) == hosts
    assert sum(result["devicesPerHost"].values()) == hosts * tpu_per_host
    assert cond.find(status, cond.JOB_SUBMITTED) is None, status["conditions"]  # no fine-tune job
    if head_kept:
        uid = kube.get("tpufinetune", name)["metadata"]["uid"]
        jobs = [job.submission_id for job in kube.head_job_client(cluster).list_jobs()]
        assert jobs == [f"tft-{uid}-1-preflight"], jobs  # and the head says so
    assert attempt["reason"] == "PreflightFailed"
    # Released (at once, or after ttlSecondsAfterFinished): read again once it is.
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster deleted", timeout=90)
    status = kube.status(name)
    (attempt,) = status["attempts"]
    released_at = cond.parse_time(attempt["sliceReleaseTime"])
    # The slice cost its chips from being ready (its last host Ready, no later than
    # ClusterReady) to its release, and the attempt says why it ended.
    ready = cond.parse_time(attempt["sliceReadyTime"])
    assert ready <= cond.parse_time(cond.find(status, cond.CLUSTER_READY)["lastTransitionTime"])
    held = (released_at - ready).total_seconds()
    assert held > 0
    assert abs(status["usage"]["chipHours"] - hosts * chips_per_host * held / 3600) < 1e-5, (status["usage"], held)
    assert abs(status["usage"]["hostHours"] - hosts * held / 3600) < 1e-5
    # The slice is released: no pod and no Ray process of it is left.
    kube.wait_for(lambda: kube.get("raycluster", cluster) is None, "RayCluster deleted", timeout=90)
    kube.wait_for(lambda: not kube.pods_of(cluster), "pods collected", timeout=90)
    uids = [p["metadata"]["uid"] for p in pods]
    kube.wait_for(lambda: not any(ground.ray_processes(uid) for uid in uids), "Ray processes gone", timeout=60)


def test_the_tutorial_v6e_4x4_sample_reserves_its_slice_and_fails_only_for_want_of_a_chip(operator, ground, kube):
    # The sample itself: its preflight (spec.preflight) runs on the slice before the fine-tune.
    manifest = sample_on_the_ground(kube, ground, "finetune-v6e-4x4.yaml")
    assert manifest["spec"]["preflight"]["enabled"] is True
    kube.apply(manifest)
    check_slice(kube, ground, manifest["metadata"]["name"], "tpu-v6e-slice", "4x4", "v6e-4x4", hosts=4,
                chips_per_host=4, tpu_per_host=4, head_resource="TPU-v6e-16-head")


# What the v7x test adds to its sample, and only this: the preflight the v6e sample ships
# with, and ttlSecondsAfterFinished, which keeps the head a little to read its job list.
V7X_ADDITIONS = {"preflight": {"enabled": True}, "ttlSecondsAfterFinished": 20}


def test_the_tutorial_v7x_2x2x2_sample_with_preflight_counts_two_devices_per_chip_and_fails_before_the_fine_tune(
        operator, ground, kube):
    manifest = sample_on_the_ground(kube, ground, "finetune-v7x-2x2x2.yaml")
    assert manifest["spec"]["tpu"] == {"generation": "v7x", "topology": "2x2x2"}
    shipped = {key: manifest["spec"].get(key) for key in V7X_ADDITIONS}
    assert all(value in (None, V7X_ADDITIONS[key]) for key, value in shipped.items()), shipped
    manifest["spec"].update(V7X_ADDITIONS)
    kube.apply(manifest)
    # 2 hosts of 4 chips; Ray schedules per chiplet: 8 TPU per host, 16 workers.
    check_slice(kube, ground, manifest["metadata"]["name"], "tpu7x", "2x2x2", "v7x-2x2x2", hosts=2, chips_per_host=4,
                tpu_per_host=8, head_resource="TPU-v7x-16-head", head_kept=True)


def test_a_pool_short_of_capacity_shows_the_schedulers_reason_within_60s(operator, ground, kube, ground_assets, storage):
    pool = tpu_pool("v5e-4x4-short", "v5e", "4x4", nodes=3)  # a 4-host slice on 3 nodes
    ground.add_pools([pool])
    try:
        kube.apply(tpu_resource("short", "v5e", "4x4", ground_assets, storage))
        started = time.monotonic()

        def explained():
            ready = cond.find(kube.status("short"), cond.CLUSTER_READY) or {}
            return ready if "Insufficient google.com/tpu" in (ready.get("message") or "") else None

        condition = kube.wait_for(explained, "ClusterReady with the scheduler's reason", timeout=within(60))
        assert time.monotonic() - started < within(60)
        assert condition["status"] == "False"
        assert "Unschedulable" in condition["message"] or "nodes are available" in condition["message"]
        kube.kubectl("delete", "tpufinetune", "short", "--timeout=60s", timeout=70)
    finally:
        ground.remove_pool(pool)
